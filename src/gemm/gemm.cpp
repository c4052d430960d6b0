// qkv::detail::sgemm (gemm/gemm.hpp): one entry point, five paths, chosen per shape class
// (linear_sgemm, a Linear's forward, takes the same paths and adds a bias).
//
// The choice, per shape class (`qkv bench` prints its table of GEMM paths per shape class; the
// measurements behind each bound are in docs/performance-log.md, "gemm/ (moved from kernel
// comments)"):
//   - x W^T (A not transposed, B transposed) whose rows are whole AVX-512 vectors, 32-64 of them
//     with n, k >= 256, or 80-128 with n, k >= 512: TiledT, the Tiled kernel on y^T = W x^T,
//     which broadcasts W where it is, packs x (small), keeps its sums in vectors (the Small
//     kernel spends about a fifth of its time at k = 512 outside its loop over k, mostly adding
//     each accumulator's lanes) and writes y back from its tile. Rows that leave a vector partly
//     empty (Small wastes no lanes), 256 rows, and n or k of 128 stay where they were faster.
//   - otherwise A not transposed, B transposed and few rows (a Linear over a few tokens, W5's
//     20-row projections): the Small kernel, which reads W where it is instead of packing it.
//     "Few" is 64 rows against OpenBLAS, which packs W even for one row. Against oneDNN, where the
//     CPU runs Small's AVX-512 tile: 32 rows, and 64 when k >= 256 and Small runs them on several
//     threads (with few steps over k, each tile's sums outweigh them). None on AVX2 with oneDNN,
//     which is faster there.
//   - many rows against a head dimension (m >= 256, and n <= 64 or 32 <= k <= 64: the reference
//     kernel's S = Q K^T, P V and its backward's products), or, on more than one thread, a
//     mid-size Linear's products (n <= 512, 32 <= k <= 512; x W^T from m = 512, the other
//     transposes from m = 1024: dx with m = tokens, dW with m = out features and k = tokens, TT),
//     where the CPU runs AVX-512: the Tiled kernel, the fused kernels' register tiles over B
//     packed into panels. One thread, fewer rows, larger k and k < 32 with n > 64 are left to
//     oneDNN, which tied or won there.
//   - everything else: oneDNN when built in, which picks its AVX-512 kernels from the CPU whatever
//     OPENBLAS_CORETYPE says (OPENBLAS_CORETYPE=Haswell runs OpenBLAS's AVX2 kernels on an AVX-512
//     core); OpenBLAS otherwise.
#include "gemm/gemm.hpp"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cassert>
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
// header says (33-64 rows only where Small will run them on several threads and the work, from
// 2^20 multiply-adds, is where that was measured to beat oneDNN).
bool small_takes(int64_t m, int64_t n, int64_t k) {
#ifdef QKV_HAVE_DNNL
  if (!small_rows_gemm_has_wide_tile()) return false;
  constexpr int64_t kMinWorkOver32Rows = int64_t{1} << 20;
  return m <= 32 || (m <= 64 && k >= 256 && m * n * k >= kMinWorkOver32Rows && small_rows_gemm_threads(m, n, k));
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

namespace {

// sgemm_on's work, plus a bias of n floats added to every row of C (null: none; only with beta
// == 0, as linear_sgemm calls it): the Small path adds it as it stores; the others start C at it.
void run_on(GemmPath path, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
            int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc, const float* bias) {
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
  if (k == 0 || alpha == 0.0f) {  // C = bias + beta C (BLAS's rule: A and B unread), beta == 0 never reading C
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j)
        c[i * ldc + j] = (bias ? bias[j] : 0.0f) + (beta == 0.0f ? 0.0f : beta * c[i * ldc + j]);
    return;
  }
  assert(!bias || beta == 0.0f);  // the contract: a bias comes with beta == 0 (linear_sgemm's call)
  if (bias && path != GemmPath::Small) {  // C starts at the bias, the product adds to it
    for (int64_t i = 0; i < m; ++i) std::copy_n(bias, n, c + i * ldc);
    beta = 1.0f;
  }
  switch (path) {
    case GemmPath::Small:
      small_rows_gemm(a, lda, m, k, b, ldb, n, alpha, beta, c, ldc, bias);
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

// sgemm's path: choose_gemm_path's, or the test override where that path can take the call.
GemmPath path_for(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k) {
  const int forced = forced_path.load(std::memory_order_relaxed);
  if (forced >= 0 && gemm_path_can_take(static_cast<GemmPath>(forced), trans_a, trans_b))
    return static_cast<GemmPath>(forced);
  return choose_gemm_path(trans_a, trans_b, m, n, k);
}

}  // namespace

void sgemm_on(GemmPath path, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
              int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  run_on(path, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, nullptr);
}

GemmPath sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
               const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const GemmPath path = path_for(trans_a, trans_b, m, n, k);
  run_on(path, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, nullptr);
  return path;
}

GemmPath linear_sgemm(int64_t m, int64_t n, int64_t k, const float* x, int64_t ldx, const float* w, int64_t ldw,
                      const float* bias, float* y, int64_t ldy) {
  const GemmPath path = path_for(false, true, m, n, k);
  run_on(path, false, true, m, n, k, 1.0f, x, ldx, w, ldw, 0.0f, y, ldy, bias);
  return path;
}

void set_gemm_path_for_test(std::optional<GemmPath> path) {
  forced_path.store(path ? static_cast<int>(*path) : -1, std::memory_order_relaxed);
}

}  // namespace qkv::detail
