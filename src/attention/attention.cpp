// qkv::scaled_dot_product_attention: checks every argument once, normalises the options into an
// AttentionProblem (problem.hpp) and hands it to a kernel. Kernels check nothing; every error a
// user can make is caught here, with a message that names the shapes or values involved.
#include "qkv/attention.hpp"

#include <cmath>
#include <ostream>
#include <sstream>

#include "attention/kernels.hpp"
#include "random.hpp"

namespace qkv {

std::string_view to_string(Backend backend) {
  switch (backend) {
    case Backend::Auto: return "Auto";
    case Backend::Reference: return "Reference";
    case Backend::Flash: return "Flash";
    case Backend::Decode: return "Decode";
  }
  return "unknown";
}

std::ostream& operator<<(std::ostream& os, Backend backend) { return os << to_string(backend); }

bool dropout_keeps(uint64_t seed, int64_t batch, int64_t head, int64_t query, int64_t key, float p) {
  return detail::counter_uniform(seed, static_cast<uint64_t>(batch), static_cast<uint64_t>(head),
                                 static_cast<uint64_t>(query), static_cast<uint64_t>(key)) >= p;
}

namespace detail {
bool dropout_keeps(const AttentionProblem& problem, int64_t b, int64_t h, int64_t i, int64_t j) {
  return qkv::dropout_keeps(problem.seed, b, h, i, j, problem.dropout_p);
}
}  // namespace detail

namespace {

constexpr const char* kWho = "scaled_dot_product_attention: ";

[[noreturn]] void fail(const std::string& message) { throw Error(kWho + message); }

std::string format_float(float x) {
  std::ostringstream os;
  os << x;
  return os.str();
}

// The sizes of one q/k/v argument read as (B, H, N, D) whatever its rank.
struct Dims {
  int64_t batch, heads, len, dim;
};

Dims read_dims(const Tensor& t, const char* name) {
  if (!t.defined()) fail(std::string(name) + " is undefined");
  const Shape& s = t.shape();
  switch (s.size()) {
    case 2: return {1, 1, s[0], s[1]};
    case 3: return {s[0], 1, s[1], s[2]};
    case 4: return {s[0], s[1], s[2], s[3]};
    default: fail(std::string(name) + " is " + s.str() + ": rank must be 2, 3 or 4");
  }
}

std::string pair(const char* a, const Tensor& ta, const char* b, const Tensor& tb) {
  return std::string(a) + " is " + ta.shape().str() + " but " + b + " is " + tb.shape().str();
}

// Checks that a tensor mask broadcasts to the scores (B, Hq, Nq, Nk) and returns how a kernel
// reads it. 2-D is (Nq, Nk), 3-D (B, Nq, Nk), 4-D (B, Hq, Nq, Nk); any dim may also be 1.
detail::MaskTermView term_view(const Mask::Term& term, const Tensor& packed, const Dims& q, int64_t kv_len,
                               const Shape& scores_shape) {
  const Shape& s = term.values.shape();
  const int64_t rank = static_cast<int64_t>(s.size());
  auto broadcast_error = [&] {
    fail(std::string("mask ") + (term.additive ? "additive " : "keep ") + s.str() +
         " does not broadcast to the scores " + scores_shape.str());
  };
  if (rank < 2 || rank > 4) broadcast_error();
  // The term's dims aligned to (B, H, Nq, Nk); absent leading dims broadcast.
  const int64_t target[4] = {q.batch, q.heads, q.len, kv_len};
  int64_t sizes[4] = {1, 1, 1, 1};
  if (rank == 2) { sizes[2] = s[0]; sizes[3] = s[1]; }
  if (rank == 3) { sizes[0] = s[0]; sizes[2] = s[1]; sizes[3] = s[2]; }
  if (rank == 4) { for (int d = 0; d < 4; ++d) sizes[d] = s[d]; }
  for (int d = 0; d < 4; ++d)
    if (sizes[d] != target[d] && sizes[d] != 1) broadcast_error();
  // Packed strides of the aligned sizes, zeroed where the dim broadcasts.
  int64_t strides[4];
  int64_t stride = 1;
  for (int d = 3; d >= 0; --d) {
    strides[d] = sizes[d] == 1 ? 0 : stride;
    stride *= sizes[d];
  }
  return {packed.data(), strides[0], strides[1], strides[2], strides[3], term.additive};
}

// A caller-provided output: used as it is when it fits, allocated when undefined.
void prepare_output(Tensor& t, const char* name, const Shape& shape, const Tensor& q, const Tensor& k,
                    const Tensor& v) {
  if (!t.defined()) {
    t = Tensor::empty(shape);
    return;
  }
  if (t.shape() != shape) fail(std::string("result.") + name + " is " + t.shape().str() + " but should be " + shape.str());
  if (!t.is_contiguous()) fail(std::string("result.") + name + " " + t.shape().str() + " is not contiguous");
  for (auto [input_name, input] : {std::pair{"q", &q}, {"k", &k}, {"v", &v}})
    if (t.shares_storage_with(*input)) fail(std::string("result.") + name + " shares storage with " + input_name);
}

}  // namespace

AttentionResult scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const AttentionOptions& options) {
  AttentionResult result;
  scaled_dot_product_attention_into(q, k, v, result, options);
  return result;
}

void scaled_dot_product_attention_into(const Tensor& q, const Tensor& k, const Tensor& v, AttentionResult& result,
                                       const AttentionOptions& options) {
  // ---- shapes
  const Dims qd = read_dims(q, "q");
  const Dims kd = read_dims(k, "k");
  const Dims vd = read_dims(v, "v");
  if (k.dim() != q.dim()) fail(pair("q", q, "k", k) + ": ranks differ");
  if (v.dim() != k.dim()) fail(pair("k", k, "v", v) + ": ranks differ");
  if (kd.dim != qd.dim) fail(pair("q", q, "k", k) + ": head dims differ");
  if (kd.batch != qd.batch) fail(pair("q", q, "k", k) + ": batch sizes differ");
  if (vd.batch != kd.batch) fail(pair("k", k, "v", v) + ": batch sizes differ");
  if (vd.heads != kd.heads) fail(pair("k", k, "v", v) + ": head counts differ");
  if (vd.len != kd.len) fail(pair("k", k, "v", v) + ": key and value lengths differ");
  if (qd.dim < 1) fail("q is " + q.shape().str() + ": head dim must be at least 1");
  if (kd.heads < 1 || qd.heads % kd.heads != 0)
    fail(pair("q", q, "k", k) + ": query heads (" + std::to_string(qd.heads) +
         ") must be a multiple of key/value heads (" + std::to_string(kd.heads) + ")");

  // ---- scalar options
  const float scale = options.scale.value_or(1.0f / std::sqrt(static_cast<float>(qd.dim)));
  if (!std::isfinite(scale) || scale <= 0) fail("scale must be finite and positive, got " + format_float(scale));
  if (!(options.dropout_p >= 0 && options.dropout_p < 1))
    fail("dropout_p must be in [0, 1), got " + format_float(options.dropout_p));

  // ---- output shapes: q's leading dims, then the per-row sizes
  std::vector<int64_t> lead(q.shape().begin(), q.shape().end() - 2);
  auto with = [&](std::initializer_list<int64_t> tail) {
    std::vector<int64_t> dims = lead;
    dims.insert(dims.end(), tail);
    return Shape(std::move(dims));
  };
  const Shape scores_shape = with({qd.len, kd.len});

  // ---- the mask, normalised
  const Mask& mask = options.mask;
  std::vector<int64_t> key_lengths(static_cast<size_t>(qd.batch), kd.len);
  if (mask.has_key_lengths()) {
    const auto& lengths = mask.lengths();
    if (static_cast<int64_t>(lengths.size()) != qd.batch)
      fail("mask key_lengths has " + std::to_string(lengths.size()) + " lengths but the batch is " +
           std::to_string(qd.batch));
    for (size_t b = 0; b < lengths.size(); ++b) {
      if (lengths[b] < 0 || lengths[b] > kd.len)
        fail("mask key_lengths[" + std::to_string(b) + "] = " + std::to_string(lengths[b]) + " is outside [0, " +
             std::to_string(kd.len) + "]");
      key_lengths[b] = lengths[b];
    }
  }
  std::vector<Tensor> packed_terms;  // keeps contiguous copies alive for the call
  std::vector<detail::MaskTermView> terms;
  for (const Mask::Term& term : mask.terms()) {
    packed_terms.push_back(term.values.contiguous());
    terms.push_back(term_view(term, packed_terms.back(), qd, kd.len, scores_shape));
  }

  if ((options.backend == Backend::Flash || options.backend == Backend::Decode) && options.need_weights)
    fail("backend " + std::string(to_string(options.backend)) +
         " never materialises the weights; use Backend::Reference or Backend::Auto with need_weights");

  const Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  prepare_output(result.output, "output", with({qd.len, vd.dim}), q, k, v);
  prepare_output(result.lse, "lse", with({qd.len}), q, k, v);
  if (options.need_weights) {
    prepare_output(result.weights, "weights", scores_shape, q, k, v);
  } else {
    result.weights = Tensor();
  }

  detail::AttentionProblem problem{
      .batch = qd.batch, .q_heads = qd.heads, .kv_heads = kd.heads,
      .q_len = qd.len, .kv_len = kd.len, .head_dim = qd.dim, .value_dim = vd.dim,
      .q = qc.data(), .k = kc.data(), .v = vc.data(), .scale = scale,
      .band_lo = mask.band_lo(), .band_hi = mask.band_hi(),
      .key_lengths = std::move(key_lengths), .terms = std::move(terms),
      .dropout_p = options.dropout_p, .seed = options.seed,
      .output = result.output.data(),
      .weights = options.need_weights ? result.weights.data() : nullptr,
      .lse = result.lse.data(),
  };
  // ---- dispatch, in one place: only the reference materialises weights; of the fused kernels,
  // decode serves few queries against many keys, flash the rest.
  Backend backend = options.backend;
  if (backend == Backend::Auto) {
    if (options.need_weights) {
      backend = Backend::Reference;
    } else {
      backend = detail::decode_is_faster(problem) ? Backend::Decode : Backend::Flash;
    }
  }
  switch (backend) {
    case Backend::Reference: detail::reference_attention(problem); break;
    case Backend::Flash: detail::flash_attention(problem); break;
    case Backend::Decode: detail::decode_attention(problem); break;
    case Backend::Auto: break;  // resolved above
  }
}

}  // namespace qkv
