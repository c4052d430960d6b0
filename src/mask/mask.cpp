// qkv::Mask: the builders normalise what the user says into one rule the kernels implement
// (a band of visible keys around each query, per-batch key lengths, tensor terms, and a boolean
// expression of symbolic rules for unions, strided, global and block-sparse patterns).
// The text form's parser is src/mask/parse.cpp.
#include "qkv/mask.hpp"

#include <algorithm>
#include <memory>

#include "mask/mod_expression.hpp"

namespace qkv {

namespace {
// "(2, 5)": lengths as the user gave them, negative ones included (the core reports those).
std::string list_str(const std::vector<int64_t>& values) {
  std::string s = "(";
  for (size_t i = 0; i < values.size(); ++i) s += (i ? ", " : "") + std::to_string(values[i]);
  return s + ")";
}

// Offsets beyond +-kUnbounded would overflow query + edge; no sequence is that long anyway.
int64_t checked_offset(int64_t offset, const char* who) {
  if (offset <= -Mask::kUnbounded || offset >= Mask::kUnbounded)
    throw Error(std::string(who) + ": offset " + std::to_string(offset) + " is outside (-2^60, 2^60)");
  return offset;
}

using RulePtr = std::shared_ptr<const Mask::Rule>;

RulePtr combine(Mask::Rule::Kind kind, RulePtr left, RulePtr right) {
  if (!left) return right;
  if (!right) return left;
  auto node = std::make_shared<Mask::Rule>();
  node->kind = kind;
  node->left = std::move(left);
  node->right = std::move(right);
  return node;
}

RulePtr leaf(Mask::Rule rule) { return std::make_shared<const Mask::Rule>(std::move(rule)); }
}  // namespace

Mask Mask::causal(int64_t offset) {
  checked_offset(offset, "Mask::causal");
  Mask m;
  m.band_hi_ = offset;
  m.text_ = offset ? "causal(offset=" + std::to_string(offset) + ")" : "causal";
  return m;
}

Mask Mask::window(int64_t left, int64_t right, int64_t offset) {
  if (left < 0 || right < 0)
    throw Error("Mask::window: left (" + std::to_string(left) + ") and right (" + std::to_string(right) +
                ") must be >= 0");
  checked_offset(offset, "Mask::window");
  Mask m;
  m.band_lo_ = offset - std::min(left, kUnbounded);
  m.band_hi_ = offset + std::min(right, kUnbounded);
  m.text_ = "window(" + std::to_string(left) + (right || offset ? ", " + std::to_string(right) : "") +
            (offset ? ", offset=" + std::to_string(offset) : "") + ")";
  return m;
}

Mask Mask::key_lengths(std::vector<int64_t> lengths) {
  Mask m;
  m.has_key_lengths_ = true;
  m.lengths_ = std::move(lengths);
  m.text_ = m.lengths_.size() == 1 && m.lengths_[0] >= 1 ? "padding(" + std::to_string(m.lengths_[0]) + ")"
                                                         : "key_lengths" + list_str(m.lengths_);
  return m;
}

Mask Mask::keep(Tensor keep) {
  if (!keep.defined()) throw Error("Mask::keep: the tensor is undefined");
  Mask m;
  m.text_ = "keep" + keep.shape().str();
  m.terms_.push_back({std::move(keep), false});
  return m;
}

Mask Mask::additive(Tensor scores) {
  if (!scores.defined()) throw Error("Mask::additive: the tensor is undefined");
  Mask m;
  m.text_ = "additive" + scores.shape().str();
  m.terms_.push_back({std::move(scores), true});
  return m;
}

Mask Mask::strided(int64_t stride, int64_t offset) {
  if (stride < 1) throw Error("Mask::strided: stride " + std::to_string(stride) + " must be >= 1");
  checked_offset(offset, "Mask::strided");
  Rule rule;
  rule.kind = Rule::Kind::Strided;
  rule.stride = stride;
  rule.offset = offset;
  Mask m;
  m.rule_ = leaf(std::move(rule));
  m.text_ = "strided(" + std::to_string(stride) + (offset ? ", " + std::to_string(offset) : "") + ")";
  return m;
}

Mask Mask::global_tokens(int64_t count) {
  if (count < 0) throw Error("Mask::global_tokens: count " + std::to_string(count) + " must be >= 0");
  Rule rule;
  rule.kind = Rule::Kind::Global;
  rule.count = count;
  Mask m;
  m.rule_ = leaf(std::move(rule));
  m.text_ = "global(" + std::to_string(count) + ")";
  return m;
}

Mask Mask::block_sparse(Tensor layout, int64_t block_q, int64_t block_k) {
  if (!layout.defined()) throw Error("Mask::block_sparse: the layout tensor is undefined");
  if (layout.dim() != 2 && layout.dim() != 3)
    throw Error("Mask::block_sparse: layout is " + layout.shape().str() +
                " but should be (query blocks, key blocks) or (Hq, query blocks, key blocks)");
  if (block_q < 1 || block_k < 1)
    throw Error("Mask::block_sparse: block sizes (" + std::to_string(block_q) + ", " + std::to_string(block_k) +
                ") must be >= 1");
  Rule rule;
  rule.kind = Rule::Kind::BlockSparse;
  rule.block_q = block_q;
  rule.block_k = block_k;
  Mask m;
  std::string shape = layout.shape().str();  // "(2, 3)"
  m.text_ = "block_sparse(" + shape.substr(1, shape.size() - 2) + "; " + std::to_string(block_q) + ", " +
            std::to_string(block_k) + ")";
  rule.tensor = std::move(layout);
  m.rule_ = leaf(std::move(rule));
  return m;
}

Mask Mask::expression(const std::string& text, std::map<std::string, Tensor> inputs) {
  std::vector<std::string> names;
  for (const auto& [name, tensor] : inputs) {
    if (!tensor.defined()) throw Error("Mask::expression: input '" + name + "' is undefined");
    names.push_back(name);
  }
  detail::ModExpression::parse(text, detail::ModKind::Mask, names);  // throws MaskParseError
  Rule rule;
  rule.kind = Rule::Kind::Expression;
  rule.expression = text;
  rule.inputs = std::move(inputs);
  Mask m;
  m.rule_ = leaf(std::move(rule));
  m.text_ = "mask: " + text;
  return m;
}

Mask Mask::function(std::shared_ptr<const MaskFunction> f) {
  if (!f) throw Error("Mask::function: the mask function is null");
  Rule rule;
  rule.kind = Rule::Kind::Expression;
  rule.function = std::move(f);
  Mask m;
  m.rule_ = leaf(std::move(rule));
  m.text_ = "mask: <C++ function>";
  return m;
}

Mask& Mask::operator&=(const Mask& other) {
  // Bands intersect: the later lower edge and the earlier upper edge.
  band_lo_ = std::max(band_lo_, other.band_lo_);
  band_hi_ = std::min(band_hi_, other.band_hi_);
  if (other.has_key_lengths_) {
    if (!has_key_lengths_) {
      lengths_ = other.lengths_;
    } else {
      if (lengths_.size() != other.lengths_.size())
        throw Error("Mask: cannot combine key_lengths" + list_str(lengths_) + " with key_lengths" +
                    list_str(other.lengths_) + ": different batch sizes");
      for (size_t b = 0; b < lengths_.size(); ++b) lengths_[b] = std::min(lengths_[b], other.lengths_[b]);
    }
    has_key_lengths_ = true;
  }
  terms_.insert(terms_.end(), other.terms_.begin(), other.terms_.end());
  rule_ = combine(Rule::Kind::And, rule_, other.rule_);
  // & binds tighter than |: an operand whose top operator is | is parenthesised.
  auto operand = [](const Mask& m) { return m.text_is_or_ ? "(" + m.text_ + ")" : m.text_; };
  if (other.text_.empty()) {
    // x & none is x
  } else if (text_.empty()) {
    text_ = other.text_;
    text_is_or_ = other.text_is_or_;
  } else {
    text_ = operand(*this) + " & " + operand(other);
    text_is_or_ = false;
  }
  return *this;
}

Mask operator&(const Mask& a, const Mask& b) {
  Mask m = a;
  m &= b;
  return m;
}

std::shared_ptr<const Mask::Rule> Mask::as_rule() const {
  RulePtr rule;
  if (has_band()) {
    Rule band;
    band.kind = Rule::Kind::Band;
    band.lo = band_lo_;
    band.hi = band_hi_;
    rule = leaf(std::move(band));
  }
  if (has_key_lengths_) {
    Rule lengths;
    lengths.kind = Rule::Kind::KeyLengths;
    lengths.lengths = lengths_;
    rule = combine(Rule::Kind::And, rule, leaf(std::move(lengths)));
  }
  for (const Term& term : terms_) {
    Rule keep;
    keep.kind = Rule::Kind::Keep;
    keep.tensor = term.values;
    rule = combine(Rule::Kind::And, rule, leaf(std::move(keep)));
  }
  return combine(Rule::Kind::And, rule, rule_);
}

Mask& Mask::operator|=(const Mask& other) {
  for (const Mask* m : {static_cast<const Mask*>(this), &other})
    for (const Term& term : m->terms_)
      if (term.additive)
        throw Error("Mask: cannot take the union of '" + str() + "' and '" + other.str() + "': additive" +
                    term.values.shape().str() +
                    " adds to the scores, which has no 'either' meaning; use a keep tensor in a union");
  if (is_none() || other.is_none()) {  // either sees everything: so does the union
    *this = Mask();
    return *this;
  }
  Mask m;
  m.rule_ = combine(Rule::Kind::Or, as_rule(), other.as_rule());
  m.text_ = text_ + " | " + other.text_;
  m.text_is_or_ = true;
  *this = std::move(m);
  return *this;
}

Mask operator|(const Mask& a, const Mask& b) {
  Mask m = a;
  m |= b;
  return m;
}

bool Mask::is_none() const { return !has_band() && !has_key_lengths_ && terms_.empty() && !rule_; }

std::string Mask::str() const { return text_.empty() ? "none" : text_; }

Tensor create_causal_mask(int64_t n) {
  if (n < 0) throw Error("create_causal_mask: n = " + std::to_string(n) + " must be >= 0");
  Tensor mask = Tensor::zeros({n, n});
  float* m = mask.data();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j <= i; ++j) m[i * n + j] = 1.0f;
  return mask;
}

Tensor create_padding_mask(const std::vector<int64_t>& lengths, int64_t max_len) {
  if (max_len < 0) throw Error("create_padding_mask: max_len = " + std::to_string(max_len) + " must be >= 0");
  const int64_t batch = static_cast<int64_t>(lengths.size());
  Tensor mask = Tensor::zeros({batch, 1, 1, max_len});
  float* m = mask.data();
  for (int64_t b = 0; b < batch; ++b) {
    if (lengths[b] < 0 || lengths[b] > max_len)
      throw Error("create_padding_mask: lengths[" + std::to_string(b) + "] = " + std::to_string(lengths[b]) +
                  " is outside [0, " + std::to_string(max_len) + "]");
    std::fill_n(m + b * max_len, lengths[b], 1.0f);
  }
  return mask;
}

}  // namespace qkv
