// Google Benchmark over the standard workloads (the table in bench/workloads.hpp, shared with
// `qkv bench`, W1-softcap / W1-alibi / W1-sinks included), for Backend::Auto (the fast path) and Backend::Reference, plus the same-run
// baselines the ratios need: BM_Sgemm (cblas_sgemm 2048^3 through OpenBLAS) and BM_Memcpy.
//
//   BM_Attention/W2/Auto       steady state: every iteration writes into the same result (_into)
//   BM_Attention/W2/Reference
//   BM_Attention/W1-softcap/Auto       W1 with one score modifier (also W1-alibi, W1-sinks)
//   BM_AttentionBackward/W2/Auto       scaled_dot_product_attention_backward (W1, W2; Auto = Flash)
//   BM_AttentionBackward/W2/Reference
//   BM_Module/W5               nn::MultiHeadAttention forward
//   BM_Sgemm/2048, BM_Memcpy/256MiB
//   BM_ReadOrder/...           W4's K and V read in decode's orders over a paged pool (below)
//
// Counters: GFLOP/s (forward FLOPs = 4 B Hq Nq Nk d, half for causal; backward 2.5 x that), and for the decode
// workload W4 the bytes of K and V read (bytes_per_second). All timings are wall-clock
// (UseRealTime): the kernels run on OpenMP and OpenBLAS threads, which CPU time of the main thread
// would miss. Threads: OMP_NUM_THREADS and OPENBLAS_NUM_THREADS.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include <benchmark/benchmark.h>

#include "core/huge_pages.hpp"
#include "qkv/qkv.hpp"
#include "workloads.hpp"

namespace {

using qkv::bench::Workload;

constexpr int kSgemmSize = 2048;
constexpr size_t kMemcpyBytes = size_t{256} << 20;

// FLOPs per iteration as a rate over the wall-clock time: GFLOP/s as benchmark prints it ("G"
// is its SI prefix, so the counter holds plain FLOP and is shown as e.g. 123.4G/s).
benchmark::Counter flops_rate(double flops) {
  return benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Attention(benchmark::State& state, const Workload* w, qkv::Backend backend) {
  const qkv::bench::AttentionInputs in = qkv::bench::make_attention_inputs(*w);
  // with the inputs' quantization scales or block table
  const qkv::AttentionOptions options = qkv::bench::make_attention_options(*w, in, backend);
  qkv::AttentionResult result;
  qkv::scaled_dot_product_attention_into(in.q, in.k, in.v, result, options);  // warm-up: allocates result
  for (auto _ : state) {
    qkv::scaled_dot_product_attention_into(in.q, in.k, in.v, result, options);
    benchmark::DoNotOptimize(result.output.data());
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] = flops_rate(qkv::bench::forward_flops(*w));
  if (w->decode) state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * qkv::bench::kv_bytes(*w)));
}

// The backward writes into the same gradients every iteration, as the forward into its result.
void BM_AttentionBackward(benchmark::State& state, const Workload* w, qkv::Backend backend) {
  const qkv::bench::AttentionInputs in = qkv::bench::make_attention_inputs(*w);
  const qkv::AttentionOptions options = qkv::bench::make_attention_options(*w, backend);
  const qkv::bench::BackwardInputs bwd = qkv::bench::make_backward_inputs(*w, in, options);
  qkv::AttentionGrads grads;
  qkv::scaled_dot_product_attention_backward_into(bwd.grad_output, in.q, in.k, in.v, bwd.forward, grads,
                                                  options);  // warm-up, allocates the gradients
  for (auto _ : state) {
    qkv::scaled_dot_product_attention_backward_into(bwd.grad_output, in.q, in.k, in.v, bwd.forward, grads, options);
    benchmark::DoNotOptimize(grads.dq.data());
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] = flops_rate(qkv::bench::backward_flops(*w));
}

void BM_Linear(benchmark::State& state, const Workload* w) {
  const qkv::bench::AttentionInputs in = qkv::bench::make_attention_inputs(*w);
  const qkv::LinearAttentionOptions options = qkv::bench::make_linear_options(*w);
  qkv::Tensor output;
  qkv::linear_attention_into(in.q, in.k, in.v, output, options);  // warm-up: allocates the output
  for (auto _ : state) {
    qkv::linear_attention_into(in.q, in.k, in.v, output, options);
    benchmark::DoNotOptimize(output.data());
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] = flops_rate(qkv::bench::forward_flops(*w));
}

void BM_Cascade(benchmark::State& state, const Workload* w) {
  const qkv::bench::CascadeInputs in = qkv::bench::make_cascade_inputs(*w);
  qkv::AttentionResult result;
  qkv::cascade_attention_into(in.q, in.prefix_k, in.prefix_v, in.suffix_k, in.suffix_v, result);  // warm-up
  for (auto _ : state) {
    qkv::cascade_attention_into(in.q, in.prefix_k, in.prefix_v, in.suffix_k, in.suffix_v, result);
    benchmark::DoNotOptimize(result.output.data());
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] = flops_rate(qkv::bench::forward_flops(*w));
}

void BM_Module(benchmark::State& state, const Workload* w) {
  const qkv::bench::ModuleInputs in = qkv::bench::make_module_inputs(*w);
  (void)in.layer.forward(in.x);  // warm-up
  for (auto _ : state) {
    qkv::nn::MultiHeadAttentionOutput out = in.layer.forward(in.x);
    benchmark::DoNotOptimize(out.output.data());
  }
  state.counters["GFLOP/s"] = flops_rate(qkv::bench::forward_flops(*w));
}

// C = A B, n x n: the machine's matrix-multiply rate through the BLAS qkv links.
void BM_Sgemm(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  const qkv::Tensor a = qkv::Tensor::randn({n, n}, 11), b = qkv::Tensor::randn({n, n}, 12);
  const qkv::Tensor c = qkv::Tensor::zeros({n, n});
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(),
                n);
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] = flops_rate(2.0 * n * static_cast<double>(n) * n);
}

// memcpy into a pre-touched buffer; bytes_per_second counts bytes read + written, as qkv bench does.
void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<char> source(bytes, 1), destination(bytes, 0);
  for (auto _ : state) {
    std::memcpy(destination.data(), source.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * 2 * bytes));
}

// The orders a decode could read a paged pool in, without the arithmetic: W4's K and V (32 heads
// x 8192 keys x 128 floats each) read on two threads, either in W4's layout (H, N, D), one stream
// per head, or in a pool of 64-key pages (pages, 64, H, D) in shuffled order, as W4-paged holds
// them. A pool's rows of one head lie H D floats (16 KB) apart; the orders over it:
//   head-by-head  each head's 8192 keys page by page, as decode reads W4's layout (over a pool,
//                 decode takes 512-key chunks of every head in turn: docs/inference.md), both
//                 prefetched 32 keys ahead into L2, decode's distance when docs/inference.md's
//                 table of these orders was measured (decode/plan.hpp's kPrefetchKeys is 8 since)
//   key-blocks    blocks of Arg keys of a page, every head over the block in turn
//   page-major    each page's keys in turn, every head's row of a key (memory order)
// The heads (or pages) are split evenly over the threads; bytes_per_second counts the K and V
// bytes read.
enum class ReadOrder { Contiguous, HeadByHead, KeyBlocks, PageMajor };

// Reads one row of K and of V (128 floats each): a float of every cache line, so that the time is
// the memory system's, not the adds' (summing every float ran at the adds' rate here).
inline void add_row(float* sum, const float* k, const float* v) {
  for (int line = 0; line < 128; line += 16) sum[line / 16] += k[line] + v[line];
}

void BM_ReadOrder(benchmark::State& state, ReadOrder order) {
  constexpr int64_t kHeads = 32, kKeys = 8192, kDim = 128, kPage = 64, kPages = kKeys / kPage, kAhead = 32;
  const int64_t block = state.range(0);
  const int64_t count = kHeads * kKeys * kDim;
  std::vector<qkv::Tensor> kv;
  for (int which = 0; which < 2; ++which) {  // ones: a huge page of zeros may become the shared zero page
    kv.push_back(qkv::detail::zeros_on_huge_pages({count}, qkv::DType::F32));
    std::fill_n(kv.back().data(), count, 1.0f);
  }
  std::vector<int64_t> table(kPages);  // the page holding keys [p kPage, (p + 1) kPage)
  for (int64_t p = 0; p < kPages; ++p) table[static_cast<size_t>(p)] = (p * 37) % kPages;  // 37: coprime to 128
  const float* k = kv[0].data();
  const float* v = kv[1].data();
  // Row (key j, head h): where it lies in the pool.
  const auto pooled = [&](int64_t h, int64_t j) {
    return ((table[static_cast<size_t>(j / kPage)] * kPage + j % kPage) * kHeads + h) * kDim;
  };
  float total = 0;
  for (auto _ : state) {
    if (order == ReadOrder::Contiguous || order == ReadOrder::HeadByHead) {
#pragma omp parallel for schedule(static) reduction(+ : total)
      for (int64_t h = 0; h < kHeads; ++h) {
        float sum[8] = {};
        const auto row_of = [&](int64_t j) { return order == ReadOrder::Contiguous ? (h * kKeys + j) * kDim : pooled(h, j); };
        for (int64_t j = 0; j < kKeys; ++j) {
          if (j + kAhead < kKeys)  // as decode prefetched a head's rows then
            for (int64_t line = 0; line < kDim; line += 16) {
              __builtin_prefetch(k + row_of(j + kAhead) + line, 0, 2);
              __builtin_prefetch(v + row_of(j + kAhead) + line, 0, 2);
            }
          add_row(sum, k + row_of(j), v + row_of(j));
        }
        for (float x : sum) total += x;
      }
    } else {
      const int64_t step = order == ReadOrder::PageMajor ? 1 : block;
#pragma omp parallel for schedule(static) reduction(+ : total)
      for (int64_t page = 0; page < kPages; ++page) {
        float sum[kHeads * 8] = {};  // a row of line sums per head, on the stack: no allocation per page
        for (int64_t j0 = page * kPage; j0 < (page + 1) * kPage; j0 += step)
          for (int64_t h = 0; h < kHeads; ++h)
            for (int64_t j = j0; j < j0 + step; ++j) add_row(sum + h * 8, k + pooled(h, j), v + pooled(h, j));
        for (float x : sum) total += x;
      }
    }
    benchmark::DoNotOptimize(total);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * 2 * count * static_cast<int64_t>(sizeof(float)));
}

void register_benchmarks() {
  for (const Workload& w : qkv::bench::kWorkloads) {
    const std::string id(w.id);
    if (w.sweep) continue;  // the decode sweep (1 GB of K/V) is `qkv bench --workload decode-sweep`
    if (w.is_module()) {
      benchmark::RegisterBenchmark(("BM_Module/" + id).c_str(), BM_Module, &w)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
      continue;
    }
    if (w.is_cascade()) {
      benchmark::RegisterBenchmark(("BM_Cascade/" + id).c_str(), BM_Cascade, &w)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
      continue;
    }
    if (w.is_linear()) {
      benchmark::RegisterBenchmark(("BM_Linear/" + id).c_str(), BM_Linear, &w)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
      continue;
    }
    for (const qkv::Backend backend : {qkv::Backend::Auto, qkv::Backend::Reference}) {
      if (backend == qkv::Backend::Reference && !w.has_reference) continue;
      const std::string name = "BM_Attention/" + id + "/" + std::string(qkv::to_string(backend));
      benchmark::RegisterBenchmark(name.c_str(), BM_Attention, &w, backend)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
    if (!w.backward) continue;
    for (const qkv::Backend backend : {qkv::Backend::Auto, qkv::Backend::Reference}) {
      if (backend == qkv::Backend::Reference && !w.has_reference) continue;
      const std::string name = "BM_AttentionBackward/" + id + "/" + std::string(qkv::to_string(backend));
      benchmark::RegisterBenchmark(name.c_str(), BM_AttentionBackward, &w, backend)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }
  benchmark::RegisterBenchmark("BM_Sgemm", BM_Sgemm)->Arg(kSgemmSize)->Unit(benchmark::kMillisecond)->UseRealTime();
  benchmark::RegisterBenchmark("BM_Memcpy", BM_Memcpy)
      ->Arg(static_cast<int64_t>(kMemcpyBytes))
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
  for (const auto& [name, order, blocks] :
       {std::tuple{"contiguous", ReadOrder::Contiguous, std::vector<int64_t>{1}},
        std::tuple{"pool/head-by-head", ReadOrder::HeadByHead, std::vector<int64_t>{1}},
        std::tuple{"pool/key-blocks", ReadOrder::KeyBlocks, std::vector<int64_t>{4, 16}},
        std::tuple{"pool/page-major", ReadOrder::PageMajor, std::vector<int64_t>{1}}}) {
    auto* b = benchmark::RegisterBenchmark((std::string("BM_ReadOrder/") + name).c_str(), BM_ReadOrder, order);
    for (int64_t block : blocks) b->Arg(block);
    b->Unit(benchmark::kMillisecond)->UseRealTime();
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("qkv_version", qkv::version());
  benchmark::AddCustomContext("omp_threads", std::to_string(omp_get_max_threads()));
  benchmark::AddCustomContext("openblas_threads", std::to_string(openblas_get_num_threads()));
  benchmark::AddCustomContext("openblas_core", openblas_get_corename());
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  benchmark::AddCustomContext("OPENBLAS_CORETYPE", coretype ? coretype : "(unset)");
  register_benchmarks();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
