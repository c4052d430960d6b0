// The one problem builder (problem.hpp): every argument of scaled_dot_product_attention and its
// backward checked once, with messages that name the shapes or values involved, and normalised
// into the AttentionProblem the kernels trust. The library's entry points (attention/dispatch.cpp) and the
// kernel tests both build their problems here.
#include "attention/problem.hpp"

#include "attention/score_text.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <sstream>
#include <string>

#include "attention/lse_merge.hpp"
#include "core/allocator.hpp"
#include "core/quantize.hpp"
#include "qkv/error.hpp"

namespace qkv::detail {

namespace {

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
constexpr float kInf = std::numeric_limits<float>::infinity();

[[noreturn]] void fail(const char* who, const std::string& message) { throw Error(who + message); }

std::string format_float(float x) {
  std::ostringstream os;
  os << x;
  return os.str();
}

// The sizes of one q/k/v argument read as (B, H, N, D) whatever its rank.
struct Dims {
  int64_t batch, heads, len, dim;
};

Dims read_dims(const char* who, const Tensor& t, const char* name) {
  if (!t.defined()) fail(who, std::string(name) + " is undefined");
  const Shape& s = t.shape();
  switch (s.size()) {
    case 2: return {1, 1, s[0], s[1]};
    case 3: return {s[0], 1, s[1], s[2]};
    case 4: return {s[0], s[1], s[2], s[3]};
    default: fail(who, std::string(name) + " is " + s.str() + ": rank must be 2, 3 or 4");
  }
}

std::string pair(const char* a, const Tensor& ta, const char* b, const Tensor& tb) {
  return std::string(a) + " is " + ta.shape().str() + " but " + b + " is " + tb.shape().str();
}

// An operand the kernels can read in place: the tensor itself when its last dim is contiguous
// and its rows do not overlap (a GEMM's leading dimension must cover a row), else one packed copy.
Tensor readable(const Tensor& t) {
  const int64_t rank = t.dim();
  const bool last_contiguous = t.strides()[static_cast<size_t>(rank - 1)] == 1 || t.size(-1) <= 1;
  const bool rows_apart = t.size(-2) <= 1 || t.strides()[static_cast<size_t>(rank - 2)] >= t.size(-1);
  return last_contiguous && rows_apart ? t : t.clone();
}

// Checks that a tensor mask broadcasts to the scores (B, Hq, Nq, Nk) and returns how a kernel
// reads it, through its own strides (a view is read in place). 2-D is (Nq, Nk), 3-D (B, Nq, Nk),
// 4-D (B, Hq, Nq, Nk); any dim may also be 1.
MaskTermView term_view(const char* who, const Mask::Term& term, const Dims& q, int64_t kv_len,
                       const Shape& scores_shape) {
  const Shape& s = term.values.shape();
  const int64_t rank = static_cast<int64_t>(s.size());
  auto broadcast_error = [&] {
    fail(who, std::string("mask ") + (term.additive ? "additive " : "keep ") + s.str() +
                  " does not broadcast to the scores " + scores_shape.str());
  };
  if (rank < 2 || rank > 4) broadcast_error();
  // The term's dims aligned to (B, H, Nq, Nk); absent leading dims broadcast.
  const int64_t target[4] = {q.batch, q.heads, q.len, kv_len};
  // Where each of the term's dims sits among (B, H, Nq, Nk).
  static constexpr int kPlace[5][4] = {{}, {}, {2, 3}, {0, 2, 3}, {0, 1, 2, 3}};
  int64_t sizes[4] = {1, 1, 1, 1}, strides[4] = {0, 0, 0, 0};
  for (int64_t d = 0; d < rank; ++d) {
    sizes[kPlace[rank][d]] = s[d];
    strides[kPlace[rank][d]] = term.values.strides()[static_cast<size_t>(d)];
  }
  for (int d = 0; d < 4; ++d) {
    if (sizes[d] != target[d] && sizes[d] != 1) broadcast_error();
    if (sizes[d] == 1) strides[d] = 0;
  }
  return {term.values.view_data(), strides[0], strides[1], strides[2], strides[3], term.additive};
}

// A per-head vector option (alibi_slopes, sinks): undefined, or Hq finite floats; with
// `batch_stride` (ALiBi) also (B, Hq), one row per batch element (FlashAttention's (B, H) slopes),
// *batch_stride then Hq (0 for one row shared by the batch).
const float* head_vector(const char* who, const Tensor& t, const char* name, int64_t heads,
                         std::vector<Tensor>& held, int64_t batch = 0, int64_t* batch_stride = nullptr) {
  if (!t.defined()) return nullptr;
  const bool per_batch = batch_stride && t.dim() == 2 && t.size(0) == batch && t.size(1) == heads;
  if (!per_batch && (t.dim() != 1 || t.size(0) != heads))
    fail(who, std::string(name) + " is " + t.shape().str() + " but should be (" + std::to_string(heads) +
                  "), one per query head" +
                  (batch_stride ? ", or (" + std::to_string(batch) + ", " + std::to_string(heads) +
                                      "), one per batch element and query head"
                                : std::string()));
  if (batch_stride) *batch_stride = per_batch ? heads : 0;
  held.push_back(t.contiguous());
  const float* values = held.back().data();
  for (int64_t e = 0; e < t.numel(); ++e)
    if (!std::isfinite(values[e]))
      fail(who, std::string(name) + "[" + (per_batch ? std::to_string(e / heads) + ", " : std::string()) +
                    std::to_string(e % heads) + "] = " + format_float(values[e]) + " is not finite");
  return values;
}

// The key lengths of a padding mask, checked against the batch and Nk (Nk for every batch
// element without one).
std::vector<int64_t> key_lengths_of(const char* who, const Mask& mask, int64_t batch, int64_t kv_len) {
  std::vector<int64_t> key_lengths(static_cast<size_t>(batch), kv_len);
  if (!mask.has_key_lengths()) return key_lengths;
  const auto& lengths = mask.lengths();
  if (static_cast<int64_t>(lengths.size()) != batch)
    fail(who, "mask key_lengths has " + std::to_string(lengths.size()) + " lengths but the batch is " +
                  std::to_string(batch));
  for (size_t b = 0; b < lengths.size(); ++b) {
    if (lengths[b] < 0 || lengths[b] > kv_len)
      fail(who, "mask key_lengths[" + std::to_string(b) + "] = " + std::to_string(lengths[b]) + " is outside [0, " +
                    std::to_string(kv_len) + "]");
    key_lengths[b] = lengths[b];
  }
  return key_lengths;
}

void check_shapes(const char* who, const Tensor& q, const Tensor& k, const Tensor& v, const Dims& qd,
                  const Dims& kd, const Dims& vd) {
  if (k.dim() != q.dim()) fail(who, pair("q", q, "k", k) + ": ranks differ");
  if (v.dim() != k.dim()) fail(who, pair("k", k, "v", v) + ": ranks differ");
  if (kd.dim != qd.dim) fail(who, pair("q", q, "k", k) + ": head dims differ");
  if (kd.batch != qd.batch) fail(who, pair("q", q, "k", k) + ": batch sizes differ");
  if (vd.batch != kd.batch) fail(who, pair("k", k, "v", v) + ": batch sizes differ");
  if (vd.heads != kd.heads) fail(who, pair("k", k, "v", v) + ": head counts differ");
  if (vd.len != kd.len) fail(who, pair("k", k, "v", v) + ": key and value lengths differ");
  if (qd.dim < 1) fail(who, "q is " + q.shape().str() + ": head dim must be at least 1");
  if (kd.heads < 1 || qd.heads % kd.heads != 0)
    fail(who, pair("q", q, "k", k) + ": query heads (" + std::to_string(qd.heads) +
                  ") must be a multiple of key/value heads (" + std::to_string(kd.heads) + ")");
}

// A caller-provided result tensor: allocated when undefined, else checked. Kernels write it
// through its strides, so any view with a contiguous last dim whose elements do not overlap works.
void prepare_output(const char* who, Tensor& t, const char* name, const Shape& shape,
                    std::initializer_list<const Tensor*> inputs, bool packed) {
  if (!t.defined()) {
    t = Tensor::empty(shape);
    return;
  }
  if (t.shape() != shape)
    fail(who, std::string(name) + " is " + t.shape().str() + " but should be " + shape.str());
  const bool last_contiguous = t.dim() == 0 || t.strides().back() == 1 || t.size(-1) <= 1;
  if (packed ? !t.is_contiguous() : !last_contiguous)
    fail(who, std::string(name) + " " + t.shape().str() + (packed ? " is not contiguous" : " has a strided last dim"));
  // No two elements may share memory: sorted by stride, each dim must step over all the smaller ones.
  std::vector<size_t> order(static_cast<size_t>(t.dim()));
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return t.strides()[a] < t.strides()[b]; });
  int64_t span = 1;
  for (size_t d : order) {
    if (t.shape()[static_cast<int64_t>(d)] == 1) continue;
    if (t.strides()[d] < span) fail(who, std::string(name) + " " + t.shape().str() + " has overlapping elements");
    span = t.strides()[d] * t.shape()[static_cast<int64_t>(d)];
  }
  for (const Tensor* input : inputs)
    if (t.shares_storage_with(*input)) fail(who, std::string(name) + " shares storage with an input");
}

// scaled_dot_product_attention's check before it allocates (build_problem, below): the
// results the caller did not provide (output, lse, and weights when `weights` is given) against
// bytes_available(), the error naming q, k, v and each result's shape, and for weights the advice
// to drop need_weights or use Backend::Flash.
void check_attention_request(const char* who, const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionResult& given, const Shape& output, const Shape& lse, const Shape* weights) {
  // What the call allocates: the outputs the caller did not provide. Summed first, so that the
  // usual call (it fits) builds no message: a decode step pays microseconds for strings otherwise.
  struct Part {
    const char* name;
    const Shape* shape;
    const Tensor* provided;
  };
  const Part all[] = {{"output", &output, &given.output}, {"lse", &lse, &given.lse}, {"weights", weights, &given.weights}};
  auto bytes_of = [](const Part& part) -> int64_t {
    if (part.shape == nullptr || part.provided->defined()) return 0;  // not asked, or the caller's own
    return part.shape->numel() * static_cast<int64_t>(sizeof(float));  // Shape checked it fits
  };
  int64_t needed = 0;
  for (const Part& part : all) needed = needed > INT64_MAX - bytes_of(part) ? INT64_MAX : needed + bytes_of(part);
  if (needed <= bytes_available()) return;
  std::string parts;
  for (const Part& part : all)
    if (bytes_of(part) > 0)
      parts += (parts.empty() ? "" : " + ") + std::string(part.name) + " " + part.shape->str() + " " +
               human_bytes(bytes_of(part));
  check_request(who, "q " + q.shape().str() + ", k " + k.shape().str() + ", v " + v.shape().str(), needed, parts,
                weights && !given.weights.defined()
                    ? "the weights " + weights->str() + " are Nq x Nk per head: call with need_weights = false, or "
                      "use Backend::Flash, which never materialises them"
                    : "");
}

}  // namespace

void check_dropout_p(const char* who, float p) {
  if (!(p >= 0 && p < 1)) fail(who, "dropout_p must be in [0, 1), got " + format_float(p));
}

template <class T>
Rows<T> rows_of(const Tensor& t) {
  const auto& st = t.strides();
  // A single row's stride is never used to step, but GEMMs take it as a leading dimension,
  // which must cover a row.
  const int64_t row_stride = t.size(-2) <= 1 ? std::max<int64_t>(t.size(-1), 1) : st[st.size() - 2];
  T* data;
  if constexpr (sizeof(T) == sizeof(float)) {
    data = t.view_data();  // checks that t is F32
  } else {
    data = static_cast<T*>(t.raw_view_data());
  }
  switch (t.dim()) {
    case 2: return {data, 0, 0, row_stride};
    case 3: return {data, st[0], 0, row_stride};
    default: return {data, st[0], st[1], row_stride};
  }
}
template Rows<const float> rows_of<const float>(const Tensor&);
template Rows<float> rows_of<float>(const Tensor&);
template Rows<const uint16_t> rows_of<const uint16_t>(const Tensor&);
template Rows<const uint8_t> rows_of<const uint8_t>(const Tensor&);

namespace {
// q in f32; k and v sharing a dtype (f32, bf16 or f16).
void check_dtypes(const char* who, const Tensor& q, const Tensor& k, const Tensor& v) {
  if (q.dtype() != DType::F32)
    fail(who, "q " + q.shape().str() + " is " + std::string(to_string(q.dtype())) +
                  ": attention needs q in f32 (k and v may be bf16, f16, int8 or int4)");
  if (k.dtype() != v.dtype())
    fail(who, "k is " + std::string(to_string(k.dtype())) + " but v is " + std::string(to_string(v.dtype())) +
                  ": k and v must share a dtype");
}

// The scalar options checked; the scale, 1 / sqrt(Dk) by default.
float checked_scale(const char* who, const AttentionOptions& options, int64_t dk) {
  const float scale = options.scale.value_or(1.0f / std::sqrt(static_cast<float>(dk)));
  if (!std::isfinite(scale) || scale <= 0) fail(who, "scale must be finite and positive, got " + format_float(scale));
  check_dropout_p(who, options.dropout_p);
  if (!(options.softcap >= 0 && std::isfinite(options.softcap)))
    fail(who, "softcap must be 0 (off) or finite and positive, got " + format_float(options.softcap));
  return scale;
}

// q, k and v as the kernels read them: in place when their last dim is contiguous (else packed
// copies, kept in `held`); K and V as floats, or as 16-bit bits when they are bf16 / f16.
struct Operands {
  Rows<const float> q, k, v;
  Rows<const uint16_t> k_bits, v_bits;
  Rows<const uint8_t> k_quant, v_quant;
  Rows<const float> k_scales, v_scales;
};
Operands bind_operands(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& options,
                       std::vector<Tensor>& held) {
  Operands o;
  held.push_back(readable(q));
  o.q = rows_of<const float>(held.back());
  const bool wide_kv = k.dtype() == DType::F32;
  if (is_quantized(k.dtype())) {  // packed rows (checked contiguous, check_quantized) and their scales
    held.insert(held.end(), {k, v, options.k_scales, options.v_scales});
    o.k_quant = rows_of<const uint8_t>(k);
    o.v_quant = rows_of<const uint8_t>(v);
    o.k_scales = rows_of<const float>(options.k_scales);
    o.v_scales = rows_of<const float>(options.v_scales);
    return o;
  }
  held.push_back(readable(k));
  if (wide_kv) o.k = rows_of<const float>(held.back()); else o.k_bits = rows_of<const uint16_t>(held.back());
  held.push_back(readable(v));
  if (wide_kv) o.v = rows_of<const float>(held.back()); else o.v_bits = rows_of<const uint16_t>(held.back());
  return o;
}

// The score function: options.score_function (a callable), or options.score_mod (text) parsed with
// its inputs bound for a (B, Hq, Nq, Nk) problem; null when there is neither.
std::shared_ptr<const ScoreFunction> score_function_of(const char* who, const AttentionOptions& options,
                                                       const Dims& qd, int64_t kv_len, std::vector<Tensor>& held) {
  if (options.score_mod.empty()) return options.score_function;
  if (options.score_function)
    throw Error(std::string(who) + "give score_mod (text) or score_function (a callable), not both");
  ModExpression text = ModExpression::parse(options.score_mod, ModKind::Score, mod_input_names(options.mod_inputs));
  std::vector<ModInput> inputs =
      bind_mod_inputs(who, text, options.mod_inputs, qd.batch, qd.heads, qd.len, kv_len, held);
  return text_score_function(std::move(text), std::move(inputs));
}
}  // namespace

BuiltProblem build_problem(const char* who, const Tensor& q, const Tensor& k, const Tensor& v,
                           const AttentionOptions& options, ScaleValues scale_values) {
  // A packed batch reaches here one sequence at a time (attention/varlen.cpp), its offsets cleared.
  if (!options.cu_seqlens_q.empty() || !options.cu_seqlens_k.empty())
    fail(who, "cu_seqlens_q / cu_seqlens_k (a packed batch) are taken by scaled_dot_product_attention and its "
              "backward only");
  // Paged K/V likewise reaches here a sequence at a time (attention/paged.cpp), its table cleared.
  if (!options.block_table.empty() || !options.cache_seqlens.empty())
    fail(who, "block_table / cache_seqlens (paged K/V) are taken by scaled_dot_product_attention's forward only");
  // Rotary tables are applied by the entry points (attention/rotary.cpp), which clear them.
  if (options.rotary_cos.defined() || options.rotary_sin.defined())
    fail(who, "rotary_cos / rotary_sin are taken by scaled_dot_product_attention and its backward only");
  // ---- shapes
  const Dims qd = read_dims(who, q, "q");
  Dims kd = read_dims(who, k, "k");
  Dims vd = read_dims(who, v, "v");
  check_dtypes(who, q, k, v);
  if (k.dtype() == DType::I4) kd.dim *= 2, vd.dim *= 2;  // two 4-bit values a byte
  check_shapes(who, q, k, v, qd, kd, vd);
  const bool scales_unchecked = is_quantized(k.dtype()) && scale_values == ScaleValues::Kernel;
  if (is_quantized(k.dtype()) && scale_values != ScaleValues::Checked) {
    check_quantized(who, "k", k, options.k_scales, kd.dim, !scales_unchecked);
    check_quantized(who, "v", v, options.v_scales, vd.dim, !scales_unchecked);
  } else if (!is_quantized(k.dtype()) && (options.k_scales.defined() || options.v_scales.defined())) {
    fail(who, "k_scales / v_scales are for int8 or int4 k and v, but k is " + std::string(to_string(k.dtype())));
  }

  const float scale = checked_scale(who, options, qd.dim);

  // ---- result shapes: q's leading dims, then the per-row sizes
  std::vector<int64_t> lead(q.shape().begin(), q.shape().end() - 2);
  auto with = [&](std::initializer_list<int64_t> tail) {
    std::vector<int64_t> dims = lead;
    dims.insert(dims.end(), tail);
    return Shape(std::move(dims));
  };
  BuiltProblem built;
  built.output_shape = with({qd.len, vd.dim});
  built.lse_shape = with({qd.len});
  built.scores_shape = with({qd.len, kd.len});

  // ---- modifiers and the mask, normalised
  int64_t alibi_batch_stride = 0;
  const float* alibi =
      head_vector(who, options.alibi_slopes, "alibi_slopes", qd.heads, built.held, qd.batch, &alibi_batch_stride);
  const float* sinks = head_vector(who, options.sinks, "sinks", qd.heads, built.held);
  const Mask mask =
      options.mask_mod.empty() ? options.mask : options.mask & Mask::expression(options.mask_mod, options.mod_inputs);
  std::shared_ptr<const ScoreFunction> score_mod = score_function_of(who, options, qd, kd.len, built.held);
  std::vector<MaskTermView> terms;
  for (const Mask::Term& term : mask.terms()) terms.push_back(term_view(who, term, qd, kd.len, built.scores_shape));
  for (const Mask::Term& term : mask.terms()) built.held.push_back(term.values);
  MaskRule rule = compile_mask_rule(
      who, mask, qd.batch, qd.heads, qd.len, kd.len,
      [&](const Tensor& keep) { return term_view(who, {keep, false}, qd, kd.len, built.scores_shape); }, built.held);

  const Operands operands = bind_operands(q, k, v, options, built.held);

  built.problem = AttentionProblem{
      .batch = qd.batch, .q_heads = qd.heads, .kv_heads = kd.heads,
      .q_len = qd.len, .kv_len = kd.len, .head_dim = qd.dim, .value_dim = vd.dim,
      .q = operands.q, .k = operands.k, .v = operands.v, .scale = scale,
      .softcap = options.softcap, .alibi_slopes = alibi, .alibi_batch_stride = alibi_batch_stride,
      .alibi_shift = 0, .sinks = sinks,
      .score_mod = std::move(score_mod),
      .band_lo = mask.band_lo(), .band_hi = mask.band_hi(),
      .key_lengths = key_lengths_of(who, mask, qd.batch, kd.len), .terms = std::move(terms),
      .rule = std::move(rule),
      .dropout_p = options.dropout_p, .seed = options.seed,
      .amx_parts = k.dtype() != DType::F32                       ? 0
                   : options.precision == MatmulPrecision::High   ? 2
                   : options.precision == MatmulPrecision::Medium ? 1
                                                                  : 0,
      .output = {}, .weights = nullptr, .lse = nullptr, .row_max = nullptr, .row_sum = nullptr,
      .kv_dtype = k.dtype(), .k_bits = operands.k_bits, .v_bits = operands.v_bits,
      .k_quant = operands.k_quant, .v_quant = operands.v_quant,
      .k_scales = operands.k_scales, .v_scales = operands.v_scales, .paged = {},
      .scales_unchecked = scales_unchecked,
  };
  return built;
}

void check_scales(const char* who, BuiltProblem& built, const Tensor& k, const Tensor& v,
                  const AttentionOptions& options) {
  if (!built.problem.scales_unchecked) return;
  const int64_t per_byte = k.dtype() == DType::I4 ? 2 : 1;
  check_quantized(who, "k", k, options.k_scales, k.size(-1) * per_byte);
  check_quantized(who, "v", v, options.v_scales, v.size(-1) * per_byte);
  built.problem.scales_unchecked = false;
}

void bind_forward_outputs(BuiltProblem& built, AttentionResult& result, bool need_weights, const Tensor& q,
                          const Tensor& k, const Tensor& v) {
  const char* who = "scaled_dot_product_attention: ";
  // Before allocating: the results' bytes against the memory limit (src/core/allocator.cpp).
  check_attention_request(who, q, k, v, result, built.output_shape, built.lse_shape,
                          need_weights ? &built.scores_shape : nullptr);
  const auto inputs = {&q, &k, &v};
  prepare_output(who, result.output, "result.output", built.output_shape, inputs, false);
  prepare_output(who, result.lse, "result.lse", built.lse_shape, inputs, true);
  prepare_output(who, result.row_max, "result.row_max", built.lse_shape, inputs, true);
  prepare_output(who, result.row_sum, "result.row_sum", built.lse_shape, inputs, true);
  if (need_weights) {
    prepare_output(who, result.weights, "result.weights", built.scores_shape, inputs, true);
  } else {
    result.weights = Tensor();
  }
  AttentionProblem& p = built.problem;
  p.output = rows_of<float>(result.output);
  p.weights = need_weights ? result.weights.data() : nullptr;
  p.lse = result.lse.data();
  p.row_max = result.row_max.data();
  p.row_sum = result.row_sum.data();
}

void expect_shape(const char* who, const Tensor& t, const char* name, const Shape& shape, const char* what) {
  if (!t.defined()) fail(who, std::string(name) + " is undefined");
  if (t.shape() != shape)
    fail(who, std::string(name) + " is " + t.shape().str() + " but should be " + shape.str() + " (" + what + ")");
}

namespace {

// Row shift and scale of the recomputed weights (problem.hpp), from row_max and row_sum when
// the forward gave them, else from lse, listing the rows whose lse lost precision.
void row_stats(const AttentionResult& forward, BuiltBackwardProblem& built) {
  const bool exact = forward.row_max.defined() && forward.row_sum.defined();
  const std::vector<float> first = exact ? forward.row_max.to_vector() : forward.lse.to_vector();
  const std::vector<float> sums = exact ? forward.row_sum.to_vector() : std::vector<float>();
  built.row_shift.resize(first.size());
  built.row_scale.resize(first.size());
  weight_row_stats(first.data(), exact ? sums.data() : nullptr, first.size(), built.row_shift.data(),
                   built.row_scale.data());
  built.rows_to_restore.clear();
  if (!exact)
    for (size_t r = 0; r < first.size(); ++r)
      if (lse_lost_precision(first[r])) built.rows_to_restore.push_back(static_cast<int64_t>(r));
}
}  // namespace

namespace {
// grads.dbias for the mask's one additive term (AttentionGrads): prepared with the term's shape
// (allocated, or checked: packed, sharing nothing with the inputs) and zeroed, read as the scores
// (B, Hq, Nq, Nk) read the term, stride 0 on its broadcast dims. No such term, or several: reset.
BiasGradView bind_bias_gradient(const char* who, const Mask& mask, const Tensor& q, const Tensor& k, const Tensor& v,
                                const Shape& scores_shape, Tensor& dbias) {
  const Mask::Term* bias = nullptr;
  int additive = 0;
  for (const Mask::Term& term : mask.terms())
    if (term.additive && ++additive == 1) bias = &term;
  if (additive != 1) {
    dbias = Tensor();
    return {};
  }
  prepare_output(who, dbias, "grads.dbias", bias->values.shape(), {&q, &k, &v, &bias->values}, true);
  std::fill_n(dbias.data(), dbias.numel(), 0.0f);
  const MaskTermView view = term_view(who, {dbias, true}, read_dims(who, q, "q"), read_dims(who, k, "k").len,
                                      scores_shape);
  return {dbias.data(), view.stride_b, view.stride_h, view.stride_q, view.stride_k};
}
}  // namespace

void build_backward_problem(BuiltBackwardProblem& built, const Tensor& grad_output, const Tensor& q,
                            const Tensor& k, const Tensor& v, const AttentionResult& forward, AttentionGrads& grads,
                            const AttentionOptions& options) {
  const char* who = "scaled_dot_product_attention_backward: ";
  if (k.defined() && v.defined() && (k.dtype() != DType::F32 || v.dtype() != DType::F32))
    fail(who, "k is " + std::string(to_string(k.dtype())) + " and v is " + std::string(to_string(v.dtype())) +
                  ": the backward needs f32 k and v (16-bit and quantized k/v are for inference); convert with "
                  "to(DType::F32) or dequantize_kv");
  built.forward = build_problem(who, q, k, v, options);
  BuiltProblem& f = built.forward;
  expect_shape(who, grad_output, "grad_output", f.output_shape, "the forward's output");
  expect_shape(who, forward.output, "forward.output", f.output_shape, "q's leading dims + (Nq, Dv)");
  expect_shape(who, forward.lse, "forward.lse", f.lse_shape, "q's leading dims + (Nq)");
  if (forward.row_max.defined()) expect_shape(who, forward.row_max, "forward.row_max", f.lse_shape, "as lse");
  if (forward.row_sum.defined()) expect_shape(who, forward.row_sum, "forward.row_sum", f.lse_shape, "as lse");
  row_stats(forward, built);

  const auto inputs = {&q, &k, &v};
  prepare_output(who, grads.dq, "grads.dq", q.shape(), inputs, false);
  prepare_output(who, grads.dk, "grads.dk", k.shape(), inputs, false);
  prepare_output(who, grads.dv, "grads.dv", v.shape(), inputs, false);
  if (options.sinks.defined()) {
    prepare_output(who, grads.dsinks, "grads.dsinks", options.sinks.shape(), inputs, true);
  } else {
    grads.dsinks = Tensor();
  }
  f.held.push_back(readable(grad_output));
  const Rows<const float> grad_output_rows = rows_of<const float>(f.held.back());
  f.held.push_back(readable(forward.output));
  const Rows<const float> output_rows = rows_of<const float>(f.held.back());
  built.problem = AttentionBackwardProblem{
      .forward = f.problem,
      .output = output_rows, .grad_output = grad_output_rows,
      .row_shift = built.row_shift.data(), .row_scale = built.row_scale.data(),
      .grad_q = rows_of<float>(grads.dq), .grad_k = rows_of<float>(grads.dk), .grad_v = rows_of<float>(grads.dv),
      .grad_sinks = grads.dsinks.defined() ? grads.dsinks.data() : nullptr,
      .grad_bias = bind_bias_gradient(who, options.mask, q, k, v, f.scores_shape, grads.dbias),
  };
}

void align_band_to_end(AttentionProblem& p) {
  const int64_t shift = p.kv_len - p.q_len;
  if (p.band_lo > -Mask::kUnbounded) p.band_lo += shift;
  if (p.band_hi < Mask::kUnbounded) p.band_hi += shift;
}

bool lse_lost_precision(float lse) {
  constexpr float kExactBelow = 128;  // |lse| < 128: half an ulp is at most 2^-18
  return !std::isnan(lse) && lse != kMinusInf && !(std::abs(lse) < kExactBelow);
}

void weight_row_stats(const float* first, const float* sums, size_t rows, float* shift, float* scale) {
  for (size_t r = 0; r < rows; ++r) {
    const bool empty = sums ? sums[r] == 0.0f : first[r] == kMinusInf;
    shift[r] = empty ? kInf : first[r];
    scale[r] = empty ? 0.0f : (sums ? 1.0f / sums[r] : 1.0f);
  }
}

void sink_gradients(const AttentionBackwardProblem& bp) {
  const AttentionProblem& p = bp.forward;
  if (!bp.grad_sinks) return;
  for (int64_t h = 0; h < p.q_heads; ++h) {
    double sum = 0;
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t i = 0; i < p.q_len; ++i) {
        const int64_t r = (b * p.q_heads + h) * p.q_len + i;
        sum += sink_gradient_of_row(p.sinks[h], bp.row_shift[r], bp.row_scale[r], bp.grad_output.row(b, h, i),
                                    bp.output.row(b, h, i), p.value_dim);
      }
    bp.grad_sinks[h] = static_cast<float>(sum);
  }
}

}  // namespace qkv::detail

namespace qkv::detail {
void prepare_result(const char* who, Tensor& t, const char* name, const Shape& shape,
                    std::initializer_list<const Tensor*> inputs, bool packed) {
  prepare_output(who, t, name, shape, inputs, packed);
}
}  // namespace qkv::detail
