// libFuzzer target: the mask-expression parser of `qkv serve` (the explorer's "mask" field; the
// grammar is in tools/qkv/mask_expr.hpp). The input is the expression, any bytes. Every outcome
// must be a Mask or the parser's error (a qkv::Error) whose column lies within the input
// (1 .. size + 1, the end); anything else escaping, or a sanitizer report, is a failure. A parsed
// Mask must then be usable: scaled_dot_product_attention under it, on a few tiny shapes, either
// refuses it with a qkv::Error (a padding longer than the keys, and only that) or returns weights
// that are finite, in [0, 1], positive exactly where the mask's normalised rule (mask.hpp) lets a
// query see a key, summing to 1 on every row that sees a key (0 on a row that sees none), and
// outputs that are finite and agree between the Reference and Flash backends.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "mask_expr.hpp"
#include "qkv/qkv.hpp"

namespace {

// ---- The parser under test: when it moves (qkv::Mask::parse), re-point these two lines.
using ParseError = qkv::cli::MaskExpressionError;  // has column(), 1-based
qkv::Mask parse(const std::string& expression) { return qkv::cli::parse_mask_expression(expression); }
// ----

[[noreturn]] void fail(const std::string& expression, const std::string& what) {
  std::fprintf(stderr, "fuzz_mask_expression: '%s': %s\n", expression.c_str(), what.c_str());
  std::abort();
}

// Key j visible to query i of batch 0 under the mask's normalised rule (mask.hpp).
bool visible(const qkv::Mask& mask, int64_t i, int64_t j) {
  if (j < i + mask.band_lo() || j > i + mask.band_hi()) return false;
  return !mask.has_key_lengths() || j < mask.lengths().front();
}

// The mask applied to one (1, 1, nq, d) x (1, 1, nk, d) problem.
void check_usable(const std::string& expression, const qkv::Mask& mask, int64_t nq, int64_t nk) {
  const qkv::Tensor q = qkv::Tensor::randn({1, 1, nq, 4}, 1);
  const qkv::Tensor k = qkv::Tensor::randn({1, 1, nk, 4}, 2);
  const qkv::Tensor v = qkv::Tensor::randn({1, 1, nk, 3}, 3);
  qkv::AttentionOptions options;
  options.mask = mask;
  options.need_weights = true;
  options.backend = qkv::Backend::Reference;
  const bool too_long = mask.has_key_lengths() && mask.lengths().front() > nk;
  qkv::AttentionResult reference;
  try {
    reference = qkv::scaled_dot_product_attention(q, k, v, options);
  } catch (const qkv::Error& e) {
    if (!too_long) fail(expression, std::string("refused on a shape it fits: ") + e.what());
    return;
  }
  if (too_long) fail(expression, "a padding longer than the keys was accepted");
  for (int64_t i = 0; i < nq; ++i) {
    double sum = 0;
    bool any = false;
    for (int64_t j = 0; j < nk; ++j) {
      const float w = reference.weights.at({0, 0, i, j});
      if (!std::isfinite(w) || w < 0 || w > 1) fail(expression, "a weight outside [0, 1]");
      if ((w > 0) != visible(mask, i, j)) fail(expression, "a weight's visibility differs from the mask's rule");
      sum += w;
      any = any || visible(mask, i, j);
    }
    if (std::abs(sum - (any ? 1.0 : 0.0)) > 1e-5) fail(expression, "a row's weights do not sum to 1 (or 0)");
  }
  options.need_weights = false;
  options.backend = qkv::Backend::Flash;
  const qkv::AttentionResult flash = qkv::scaled_dot_product_attention(q, k, v, options);
  const std::vector<float> a = reference.output.to_vector(), b = flash.output.to_vector();
  for (size_t e = 0; e < a.size(); ++e) {
    if (!std::isfinite(a[e]) || !std::isfinite(b[e])) fail(expression, "a non-finite output");
    if (std::abs(a[e] - b[e]) > 1e-4f) fail(expression, "Reference and Flash outputs differ");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string expression(reinterpret_cast<const char*>(data), size);
  qkv::Mask mask;
  try {
    mask = parse(expression);
  } catch (const ParseError& e) {
    if (e.column() < 1 || e.column() > expression.size() + 1) {
      fail(expression, "an error whose column is outside the input: " + std::to_string(e.column()));
    }
    if (std::string(e.what()).empty()) fail(expression, "an error without a message");
    return 0;
  }
  // Anything else thrown (even another qkv::Error) escapes and fails the run: the parser's
  // errors are its own kind, with a column.
  (void)mask.str();
  for (const auto& [nq, nk] : {std::pair<int64_t, int64_t>{1, 1}, {3, 5}, {6, 6}, {5, 2}}) check_usable(expression, mask, nq, nk);
  return 0;
}
