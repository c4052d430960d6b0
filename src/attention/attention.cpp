// qkv::scaled_dot_product_attention and its backward: check every argument once, normalise the
// options into an AttentionProblem (problem.hpp, built by one helper for both directions) and
// hand it to a kernel. Kernels check nothing; every error a user can make is caught here, with a
// message that names the shapes or values involved.
#include "qkv/attention.hpp"

#include <cmath>
#include <ostream>
#include <sstream>

#include "attention/kernels.hpp"
#include "memory.hpp"
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

constexpr const char* kForward = "scaled_dot_product_attention: ";
constexpr const char* kBackward = "scaled_dot_product_attention_backward: ";

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

// Checks that a tensor mask broadcasts to the scores (B, Hq, Nq, Nk) and returns how a kernel
// reads it. 2-D is (Nq, Nk), 3-D (B, Nq, Nk), 4-D (B, Hq, Nq, Nk); any dim may also be 1.
detail::MaskTermView term_view(const char* who, const Mask::Term& term, const Tensor& packed, const Dims& q,
                               int64_t kv_len, const Shape& scores_shape) {
  const Shape& s = term.values.shape();
  const int64_t rank = static_cast<int64_t>(s.size());
  auto broadcast_error = [&] {
    fail(who, std::string("mask ") + (term.additive ? "additive " : "keep ") + s.str() +
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

// What both directions share: q, k, v and the options checked and normalised into a problem
// whose q, k, v, scale, masks and dropout are set (output, weights and lse left null), the
// shapes of the forward's results, and the packed copies the problem points into.
struct CheckedProblem {
  detail::AttentionProblem problem;
  Shape output_shape, lse_shape, scores_shape;  // L + (Nq, Dv), L + (Nq), L + (Nq, Nk)
  Tensor qc, kc, vc;                            // contiguous q, k, v
  std::vector<Tensor> packed_terms;             // contiguous mask tensors
};

CheckedProblem check_problem(const char* who, const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionOptions& options) {
  // ---- shapes
  const Dims qd = read_dims(who, q, "q");
  const Dims kd = read_dims(who, k, "k");
  const Dims vd = read_dims(who, v, "v");
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

  // ---- scalar options
  const float scale = options.scale.value_or(1.0f / std::sqrt(static_cast<float>(qd.dim)));
  if (!std::isfinite(scale) || scale <= 0) fail(who, "scale must be finite and positive, got " + format_float(scale));
  if (!(options.dropout_p >= 0 && options.dropout_p < 1))
    fail(who, "dropout_p must be in [0, 1), got " + format_float(options.dropout_p));

  // ---- result shapes: q's leading dims, then the per-row sizes
  std::vector<int64_t> lead(q.shape().begin(), q.shape().end() - 2);
  auto with = [&](std::initializer_list<int64_t> tail) {
    std::vector<int64_t> dims = lead;
    dims.insert(dims.end(), tail);
    return Shape(std::move(dims));
  };
  CheckedProblem checked;
  checked.output_shape = with({qd.len, vd.dim});
  checked.lse_shape = with({qd.len});
  checked.scores_shape = with({qd.len, kd.len});

  // ---- the mask, normalised
  const Mask& mask = options.mask;
  std::vector<int64_t> key_lengths(static_cast<size_t>(qd.batch), kd.len);
  if (mask.has_key_lengths()) {
    const auto& lengths = mask.lengths();
    if (static_cast<int64_t>(lengths.size()) != qd.batch)
      fail(who, "mask key_lengths has " + std::to_string(lengths.size()) + " lengths but the batch is " +
                    std::to_string(qd.batch));
    for (size_t b = 0; b < lengths.size(); ++b) {
      if (lengths[b] < 0 || lengths[b] > kd.len)
        fail(who, "mask key_lengths[" + std::to_string(b) + "] = " + std::to_string(lengths[b]) +
                      " is outside [0, " + std::to_string(kd.len) + "]");
      key_lengths[b] = lengths[b];
    }
  }
  std::vector<detail::MaskTermView> terms;
  for (const Mask::Term& term : mask.terms()) {
    checked.packed_terms.push_back(term.values.contiguous());
    terms.push_back(term_view(who, term, checked.packed_terms.back(), qd, kd.len, checked.scores_shape));
  }

  checked.qc = q.contiguous();
  checked.kc = k.contiguous();
  checked.vc = v.contiguous();
  checked.problem = detail::AttentionProblem{
      .batch = qd.batch, .q_heads = qd.heads, .kv_heads = kd.heads,
      .q_len = qd.len, .kv_len = kd.len, .head_dim = qd.dim, .value_dim = vd.dim,
      .q = checked.qc.data(), .k = checked.kc.data(), .v = checked.vc.data(), .scale = scale,
      .band_lo = mask.band_lo(), .band_hi = mask.band_hi(),
      .key_lengths = std::move(key_lengths), .terms = std::move(terms),
      .dropout_p = options.dropout_p, .seed = options.seed,
      .output = nullptr, .weights = nullptr, .lse = nullptr,
  };
  return checked;
}

// A caller-provided output: used as it is when it fits, allocated when undefined.
void prepare_output(Tensor& t, const char* name, const Shape& shape, const Tensor& q, const Tensor& k,
                    const Tensor& v) {
  if (!t.defined()) {
    t = Tensor::empty(shape);
    return;
  }
  if (t.shape() != shape)
    fail(kForward, std::string("result.") + name + " is " + t.shape().str() + " but should be " + shape.str());
  if (!t.is_contiguous()) fail(kForward, std::string("result.") + name + " " + t.shape().str() + " is not contiguous");
  for (auto [input_name, input] : {std::pair{"q", &q}, {"k", &k}, {"v", &v}})
    if (t.shares_storage_with(*input))
      fail(kForward, std::string("result.") + name + " shares storage with " + input_name);
}

// A backward input that must have the shape of a forward result.
void expect_shape(const Tensor& t, const char* name, const Shape& shape, const char* what) {
  if (!t.defined()) fail(kBackward, std::string(name) + " is undefined");
  if (t.shape() != shape)
    fail(kBackward, std::string(name) + " is " + t.shape().str() + " but should be " + shape.str() + " (" + what + ")");
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
  CheckedProblem checked = check_problem(kForward, q, k, v, options);

  if ((options.backend == Backend::Flash || options.backend == Backend::Decode) && options.need_weights)
    fail(kForward, "backend " + std::string(to_string(options.backend)) +
                       " never materialises the weights; use Backend::Reference or Backend::Auto with need_weights");

  // Before allocating: the results' bytes against the memory limit (src/memory.cpp).
  detail::check_attention_request(kForward, q, k, v, result, checked.output_shape, checked.lse_shape,
                                  options.need_weights ? &checked.scores_shape : nullptr);
  prepare_output(result.output, "output", checked.output_shape, q, k, v);
  prepare_output(result.lse, "lse", checked.lse_shape, q, k, v);
  if (options.need_weights) {
    prepare_output(result.weights, "weights", checked.scores_shape, q, k, v);
  } else {
    result.weights = Tensor();
  }

  detail::AttentionProblem& problem = checked.problem;
  problem.output = result.output.data();
  problem.weights = options.need_weights ? result.weights.data() : nullptr;
  problem.lse = result.lse.data();
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

AttentionGrads scaled_dot_product_attention_backward(const Tensor& grad_output, const Tensor& q, const Tensor& k,
                                                     const Tensor& v, const AttentionResult& forward,
                                                     const AttentionOptions& options) {
  CheckedProblem checked = check_problem(kBackward, q, k, v, options);
  expect_shape(grad_output, "grad_output", checked.output_shape, "the forward's output");
  expect_shape(forward.output, "forward.output", checked.output_shape, "q's leading dims + (Nq, Dv)");
  expect_shape(forward.lse, "forward.lse", checked.lse_shape, "q's leading dims + (Nq)");

  const Tensor grad_output_c = grad_output.contiguous();
  const Tensor output_c = forward.output.contiguous();
  const Tensor lse_c = forward.lse.contiguous();
  AttentionGrads grads{Tensor::empty(q.shape()), Tensor::empty(k.shape()), Tensor::empty(v.shape())};
  const detail::AttentionBackwardProblem problem{
      .forward = std::move(checked.problem),
      .output = output_c.data(), .lse = lse_c.data(), .grad_output = grad_output_c.data(),
      .grad_q = grads.dq.data(), .grad_k = grads.dk.data(), .grad_v = grads.dv.data(),
  };
  // ---- dispatch: the reference when asked for, else flash (decode has no backward; a forward
  // that ran on decode has the same output and lse, which is all backward reads).
  if (options.backend == Backend::Reference) {
    detail::reference_attention_backward(problem);
  } else {
    detail::flash_attention_backward(problem);
  }
  return grads;
}

}  // namespace qkv
