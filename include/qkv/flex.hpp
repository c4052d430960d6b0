// Your own score function in C++ (FlexAttention's score_mod as a callable, docs/flex.md): a
// generic lambda
//
//   auto relative = qkv::score_function([](auto s, int64_t b, int64_t h, int64_t q, int64_t k) {
//     return s - 0.1f * static_cast<float>(q > k ? q - k : k - q);
//   });
//   options.score_function = relative;
//
// called by the kernels one virtual call per tile of scores in the forward (ScoreFunction::tile)
// and per line in the backward (ScoreFunction::line), the lambda inlined over the elements in the
// template instantiated here, in your translation unit: no function pointer per element. Its derivative in s, for the backward, comes from calling it
// with s a Dual (value and d/ds): write it with operators and the functions below (qkv::tanh,
// qkv::exp, ... found by argument-dependent lookup when called unqualified) so that it takes
// both a float and a Dual. The text score functions (AttentionOptions::score_mod) implement the
// same interface.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>

namespace qkv {

// Where a line of scores sits: element x is query i0 + x * query_step against key
// j0 + x * key_step, of query head h, batch b.
struct ScoreLine {
  int64_t b, h, i0, j0, query_step, key_step;
};

// The one interface the kernels call for a score function, once per line of scores.
class ScoreFunction {
 public:
  virtual ~ScoreFunction() = default;
  // Floats of scratch line() needs for lines of up to n scores.
  virtual size_t scratch_floats(size_t n) const = 0;
  // s[x] <- f(s[x], b, h, query(x), key(x)) for x < count; with `slope`, slope[x] = df/ds there.
  // n >= count is the line's length in whole SIMD vectors (elements past count have no query or
  // key and are left alone); `scratch` holds scratch_floats(n) floats, 64-byte aligned.
  virtual void line(const ScoreLine& at, size_t n, size_t count, float* s, float* slope, float* scratch) const = 0;
  // The forward's whole tile in one call: `lines` lines, line l at `first` with its key moved by
  // l * line_key_step and its scores at s + l * n, as line() without the derivative. By default
  // line() per line; a callable runs the tile in one loop (ScoreCallable).
  virtual void tile(const ScoreLine& first, int64_t line_key_step, size_t lines, size_t n, size_t count, float* s,
                    float* scratch) const {
    for (size_t l = 0; l < lines; ++l) {
      ScoreLine at = first;
      at.j0 += static_cast<int64_t>(l) * line_key_step;
      line(at, n, count, s + l * n, nullptr, scratch);
    }
  }
};

// A dual number: a value and its derivative in the score s.
struct Dual {
  float value, slope;
};

namespace flex_detail {
template <class T>
using IfNumber = std::enable_if_t<std::is_arithmetic_v<T>, int>;
inline Dual dual(Dual d) { return d; }
template <class T, IfNumber<T> = 0>
Dual dual(T v) {
  return {static_cast<float>(v), 0.0f};
}
}  // namespace flex_detail

inline Dual operator-(Dual a) { return {-a.value, -a.slope}; }
inline Dual operator+(Dual a, Dual b) { return {a.value + b.value, a.slope + b.slope}; }
inline Dual operator-(Dual a, Dual b) { return {a.value - b.value, a.slope - b.slope}; }
inline Dual operator*(Dual a, Dual b) { return {a.value * b.value, a.slope * b.value + a.value * b.slope}; }
inline Dual operator/(Dual a, Dual b) {
  return {a.value / b.value, (a.slope * b.value - a.value * b.slope) / (b.value * b.value)};
}
#define QKV_DUAL_MIXED(op)                                                                        \
  template <class T, flex_detail::IfNumber<T> = 0>                                               \
  Dual operator op(Dual a, T b) {                                                                \
    return a op flex_detail::dual(b);                                                            \
  }                                                                                               \
  template <class T, flex_detail::IfNumber<T> = 0>                                               \
  Dual operator op(T a, Dual b) {                                                                \
    return flex_detail::dual(a) op b;                                                            \
  }
QKV_DUAL_MIXED(+)
QKV_DUAL_MIXED(-)
QKV_DUAL_MIXED(*)
QKV_DUAL_MIXED(/)
#undef QKV_DUAL_MIXED
// Comparisons read the values (a condition is flat in s).
inline bool operator<(Dual a, Dual b) { return a.value < b.value; }
inline bool operator>(Dual a, Dual b) { return a.value > b.value; }
template <class T, flex_detail::IfNumber<T> = 0>
bool operator<(Dual a, T b) { return a.value < static_cast<float>(b); }
template <class T, flex_detail::IfNumber<T> = 0>
bool operator>(Dual a, T b) { return a.value > static_cast<float>(b); }

inline Dual abs(Dual a) { return a.value > 0 ? a : a.value < 0 ? -a : Dual{0.0f, 0.0f}; }
inline Dual exp(Dual a) {
  const float e = std::exp(a.value);
  return {e, e * a.slope};
}
inline Dual log(Dual a) { return {std::log(a.value), a.slope / a.value}; }
inline Dual sqrt(Dual a) {
  const float r = std::sqrt(a.value);
  return {r, a.slope / (2 * r)};
}
inline Dual tanh(Dual a) {
  const float t = std::tanh(a.value);
  return {t, (1 - t * t) * a.slope};
}
inline Dual min(Dual a, Dual b) { return a.value <= b.value ? a : b; }
inline Dual max(Dual a, Dual b) { return a.value >= b.value ? a : b; }
// The same functions on plain numbers, so that one unqualified call serves both instantiations.
inline float abs(float a) { return std::fabs(a); }
inline float exp(float a) { return std::exp(a); }
inline float log(float a) { return std::log(a); }
inline float sqrt(float a) { return std::sqrt(a); }
inline float tanh(float a) { return std::tanh(a); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }

// How a callable's lines are compiled. The callable is instantiated in your translation unit,
// which is usually compiled for the baseline x86-64 (SSE2), where a loop over int64 positions
// cannot be vectorised (SSE2 has no int64 compare and no int64 -> float conversion): each score
// then cost a scalar conversion and a branch. So on x86-64 with GCC or Clang the loop is
// compiled three times, for AVX-512 (F, VL, DQ, BW: int64 vectors, compares and conversions),
// for AVX2 and for the baseline, `flatten` inlining the callable into each, and the best one the
// CPU runs is chosen once, when the wrapper is made. Elsewhere the loop is compiled once.
namespace flex_detail {
enum class Isa { Baseline, Avx2, Avx512 };

// (Not clang-cl: __builtin_cpu_supports needs compiler-rt's CPU model, which MSVC's runtime lacks.)
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(_MSC_VER)
#define QKV_FLEX_MULTIVERSION 1
inline Isa best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw"))
    return Isa::Avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::Avx2;
  return Isa::Baseline;
}
template <class Body>
__attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma"), flatten)) void run_avx512(const Body& body) {
  body();
}
template <class Body>
__attribute__((target("avx2,fma"), flatten)) void run_avx2(const Body& body) {
  body();
}
#else
inline Isa best_isa() { return Isa::Baseline; }
#endif

// `isa`, or best_isa() where the CPU cannot run it (an AVX-512 copy on an AVX2 CPU would fault).
inline Isa runnable(Isa isa) {
  const Isa best = best_isa();
  return static_cast<int>(isa) > static_cast<int>(best) ? best : isa;
}

// body() compiled for `isa` (one of best_isa()'s answers).
template <class Body>
inline void run(Isa isa, const Body& body) {
#ifdef QKV_FLEX_MULTIVERSION
  if (isa == Isa::Avx512) return run_avx512(body);
  if (isa == Isa::Avx2) return run_avx2(body);
#endif
  (void)isa;
  body();
}

// Query and key of element x of a line.
inline int64_t query_of(const ScoreLine& at, size_t x) { return at.i0 + static_cast<int64_t>(x) * at.query_step; }
inline int64_t key_of(const ScoreLine& at, size_t x) { return at.j0 + static_cast<int64_t>(x) * at.key_step; }
}  // namespace flex_detail

// A callable f(s, b, h, q, k) as a ScoreFunction: its line() runs f over the line's elements,
// inlined, on floats, or on Duals when the derivative is asked for.
template <class F>
class ScoreCallable final : public ScoreFunction {
 public:
  // isa: which copy of the loops runs (tests ask for each; best_isa() is the fastest the CPU runs);
  // one the CPU cannot run falls back to best_isa().
  explicit ScoreCallable(F f, flex_detail::Isa isa = flex_detail::best_isa())
      : f_(std::move(f)), isa_(flex_detail::runnable(isa)) {}
  size_t scratch_floats(size_t) const override { return 0; }
  void line(const ScoreLine& at, size_t, size_t count, float* s, float* slope, float*) const override {
    using flex_detail::key_of;
    using flex_detail::query_of;
    const F& f = f_;
    if (slope == nullptr) {
      flex_detail::run(isa_, [&] {
        for (size_t x = 0; x < count; ++x) s[x] = static_cast<float>(f(s[x], at.b, at.h, query_of(at, x), key_of(at, x)));
      });
      return;
    }
    flex_detail::run(isa_, [&] {
      for (size_t x = 0; x < count; ++x) {
        const Dual out = flex_detail::dual(f(Dual{s[x], 1.0f}, at.b, at.h, query_of(at, x), key_of(at, x)));
        s[x] = out.value;
        slope[x] = out.slope;
      }
    });
  }
  // One dispatch and one loop nest per tile: the per-line call and loop set-up cost about what a
  // line of 48 vectorised scores does.
  void tile(const ScoreLine& first, int64_t line_key_step, size_t lines, size_t n, size_t count, float* s,
            float*) const override {
    using flex_detail::key_of;
    using flex_detail::query_of;
    const F& f = f_;
    flex_detail::run(isa_, [&] {
      for (size_t l = 0; l < lines; ++l) {
        const int64_t key_shift = static_cast<int64_t>(l) * line_key_step;
        float* line_s = s + l * n;
        for (size_t x = 0; x < count; ++x)
          line_s[x] = static_cast<float>(f(line_s[x], first.b, first.h, query_of(first, x), key_of(first, x) + key_shift));
      }
    });
  }

 private:
  F f_;
  flex_detail::Isa isa_;
};

template <class F>
std::shared_ptr<const ScoreFunction> score_function(F f) {
  return std::make_shared<const ScoreCallable<F>>(std::move(f));
}

// Your own mask function in C++ (FlexAttention's mask_mod as a callable): a callable
// f(b, h, q, k) -> bool, true where query q of head h, batch b sees key k, made a Mask by
// Mask::function and combined with any other mask:
//
//   std::vector<int64_t> doc = ...;  // per token, read by reference: keep it alive
//   options.mask = qkv::Mask::causal() & qkv::Mask::function(qkv::mask_function(
//       [&doc](int64_t, int64_t, int64_t q, int64_t k) { return doc[q] == doc[k]; }, {false, false}));
//
// As for score_function: one virtual call per line (MaskFunction::line), f inlined over the
// line in the template instantiated in your translation unit. The function is evaluated once
// per call over every pair into a block map (FlexAttention's block mask, mask/mod_blocks.hpp)
// when the problem has at most 2^24 pairs per map: tiles all hidden are skipped, tiles all
// shown get no per-element mask, and only partial tiles call f again. `reads` says whether f
// depends on b and h: when it does not, one map serves every batch and head (smaller, so larger
// problems get one).
struct MaskReads {
  bool batch = true, head = true;
};

// The one interface the kernels call for a mask function, once per line.
class MaskFunction {
 public:
  virtual ~MaskFunction() = default;
  // shown[x] = 1 where query at.i0 + x * at.query_step sees key at.j0 + x * at.key_step (of head
  // at.h, batch at.b), else 0, for x < count.
  virtual void line(const ScoreLine& at, size_t count, float* shown) const = 0;
  virtual MaskReads reads() const = 0;
};

template <class F>
class MaskCallable final : public MaskFunction {
 public:
  MaskCallable(F f, MaskReads reads) : f_(std::move(f)), reads_(reads), isa_(flex_detail::best_isa()) {}
  void line(const ScoreLine& at, size_t count, float* shown) const override {
    using flex_detail::key_of;
    using flex_detail::query_of;
    const F& f = f_;
    flex_detail::run(isa_, [&] {  // compiled per instruction set, as ScoreCallable::line
      for (size_t x = 0; x < count; ++x) shown[x] = f(at.b, at.h, query_of(at, x), key_of(at, x)) ? 1.0f : 0.0f;
    });
  }
  MaskReads reads() const override { return reads_; }

 private:
  F f_;
  MaskReads reads_;
  flex_detail::Isa isa_;
};

template <class F>
std::shared_ptr<const MaskFunction> mask_function(F f, MaskReads reads = {}) {
  return std::make_shared<const MaskCallable<F>>(std::move(f), reads);
}

}  // namespace qkv
