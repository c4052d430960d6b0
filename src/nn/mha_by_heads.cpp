// MultiHeadAttention's inference forward(x) for few rows, by heads: one OpenMP region in which each
// thread projects the q, k and v of the KV heads it is dealt (its own share first, then heads
// taken from a slower thread's), attends over them (the functional core, on views of those
// heads) and, after one barrier, computes its share of the output projection's columns.
//
// Why: the general forward splits each projection's output columns between the threads and runs
// a small attention on the calling thread, so the attention read half of q, k and v from the other
// core's cache, and the out-projection's second thread read all of its input from the first's.
// Split by heads, q, k and v stay in the cache of the core that wrote them, the attention runs on
// every thread, and one region replaces two (docs/performance-log.md, "W5 by heads").
//
// The arithmetic is the general path's, step for step: the same GEMM kernel (Small) computes each
// output column from the same row of W, and each head's attention is a core call on that head.
// Auto picks its kernel per call from the call's own items and one thread (decode.cpp's
// decode_is_faster), so a group's call can take another kernel than the whole call does: with
// 9-64 queries and fewer flash items than threads the whole call runs decode and a group flash;
// with at most 8 queries the other way round where decode's items are fewer than the threads.
// The outputs then agree to rounding rather than bit for bit (tests/nn/test_mha_by_heads.cpp
// compares the two paths).
//
// The core and the GEMM run on the team's threads here, so their scratch stays in those threads'
// workspaces (a few rows' worth), which release_workspaces() on the caller does not reach.

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <vector>

#include "gemm/gemm.hpp"
#include "gemm/small.hpp"
#include "nn/mha_by_heads.hpp"
#include "qkv/nn.hpp"
#include "simd/item_shares.hpp"

namespace qkv::detail {
namespace {
std::atomic<uint64_t> by_heads_forwards{0};
std::atomic<int> team_for_test{0};
}  // namespace
uint64_t mha_by_heads_forwards_for_test() { return by_heads_forwards.load(std::memory_order_relaxed); }
int set_mha_by_heads_team_for_test(int team) { return team_for_test.exchange(team); }
}  // namespace qkv::detail

namespace qkv::nn {

namespace {

// The part [first, first + count) of `total` items that worker `t` of `workers` takes, in whole
// units of `unit` items (the last part takes the rest).
struct Part {
  int64_t first, count;
};
Part part_of(int64_t total, int t, int workers, int64_t unit) {
  const int64_t units = (total + unit - 1) / unit;
  const int64_t first = std::min(total, units * t / workers * unit);
  const int64_t last = std::min(total, units * (t + 1) / workers * unit);
  return {first, last - first};
}

// Output columns of the out-projection a thread computes, in whole AVX-512 vectors.
constexpr int64_t kColumnUnit = 16;

}  // namespace

bool MultiHeadAttention::forward_by_heads_applies(const Tensor& x, const Mask& mask, Weights weights) const {
  // Inference only (training keeps the whole q, k, v and the core's result for backward), softmax
  // attention, no weights asked for, and a mask that reads no head: a band, key lengths, or none
  // (a tensor term, block layout or mask function may depend on the head, which each thread's
  // call would count from its own first head).
  if (training_ || !fused() || options_.attention != AttentionKind::Softmax || weights != Weights::None) return false;
  // float32 throughout (what apply() takes); anything else gets the general path's error.
  if (x.dtype() != DType::F32 || (sinks.defined() && sinks.dtype() != DType::F32) ||
      (out_proj.weight.defined() && out_proj.weight.dtype() != DType::F32) ||
      (out_proj.bias.defined() && out_proj.bias.dtype() != DType::F32))
    return false;
  if (relative_position_bias || !mask.terms().empty() || mask.rule()) return false;
  // Each thread's call checks its own slice of the sinks and would name their heads from its
  // first: wrong sinks go through the general path, whose error counts heads from 0.
  if (sinks.defined()) {
    if (sinks.dim() != 1 || sinks.size(0) != num_heads_) return false;
    const Tensor values = sinks.contiguous();
    if (!std::all_of(values.data(), values.data() + num_heads_, [](float s) { return std::isfinite(s); })) return false;
  }
  // The out-projection must be what apply() would accept; otherwise the general path says why not.
  const Tensor& w = out_proj.weight;
  if (!w.defined() || w.shape() != Shape{embed_dim_, embed_dim_} || !w.is_contiguous()) return false;
  if (out_proj.bias.defined() && (out_proj.bias.shape() != Shape{embed_dim_} || !out_proj.bias.is_contiguous()))
    return false;
  // Where the general path's in-projection runs the Small kernel on several threads (few rows,
  // so the attention is small too); the threads dividing the KV heads (whole heads cannot even
  // out 8 heads on 3 threads, or 3 on 2, where the general path splits the columns evenly);
  // not inside a caller's OpenMP region (its calls would run on one thread there anyway).
  const int threads = omp_get_max_threads();
  const int64_t rows = x.numel() / embed_dim_, n = embed_dim_ + 2 * num_kv_heads_ * head_dim();
  return threads > 1 && num_kv_heads_ % threads == 0 && !omp_in_parallel() &&
         detail::choose_gemm_path(false, true, rows, n, embed_dim_) == detail::GemmPath::Small &&
         detail::small_rows_gemm_threads(rows, n, embed_dim_);
}

MultiHeadAttentionOutput MultiHeadAttention::forward_by_heads(const Tensor& x_in, const Mask& mask,
                                                              bool unbatched) const {
  const int64_t batch = x_in.size(0), len = x_in.size(1), rows = batch * len, hd = head_dim(), E = embed_dim_;
  const int64_t group = num_heads_ / num_kv_heads_, width = E + 2 * num_kv_heads_ * hd;
  const Tensor x = x_in.contiguous();
  const Tensor projected = Tensor::empty({batch, len, num_heads_ + 2 * num_kv_heads_, hd});
  const Tensor concatenated = Tensor::empty({batch, len, num_heads_, hd});
  const Tensor output = Tensor::empty({batch, len, E});

  AttentionOptions attention;
  attention.mask = options_.causal ? mask & Mask::causal() : mask;
  attention.softcap = options_.softcap;
  attention.precision = options_.precision;

  const Linear& in = *in_proj_;
  const float* w_in = in.weight.data();
  const float* b_in = in.bias.defined() ? in.bias.data() : nullptr;
  const float* w_out = out_proj.weight.data();
  const float* b_out = out_proj.bias.defined() ? out_proj.bias.data() : nullptr;
  const float* x_rows = x.data();
  float* projected_rows = projected.data();
  float* concatenated_rows = concatenated.data();
  float* output_rows = output.data();

  // Step 1 for one KV head g: its q, k and v columns of in_proj_ (its group of query heads' q),
  // each block through the Small kernel the gate found (linear_sgemm would choose again, seeing
  // one thread, and could leave it).
  const auto project = [&](int64_t g) {
    const Part blocks[3] = {{g * group * hd, group * hd}, {E + g * hd, hd}, {E + (num_kv_heads_ + g) * hd, hd}};
    for (const Part& block : blocks)
      detail::small_rows_gemm(x_rows, E, rows, E, w_in + block.first * E, E, block.count, 1.0f, 0.0f,
                              projected_rows + block.first, width, b_in ? b_in + block.first : nullptr);
  };
  // Steps 2b-4 for the KV heads [g0, g0 + count): rotary, attention over their query heads (one
  // core call), written straight into those heads' columns of `concatenated`.
  const auto attend_heads = [&](int64_t g0, int64_t count) {
    const int64_t q0 = g0 * group, qn = count * group;
    const Tensor q = projected.narrow(2, q0, qn).transpose(1, 2);
    const Tensor k = projected.narrow(2, num_heads_ + g0, count).transpose(1, 2);
    const Tensor v = projected.narrow(2, num_heads_ + num_kv_heads_ + g0, count).transpose(1, 2);
    if (rotary_) {
      rotary_->apply_inplace(q, {0});
      rotary_->apply_inplace(k, {0});
    }
    AttentionOptions heads = attention;
    if (alibi_slopes_.defined()) heads.alibi_slopes = alibi_slopes_.narrow(0, q0, qn);
    if (sinks.defined()) heads.sinks = sinks.narrow(0, q0, qn);
    AttentionResult attended;
    attended.output = concatenated.narrow(2, q0, qn).transpose(1, 2);
    scaled_dot_product_attention_into(q, k, v, attended, heads);
  };

  const int workers = static_cast<int>(std::min<int64_t>(omp_get_max_threads(), num_kv_heads_));
  // KV heads dealt as ItemShares deals a kernel's items: each thread its own contiguous share
  // first, then heads from the back of the fullest share, so a core slowed by a neighbour does
  // not hold the projections back (a fixed split ran at the slower core's pace).
  detail::ItemShares shares(workers, num_kv_heads_);
  // What each thread threw: [t] before the barrier, [workers + t] after it (so that no thread
  // writes what another reads after the barrier).
  std::vector<std::exception_ptr> failed(2 * static_cast<size_t>(workers));
  const int team_for_test = detail::team_for_test.load(std::memory_order_relaxed);
#pragma omp parallel num_threads(team_for_test > 0 ? std::min(team_for_test, workers) : workers)
  {
    const int t = omp_get_thread_num(), team = omp_get_num_threads();
    // The calls below run on this thread alone (no nested regions): this implicit task's
    // thread count, which the region's end discards.
    omp_set_num_threads(1);
    try {
      // ---- 1. project the KV heads this thread gets, 2. split (views), then attend over them
      // here, where their q, k and v were written: one call per run of consecutive heads (its
      // own share, then what it took from others).
      std::vector<int64_t> mine;
      for (int64_t first = 0, last = 0; shares.next(t, first, last);)
        for (int64_t g = first; g < last; ++g) {
          project(g);
          mine.push_back(g);
        }
      std::sort(mine.begin(), mine.end());
      for (size_t run = 0; run < mine.size();) {
        size_t end = run + 1;
        while (end < mine.size() && mine[end] == mine[end - 1] + 1) ++end;
        attend_heads(mine[run], static_cast<int64_t>(end - run));
        run = end;
      }
    } catch (...) {
      failed[static_cast<size_t>(t)] = std::current_exception();
    }
    // Every thread reaches the barrier, failed or not (a thread that skipped it would hang the team).
#pragma omp barrier
    const bool any_failed =
        std::any_of(failed.begin(), failed.begin() + workers, [](const auto& e) { return e != nullptr; });
    if (!any_failed) {
      try {
        // ---- 5. this thread's columns of the output projection, over every head's output. A
        // fixed share: the threads leave the barrier together, and the product is about a
        // quarter of the forward (dealing its columns too was not measured).
        const Part columns = part_of(E, t, team, kColumnUnit);
        if (columns.count > 0)
          detail::small_rows_gemm(concatenated_rows, E, rows, E, w_out + columns.first * E, E, columns.count, 1.0f,
                                  0.0f, output_rows + columns.first, E, b_out ? b_out + columns.first : nullptr);
      } catch (...) {
        failed[static_cast<size_t>(workers + t)] = std::current_exception();
      }
    }
  }
  for (const std::exception_ptr& e : failed)
    if (e) std::rethrow_exception(e);
  detail::by_heads_forwards.fetch_add(1, std::memory_order_relaxed);

  MultiHeadAttentionOutput result;
  result.output = unbatched ? output.squeeze(0) : output;
  return result;
}

}  // namespace qkv::nn
