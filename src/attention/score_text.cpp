// TextScoreFunction: a parsed score function behind qkv::ScoreFunction. Highway's foreach_target
// re-includes this file once per SIMD target; the class and its dispatch live in the HWY_ONCE part.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/score_text.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "attention/steps/score_mod-inl.h"
#include "hwy/highway.h"

#ifndef QKV_ATTENTION_SCORE_TEXT_ONCE
#define QKV_ATTENTION_SCORE_TEXT_ONCE
#include <memory>
#include <utility>
#include <vector>

#include "attention/score_text.hpp"
#endif

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {

void TextLine(const ModExpression& e, const ModInput* inputs, const ScoreLine& at, size_t n, size_t count,
              float* HWY_RESTRICT s, float* HWY_RESTRICT slope, float* HWY_RESTRICT scratch) {
  pipeline::TextScoreLine(e, inputs, at, n, count, s, slope, scratch);
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace qkv::detail {

HWY_EXPORT(TextLine);

namespace {
class TextScoreFunction final : public ScoreFunction {
 public:
  TextScoreFunction(ModExpression e, std::vector<ModInput> inputs) : e_(std::move(e)), inputs_(std::move(inputs)) {}
  size_t scratch_floats(size_t n) const override { return e_.scratch_floats(n); }
  void line(const ScoreLine& at, size_t n, size_t count, float* s, float* slope, float* scratch) const override {
    HWY_DYNAMIC_DISPATCH(TextLine)(e_, inputs_.data(), at, n, count, s, slope, scratch);
  }

 private:
  ModExpression e_;
  std::vector<ModInput> inputs_;
};
}  // namespace

std::shared_ptr<const ScoreFunction> text_score_function(ModExpression e, std::vector<ModInput> inputs) {
  return std::make_shared<const TextScoreFunction>(std::move(e), std::move(inputs));
}

}  // namespace qkv::detail
#endif  // HWY_ONCE
