// bf16_dot_gemm (gemm/bf16_dot.hpp): oneDNN's matmul on bfloat16 x and W, float32 y.
//
// A primitive is built per (m, n, k, layout) (oneDNN generates its kernel then: milliseconds) and
// kept; a prefill meets a handful of shapes per model, so the cache holds at most kCachedShapes
// and starts over when full. x is rounded into per-thread scratch (m x k bfloat16); W and y are
// handed to oneDNN where they are (W as (k, n) with strides: (1, k) for an (n, k) matrix).
#include "gemm/bf16_dot.hpp"

#include <algorithm>
#include <atomic>
#include <string>

#include "qkv/error.hpp"

#ifdef QKV_HAVE_DNNL
#include <oneapi/dnnl/dnnl.hpp>

#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "qkv/dtype.hpp"
#include "simd/item_shares.hpp"
#endif

namespace qkv::detail {

namespace {

std::atomic<bool> enabled_for_test{true};

std::string shape_text(int64_t m, int64_t k, bool in_out, int64_t n) {
  return "bf16_dot_gemm(m " + std::to_string(m) + ", k " + std::to_string(k) + ", n " + std::to_string(n) +
         (in_out ? ", W (k, n))" : ", W (n, k))");
}

#ifdef QKV_HAVE_DNNL
using dnnl::memory;

// Distinct shapes kept: a model's prefill has 4-7 per prompt length.
constexpr size_t kCachedShapes = 64;

// x (count floats) rounded into `to`, in chunks shared among the OpenMP threads when there are
// many (a prefill's rows: on one thread a visible share of the product's time, docs/models.md).
void round_to_bf16(const float* x, int64_t count, uint16_t* to) {
  constexpr int64_t kChunk = int64_t{1} << 15, kMinForThreads = int64_t{1} << 17;
  const int workers = count >= kMinForThreads ? omp_get_max_threads() : 1;
  for_each_item(workers, (count + kChunk - 1) / kChunk, [&](int64_t item) {
    const int64_t begin = item * kChunk;
    convert(x + begin, DType::F32, to + begin, DType::BF16, static_cast<size_t>(std::min(kChunk, count - begin)));
  });
}

bool cpu_has_bf16_dots() {
  const dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
  return isa == dnnl_cpu_isa_avx512_core_bf16 || isa == dnnl_cpu_isa_avx512_core_amx;
}

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

struct Primitive {
  dnnl::matmul matmul;
  memory::desc x, w, y;
};

// The primitive of one shape, built on first use.
const Primitive& primitive_for(int64_t m, int64_t k, bool in_out, int64_t n) {
  static std::mutex mutex;
  static std::map<std::tuple<int64_t, int64_t, bool, int64_t>, Primitive> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(m, k, in_out, n);
  if (const auto found = cache.find(key); found != cache.end()) return found->second;
  if (cache.size() >= kCachedShapes) cache.clear();  // no caller holds a reference across calls
  Primitive p;
  p.x = memory::desc({m, k}, memory::data_type::bf16, memory::dims{k, 1});
  p.w = memory::desc({k, n}, memory::data_type::bf16, in_out ? memory::dims{n, 1} : memory::dims{1, k});
  p.y = memory::desc({m, n}, memory::data_type::f32, memory::dims{n, 1});
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(p.x, p.w, p.y), cpu_engine());
  p.matmul = dnnl::matmul(pd);
  return cache.emplace(key, std::move(p)).first->second;
}
#endif

}  // namespace

bool bf16_dot_gemm_available() {
#ifdef QKV_HAVE_DNNL
  static const bool cpu = cpu_has_bf16_dots();
  return cpu && enabled_for_test.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

void bf16_dot_gemm(const float* x, int64_t m, int64_t k, const void* w, bool in_out, int64_t n, float* y) {
  if (m < 0 || k < 0 || n < 0) throw Error(shape_text(m, k, in_out, n) + ": negative size");
  if (!bf16_dot_gemm_available())
    throw Error(shape_text(m, k, in_out, n) + ": no bfloat16 dot products here (oneDNN and AVX512-BF16 or AMX)");
  if (m == 0 || n == 0) return;
  if (k == 0) {
    for (int64_t i = 0; i < m * n; ++i) y[i] = 0.0f;
    return;
  }
#ifdef QKV_HAVE_DNNL
  try {
    thread_local std::vector<uint16_t> rounded;
    rounded.resize(static_cast<size_t>(m * k));
    round_to_bf16(x, m * k, rounded.data());
    const Primitive& p = primitive_for(m, k, in_out, n);
    memory x_memory(p.x, cpu_engine(), rounded.data());
    memory w_memory(p.w, cpu_engine(), const_cast<void*>(w));  // read only: matmul's weights
    memory y_memory(p.y, cpu_engine(), y);
    dnnl::stream stream(cpu_engine());
    p.matmul.execute(stream, {{DNNL_ARG_SRC, x_memory}, {DNNL_ARG_WEIGHTS, w_memory}, {DNNL_ARG_DST, y_memory}});
    stream.wait();
  } catch (const dnnl::error& e) {
    throw Error(shape_text(m, k, in_out, n) + ": oneDNN failed: " + e.what());
  }
#else
  (void)x, (void)w, (void)y;
#endif
}

void set_bf16_dot_gemm_for_test(bool enabled) { enabled_for_test.store(enabled, std::memory_order_relaxed); }

}  // namespace qkv::detail
