// The functional core: scaled dot-product attention, softmax(Q K^T * scale + mask) V.
// Every front end (qkv::nn, the CLI, Python) goes through this one call. It checks its
// arguments once, then hands a normalised problem to a kernel.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string_view>

#include "qkv/mask.hpp"
#include "qkv/tensor.hpp"

namespace qkv {

enum class Backend {
  Auto,       // Decode for few queries (<= 64) over many keys, else Flash; Reference for weights
  Reference,  // the textbook algorithm, scores materialised: the oracle of every test
  Flash,      // tiled, online softmax, SIMD + threads, never an n x n matrix; no weights
  Decode,     // few queries against a long KV cache, keys split across threads; no weights
};
std::string_view to_string(Backend backend);
std::ostream& operator<<(std::ostream& os, Backend backend);

struct AttentionOptions {
  Mask mask;                        // none by default
  std::optional<float> scale;       // default 1 / sqrt(Dk)
  float dropout_p = 0;              // dropout on the weights (training); 0 <= p < 1
  uint64_t seed = 0;                // picks the dropped elements, see dropout_keeps()
  bool need_weights = false;        // also return the attention weights
  Backend backend = Backend::Auto;
};

// Shapes, with L = q's leading dims ((), (B) or (B, Hq) for rank 2, 3 or 4):
//   output  L + (Nq, Dv)
//   weights L + (Nq, Nk), only when need_weights; after dropout, as applied to V
//   lse     L + (Nq), the log-sum-exp of each row's scaled, masked scores (-inf: no key visible)
struct AttentionResult {
  Tensor output;
  Tensor weights;
  Tensor lse;
};

// q: (B, Hq, Nq, Dk)  k: (B, Hkv, Nk, Dk)  v: (B, Hkv, Nk, Dv), Hq a multiple of Hkv
// (grouped-query: query head h reads key/value head h / (Hq / Hkv), nothing is copied).
// Rank 3 (B, N, D) and rank 2 (N, D) are one head. A query that sees no key gets an output of
// zeros, weights of zeros and lse = -inf, never NaN. Bad arguments throw qkv::Error.
AttentionResult scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const AttentionOptions& options = {});

// The same, writing into `result`: each of its tensors that is defined must already have the
// shape above and be contiguous, and is overwritten in place; undefined ones are allocated (and
// weights is reset when not asked for). Calling it again with the same `result` allocates
// nothing, so a loop pays for fresh pages once. The outputs must not share storage with q, k, v.
void scaled_dot_product_attention_into(const Tensor& q, const Tensor& k, const Tensor& v, AttentionResult& result,
                                       const AttentionOptions& options = {});

// Gradients of scaled_dot_product_attention with respect to q, k and v, shaped as q, k and v.
struct AttentionGrads { Tensor dq, dk, dv; };
// grad_output: shaped as forward.output. `forward` is the result of the forward call on the same
// q, k, v and options (its output and lse are used; the weights are recomputed from lse).
// options.backend: Reference, Flash, or Auto (Flash). Decode has no backward: Auto/Flash serve it.
AttentionGrads scaled_dot_product_attention_backward(const Tensor& grad_output, const Tensor& q, const Tensor& k,
                                                     const Tensor& v, const AttentionResult& forward,
                                                     const AttentionOptions& options = {});

// The dropout decision for one weight: a counter-based hash of (seed, batch, head, query, key),
// so every kernel drops exactly the same elements. True = kept (and scaled by 1 / (1 - p)).
bool dropout_keeps(uint64_t seed, int64_t batch, int64_t head, int64_t query, int64_t key,
                   float p);

}  // namespace qkv
