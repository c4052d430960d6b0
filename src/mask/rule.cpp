// The symbolic mask rule (mask/rule.hpp): normalised from Mask::rule() once per call, then
// evaluated per element by the reference and per tile by every kernel.
#include "mask/rule.hpp"

#include "mask/mod_blocks.hpp"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace qkv::detail {

namespace {
using Kind = Mask::Rule::Kind;

// A mask function over a line into `out`. The scratch is the calling thread's, grown once
// (kernels classify and mask tiles on their own threads).
void evaluate_function(const RuleNode& n, const ModLine& line, size_t count, float* out) {
  if (n.function) return n.function->line({line.b, line.h, line.i0, line.j0, line.query_step, line.key_step}, count, out);
  thread_local std::vector<float> scratch;
  const size_t need = n.expression->scratch_floats(count);
  if (scratch.size() < need) scratch.resize(need);
  n.expression->evaluate(line, count, nullptr, n.inputs.data(), out, nullptr, scratch.data());
}

// Keys [j0, j0 + count) of query i (or one element): 1 where shown.
const float* expression_line(const RuleNode& n, int64_t b, int64_t h, int64_t i, int64_t j0, size_t count) {
  thread_local std::vector<float> out;
  if (out.size() < count) out.resize(count);
  evaluate_function(n, {b, h, i, j0, 0, 1}, count, out.data());
  return out.data();
}

TileVisibility expression_tile(const RuleNode& n, int64_t b, int64_t h, int64_t i0, int64_t i1, int64_t j0,
                               int64_t j1) {
  bool any = false, all = true;
  const size_t count = static_cast<size_t>(j1 - j0 + 1);
  for (int64_t i = i0; i <= i1; ++i) {
    const float* shown = expression_line(n, b, h, i, j0, count);
    for (size_t x = 0; x < count; ++x) {
      any = any || shown[x] != 0.0f;
      all = all && shown[x] != 0.0f;
    }
    if (any && !all) return TileVisibility::Partial;
  }
  return !any ? TileVisibility::Hidden : (all ? TileVisibility::Full : TileVisibility::Partial);
}

TileVisibility leaf_tile(const RuleNode& n, int64_t b, int64_t h, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
  using TV = TileVisibility;
  switch (n.kind) {
    case Kind::Band: {  // j - i runs over [j0 - i1, j1 - i0]
      const int64_t d_min = j0 - i1, d_max = j1 - i0;
      if (d_max < n.lo || d_min > n.hi) return TV::Hidden;
      return d_min >= n.lo && d_max <= n.hi ? TV::Full : TV::Partial;
    }
    case Kind::KeyLengths: {
      const int64_t length = n.lengths[static_cast<size_t>(b)];
      if (j0 >= length) return TV::Hidden;
      return j1 < length ? TV::Full : TV::Partial;
    }
    case Kind::Strided: {  // visible diagonals: j - i = offset (mod stride)
      if (n.stride == 1) return TV::Full;
      const int64_t d_min = j0 - i1, d_max = j1 - i0;
      const int64_t first = d_min + floor_mod(n.offset - d_min, n.stride);
      return first > d_max ? TV::Hidden : TV::Partial;
    }
    case Kind::Global:
      if (j1 < n.count || i1 < n.count) return TV::Full;
      return j0 >= n.count && i0 >= n.count ? TV::Hidden : TV::Partial;
    case Kind::BlockSparse: {
      bool any = false, all = true;
      for (int64_t a = i0 / n.block_q; a <= i1 / n.block_q; ++a)
        for (int64_t c = j0 / n.block_k; c <= j1 / n.block_k; ++c) {
          const bool keep = n.view.at(0, h, a, c) != 0.0f;
          any = any || keep;
          all = all && keep;
        }
      return !any ? TV::Hidden : (all ? TV::Full : TV::Partial);
    }
    case Kind::Expression: {
      if (n.blocks)
        if (const std::optional<TileVisibility> mapped = n.blocks->classify(b, h, i0, i1, j0, j1)) return *mapped;
      return expression_tile(n, b, h, i0, i1, j0, j1);
    }
    default:  // Keep: per element
      return TV::Partial;
  }
}
}  // namespace

bool MaskRule::visible(int64_t b, int64_t h, int64_t i, int64_t j, int node) const {
  const RuleNode& n = nodes[static_cast<size_t>(node == -2 ? root() : node)];
  switch (n.kind) {
    case Kind::Band: return j - i >= n.lo && j - i <= n.hi;
    case Kind::KeyLengths: return j < n.lengths[static_cast<size_t>(b)];
    case Kind::Strided: return floor_mod(n.offset + i - j, n.stride) == 0;
    case Kind::Global: return j < n.count || i < n.count;
    case Kind::BlockSparse: return n.view.at(0, h, i / n.block_q, j / n.block_k) != 0.0f;
    case Kind::Keep: return n.view.at(b, h, i, j) != 0.0f;
    case Kind::Expression: return *expression_line(n, b, h, i, j, 1) != 0.0f;
    case Kind::And: return visible(b, h, i, j, n.left) && visible(b, h, i, j, n.right);
    case Kind::Or: return visible(b, h, i, j, n.left) || visible(b, h, i, j, n.right);
  }
  return false;
}

void MaskRule::function_line(int node, const ModLine& line, size_t count, float* out) const {
  evaluate_function(nodes[static_cast<size_t>(node)], line, count, out);
}

TileVisibility MaskRule::classify(int64_t b, int64_t h, int64_t i0, int64_t i1, int64_t j0, int64_t j1,
                                  int node) const {
  using TV = TileVisibility;
  const RuleNode& n = nodes[static_cast<size_t>(node == -2 ? root() : node)];
  if (n.kind == Kind::And) {
    const TV left = classify(b, h, i0, i1, j0, j1, n.left);
    if (left == TV::Hidden) return TV::Hidden;
    const TV right = classify(b, h, i0, i1, j0, j1, n.right);
    if (right == TV::Hidden) return TV::Hidden;
    return left == TV::Full && right == TV::Full ? TV::Full : TV::Partial;
  }
  if (n.kind == Kind::Or) {
    const TV left = classify(b, h, i0, i1, j0, j1, n.left);
    if (left == TV::Full) return TV::Full;
    const TV right = classify(b, h, i0, i1, j0, j1, n.right);
    if (right == TV::Full) return TV::Full;
    return left == TV::Hidden && right == TV::Hidden ? TV::Hidden : TV::Partial;
  }
  return leaf_tile(n, b, h, i0, i1, j0, j1);
}

StridedSplit strided_split(const MaskRule& rule, int64_t min_stride) {
  if (rule.empty()) return {};
  const RuleNode& root = rule.nodes[static_cast<size_t>(rule.root())];
  if (root.kind != Kind::Or) return {};
  for (const auto& [strided, rest] : {std::pair{root.left, root.right}, std::pair{root.right, root.left}}) {
    const RuleNode& n = rule.nodes[static_cast<size_t>(strided)];
    if (n.kind == Kind::Strided && n.stride >= min_stride) return {rest, n.stride, n.offset};
  }
  return {};
}

MaskRule rest_rule(const MaskRule& rule, const StridedSplit& split, int64_t& band_lo, int64_t& band_hi) {
  const RuleNode& rest = rule.nodes[static_cast<size_t>(split.rest)];
  if (rest.kind == Kind::Band) {
    band_lo = std::max(band_lo, rest.lo);
    band_hi = std::min(band_hi, rest.hi);
    return {};
  }
  MaskRule out = rule;
  out.root_node = split.rest;
  return out;
}

namespace {
struct Compiler {
  const char* who;
  int64_t batch, q_heads, q_len, kv_len;
  const std::function<MaskTermView(const Tensor&)>& keep_view;
  std::vector<Tensor>& held;
  MaskRule rule;

  [[noreturn]] void fail(const std::string& message) const { throw Error(std::string(who) + message); }

  void check_lengths(const std::vector<int64_t>& lengths) const {
    if (static_cast<int64_t>(lengths.size()) != batch)
      fail("mask key_lengths has " + std::to_string(lengths.size()) + " lengths but the batch is " +
           std::to_string(batch));
    for (size_t b = 0; b < lengths.size(); ++b)
      if (lengths[b] < 0 || lengths[b] > kv_len)
        fail("mask key_lengths[" + std::to_string(b) + "] = " + std::to_string(lengths[b]) + " is outside [0, " +
             std::to_string(kv_len) + "]");
  }

  MaskTermView layout_view(const Mask::Rule& r) {
    const Tensor& layout = r.tensor;
    const int64_t rows = (q_len + r.block_q - 1) / r.block_q, cols = (kv_len + r.block_k - 1) / r.block_k;
    const int64_t rank = layout.dim();
    const bool heads_ok = rank == 2 || layout.size(0) == q_heads || layout.size(0) == 1;
    if (!heads_ok || layout.size(-2) != rows || layout.size(-1) != cols)
      fail("mask block_sparse layout is " + layout.shape().str() + " but blocks of " + std::to_string(r.block_q) +
           " x " + std::to_string(r.block_k) + " over Nq = " + std::to_string(q_len) + ", Nk = " +
           std::to_string(kv_len) + " need (" + std::to_string(rows) + ", " + std::to_string(cols) + ") or (" +
           std::to_string(q_heads) + ", " + std::to_string(rows) + ", " + std::to_string(cols) + ")");
    held.push_back(layout);
    const auto& strides = layout.strides();
    const int64_t stride_h = rank == 3 && layout.size(0) > 1 ? strides[0] : 0;
    return {layout.view_data(), 0, stride_h, strides[static_cast<size_t>(rank - 2)],
            strides[static_cast<size_t>(rank - 1)], false};
  }

  // A mask function's program and its inputs' views (bind_mod_inputs checks them), or its C++
  // callable; and its block map.
  void compile_expression(const Mask::Rule& r, RuleNode& n) {
    if (r.function) {  // C++: nothing to parse or bind
      n.function = r.function;
      n.blocks = ModBlocks::build(*n.function, batch, q_heads, q_len, kv_len);
      return;
    }
    n.expression = std::make_shared<const ModExpression>(
        ModExpression::parse(r.expression, ModKind::Mask, mod_input_names(r.inputs)));
    n.inputs = bind_mod_inputs(who, *n.expression, r.inputs, batch, q_heads, q_len, kv_len, held);
    n.blocks = ModBlocks::build(*n.expression, n.inputs, batch, q_heads, q_len, kv_len);
  }

  int add(const Mask::Rule& r) {
    RuleNode n;
    n.kind = r.kind;
    if (r.kind == Kind::And || r.kind == Kind::Or) {
      n.left = add(*r.left);
      n.right = add(*r.right);
    }
    n.lo = r.lo;
    n.hi = r.hi;
    n.stride = r.stride;
    n.offset = r.offset;
    n.count = r.count;
    n.block_q = r.block_q;
    n.block_k = r.block_k;
    if (r.kind == Kind::KeyLengths) {
      check_lengths(r.lengths);
      n.lengths = r.lengths;
    }
    if (r.kind == Kind::Keep) n.view = keep_view(r.tensor);
    if (r.kind == Kind::BlockSparse) n.view = layout_view(r);
    if (r.kind == Kind::Expression) compile_expression(r, n);
    rule.nodes.push_back(std::move(n));
    return static_cast<int>(rule.nodes.size()) - 1;
  }
};
}  // namespace

MaskRule compile_mask_rule(const char* who, const Mask& mask, int64_t batch, int64_t q_heads, int64_t q_len,
                           int64_t kv_len, const std::function<MaskTermView(const Tensor&)>& keep_view,
                           std::vector<Tensor>& held) {
  Compiler compiler{who, batch, q_heads, q_len, kv_len, keep_view, held, {}};
  if (mask.rule()) compiler.add(*mask.rule());
  return std::move(compiler.rule);
}

}  // namespace qkv::detail
