// qkv::detail::sgemm (gemm/gemm.hpp): one entry point, five paths, chosen per shape class.
//
// The choice (measured by `qkv bench`'s table of GEMM paths per shape class; docs/performance.md):
//   - x W^T (A not transposed, B transposed) whose rows are whole AVX-512 vectors, 32-64 of them
//     with n, k >= 256, or 80-128 with n, k >= 512: TiledT, the Tiled kernel on y^T = W x^T,
//     which broadcasts W where it is, packs x (small), keeps its sums in vectors (the Small
//     kernel spends about a fifth of its time at k = 512 outside its loop over k, mostly adding
//     each accumulator's lanes: perf, one thread) and writes y back from its tile. Sapphire
//     Rapids-class Xeon, operands 64-byte aligned, TiledT's rate over the path chosen before
//     (medians of 5 alternated rounds of 10 ms batches):
//     two threads, NT 32, 48, 64 x 512 x 512 1.11-1.19 (over Small), x 1536 x 512 and 2048 x 512
//     1.12-1.22, 512 x 2048 1.22-1.29, 256 x 256 1.00-1.12; 96 and 128 x 512, 1536, 2048 x 512
//     1.07-1.20 (over oneDNN), 512 x 2048 1.18-1.33; 80 and 112 rows alike; one thread 1.09-1.36
//     and 0.98-1.19 on the same shapes, and 1.19-1.31 over OpenBLAS (the choice without oneDNN)
//     from 80 rows. Not chosen: rows that leave a vector partly empty (20, 24 and 40 rows:
//     0.61-1.05 over Small, which wastes no lanes), 256 rows (0.86-1.01 over oneDNN), 96-128 rows
//     against n or k of 256 (0.87-0.95), n = 128 (0.94-0.99 over Small on two threads), k = 128
//     (0.90-0.97 over oneDNN from 48 rows).
//   - otherwise A not transposed, B transposed and few rows (a Linear over a few tokens, W5's
//     20-row projections): the Small kernel, which reads W where it is instead of packing it. "Few" is
//     64 rows against OpenBLAS, which packs W even for one row. Against oneDNN, where the CPU runs
//     Small's AVX-512 tile: 32 rows, and 64 when k >= 256 and Small runs them on several threads. Ice
//     Lake, NT m x n x k, after Small's register fix, oneDNN's time over Small's: two threads,
//     64 x 512 x 512 1.6x, 64 x 256 x 256 1.4x, 64 x 2048 x 512 1.6x, but 64 x 512 x 64 0.85x and
//     64 x 64 x 64 0.58x (each tile's sums outweigh its 4 steps over k); one thread, 64 rows,
//     0.93x at k = 512 and 0.53-0.71x at k = 128-256; 20-33 rows, 0.78x (one thread,
//     20 x 256 x 128) to 4.5x. None on AVX2 with oneDNN: there (Zen 3) oneDNN took 0.82-0.90 x
//     Small's time on W5 (in-process A/B, 1 and 2 threads).
//   - many rows against a head dimension (m >= 256, and n <= 64 or 32 <= k <= 64: the reference
//     kernel's S = Q K^T, P V and its backward's products), or, on more than one thread, a
//     mid-size Linear's products (n <= 512, 32 <= k <= 512; x W^T from m = 512, the other
//     transposes from m = 1024: dx with m = tokens, dW with m = out features and k = tokens, TT),
//     where the CPU runs AVX-512: the Tiled kernel, the fused kernels' register tiles over B
//     packed into panels. Ice Lake, operands 64-byte aligned as qkv's Tensors are, the Tiled
//     kernel's time over oneDNN's (per-round ratios of 20 ms batches of calls, as `qkv bench`
//     times them, alternated; medians of 12 rounds, two runs; two threads): NT 256 x 256 x 64
//     0.77-0.81, 512 x 512 x 64 0.85-0.87, 2048 x 2048 x 64 0.76-0.83; NN 512 x 64 x 512
//     0.74-0.80, 2048 x 64 x 2048 0.87-0.97; TN 512 x 64 x 512 0.95-0.96; NT 512 x 512 x 512
//     0.89-0.90, 768 x 512 x 512 0.87, 1024 x 512 x 512 0.83-0.87, 2048 x 512 x 512 0.78-0.83,
//     512 x 512 x 128 0.77-0.82; NN 1024 x 512 x 512 0.94-0.96, 2048 x 512 x 512 0.98-0.99; TN
//     1024 x 512 x 512 0.92-0.95, 2048 x 512 x 512 0.87-0.89. One thread: NT 256 x 256 x 64 0.90,
//     512 x 512 x 64 1.00, NN 512 x 64 x 512 0.84, TN 512 x 64 x 512 0.91. Not chosen, it lost
//     or tied: one thread, NT 512, 1024 and 2048 x 512 x 512 1.13-1.22, NN 512 x 512 x 512 1.09,
//     1024 x 512 x 512 1.08, TN 512 x 512 x 512 1.18; two threads, below 1024 rows NN 512 x 512 x
//     512 1.01-1.05, 768 x 512 x 512 1.00, TN 512 x 512 x 512 1.09-1.20, 768 x 512 x 512 0.97;
//     TN 512 x 512 x 1024 1.05, x 2048 1.07 (a Linear's dW), x 4096 1.12. (Earlier measurements
//     of this rule used buffers 16 bytes past a 64-byte line, which slow oneDNN by 10-15% on
//     these shapes and had made the Tiled path look faster than it is; misaligned, it still is
//     not chosen: NT 256 x 512 x 512 0.94-1.04, 256 x 1536 x 512 1.14-1.16, 384 x 384 x 384
//     1.05-1.10, 512 x 1536 x 512 1.04, 1024 x 1536 x 512 1.24, 4096 x 4096 x 128 1.12, 2048 x
//     2048 x 32 1.09, 512 x 512 x 16 1.02.) k < 32 with n > 64 is left to oneDNN, mixed
//     (misaligned): TN 1536 x 512 x 8 1.07, x 20 0.89, 2048 x 512 x 20 0.83-0.94; NT 2048 x 512 x
//     16 0.79-0.81, 4096 x 256 x 16 0.94-1.00; NN 2048 x 512 x 16 1.08-1.11;
//   - everything else: oneDNN when built in, which picks its AVX-512 kernels from the CPU whatever
//     OPENBLAS_CORETYPE says (2048^3 under OPENBLAS_CORETYPE=Haswell: oneDNN ~1.9x OpenBLAS; unset,
//     within the noise of each other); OpenBLAS otherwise.
#include "gemm/gemm.hpp"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <string>

#include "qkv/error.hpp"
#include "gemm/small.hpp"
#include "gemm/tiled.hpp"

#ifdef QKV_HAVE_DNNL
#include <oneapi/dnnl/dnnl.h>
#endif

namespace qkv::detail {

namespace {

// Whether the Small kernel takes x W^T with m rows, n outputs and depth k: few rows, as the
// header says (33-64 rows only where Small will run them on several threads).
bool small_takes(int64_t m, int64_t n, int64_t k) {
#ifdef QKV_HAVE_DNNL
  if (!small_rows_gemm_has_wide_tile()) return false;
  return m <= 32 || (m <= 64 && k >= 256 && small_rows_gemm_threads(m, n, k));
#else
  (void)n, (void)k;
  return m <= 64;
#endif
}

// Whether TiledT takes x W^T with m rows, n outputs and depth k: as this file's first comment says.
bool tiled_transposed_takes(int64_t m, int64_t n, int64_t k) {
  constexpr int64_t kLanes = 16;  // AVX-512's, the target of the wide panels
  if (!tiled_gemm_has_wide_panels() || m % kLanes != 0) return false;
  if (m >= 32 && m <= 64) return n >= 256 && k >= 256;
  return m > 64 && m <= 128 && n >= 512 && k >= 512;
}

// Whether the Tiled kernel takes an m x n x k product: as this file's first comment says.
bool tiled_takes(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k) {
  if (!tiled_gemm_has_wide_panels()) return false;
  if (m >= 256 && (n <= 64 || (k >= 32 && k <= 64))) return true;  // against a head dimension
  const int64_t linear_rows = !trans_a && trans_b ? 512 : 1024;     // a mid-size Linear
  return m >= linear_rows && n <= 512 && k >= 32 && k <= 512 && tiled_gemm_threads(m, n, k);
}

// The test override: -1 none, else a GemmPath.
std::atomic<int> forced_path{-1};

std::string shape_text(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k) {
  return std::string("sgemm(") + (trans_a ? "T" : "N") + (trans_b ? "T" : "N") + ", m " + std::to_string(m) +
         ", n " + std::to_string(n) + ", k " + std::to_string(k) + ")";
}

void check_fits_int(int64_t value, const char* name, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k) {
  if (value > INT_MAX)
    throw Error(shape_text(trans_a, trans_b, m, n, k) + ": " + name + " = " + std::to_string(value) +
                " exceeds OpenBLAS's int");
}

void run_openblas(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                  int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const std::pair<int64_t, const char*> sizes[] = {{m, "m"}, {n, "n"}, {k, "k"}, {lda, "lda"}, {ldb, "ldb"}, {ldc, "ldc"}};
  for (const auto& [value, name] : sizes) check_fits_int(value, name, trans_a, trans_b, m, n, k);
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b,
              static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
}

#ifdef QKV_HAVE_DNNL
void run_onednn(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
                const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const dnnl_status_t status =
      dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  if (status != dnnl_success)
    throw Error(shape_text(trans_a, trans_b, m, n, k) + ": dnnl_sgemm failed (status " +
                std::to_string(static_cast<int>(status)) + ")");
}
#endif

}  // namespace

std::string_view to_string(GemmPath path) {
  switch (path) {
    case GemmPath::Small: return "Small";
    case GemmPath::Tiled: return "Tiled";
    case GemmPath::TiledT: return "TiledT";
    case GemmPath::OneDnn: return "oneDNN";
    case GemmPath::OpenBlas: return "OpenBLAS";
  }
  return "?";
}

bool gemm_path_can_take(GemmPath path, bool trans_a, bool trans_b) {
  switch (path) {
    case GemmPath::Small: return !trans_a && trans_b;
    case GemmPath::Tiled: return true;
    case GemmPath::TiledT: return true;
#ifdef QKV_HAVE_DNNL
    case GemmPath::OneDnn: return true;
#else
    case GemmPath::OneDnn: return false;
#endif
    case GemmPath::OpenBlas: return true;
  }
  return false;
}

GemmPath choose_gemm_path(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k) {
  if (!trans_a && trans_b && tiled_transposed_takes(m, n, k)) return GemmPath::TiledT;
  if (!trans_a && trans_b && small_takes(m, n, k)) return GemmPath::Small;
  if (tiled_takes(trans_a, trans_b, m, n, k)) return GemmPath::Tiled;
  if (gemm_path_can_take(GemmPath::OneDnn, trans_a, trans_b)) return GemmPath::OneDnn;
  return GemmPath::OpenBlas;
}

void sgemm_on(GemmPath path, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
              int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (!gemm_path_can_take(path, trans_a, trans_b))
    throw Error(shape_text(trans_a, trans_b, m, n, k) + ": the " + std::string(to_string(path)) +
                " path cannot take it in this build");
  if (m < 0 || n < 0 || k < 0)
    throw Error(shape_text(trans_a, trans_b, m, n, k) + ": negative size");
  if (m == 0 || n == 0) return;
  // Leading dimensions: at least the stored row length (BLAS's rule; all >= 1 from here on).
  const int64_t a_cols = trans_a ? m : k, b_cols = trans_b ? k : n;
  if (lda < a_cols || ldb < b_cols || ldc < n)
    throw Error(shape_text(trans_a, trans_b, m, n, k) + ": lda " + std::to_string(lda) + ", ldb " +
                std::to_string(ldb) + ", ldc " + std::to_string(ldc) + " shorter than the rows they separate");
  if (k == 0 || alpha == 0.0f) {  // C = beta C (BLAS's rule: A and B unread), beta == 0 never reading C
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
    return;
  }
  switch (path) {
    case GemmPath::Small:
      small_rows_gemm(a, lda, m, k, b, ldb, n, alpha, beta, c, ldc);
      return;
    case GemmPath::Tiled:
      tiled_gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
      return;
    case GemmPath::TiledT:
      tiled_gemm_transposed(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
      return;
    case GemmPath::OneDnn:
#ifdef QKV_HAVE_DNNL
      run_onednn(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
#endif
      return;
    case GemmPath::OpenBlas:
      run_openblas(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
      return;
  }
}

GemmPath sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
               const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  GemmPath path = choose_gemm_path(trans_a, trans_b, m, n, k);
  const int forced = forced_path.load(std::memory_order_relaxed);
  if (forced >= 0 && gemm_path_can_take(static_cast<GemmPath>(forced), trans_a, trans_b))
    path = static_cast<GemmPath>(forced);
  sgemm_on(path, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  return path;
}

void set_gemm_path_for_test(std::optional<GemmPath> path) {
  forced_path.store(path ? static_cast<int>(*path) : -1, std::memory_order_relaxed);
}

}  // namespace qkv::detail
