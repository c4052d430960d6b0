// The standard workloads W0-W5, defined here and shared by `qkv bench` (tools/qkv/bench.cpp),
// the Google Benchmark target (bench/attention_benchmark.cpp) and, in Python, bench/compare_torch.py,
// so all three measure the same shapes.
//
//   id          shape                                       mask
//   W0          B=1 H=8 N=256 d=64                          causal (the course's CPU benchmark)
//   W1          B=4 H=12 N=512 d=64                         none (BERT-base)
//   W1-softcap  W1 with softcap 30                          (the score modifiers' cost: issue 9's
//   W1-alibi    W1 with ALiBi, the standard slopes           target is each within 15% of W1;
//   W1-sinks    W1 with a sink logit per head                `--workload W1` runs all its rows)
//   W1-bias     W1 with a (1, H, N, N) additive bias, also backward (W1-bias-bwd: the bias's
//               gradient dbias; issue 42's target: within 1.3 x W1-bwd's time)
//   W1-relpos   W1 with a score function as text, `s - 0.1 * abs(q - k)` (a relative-position
//               bias; issue 42's target: <= 1.5 x W1's time; also timed backward)
//   W1-relpos-cpp  the same as a C++ callable (qkv::score_function of a generic lambda; target
//               <= 1.2 x W1's time; also timed backward)
//   W2       B=1 H=12 N=2048 d=64                        causal (GPT-2)
//   W2-full  W2 without the mask: the target is causal <= 0.6 x the time of full
//   W2-summary  W2 with attention summaries (AttentionOptions::summary_top_k = 8): issue 39's
//            target is <= 1.3 x W2's time; `--workload W2-summary` brings W2
//   W2-docs  W2's shape with a mask function, `doc(q) == doc(k)`, 4 equal documents packed in
//            the 2048 tokens (no causal mask: a quarter of the pairs; issue 42's target: <= 0.35 x
//            W2-full's time, the hidden tiles skipped)
//   W3       B=1 Hq=32 Hkv=8 N=4096 d=128                causal (Llama-style GQA)
//   W4       B=1 H=32 d=128, 1 query vs 8192 keys        decode (reported in GB/s of K and V)
//   W4-bf16  W4 with K and V in bfloat16                  (issue 11's target: each <= 0.55 x W4's
//   W4-f16   W4 with K and V in float16                    time; `--workload W4` runs all of W4-*)
//   W4-int8  W4 with K and V int8, a scale per token and head (issue 41's target: <= 0.32 x W4's time)
//   W4-int4  W4 with K and V 4-bit, a scale per 32 values      (issue 41's target: <= 0.22 x W4's time)
//   W4-paged W4 with K and V in a pool of 64-key pages in shuffled order, read through a block
//            table (issue 41's target: within 10% of W4's time)
//   W4-paged-int8  W4-int8's K and V (and scales) in W4-paged's pages: within 10% of W4-int8's
//   decode-<N>k[-bf16]  W4's heads, 1 query vs N = 1, 4, 16, 32 thousand keys, K/V f32 or bf16:
//            the decode sweep in GB/s, only on request (`--workload decode-sweep`: 1 GB of K/V)
//   W5       MultiHeadAttention: batch 2, seq 10, embed 512, 8 heads, no mask (module forward)
//   W7       B=1 H=8 N=16384 d=64, causal linear attention (qkv::linear_attention, elu+1)
//   W7-flash W7's shape and causal mask, softmax attention (Auto = flash; no Reference row: its
//            N x N scores would be 8 GiB): the target is W7 >= 20 x faster; `qkv bench`
//            also fits W7's time slope from N = 4096 to 65536 (target <= 1.1)
//   V1       16 sequences of 70 to 1766 tokens (mean 512; kVarlenLengths), H=12 d=64, causal, packed
//            in one call (cu_seqlens; causal per sequence); `--workload V1` brings V1-padded
//   V1-padded the same sequences padded to (16, 12, 2048, 64) with key lengths (causal & key_lengths):
//            issue 41's target is V1 >= 1.8 x faster, forward and backward (V1-bwd, V1-padded-bwd).
//            Both count the FLOPs of the packed sequences' visible pairs alone.
//   C1       16 sequences sharing a 4096-token prompt, each with 256 tokens of its own, one decode
//            step (Nq = 1), 32 heads of 128 (W4's): qkv::cascade_attention, the prefix's K/V read
//            once for all 16 (kCascadePrefix); `--workload C1` brings C1-separate
//   C1-separate the same step without sharing: one batched decode call over each sequence's own
//            copy of its 4352 keys ((16, 32, 4352, 128) K/V, 2.3 GB): issue 41's target is C1
//            >= 4 x faster. Both count 4 d FLOPs per (query, key) pair of the 4352 keys.
//   W6       B=1 H=8 N=16384 d=64                        causal & (window(255) | strided(256))
//            (Sparse Transformer's strided head; issue 10's target: GFLOP/s on the visible pairs
//            >= 0.5 x W2's dense-causal GFLOP/s in the same run; `--workload W6` brings W2)
//
// A sparse workload counts 4 d FLOPs per visible (query, key) pair (sparse_visible_pairs), not
// per pair of the n x n matrix.
// Attention FLOPs = 4 * B * Hq * Nq * Nk * d (Q K^T and P V, a multiply-add each), half of it
// for causal. W1, W2 and W6 are also timed backward (scaled_dot_product_attention_backward, rows
// "W1-bwd", "W2-bwd", "W6-bwd"), counted as 2.5 x the forward FLOPs (the FlashAttention-2 convention: five
// matrix products instead of two, the recomputed Q K^T included). Linear attention's FLOPs are
// its two N x d x d products, 4 * B * Hq * N * d * Dv, whatever the mask (the causal form's
// intra-chunk block is extra work, not counted). Header-only, public API alone.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>
#include <string_view>

#include "core/huge_pages.hpp"  // decode's K/V on huge pages, as nn::KVCache and nn::PagedKVCache put theirs
#include "qkv/qkv.hpp"

namespace qkv::bench {

enum class WorkloadKind {
  Attention,  // one scaled_dot_product_attention call
  Module,     // one nn::MultiHeadAttention forward (projections + attention)
  Linear,     // one linear_attention call (causal when `causal`)
  Cascade,    // one cascade_attention call: kv_len - kCascadePrefix keys of each sequence's own
};

// The score modifier an attention workload turns on (AttentionOptions), if any.
enum class Modifier {
  None,
  Softcap,  // softcap = kSoftcap
  Alibi,    // alibi_slopes = the standard 2^(-8 (h + 1) / Hq)
  Sinks,    // sinks = one fixed random logit per query head
  RelativePosition,  // score_mod = kRelativePosition
  RelativePositionCpp,  // score_function = the same as a C++ lambda
  Documents,         // mask_mod = kDocuments, doc = kDocumentCount equal documents over the keys
  Bias,     // mask = a (1, Hq, Nq, Nk) additive tensor (a learned bias; its backward returns dbias)
  Packed,   // q, k, v (total, H, d) holding kVarlenLengths' sequences, cu_seqlens_q = cu_seqlens_k
  Padded,   // the same sequences in (B, H, Nq, d), padded, mask & key_lengths(kVarlenLengths)
  Paged,    // k, v as pools of kPageSize-key pages in a shuffled order, block_table + cache_seqlens
};
// The packed workloads' sequence lengths: 16 draws log-uniform in [32, 2048] (numpy
// default_rng(41)), the longest adjusted so that they sum to 8192 (mean 512).
inline constexpr std::array<int64_t, 16> kVarlenLengths = {90, 70, 903, 349, 1089, 163, 386, 154,
                                                           192, 774, 421, 79, 516, 996, 244, 1766};
inline bool is_varlen(Modifier m) { return m == Modifier::Packed || m == Modifier::Padded; }
inline constexpr float kSoftcap = 30.0f;  // Gemma 2's attention softcap
// The cascade workloads' shared prefix: C1's kv_len (4352) is these keys plus each sequence's own.
inline constexpr int64_t kCascadePrefix = 4096;
inline constexpr const char* kRelativePosition = "s - 0.1 * abs(q - k)";
inline constexpr const char* kDocuments = "doc(q) == doc(k)";
inline constexpr int64_t kDocumentCount = 4;
inline constexpr int64_t kPageSize = 64;  // the paged rows' page size (issue 41's target is at 64)

struct Workload {
  std::string_view id;           // "W2"
  std::string_view description;  // "GPT-2"
  WorkloadKind kind;
  int64_t batch;
  int64_t q_heads;
  int64_t kv_heads;  // < q_heads: grouped-query attention
  int64_t q_len;     // Nq
  int64_t kv_len;    // Nk
  int64_t head_dim;  // d, for both keys and values
  bool causal;
  bool decode;       // few queries against a long cache: memory-bound, reported in GB/s
  bool backward = false;  // also timed backward (scaled_dot_product_attention_backward)
  Modifier modifier = Modifier::None;
  bool has_reference = true;  // false: no Reference row (its N x N scores would not fit)
  // Sparse workloads (sparse_stride > 0): the mask is causal & (window(sparse_window) | strided(sparse_stride)).
  int64_t sparse_window = 0, sparse_stride = 0;

  bool is_sparse() const { return sparse_stride > 0; }
  // The mask in Mask::parse's syntax: "causal & (window(255) | strided(256))", "causal" or "none".
  std::string mask_expression() const {
    if (is_sparse())
      return "causal & (window(" + std::to_string(sparse_window) + ") | strided(" + std::to_string(sparse_stride) + "))";
    return causal ? "causal" : "none";
  }
  DType kv_dtype = DType::F32;  // the element type of K and V
  bool sweep = false;           // a decode-sweep row: run only when asked for
  int64_t summary_top_k = 0;    // > 0: the call also returns attention summaries

  // Module workloads only: the layer's width; head_dim = embed_dim / q_heads.
  int64_t embed_dim() const { return q_heads * head_dim; }
  bool is_module() const { return kind == WorkloadKind::Module; }
  bool is_linear() const { return kind == WorkloadKind::Linear; }
  bool is_cascade() const { return kind == WorkloadKind::Cascade; }
};

// W2-full and W2-docs follow W2: `--workload W2` runs all three, since the targets compare them;
// the W1-<modifier> rows follow W1 for the same reason.
// W7-flash follows W7 for the same reason.
inline constexpr std::array<Workload, 36> kWorkloads = {{
    {"W0", "course CPU benchmark", WorkloadKind::Attention, 1, 8, 8, 256, 256, 64, true, false},
    {"W1", "BERT-base", WorkloadKind::Attention, 4, 12, 12, 512, 512, 64, false, false, true},
    {"W1-softcap", "W1, softcap 30", WorkloadKind::Attention, 4, 12, 12, 512, 512, 64, false, false, false,
     Modifier::Softcap},
    {"W1-alibi", "W1, ALiBi", WorkloadKind::Attention, 4, 12, 12, 512, 512, 64, false, false, false, Modifier::Alibi},
    {"W1-sinks", "W1, sinks", WorkloadKind::Attention, 4, 12, 12, 512, 512, 64, false, false, false, Modifier::Sinks},
    {"W1-relpos", "W1, score_mod text", WorkloadKind::Attention, 4, 12, 12, 512, 512, 64, false, false, true,
     Modifier::RelativePosition},
    {"W1-relpos-cpp", "W1, score function in C++", WorkloadKind::Attention, 4, 12, 12, 512, 512, 64, false, false,
     true, Modifier::RelativePositionCpp},
    {"W1-bias", "W1, (1, H, N, N) bias", WorkloadKind::Attention, 4, 12, 12, 512, 512, 64, false, false, true,
     Modifier::Bias},
    {"W2", "GPT-2", WorkloadKind::Attention, 1, 12, 12, 2048, 2048, 64, true, false, true},
    {"W2-full", "W2 unmasked", WorkloadKind::Attention, 1, 12, 12, 2048, 2048, 64, false, false},
    {"W2-summary", "W2, summaries (top 8)", WorkloadKind::Attention, 1, 12, 12, 2048, 2048, 64, true, false, false,
     Modifier::None, false, 0, 0, DType::F32, false, 8},
    {"W2-docs", "W2, 4 documents", WorkloadKind::Attention, 1, 12, 12, 2048, 2048, 64, false, false, false,
     Modifier::Documents},
    {"W3", "Llama GQA", WorkloadKind::Attention, 1, 32, 8, 4096, 4096, 128, true, false},
    {"W4", "decode, KV cache", WorkloadKind::Attention, 1, 32, 32, 1, 8192, 128, false, true},
    {"W4-bf16", "W4, bf16 K/V", WorkloadKind::Attention, 1, 32, 32, 1, 8192, 128, false, true, false,
     Modifier::None, true, 0, 0, DType::BF16},
    {"W4-f16", "W4, f16 K/V", WorkloadKind::Attention, 1, 32, 32, 1, 8192, 128, false, true, false,
     Modifier::None, true, 0, 0, DType::F16},
    {"W4-int8", "W4, int8 K/V", WorkloadKind::Attention, 1, 32, 32, 1, 8192, 128, false, true, false,
     Modifier::None, true, 0, 0, DType::I8},
    {"W4-int4", "W4, int4 K/V", WorkloadKind::Attention, 1, 32, 32, 1, 8192, 128, false, true, false,
     Modifier::None, true, 0, 0, DType::I4},
    {"W4-paged", "W4, 64-key pages shuffled", WorkloadKind::Attention, 1, 32, 32, 1, 8192, 128, false, true, false,
     Modifier::Paged, false},
    {"W4-paged-int8", "W4-int8, 64-key pages shuffled", WorkloadKind::Attention, 1, 32, 32, 1, 8192, 128, false, true,
     false, Modifier::Paged, false, 0, 0, DType::I8},
    {"W5", "MultiHeadAttention", WorkloadKind::Module, 2, 8, 8, 10, 10, 64, false, false},
    {"V1", "16 sequences, packed", WorkloadKind::Attention, 16, 12, 12, 2048, 2048, 64, true, false, true,
     Modifier::Packed, false},
    {"V1-padded", "V1 padded to 2048", WorkloadKind::Attention, 16, 12, 12, 2048, 2048, 64, true, false, true,
     Modifier::Padded, false},
    {"C1", "16 x (4096 shared + 256 own)", WorkloadKind::Cascade, 16, 32, 32, 1, 4096 + 256, 128, false, true,
     false, Modifier::None, false},
    {"C1-separate", "C1 without sharing", WorkloadKind::Attention, 16, 32, 32, 1, 4096 + 256, 128, false, true,
     false, Modifier::None, false},
    {"W6", "strided sparse", WorkloadKind::Attention, 1, 8, 8, 16384, 16384, 64, true, false, true, Modifier::None,
     false, 255, 256},
    {"W7", "linear attention, causal", WorkloadKind::Linear, 1, 8, 8, 16384, 16384, 64, true, false, false,
     Modifier::None, false},
    {"W7-flash", "W7's shape, softmax", WorkloadKind::Attention, 1, 8, 8, 16384, 16384, 64, true, false, false,
     Modifier::None, false},
#define QKV_DECODE_SWEEP_ROW(id, keys, dtype) \
  {id, "decode sweep", WorkloadKind::Attention, 1, 32, 32, 1, keys, 128, false, true, false, Modifier::None, false, 0, 0, dtype, true}
    QKV_DECODE_SWEEP_ROW("decode-1k", 1024, DType::F32),
    QKV_DECODE_SWEEP_ROW("decode-1k-bf16", 1024, DType::BF16),
    QKV_DECODE_SWEEP_ROW("decode-4k", 4096, DType::F32),
    QKV_DECODE_SWEEP_ROW("decode-4k-bf16", 4096, DType::BF16),
    QKV_DECODE_SWEEP_ROW("decode-16k", 16384, DType::F32),
    QKV_DECODE_SWEEP_ROW("decode-16k-bf16", 16384, DType::BF16),
    QKV_DECODE_SWEEP_ROW("decode-32k", 32768, DType::F32),
    QKV_DECODE_SWEEP_ROW("decode-32k-bf16", 32768, DType::BF16),
#undef QKV_DECODE_SWEEP_ROW
}};

// The (query, key) pairs a sparse workload's mask lets through, over every batch and head:
// query i (Nq = Nk, causal) sees min(i, W) + 1 keys of its window and the multiples of S
// behind it beyond the window.
inline double sparse_visible_pairs(const Workload& w) {
  double pairs = 0;
  for (int64_t i = 0; i < w.q_len; ++i) {
    const int64_t window = std::min(i, w.sparse_window) + 1;
    const int64_t strided = i > w.sparse_window ? i / w.sparse_stride - w.sparse_window / w.sparse_stride : 0;
    pairs += static_cast<double>(window + strided);
  }
  return pairs * static_cast<double>(w.batch * w.q_heads);
}

// A workload by id ("W2", case-insensitive), or nullptr.
inline const Workload* find_workload(std::string_view id) {
  const auto lower = [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; };
  for (const Workload& workload : kWorkloads) {
    if (workload.id.size() != id.size()) continue;
    bool same = true;
    for (size_t i = 0; i < id.size(); ++i) same = same && lower(id[i]) == lower(workload.id[i]);
    if (same) return &workload;
  }
  return nullptr;
}

// "(1, 32, 4096, 128) x (1, 8, 4096, 128)", or for a module "x (2, 10, 512), 8 heads".
inline std::string shape_string(const Workload& w) {
  if (w.is_module()) {
    return "x (" + std::to_string(w.batch) + ", " + std::to_string(w.q_len) + ", " + std::to_string(w.embed_dim()) +
           "), " + std::to_string(w.q_heads) + " heads";
  }
  const auto dims = [&](int64_t heads, int64_t len) {
    return "(" + std::to_string(w.batch) + ", " + std::to_string(heads) + ", " + std::to_string(len) + ", " +
           std::to_string(w.head_dim) + ")";
  };
  if (w.is_cascade())  // the shared prefix, then each sequence's own keys
    return dims(w.q_heads, w.q_len) + " x (1, " + std::to_string(w.kv_heads) + ", " + std::to_string(kCascadePrefix) +
           ", " + std::to_string(w.head_dim) + ") + " + dims(w.kv_heads, w.kv_len - kCascadePrefix);
  return dims(w.q_heads, w.q_len) + " x " + dims(w.kv_heads, w.kv_len);
}

// Forward FLOPs of one call. Attention: 4 B Hq Nq Nk d, halved when causal (qkv::analysis::forward_flops,
// include/qkv/analysis.hpp). The modifiers' few operations per score are not counted. Module:
// the four projections (2 B N E^2 each) plus its attention.
inline double forward_flops(const Workload& w) {
  if (w.is_linear())
    return 4.0 * static_cast<double>(w.batch) * static_cast<double>(w.q_heads) * static_cast<double>(w.q_len) *
           static_cast<double>(w.head_dim) * static_cast<double>(w.head_dim);
  if (w.is_sparse()) return 4.0 * static_cast<double>(w.head_dim) * sparse_visible_pairs(w);
  if (is_varlen(w.modifier)) {  // the causal pairs of the packed sequences
    double pairs = 0;
    for (int64_t n : kVarlenLengths) pairs += 0.5 * static_cast<double>(n) * static_cast<double>(n + 1);
    return 4.0 * static_cast<double>(w.head_dim * w.q_heads) * pairs;
  }
  const double attention = analysis::forward_flops(
      {w.batch, w.q_heads, w.kv_heads, w.q_len, w.kv_len, w.head_dim, w.head_dim, w.causal});
  if (!w.is_module()) return attention;
  const double embed = static_cast<double>(w.embed_dim());
  const double projections = 4.0 * 2.0 * static_cast<double>(w.batch) * static_cast<double>(w.q_len) * embed * embed;
  return projections + attention;
}

// Backward FLOPs of one call: 2.5 x the forward (attention workloads only).
inline constexpr double kBackwardFlopsFactor = 2.5;
inline double backward_flops(const Workload& w) { return kBackwardFlopsFactor * forward_flops(w); }

// Bytes of K and V one call must read (in their dtype, quantized ones with their scales): what
// bounds a decode step.
inline double kv_bytes(const Workload& w) {
  const double row = w.kv_dtype == DType::I4 ? static_cast<double>(w.head_dim) / 2
                                             : static_cast<double>(w.head_dim * static_cast<int64_t>(element_size(w.kv_dtype)));
  const double scales = is_quantized(w.kv_dtype) ? 4.0 * static_cast<double>(quantized_groups(w.kv_dtype, w.head_dim)) : 0;
  const double rows = w.is_cascade()  // the prefix once, each sequence's own keys
                          ? static_cast<double>(kCascadePrefix + w.batch * (w.kv_len - kCascadePrefix))
                          : static_cast<double>(w.batch) * static_cast<double>(w.kv_len);
  return 2.0 * rows * static_cast<double>(w.kv_heads) * (row + scales);
}

// The inputs of an attention workload, from fixed seeds.
struct AttentionInputs {
  Tensor q;  // (B, Hq, Nq, d)
  Tensor k;  // (B, Hkv, Nk, d)
  Tensor v;  // (B, Hkv, Nk, d)
  Tensor k_scales, v_scales;  // quantized K/V (int8, int4): their scales, for AttentionOptions
  std::vector<int64_t> block_table;  // paged K/V: (B, Nk / kPageSize) pool pages; k, v the pools
};

// Paged inputs: k and v (B, Hkv, Nk, d) moved into pools (B Nk / kPageSize, kPageSize, Hkv, d) whose
// pages lie in a shuffled order (a fixed seed), and the block table that finds them. The pools are
// advised for huge pages before they are written, as nn::PagedKVCache advises its own (a head's
// rows lie Hkv d elements apart: with 4 KB pages each key costs a TLB entry).
inline AttentionInputs paged_inputs(const Tensor& q, const Tensor& k, const Tensor& v) {
  const int64_t batch = k.size(0), heads = k.size(1), keys = k.size(2), dim = k.size(3);
  const int64_t pages = keys / kPageSize;  // Nk a multiple of the page size
  std::vector<int64_t> table(static_cast<size_t>(batch * pages));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937_64(7));
  const auto pool_of = [&](const Tensor& t) {
    Tensor pool = detail::zeros_on_huge_pages({batch * pages, kPageSize, heads, dim}, DType::F32);
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t j = 0; j < keys; ++j)
          std::copy_n(t.data() + ((b * heads + h) * keys + j) * dim, dim,
                      pool.data() + ((table[static_cast<size_t>(b * pages + j / kPageSize)] * kPageSize +
                                      j % kPageSize) * heads + h) * dim);
    return pool;
  };
  return {q, pool_of(k), pool_of(v), Tensor(), Tensor(), std::move(table)};
}

// A copy of t in memory advised for huge pages before it is written, as nn::KVCache's and
// nn::PagedKVCache's buffers are (detail::zeros_on_huge_pages).
inline Tensor on_huge_pages(const Tensor& t) {
  Tensor out = detail::zeros_on_huge_pages(t.shape(), t.dtype());
  std::memcpy(out.raw_data(), t.raw_data(), static_cast<size_t>(t.numel()) * element_size(t.dtype()));
  return out;
}

// The same pools quantized (quantize_kv of each pool: the rows' bytes and scales paged alike).
inline AttentionInputs paged_inputs(const Tensor& q, const Tensor& k, const Tensor& v, DType dtype) {
  AttentionInputs in = paged_inputs(q, k, v);
  if (!is_quantized(dtype)) return in;
  const QuantizedTensor kq = quantize_kv(in.k, dtype), vq = quantize_kv(in.v, dtype);
  return {q, on_huge_pages(kq.values), on_huge_pages(vq.values), on_huge_pages(kq.scales), on_huge_pages(vq.scales),
          std::move(in.block_table)};
}

inline AttentionInputs make_attention_inputs(const Workload& w) {
  if (w.modifier == Modifier::Packed) {
    int64_t total = 0;
    for (int64_t n : kVarlenLengths) total += n;
    return {Tensor::randn({total, w.q_heads, w.head_dim}, 1), Tensor::randn({total, w.kv_heads, w.head_dim}, 2),
            Tensor::randn({total, w.kv_heads, w.head_dim}, 3), Tensor(), Tensor(), {}};
  }
  const Tensor k = Tensor::randn({w.batch, w.kv_heads, w.kv_len, w.head_dim}, /*seed=*/2);
  const Tensor v = Tensor::randn({w.batch, w.kv_heads, w.kv_len, w.head_dim}, /*seed=*/3);
  const Tensor q = Tensor::randn({w.batch, w.q_heads, w.q_len, w.head_dim}, /*seed=*/1);
  if (w.modifier == Modifier::Paged) return paged_inputs(q, k, v, w.kv_dtype);
  // A decode workload's K/V (and scales) stand for a KV cache: on huge pages, as nn::KVCache's.
  const auto cache = [&](const Tensor& t) { return w.decode ? on_huge_pages(t) : t; };
  if (!is_quantized(w.kv_dtype)) return {q, cache(k.to(w.kv_dtype)), cache(v.to(w.kv_dtype)), Tensor(), Tensor(), {}};
  const QuantizedTensor kq = quantize_kv(k, w.kv_dtype), vq = quantize_kv(v, w.kv_dtype);
  return {q, cache(kq.values), cache(vq.values), cache(kq.scales), cache(vq.scales), {}};
}

// A cascade workload's inputs, from fixed seeds: q (B, Hq, 1, d), the prefix (1, Hkv, kCascadePrefix,
// d) and the suffixes (B, Hkv, kv_len - kCascadePrefix, d).
struct CascadeInputs {
  Tensor q, prefix_k, prefix_v, suffix_k, suffix_v;
};

// K/V on huge pages, as the decode workloads' (make_attention_inputs), so that C1 and
// C1-separate read the same kind of pages.
inline CascadeInputs make_cascade_inputs(const Workload& w) {
  const int64_t own = w.kv_len - kCascadePrefix;
  return {Tensor::randn({w.batch, w.q_heads, w.q_len, w.head_dim}, 1),
          on_huge_pages(Tensor::randn({1, w.kv_heads, kCascadePrefix, w.head_dim}, 2).to(w.kv_dtype)),
          on_huge_pages(Tensor::randn({1, w.kv_heads, kCascadePrefix, w.head_dim}, 3).to(w.kv_dtype)),
          on_huge_pages(Tensor::randn({w.batch, w.kv_heads, own, w.head_dim}, 7).to(w.kv_dtype)),
          on_huge_pages(Tensor::randn({w.batch, w.kv_heads, own, w.head_dim}, 8).to(w.kv_dtype))};
}

inline LinearAttentionOptions make_linear_options(const Workload& w) {
  LinearAttentionOptions options;
  options.causal = w.causal;
  return options;
}

inline AttentionOptions make_attention_options(const Workload& w, Backend backend,
                                               MatmulPrecision precision = MatmulPrecision::Highest) {
  AttentionOptions options;
  if (w.causal) options.mask = Mask::causal();
  if (w.is_sparse()) options.mask = Mask::parse(w.mask_expression());
  options.backend = backend;
  options.precision = precision;
  options.summary_top_k = w.summary_top_k;
  switch (w.modifier) {
    case Modifier::None:
      break;
    case Modifier::Softcap:
      options.softcap = kSoftcap;
      break;
    case Modifier::Alibi:
      options.alibi_slopes = Tensor::empty({w.q_heads});
      for (int64_t h = 0; h < w.q_heads; ++h)
        options.alibi_slopes.data()[h] =
            static_cast<float>(std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(w.q_heads)));
      break;
    case Modifier::Sinks:
      options.sinks = Tensor::randn({w.q_heads}, /*seed=*/5);
      break;
    case Modifier::RelativePosition:
      options.score_mod = kRelativePosition;
      break;
    case Modifier::RelativePositionCpp:
      // |q - k| converted once, outside any branch: GCC vectorises that (docs/flex.md, "Writing a
      // callable that vectorises")
      options.score_function = score_function([](auto s, int64_t, int64_t, int64_t q, int64_t k) {
        return s - 0.1f * static_cast<float>(std::abs(q - k));
      });
      break;
    case Modifier::Documents: {
      Tensor doc = Tensor::empty({w.kv_len});
      for (int64_t j = 0; j < w.kv_len; ++j) doc.data()[j] = static_cast<float>(j * kDocumentCount / w.kv_len);
      options.mask_mod = kDocuments;
      options.mod_inputs = {{"doc", doc}};
      break;
    }
    case Modifier::Bias:
      options.mask = options.mask & Mask::additive(Tensor::randn({1, w.q_heads, w.q_len, w.kv_len}, /*seed=*/6));
      break;
    case Modifier::Packed:
      options.cu_seqlens_q = {0};
      for (int64_t n : kVarlenLengths) options.cu_seqlens_q.push_back(options.cu_seqlens_q.back() + n);
      options.cu_seqlens_k = options.cu_seqlens_q;
      break;
    case Modifier::Padded:
      options.mask = options.mask & Mask::key_lengths({kVarlenLengths.begin(), kVarlenLengths.end()});
      break;
    case Modifier::Paged:  // the block table comes with the inputs
      options.cache_seqlens.assign(static_cast<size_t>(w.batch), w.kv_len);
      break;
  }
  return options;
}

// The same with the inputs' scales when K and V are quantized.
inline AttentionOptions make_attention_options(const Workload& w, const AttentionInputs& in, Backend backend,
                                               MatmulPrecision precision = MatmulPrecision::Highest) {
  AttentionOptions options = make_attention_options(w, backend, precision);
  options.k_scales = in.k_scales;
  options.v_scales = in.v_scales;
  options.block_table = in.block_table;
  return options;
}

// What a backward call needs besides q, k, v: an upstream gradient (fixed seed) and the forward
// result on the same inputs and options (its output and lse).
struct BackwardInputs {
  Tensor grad_output;      // shaped as the forward output
  AttentionResult forward;
};

// (The workload is not read: the gradient takes the forward output's shape, packed or not.)
inline BackwardInputs make_backward_inputs(const Workload& /*w*/, const AttentionInputs& in,
                                           const AttentionOptions& options) {
  BackwardInputs out;
  out.forward = scaled_dot_product_attention(in.q, in.k, in.v, options);
  out.grad_output = Tensor::randn(out.forward.output.shape(), /*seed=*/4);
  return out;
}

// The layer and input of a module workload, in eval mode (no dropout), its attention at `precision`.
struct ModuleInputs {
  nn::MultiHeadAttention layer;
  Tensor x;  // (B, N, embed_dim)
};

inline ModuleInputs make_module_inputs(const Workload& w, MatmulPrecision precision = MatmulPrecision::Highest) {
  ModuleInputs inputs{nn::MultiHeadAttention(w.embed_dim(), w.q_heads, {.seed = 42, .precision = precision}),
                      Tensor::randn({w.batch, w.q_len, w.embed_dim()}, /*seed=*/1)};
  inputs.layer.eval();
  return inputs;
}

}  // namespace qkv::bench
