// qkv::detail::sgemm (src/gemm/gemm.hpp), the library's one GEMM entry point outside the fused kernels:
// every path it can take (Small, Tiled, TiledT, oneDNN when built in, OpenBLAS) against a float64 loop, on odd
// shapes, every transpose the path takes, padded leading dimensions, alpha and beta, outputs
// poisoned; linear_sgemm (a Linear's forward, with its bias) likewise; then the callers
// (nn::Linear, the reference kernel forward and backward) run on each path through the test hook.
#include <gtest/gtest.h>
#include <hwy/targets.h>
#include <omp.h>

#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "gemm/gemm.hpp"
#include "gemm/small.hpp"
#include "gemm/tiled.hpp"
#include "harness/kernel_cases.hpp"
#include "harness/oracle.hpp"
#include "qkv/qkv.hpp"

namespace {

using qkv::detail::GemmPath;
using qkv_test::Random;

constexpr GemmPath kAllPaths[] = {GemmPath::Small, GemmPath::Tiled, GemmPath::TiledT, GemmPath::OneDnn,
                                   GemmPath::OpenBlas};
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
// Written into C's padding (the columns between n and ldc): no path may touch it.
constexpr float kPadding = -12345.0f;

// The paths this build has (OneDnn only with QKV_HAVE_DNNL).
std::vector<GemmPath> built_paths() {
  std::vector<GemmPath> out;
  for (GemmPath path : kAllPaths)
    if (qkv::detail::gemm_path_can_take(path, false, true)) out.push_back(path);
  return out;
}

// Sets the test override for its lifetime.
class ForcedPath {
 public:
  explicit ForcedPath(std::optional<GemmPath> path) { qkv::detail::set_gemm_path_for_test(path); }
  ~ForcedPath() { qkv::detail::set_gemm_path_for_test(std::nullopt); }
  ForcedPath(const ForcedPath&) = delete;
  ForcedPath& operator=(const ForcedPath&) = delete;
};

struct GemmCase {
  bool trans_a, trans_b;
  int64_t m, n, k, lda, ldb, ldc;
  float alpha, beta;
  std::vector<float> a, b, c;  // c: the initial C (NaN where beta == 0), padding included

  std::string name() const {
    return std::string(trans_a ? "T" : "N") + (trans_b ? "T" : "N") + " m=" + std::to_string(m) +
           " n=" + std::to_string(n) + " k=" + std::to_string(k) + " lda=" + std::to_string(lda) +
           " ldb=" + std::to_string(ldb) + " ldc=" + std::to_string(ldc) + " alpha=" + std::to_string(alpha) +
           " beta=" + std::to_string(beta);
  }
};

GemmCase make_gemm_case(Random& rng, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                        float beta) {
  GemmCase g{trans_a, trans_b, m, n, k, 0, 0, 0, alpha, beta, {}, {}, {}};
  const int64_t a_rows = trans_a ? k : m, a_cols = trans_a ? m : k;
  const int64_t b_rows = trans_b ? n : k, b_cols = trans_b ? k : n;
  g.lda = a_cols + rng.integer(0, 3);  // padded rows: strided views
  g.ldb = b_cols + rng.integer(0, 3);
  g.ldc = n + rng.integer(0, 3);
  g.a = rng.normals(a_rows * g.lda);
  g.b = rng.normals(b_rows * g.ldb);
  g.c.assign(static_cast<size_t>(m * g.ldc), kPadding);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      g.c[static_cast<size_t>(i * g.ldc + j)] = beta == 0.0f ? kNaN : static_cast<float>(rng.normal());
  return g;
}

// Checks `got` (C after the call) against the float64 product (plus `bias`, n terms added to every
// row, when given), and the padding untouched.
void expect_matches_float64(const GemmCase& g, const std::vector<float>& got, const std::vector<float>* bias = nullptr) {
  for (int64_t i = 0; i < g.m; ++i) {
    for (int64_t j = 0; j < g.n; ++j) {
      double sum = 0, magnitude = 0;
      for (int64_t p = 0; p < g.k; ++p) {
        const double a = g.a[static_cast<size_t>(g.trans_a ? p * g.lda + i : i * g.lda + p)];
        const double b = g.b[static_cast<size_t>(g.trans_b ? j * g.ldb + p : p * g.ldb + j)];
        sum += a * b;
        magnitude += std::abs(a * b);
      }
      const double before = g.c[static_cast<size_t>(i * g.ldc + j)];
      const double term = bias ? (*bias)[static_cast<size_t>(j)] : 0.0;
      const double want = g.alpha * sum + term + (g.beta == 0.0f ? 0.0 : g.beta * before);
      const double scale =
          std::abs(g.alpha) * magnitude + std::abs(term) + (g.beta == 0.0f ? 0.0 : std::abs(g.beta * before));
      const double value = got[static_cast<size_t>(i * g.ldc + j)];
      ASSERT_TRUE(std::isfinite(value)) << g.name() << " C[" << i << ", " << j << "] = " << value;
      ASSERT_NEAR(value, want, 1e-6 * static_cast<double>(g.k + 4) * scale + 1e-30)
          << g.name() << " C[" << i << ", " << j << "]";
    }
    for (int64_t j = g.n; j < g.ldc; ++j)
      ASSERT_EQ(got[static_cast<size_t>(i * g.ldc + j)], kPadding) << g.name() << " wrote padding C[" << i << ", " << j << "]";
  }
}

// Odd sizes around every tile and vector width, and some large enough for threads. The Small
// kernel's tiles (5 rows x 4 outputs on AVX-512, 4 x 3 elsewhere) leave every count of rows (1-4)
// with every count of outputs (1-3), k > 0, in these shapes, for both tile sizes. The Tiled
// kernel's panels (1-4 vectors, the last partial or whole), row blocks (about 48 rows, threads from
// 2^20 multiply-adds, each packing its own panels up to 512 KiB from 48 rows a thread, 257 x 129 x
// 65 and 97 x 45 x 260, or sharing larger ones, 7 x 400 x 400, or those of fewer rows, 30 x 200 x
// 200) and depth blocks (128) meet their ends in the last rows; on one thread 137 rows make blocks
// of 48, 40 and 49 (longer than 48: a transposed A's copy, 137 x 99 x 130, and the tail scratch
// hold up to 56); a transposed A under one panel is read in place (137 x 33 x 130) unless its rows
// are over 2 KiB apart (520 x 33 x 70: copied); on 3 threads, 7 x 400 x 400 splits its rows into
// [0, 0), [0, 7) and [7, 7). TiledT runs the same kernel on the transposed product, so there n is
// the rows of its blocks: 400 x 7 x 400 gives it the empty blocks.
const std::vector<std::array<int64_t, 3>> kShapes = {  // m, n, k
    {1, 1, 1}, {1, 17, 5}, {3, 1, 33}, {5, 4, 16}, {7, 33, 50}, {13, 99, 100}, {20, 1537, 512},
    {2, 6, 19}, {3, 7, 21}, {4, 10, 33}, {8, 5, 18}, {9, 14, 37}, {6, 6, 20}, {11, 7, 13}, {13, 10, 9},
    {4, 5, 24}, {14, 11, 30}, {1, 3, 40}, {2, 7, 12}, {7, 5, 22},
    {64, 31, 7}, {65, 48, 17}, {130, 70, 49}, {257, 129, 65}, {6, 7, 0},
    {100, 64, 150}, {61, 83, 131}, {49, 16, 300}, {30, 200, 200}, {7, 400, 400}, {400, 7, 400},
    {97, 45, 260}, {137, 33, 130}, {137, 99, 130}, {520, 33, 70}};

TEST(Gemm, EveryPathMatchesFloat64) {
  Random rng;
  SCOPED_TRACE(rng.note());
  // beta cycles through 0, 1 and -0.5 from case to case: the shapes' count is not a multiple of 3,
  // so each shape meets all three over three transposes or thread counts in a row.
  size_t beta_turn = 0;
  const int threads_before = omp_get_max_threads();
  for (GemmPath path : built_paths()) {
    SCOPED_TRACE(std::string("path ") + std::string(qkv::detail::to_string(path)));
    // The Small and Tiled (and TiledT) kernels are ours, SIMD per target (tiles, panels and sums differ): every
    // runnable target in turn; the libraries dispatch on their own (0: the CPU's choice).
    const bool tiled = path == GemmPath::Tiled || path == GemmPath::TiledT;
    const bool ours = path == GemmPath::Small || tiled;
    const std::vector<int64_t> targets = ours ? qkv_test::runnable_targets() : std::vector<int64_t>{0};
    for (int64_t target : targets) {
      std::optional<qkv_test::ForcedTarget> forced;
      if (target != 0) {
        forced.emplace(target);
        // Highway's chosen target is one for the whole library: flash's is Small's.
        ASSERT_EQ(qkv::detail::flash_attention_target(), target) << "the target was not forced";
      }
      SCOPED_TRACE(std::string("SIMD target ") + (target != 0 ? hwy::TargetName(target) : "as the CPU"));
      for (int threads : {1, 2, 3}) {
        omp_set_num_threads(threads);
        SCOPED_TRACE("threads " + std::to_string(threads));
        for (bool trans_a : {false, true}) {
          for (bool trans_b : {false, true}) {
            if (!qkv::detail::gemm_path_can_take(path, trans_a, trans_b)) continue;
            for (const auto& [m, n, k] : kShapes) {
              // 3 threads: the Tiled kernel's uneven row blocks (the same on every target), on
              // the shapes it threads; more threads than this machine's cores wait long at barriers.
              if (threads == 3 && (!tiled || target != targets.front() ||
                                   m * n * k < (int64_t{1} << 20)))
                continue;
              const float alpha = rng.chance(0.5) ? 1.0f : static_cast<float>(rng.uniform(-2, 2));
              const float beta = std::array<float, 3>{0.0f, 1.0f, -0.5f}[beta_turn++ % 3];
              const GemmCase g = make_gemm_case(rng, trans_a, trans_b, m, n, k, alpha, beta);
              std::vector<float> c = g.c;
              qkv::detail::sgemm_on(path, trans_a, trans_b, m, n, k, alpha, g.a.data(), g.lda, g.b.data(), g.ldb,
                                    beta, c.data(), g.ldc);
              expect_matches_float64(g, c);
            }
          }
        }
      }
    }
  }
  omp_set_num_threads(threads_before);
}

// The Small path takes A not transposed and B transposed only; Tiled, TiledT and OpenBLAS every
// transpose; oneDNN exactly when built in.
TEST(Gemm, PathsTakeWhatTheySay) {
  EXPECT_TRUE(qkv::detail::gemm_path_can_take(GemmPath::Small, false, true));
  EXPECT_FALSE(qkv::detail::gemm_path_can_take(GemmPath::Small, false, false));
  EXPECT_FALSE(qkv::detail::gemm_path_can_take(GemmPath::Small, true, false));
  EXPECT_FALSE(qkv::detail::gemm_path_can_take(GemmPath::Small, true, true));
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      EXPECT_TRUE(qkv::detail::gemm_path_can_take(GemmPath::OpenBlas, ta, tb));
      EXPECT_TRUE(qkv::detail::gemm_path_can_take(GemmPath::Tiled, ta, tb));
      EXPECT_TRUE(qkv::detail::gemm_path_can_take(GemmPath::TiledT, ta, tb));
    }
#ifdef QKV_HAVE_DNNL
  EXPECT_TRUE(qkv::detail::gemm_path_can_take(GemmPath::OneDnn, true, false));
#else
  EXPECT_FALSE(qkv::detail::gemm_path_can_take(GemmPath::OneDnn, true, false));
#endif
}

// The choice: x W^T with rows in whole AVX-512 vectors to TiledT, its other few rows to Small,
// many rows against a head dimension or (on several threads) of a mid-size Linear to Tiled (on
// AVX-512), the rest to oneDNN when built in, else OpenBLAS; and the test hook overrides it only
// where the forced path can take the call.
TEST(Gemm, ChoiceAndTestHook) {
  const GemmPath large = qkv::detail::gemm_path_can_take(GemmPath::OneDnn, false, false) ? GemmPath::OneDnn
                                                                                           : GemmPath::OpenBlas;
  // Few rows go to Small, except to oneDNN where Small runs its 16-register tile (see gemm.cpp).
  const bool small_wins = large == GemmPath::OpenBlas || qkv::detail::small_rows_gemm_has_wide_tile();
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 20, 1536, 512), small_wins ? GemmPath::Small : large);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 32, 64, 64), small_wins ? GemmPath::Small : large);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 65, 512, 512), large);
  const int threads_before = omp_get_max_threads();
  omp_set_num_threads(2);
  // TiledT (AVX-512): rows in whole vectors, 32-64 against n, k >= 256, 80-128 against n, k >= 512;
  // each edge just past. Where TiledT is not built for the target, 32-64 rows are Small's rule's.
  const bool wide = qkv::detail::tiled_gemm_has_wide_panels();
  const GemmPath few_rows = small_wins ? GemmPath::Small : large;
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 32, 512, 512), wide ? GemmPath::TiledT : few_rows);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 64, 256, 256), wide ? GemmPath::TiledT : few_rows);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 128, 512, 512), wide ? GemmPath::TiledT : large);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 80, 1536, 512), wide ? GemmPath::TiledT : large);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 32, 255, 256), few_rows);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 32, 512, 255), few_rows);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 40, 512, 512), few_rows);  // 2.5 vectors
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 16, 512, 512), few_rows);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 144, 512, 512), large);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 96, 511, 512), large);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 96, 512, 511), large);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, false, 64, 512, 512), large);  // x W: no TiledT
  // 33-64 rows that TiledT leaves: Small where its AVX-512 tile beats oneDNN, deep products on
  // several threads.
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 60, 512, 256), small_wins ? GemmPath::Small : large);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 60, 512, 255),
            large == GemmPath::OpenBlas ? GemmPath::Small : large);
  // ... and only where Small would thread them: too few outputs or multiply-adds run on one.
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 64, 48, 256),
            large == GemmPath::OpenBlas ? GemmPath::Small : large);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 40, 64, 256),
            large == GemmPath::OpenBlas ? GemmPath::Small : large);
  omp_set_num_threads(1);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 60, 512, 512),
            large == GemmPath::OpenBlas ? GemmPath::Small : large);
  omp_set_num_threads(threads_before);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, false, 20, 1536, 512), large);
  EXPECT_EQ(qkv::detail::choose_gemm_path(true, false, 512, 512, 2048), large);
  // Tiled: m >= 256 against n <= 64 or 32 <= k <= 64 (the reference kernel's products), or, on
  // several threads, a mid-size Linear (n <= 512, 32 <= k <= 512) from 512 rows for x W^T, from
  // 1024 for the other transposes; each edge just past.
  const GemmPath tiled = qkv::detail::tiled_gemm_has_wide_panels() ? GemmPath::Tiled : large;
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 512, 512, 64), tiled);   // S = Q K^T
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, false, 512, 64, 512), tiled);  // O = P V
  EXPECT_EQ(qkv::detail::choose_gemm_path(true, false, 512, 64, 512), tiled);   // dK = dS^T Q
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 255, 512, 64), large);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 256, 512, 65), large);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 512, 512, 32), tiled);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 512, 512, 31), large);
  EXPECT_EQ(qkv::detail::choose_gemm_path(true, false, 1536, 512, 20), large);  // a Linear's dW, 20 tokens
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, false, 256, 64, 8), tiled);
  omp_set_num_threads(2);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 512, 512, 512), tiled);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 511, 512, 512), large);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, false, 1024, 512, 512), tiled);  // a Linear's dx
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, false, 1023, 512, 512), large);
  EXPECT_EQ(qkv::detail::choose_gemm_path(true, false, 1024, 512, 512), tiled);   // a Linear's dW
  EXPECT_EQ(qkv::detail::choose_gemm_path(true, false, 1023, 512, 512), large);
  EXPECT_EQ(qkv::detail::choose_gemm_path(true, true, 1024, 512, 512), tiled);
  EXPECT_EQ(qkv::detail::choose_gemm_path(true, true, 1023, 512, 512), large);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 2048, 513, 512), large);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, false, 2048, 512, 513), large);
  omp_set_num_threads(1);  // one thread: oneDNN's own kernel is ahead on a mid-size Linear
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 2048, 512, 512), large);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, false, 2048, 512, 512), large);
  EXPECT_EQ(qkv::detail::choose_gemm_path(true, false, 1024, 512, 512), large);
  EXPECT_EQ(qkv::detail::choose_gemm_path(false, true, 512, 512, 64), tiled);
  omp_set_num_threads(threads_before);

  Random rng;
  const GemmCase g = make_gemm_case(rng, false, false, 9, 11, 13, 1.0f, 0.0f);
  for (GemmPath path : built_paths()) {
    ForcedPath forced(path);
    std::vector<float> c = g.c;
    const GemmPath took = qkv::detail::sgemm(false, false, g.m, g.n, g.k, 1.0f, g.a.data(), g.lda, g.b.data(), g.ldb,
                                             0.0f, c.data(), g.ldc);
    EXPECT_EQ(took, path == GemmPath::Small ? large : path);  // Small cannot take NN: the choice stands
    expect_matches_float64(g, c);
  }
}

// alpha == 0 is C = beta C on every path, A and B unread (BLAS's rule): NaN in them stays out.
TEST(Gemm, AlphaZeroReadsNeitherAnorB) {
  const std::vector<float> a(12, kNaN), b(12, kNaN);
  for (GemmPath path : built_paths())
    for (float beta : {0.0f, -0.5f}) {
      std::vector<float> c = {1, 2, 3, 4, 5, 6, 7, 8, 9};
      qkv::detail::sgemm_on(path, false, true, 3, 3, 4, 0.0f, a.data(), 4, b.data(), 4, beta, c.data(), 3);
      for (size_t i = 0; i < c.size(); ++i)
        EXPECT_EQ(c[i], beta * static_cast<float>(i + 1)) << qkv::detail::to_string(path) << " beta " << beta;
    }
}

// x rows off the 64-byte lines (numpy's 16-byte alignment, a padded stride): the Small path
// copies them into aligned scratch (gemm/small.cpp), which memory_stats counts; under a memory
// limit that refuses the scratch, it runs on the rows as they are. Both against float64.
TEST(Gemm, SmallCopiesRowsOffTheLinesAndRunsWithoutTheCopyUnderALimit) {
  Random rng;
  SCOPED_TRACE(rng.note());
  GemmCase g = make_gemm_case(rng, false, true, 20, 600, 100, 1.0f, 0.0f);  // threaded on 2
  g.lda = 101;  // off the lines whatever the vector's alignment
  g.a = rng.normals(g.m * g.lda);
  const int threads_before = omp_get_max_threads();
  for (int threads : {1, 2}) {
    omp_set_num_threads(threads);
    SCOPED_TRACE("threads " + std::to_string(threads));
    qkv::release_workspaces();
    const int64_t before = qkv::memory_stats().current_bytes;
    std::vector<float> c = g.c;
    qkv::detail::sgemm_on(GemmPath::Small, false, true, g.m, g.n, g.k, g.alpha, g.a.data(), g.lda, g.b.data(), g.ldb,
                          g.beta, c.data(), g.ldc);
    expect_matches_float64(g, c);
    // The copies: 20 rows of 100 floats, padded to 112, one per worker (20 x 600 x 100 is
    // threaded on 2).
    EXPECT_GE(qkv::memory_stats().current_bytes - before, int64_t{threads} * 20 * 112 * 4)
        << "no aligned copy was made";

    qkv::release_workspaces();
    const int64_t held = qkv::memory_stats().current_bytes;
    qkv::set_memory_limit(held + 1024);
    c = g.c;
    qkv::detail::sgemm_on(GemmPath::Small, false, true, g.m, g.n, g.k, g.alpha, g.a.data(), g.lda, g.b.data(), g.ldb,
                          g.beta, c.data(), g.ldc);
    qkv::set_memory_limit(0);
    expect_matches_float64(g, c);
    EXPECT_EQ(qkv::memory_stats().current_bytes, held) << "scratch held under the limit";
  }
  omp_set_num_threads(threads_before);
}

TEST(Gemm, BadArgumentsThrowNamingTheShape) {
  std::vector<float> a(64, 1.0f), b(64, 1.0f), c(64, 0.0f);
  try {
    qkv::detail::sgemm_on(GemmPath::OpenBlas, false, false, 4, 4, 4, 1.0f, a.data(), 3, b.data(), 4, 0.0f, c.data(), 4);
    FAIL() << "lda 3 < k 4 was accepted";
  } catch (const qkv::Error& e) {
    EXPECT_NE(std::string(e.what()).find("lda 3"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("m 4"), std::string::npos) << e.what();
  }
  EXPECT_THROW(qkv::detail::sgemm_on(GemmPath::Small, false, false, 4, 4, 4, 1.0f, a.data(), 4, b.data(), 4, 0.0f,
                                     c.data(), 4),
               qkv::Error);
  EXPECT_THROW(qkv::detail::sgemm_on(GemmPath::OpenBlas, false, false, -1, 4, 4, 1.0f, a.data(), 4, b.data(), 4, 0.0f,
                                     c.data(), 4),
               qkv::Error);
#ifndef QKV_HAVE_DNNL
  EXPECT_THROW(qkv::detail::sgemm_on(GemmPath::OneDnn, false, false, 4, 4, 4, 1.0f, a.data(), 4, b.data(), 4, 0.0f,
                                     c.data(), 4),
               qkv::Error);
#endif
}

// linear_sgemm (a Linear's y = x W^T + bias): on every path, SIMD target (of our kernels) and 1 or
// 2 threads, each shape with a bias and without, y poisoned with NaN, against float64. The Small
// path adds the bias in its tiles' stores (every count of rows and outputs a tile leaves, threaded
// blocks on the larger shapes); the others start y at the bias. small_rows_gemm itself is also
// called with a bias, alpha and beta (1, -0.5) together, as its header allows.
TEST(Gemm, LinearSgemmAddsTheBiasOnEveryPath) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const int threads_before = omp_get_max_threads();
  for (GemmPath path : built_paths()) {
    SCOPED_TRACE(std::string("path ") + std::string(qkv::detail::to_string(path)));
    ForcedPath forced_path(path);
    const bool ours = path == GemmPath::Small || path == GemmPath::Tiled || path == GemmPath::TiledT;
    const std::vector<int64_t> targets = ours ? qkv_test::runnable_targets() : std::vector<int64_t>{0};
    for (int64_t target : targets) {
      std::optional<qkv_test::ForcedTarget> forced;
      if (target != 0) forced.emplace(target);
      SCOPED_TRACE(std::string("SIMD target ") + (target != 0 ? hwy::TargetName(target) : "as the CPU"));
      for (int threads : {1, 2}) {
        omp_set_num_threads(threads);
        SCOPED_TRACE("threads " + std::to_string(threads));
        for (const auto& [m, n, k] : kShapes) {
          if (m * n * k > (int64_t{1} << 22) && target != targets.front()) continue;  // the largest on one target
          const std::vector<float> bias = rng.normals(n);
          for (bool with_bias : {true, false}) {
            SCOPED_TRACE(with_bias ? "with a bias" : "no bias");
            const GemmCase g = make_gemm_case(rng, false, true, m, n, k, 1.0f, 0.0f);
            std::vector<float> c = g.c;
            EXPECT_EQ(qkv::detail::linear_sgemm(m, n, k, g.a.data(), g.lda, g.b.data(), g.ldb,
                                                with_bias ? bias.data() : nullptr, c.data(), g.ldc),
                      path);
            expect_matches_float64(g, c, with_bias ? &bias : nullptr);
          }
          if (path == GemmPath::Small) {
            SCOPED_TRACE("small_rows_gemm with a bias, alpha and beta");
            for (float beta : {1.0f, -0.5f}) {
              const GemmCase g = make_gemm_case(rng, false, true, m, n, k, static_cast<float>(rng.uniform(-2, 2)), beta);
              std::vector<float> c = g.c;
              qkv::detail::small_rows_gemm(g.a.data(), g.lda, m, k, g.b.data(), g.ldb, n, g.alpha, beta, c.data(),
                                           g.ldc, bias.data());
              expect_matches_float64(g, c, &bias);
            }
          }
        }
      }
    }
  }
  omp_set_num_threads(threads_before);
}

// nn::Linear forward (x W^T + b) and backward (dx = g W, dW += g^T x, db) on every path, against
// float64, with row counts on both sides of the Small path's limit.
TEST(Gemm, LinearOnEveryPathMatchesFloat64) {
  Random rng;
  SCOPED_TRACE(rng.note());
  for (GemmPath path : built_paths()) {
    ForcedPath forced(path);
    SCOPED_TRACE(std::string("path ") + std::string(qkv::detail::to_string(path)));
    for (const auto& [rows, in, out] : std::vector<std::array<int64_t, 3>>{{3, 17, 5}, {20, 65, 33}, {131, 40, 70}}) {
      SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(in) + " -> " + std::to_string(out));
      qkv::nn::Linear linear(in, out, true, rng.next_u64());
      const qkv::Tensor x = rng.randn({rows, in});
      const qkv::Tensor g = rng.randn({rows, out});
      const qkv::Tensor y = linear.forward(x);
      const qkv::Tensor dx = linear.backward(g);
      const float* xs = x.data();
      const float* gs = g.data();
      const float* w = linear.weight.data();
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t o = 0; o < out; ++o) {
          double want = linear.bias.data()[o];
          for (int64_t i = 0; i < in; ++i) want += static_cast<double>(xs[r * in + i]) * w[o * in + i];
          ASSERT_NEAR(y.data()[r * out + o], want, 1e-5 * std::sqrt(static_cast<double>(in))) << "y " << r << ", " << o;
        }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < in; ++i) {
          double want = 0;
          for (int64_t o = 0; o < out; ++o) want += static_cast<double>(gs[r * out + o]) * w[o * in + i];
          ASSERT_NEAR(dx.data()[r * in + i], want, 1e-5 * std::sqrt(static_cast<double>(out))) << "dx " << r << ", " << i;
        }
      for (int64_t o = 0; o < out; ++o)
        for (int64_t i = 0; i < in; ++i) {
          double want = 0;
          for (int64_t r = 0; r < rows; ++r) want += static_cast<double>(gs[r * out + o]) * xs[r * in + i];
          ASSERT_NEAR(linear.weight_grad.data()[o * in + i], want, 1e-5 * std::sqrt(static_cast<double>(rows)))
              << "dW " << o << ", " << i;
        }
    }
  }
}

// The reference kernel on every path: forward against the float64 oracle (NaN-poisoned outputs,
// several masks and modifiers), backward against the flash backward (its own micro-GEMM, tested
// against float64 in attention/test_backward.cpp).
TEST(Gemm, ReferenceKernelOnEveryPath) {
  Random rng;
  SCOPED_TRACE(rng.note());
  using qkv_test::MaskKind;
  std::vector<qkv_test::Case> cases;
  for (const qkv_test::Sizes& s : {qkv_test::Sizes{1, 2, 1, 7, 9, 5, 3}, qkv_test::Sizes{2, 3, 3, 70, 33, 17, 19},
                                   qkv_test::Sizes{1, 2, 2, 3, 130, 64, 64}})
    for (MaskKind kind : {MaskKind::None, MaskKind::Causal, MaskKind::KeyLengths, MaskKind::Additive4D})
      cases.push_back(qkv_test::make_case(rng, s, kind, 1.0, 0.0f, qkv_test::Modifier::All));
  std::vector<qkv_test::Expected> expected;
  for (const qkv_test::Case& c : cases) expected.push_back(qkv_test::expect(c));
  for (GemmPath path : built_paths()) {
    ForcedPath forced(path);
    SCOPED_TRACE(std::string("path ") + std::string(qkv::detail::to_string(path)));
    for (size_t n = 0; n < cases.size(); ++n) {
      const qkv_test::Case& c = cases[n];
      qkv_test::check_kernel(qkv::detail::reference_attention, c, expected[n]);
      qkv::AttentionOptions reference = qkv_test::options_of(c, qkv::Backend::Reference);
      qkv::AttentionOptions flash = qkv_test::options_of(c, qkv::Backend::Flash);
      const qkv::AttentionResult forward = qkv::scaled_dot_product_attention(c.q, c.k, c.v, flash);
      const qkv::Tensor grad_output = rng.randn(forward.output.shape());
      const qkv::AttentionGrads want = qkv::scaled_dot_product_attention_backward(grad_output, c.q, c.k, c.v, forward, flash);
      const qkv::AttentionGrads got =
          qkv::scaled_dot_product_attention_backward(grad_output, c.q, c.k, c.v, forward, reference);
      for (const auto& [name, a, b] : {std::tuple{"dq", got.dq, want.dq}, std::tuple{"dk", got.dk, want.dk},
                                       std::tuple{"dv", got.dv, want.dv}}) {
        const std::vector<float> x = a.to_vector(), y = b.to_vector();
        ASSERT_EQ(x.size(), y.size());
        for (size_t i = 0; i < x.size(); ++i)
          ASSERT_NEAR(x[i], y[i], 1e-4 * (1.0 + std::abs(y[i]))) << c.name << " " << name << "[" << i << "]";
      }
    }
  }
}

}  // namespace
