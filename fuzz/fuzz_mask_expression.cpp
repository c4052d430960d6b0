// libFuzzer target: the library's mask-expression parser, qkv::Mask::parse (the grammar is in
// include/qkv/mask.hpp), which the explorer's "mask" field, the CLI and Python use. The input is the expression, any bytes. Every outcome
// must be a Mask or the parser's error (a qkv::Error) whose column lies within the input
// (1 .. size + 1, the end); anything else escaping, or a sanitizer report, is a failure. A parsed
// Mask must then be usable: scaled_dot_product_attention under it, on a few tiny shapes, either
// refuses it with a qkv::Error (a padding longer than the keys, and only that) or returns weights
// that are finite, in [0, 1], positive exactly where the mask's normalised rule (mask.hpp) lets a
// query see a key, summing to 1 on every row that sees a key (0 on a row that sees none), and
// outputs that are finite and agree between the Reference and Flash backends. Mask::str() of a
// parsed mask parses back to a mask that prints the same.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "qkv/qkv.hpp"

namespace {

using ParseError = qkv::MaskParseError;  // has column(), 1-based
qkv::Mask parse(const std::string& expression) { return qkv::Mask::parse(expression); }

[[noreturn]] void fail(const std::string& expression, const std::string& what) {
  std::fprintf(stderr, "fuzz_mask_expression: '%s': %s\n", expression.c_str(), what.c_str());
  std::abort();
}

using Rule = qkv::Mask::Rule;

// Key j visible to query i of batch 0 under one node of the symbolic rule (mask.hpp), evaluated
// here from its definition, apart from the library's own evaluation (src/mask/rule.cpp).
bool rule_allows(const Rule& r, int64_t i, int64_t j) {
  switch (r.kind) {
    case Rule::Kind::Band: return j >= i + r.lo && j <= i + r.hi;
    case Rule::Kind::KeyLengths: return j < r.lengths.front();
    case Rule::Kind::Strided: return (((r.offset + i - j) % r.stride) + r.stride) % r.stride == 0;
    case Rule::Kind::Global: return j < r.count || i < r.count;
    case Rule::Kind::And: return rule_allows(*r.left, i, j) && rule_allows(*r.right, i, j);
    case Rule::Kind::Or: return rule_allows(*r.left, i, j) || rule_allows(*r.right, i, j);
    case Rule::Kind::Expression: return true;  // a mask function: see has_function
    case Rule::Kind::BlockSparse:
    case Rule::Kind::Keep: break;  // tensors: no expression makes them
  }
  std::fprintf(stderr, "fuzz_mask_expression: a parsed mask holds a tensor rule\n");
  std::abort();
}

// Key j visible to query i of batch 0: the normalised band and lengths, and the rule.
bool visible(const qkv::Mask& mask, int64_t i, int64_t j) {
  if (j < i + mask.band_lo() || j > i + mask.band_hi()) return false;
  if (mask.has_key_lengths() && j >= mask.lengths().front()) return false;
  return !mask.rule() || rule_allows(*mask.rule(), i, j);
}

// Key lengths that do not fit a batch of 1 with nk keys, anywhere in the mask: the library must refuse them.
bool lengths_misfit(const std::vector<int64_t>& lengths, int64_t nk) { return lengths.size() != 1 || lengths.front() > nk; }
bool rule_misfits(const Rule& r, int64_t nk) {
  if (r.kind == Rule::Kind::KeyLengths) return lengths_misfit(r.lengths, nk);
  if (r.kind == Rule::Kind::And || r.kind == Rule::Kind::Or) return rule_misfits(*r.left, nk) || rule_misfits(*r.right, nk);
  return false;
}

// Whether the rule holds a mask function ("mask: ..."), whose visibility this harness does not
// evaluate apart (it would be a second interpreter): its weights are checked for range, sums and
// the kernels' agreement only.
bool has_function(const Rule& r) {
  if (r.kind == Rule::Kind::Expression) return true;
  return (r.kind == Rule::Kind::And || r.kind == Rule::Kind::Or) && (has_function(*r.left) || has_function(*r.right));
}

// The mask applied to one (1, 1, nq, d) x (1, 1, nk, d) problem.
void check_usable(const std::string& expression, const qkv::Mask& mask, int64_t nq, int64_t nk) {
  const qkv::Tensor q = qkv::Tensor::randn({1, 1, nq, 4}, 1);
  const qkv::Tensor k = qkv::Tensor::randn({1, 1, nk, 4}, 2);
  const qkv::Tensor v = qkv::Tensor::randn({1, 1, nk, 3}, 3);
  qkv::AttentionOptions options;
  options.mask = mask;
  options.need_weights = true;
  options.backend = qkv::Backend::Reference;
  const bool too_long = (mask.has_key_lengths() && lengths_misfit(mask.lengths(), nk)) ||
                        (mask.rule() && rule_misfits(*mask.rule(), nk));
  qkv::AttentionResult reference;
  try {
    reference = qkv::scaled_dot_product_attention(q, k, v, options);
  } catch (const qkv::Error& e) {
    if (!too_long) fail(expression, std::string("refused on a shape it fits: ") + e.what());
    return;
  }
  if (too_long) fail(expression, "key lengths that do not fit the batch or the keys were accepted");
  const bool function = mask.rule() && has_function(*mask.rule());
  for (int64_t i = 0; i < nq; ++i) {
    double sum = 0;
    bool any = false;
    for (int64_t j = 0; j < nk; ++j) {
      const float w = reference.weights.at({0, 0, i, j});
      if (!std::isfinite(w) || w < 0 || w > 1) fail(expression, "a weight outside [0, 1]");
      if (!function && (w > 0) != visible(mask, i, j))
        fail(expression, "a weight's visibility differs from the mask's rule");
      sum += w;
      any = any || (function ? w > 0 : visible(mask, i, j));
    }
    if (std::abs(sum - (any ? 1.0 : 0.0)) > 1e-5) fail(expression, "a row's weights do not sum to 1 (or 0)");
  }
  options.need_weights = false;
  options.backend = qkv::Backend::Flash;
  const qkv::AttentionResult flash = qkv::scaled_dot_product_attention(q, k, v, options);
  const std::vector<float> a = reference.output.to_vector(), b = flash.output.to_vector();
  for (size_t e = 0; e < a.size(); ++e) {
    if (!std::isfinite(a[e]) || !std::isfinite(b[e])) fail(expression, "a non-finite output");
    if (std::abs(a[e] - b[e]) > 1e-4f) fail(expression, "Reference and Flash outputs differ");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string expression(reinterpret_cast<const char*>(data), size);
  qkv::Mask mask;
  try {
    mask = parse(expression);
  } catch (const ParseError& e) {
    if (e.column() < 1 || e.column() > expression.size() + 1) {
      fail(expression, "an error whose column is outside the input: " + std::to_string(e.column()));
    }
    if (std::string(e.what()).empty()) fail(expression, "an error without a message");
    return 0;
  }
  // Anything else thrown (even another qkv::Error) escapes and fails the run: the parser's
  // errors are its own kind, with a column.
  const std::string text = mask.str();
  qkv::Mask again;
  try {
    again = parse(text);
  } catch (const ParseError& e) {
    fail(expression, "str() gives '" + text + "', which does not parse: " + e.what());
  }
  if (again.str() != text) fail(expression, "str() '" + text + "' parses back to '" + again.str() + "'");
  for (const auto& [nq, nk] : {std::pair<int64_t, int64_t>{1, 1}, {3, 5}, {6, 6}, {5, 2}}) check_usable(expression, mask, nq, nk);
  return 0;
}
