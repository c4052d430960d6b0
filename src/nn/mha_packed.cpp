// MultiHeadAttention on a packed batch (include/qkv/nn.hpp, forward_packed): the sequences' tokens
// end to end in one (total_tokens, embed_dim) matrix, so the projections are one GEMM each over
// every token and no padding is computed; each sequence is rotated from position 0 on a view of
// its rows, and the attention is one scaled_dot_product_attention call with cu_seqlens (the packed
// batch, src/attention/varlen.cpp), which reads the (total, H, hd) heads in place and writes its
// output straight into out_proj's input.
#include <string>
#include <vector>

#include "nn/module_lock.hpp"
#include "qkv/nn.hpp"

namespace qkv::nn {

MultiHeadAttentionOutput MultiHeadAttention::forward_packed(const Tensor& x, const std::vector<int64_t>& cu_seqlens,
                                                            const Mask& mask) const {
  const std::shared_lock lock(lock_.mutex().mutex);  // reads the module only (include/qkv/nn.hpp)
  const std::string who = "MultiHeadAttention::forward_packed: ";
  if (!x.defined() || x.dim() != 2 || x.size(1) != embed_dim_)
    throw Error(who + "x is " + (x.defined() ? x.shape().str() : std::string("undefined")) +
                " but should be (total_tokens, " + std::to_string(embed_dim_) + ")");
  if (options_.attention == AttentionKind::Linear)
    throw Error(who + "a packed batch runs softmax attention; this layer uses linear attention");
  if (relative_position_bias) throw Error(who + "relative_position_bias is not taken on a packed batch yet");
  const int64_t total = x.size(0), hd = head_dim();

  // ---- 1. project every token at once, 2. split into heads: (total, H, hd) views
  const Tensor q = q_proj.apply(x).reshape({total, num_heads_, hd});
  const Tensor k = k_proj.apply(x).reshape({total, num_kv_heads_, hd});
  const Tensor v = v_proj.apply(x).reshape({total, num_kv_heads_, hd});

  AttentionOptions attention;
  attention.mask = options_.causal ? mask & Mask::causal() : mask;
  attention.softcap = options_.softcap;
  attention.alibi_slopes = alibi_slopes_;
  attention.sinks = sinks;
  attention.precision = options_.precision;
  attention.cu_seqlens_q = attention.cu_seqlens_k = cu_seqlens;
  // ---- 2b. rotate each sequence from position 0; the rotation reads the offsets before the
  // attention call checks them, so their bounds are checked here first
  if (rotary_) {
    for (size_t b = 0; b + 1 < cu_seqlens.size(); ++b) {
      const int64_t start = cu_seqlens[b], length = cu_seqlens[b + 1] - start;
      if (start < 0 || length < 0 || cu_seqlens[b + 1] > total)
        throw Error(who + "cu_seqlens[" + std::to_string(b) + "] = " + std::to_string(start) + ", cu_seqlens[" +
                    std::to_string(b + 1) + "] = " + std::to_string(cu_seqlens[b + 1]) +
                    ": the offsets must be non-decreasing within [0, " + std::to_string(total) + "]");
      for (const Tensor* heads : {&q, &k})
        rotary_->apply_inplace(heads->narrow(0, start, length).transpose(0, 1).unsqueeze(0), {0});
    }
  }
  // ---- 3. attend, each sequence to its own tokens, into (total, H, hd) = out_proj's input
  const Tensor concatenated = Tensor::empty({total, num_heads_, hd});
  AttentionResult result;
  result.output = concatenated;
  scaled_dot_product_attention_into(q, k, v, result, attention);
  // ---- 4. the heads side by side (already), 5. output projection
  MultiHeadAttentionOutput out;
  out.output = out_proj.apply(concatenated.reshape({total, embed_dim_}));
  return out;
}

}  // namespace qkv::nn
