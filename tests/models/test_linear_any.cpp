// models::detail::linear on stored 16-bit weights against a float64 product of the stored values,
// with shapes that cut W into several panels (the last one partial) in both layouts, for the few-
// rows (decode) and many-rows (prefill) panel sizes; many rows on a bf16 W with the bfloat16 dot
// products (gemm/bf16_dot.hpp) against the product of x rounded to bfloat16, and with them switched
// off (the fallback of a CPU without them) against the product of x itself.
#include <cmath>
#include <ostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "gemm/bf16_dot.hpp"
#include "models/linear_any.hpp"
#include "qkv/dtype.hpp"

namespace qkv::models::detail {
namespace {

struct LinearCase {
  int64_t m, out, in;
  Layout layout;
  DType dtype;
};

void PrintTo(const LinearCase& c, std::ostream* os) {
  *os << "m " << c.m << ", out " << c.out << ", in " << c.in
      << (c.layout == Layout::OutIn ? ", (out, in) " : ", (in, out) ") << c.dtype;
}

class LinearAny : public ::testing::TestWithParam<LinearCase> {};

TEST_P(LinearAny, EqualsTheProductOfTheStoredValues) {
  const LinearCase p = GetParam();
  uint64_t state = 77;
  const auto uniform = [&] {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<float>(static_cast<double>(state >> 11) * 0x1.0p-52 - 1.0);
  };
  std::vector<float> x(static_cast<size_t>(p.m * p.in)), w(static_cast<size_t>(p.out * p.in)),
      bias(static_cast<size_t>(p.out));
  for (float& v : x) v = uniform();
  for (float& v : w) v = uniform();
  for (float& v : bias) v = uniform();
  std::vector<uint16_t> stored(w.size());
  const DType dtype = p.dtype;
  if (dtype != DType::F32) convert(w.data(), DType::F32, stored.data(), dtype, w.size());
  std::vector<float> back(w.size());
  if (dtype != DType::F32) convert(stored.data(), dtype, back.data(), DType::F32, w.size());
  const std::vector<float>& values = dtype == DType::F32 ? w : back;  // what W holds, stored (rows, cols)
  const StoredMatrix matrix{.data = dtype == DType::F32 ? static_cast<const void*>(w.data()) : stored.data(),
                            .dtype = dtype,
                            .out = p.out,
                            .in = p.in,
                            .layout = p.layout};
  for (bool dots : {true, false}) {
    qkv::detail::set_bf16_dot_gemm_for_test(dots);
    const bool rounds_x = dtype == DType::BF16 && p.m > kMaxRowsInPlace && qkv::detail::bf16_dot_gemm_available();
    std::vector<float> x_used = x;  // what the products see
    if (rounds_x) {
      std::vector<uint16_t> bits(x.size());
      convert(x.data(), DType::F32, bits.data(), DType::BF16, x.size());
      convert(bits.data(), DType::BF16, x_used.data(), DType::F32, x.size());
    }
    std::vector<float> y(static_cast<size_t>(p.m * p.out), NAN);
    linear(x.data(), p.m, matrix, bias.data(), y.data());
    double worst = 0;
    for (int64_t i = 0; i < p.m; ++i)
      for (int64_t o = 0; o < p.out; ++o) {
        double want = bias[static_cast<size_t>(o)];
        for (int64_t k = 0; k < p.in; ++k) {
          const size_t at = static_cast<size_t>(p.layout == Layout::OutIn ? o * p.in + k : k * p.out + o);
          want += static_cast<double>(x_used[static_cast<size_t>(i * p.in + k)]) * values[at];
        }
        const double got = y[static_cast<size_t>(i * p.out + o)];
        worst = std::isnan(got) ? INFINITY : std::max(worst, std::abs(got - want));
      }
    EXPECT_LE(worst, 1e-5 * std::sqrt(static_cast<double>(p.in)) * 4) << (dots ? "dot products on" : "off");
  }
  qkv::detail::set_bf16_dot_gemm_for_test(true);
}

INSTANTIATE_TEST_SUITE_P(
    Panels, LinearAny,
    ::testing::Values(LinearCase{3, 500, 300, Layout::OutIn, DType::BF16},     // 218-row panels: 3
                      LinearCase{3, 300, 500, Layout::InOut, DType::F16},      // 218-row panels of in: 3
                      LinearCase{20, 1000, 1100, Layout::OutIn, DType::BF16},  // 953-row panels: 2
                      LinearCase{20, 1100, 1000, Layout::InOut, DType::BF16},  // 953-row panels of in: 2
                      LinearCase{33, 77, 131, Layout::OutIn, DType::BF16},     // dot products, odd
                      LinearCase{33, 131, 77, Layout::InOut, DType::BF16},
                      LinearCase{17, 45, 19, Layout::OutIn, DType::F16},       // no f16 dot products
                      LinearCase{5, 37, 29, Layout::InOut, DType::F32},
                      LinearCase{5, 37, 29, Layout::OutIn, DType::F32}),
    [](const auto& info) {
      const LinearCase& c = info.param;
      return "m" + std::to_string(c.m) + "_out" + std::to_string(c.out) + "_in" + std::to_string(c.in) +
             (c.layout == Layout::OutIn ? "_OutIn_" : "_InOut_") + std::string(to_string(c.dtype));
    });

}  // namespace
}  // namespace qkv::models::detail
