// KeyMajorTerms (key_major_terms.hpp): the transposed copies, by panels of kBlock query rows x
// every key, dealt to a launch's workers; each panel by the register transposes of the kernels'
// "finish" step (steps/pack-inl.h, UnpackTransposed: 16 x 16 blocks on AVX-512, 4 x 4 in
// 128-bit vectors on the other targets), a strided view (a key stride other than 1) one float
// at a time.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/flash/key_major_terms.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "attention/steps/pack-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace qkv::detail {
namespace HWY_NAMESPACE {

// to[c * to_stride + r] = from[r * from_stride + c] for r < rows, c < cols (every element copied
// bitwise: UnpackTransposed without its factor).
void TransposePanel(const float* from, int64_t from_stride, int64_t rows, int64_t cols, float* to, int64_t to_stride) {
  pipeline::UnpackTransposed(from, static_cast<size_t>(from_stride), static_cast<size_t>(cols),
                             static_cast<size_t>(rows), nullptr, Rows<float>{to, 0, 0, to_stride}, 0, 0, 0);
}

// NOLINTNEXTLINE(google-readability-namespace-comments)
}  // namespace HWY_NAMESPACE
}  // namespace qkv::detail
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include <algorithm>

#include "attention/flash/key_major_terms.hpp"
#include "attention/launch.hpp"
#include "core/allocator.hpp"

namespace qkv::detail {
HWY_EXPORT(TransposePanel);

namespace {

constexpr int64_t kBlock = 32;  // query rows per panel (a panel's rows and its copy stay in L2)
constexpr int64_t kMinQueries = 16;  // fewer: a tile's line is a short gather, cheaper than a copy

// body(plane, i0, i1) for each panel of query rows [i0, i1) of each of `planes` planes, on the
// workers of a launch sized for `elements` copied floats.
template <class Body>
void for_each_panel(int64_t planes, int64_t q_len, int64_t elements, const Body& body) {
  const int64_t blocks = (q_len + kBlock - 1) / kBlock;
  const Launch launch(WorkspaceSlot::FlashScratch, 8.0 * static_cast<double>(elements), planes * blocks, 0);
  launch.for_each_run(planes * blocks, 1, [&](int64_t item, int64_t) {
    const int64_t i0 = item % blocks * kBlock;
    body(item / blocks, i0, std::min(q_len, i0 + kBlock));
  });
}

// Rows [i0, i1) of a (.., Nq, Nk) plane (row stride `row`, key stride `key`) into its key-major
// copy (key j's row at copy + j nq).
void to_key_major(const float* plane, int64_t row, int64_t key, float* copy, int64_t nq, int64_t nk, int64_t i0,
                  int64_t i1) {
  if (key == 1) return HWY_DYNAMIC_DISPATCH(TransposePanel)(plane + i0 * row, row, i1 - i0, nk, copy + i0, nq);
  for (int64_t j = 0; j < nk; ++j)
    for (int64_t i = i0; i < i1; ++i) copy[j * nq + i] = plane[i * row + j * key];
}

// The way back: rows [i0, i1) of a plane of contiguous rows (row stride `row`) from its key-major
// copy.
void from_key_major(const float* copy, float* plane, int64_t row, int64_t nq, int64_t nk, int64_t i0, int64_t i1) {
  HWY_DYNAMIC_DISPATCH(TransposePanel)(copy + i0, nq, nk, i1 - i0, plane + i0 * row, row);
}

bool has_query_rows(const MaskTermView& t, int64_t q_len) {
  return t.stride_q != 0 && t.stride_k != 0 && q_len >= kMinQueries;
}

}  // namespace

// The copies live in this thread's workspace, one slot per use (a forward pass may run before a
// backward in one call; never nested in it), kept for the next call (no fresh pages).
KeyMajorTerms::KeyMajorTerms(AttentionProblem& p) : KeyMajorTerms(p, nullptr, WorkspaceSlot::ForwardTerms) {}

KeyMajorTerms::KeyMajorTerms(AttentionBackwardProblem& bp)
    : KeyMajorTerms(bp.forward, bp.grad_bias.data ? &bp.grad_bias : nullptr, WorkspaceSlot::BackwardTerms) {}

KeyMajorTerms::KeyMajorTerms(AttentionProblem& p, BiasGradView* grad, WorkspaceSlot slot) {
  const int64_t nq = p.q_len, nk = p.kv_len, plane = nq * nk;
  const auto planes_b = [&](const MaskTermView& t) { return t.stride_b != 0 ? p.batch : 1; };
  const auto planes_h = [&](const MaskTermView& t) { return t.stride_h != 0 ? p.q_heads : 1; };
  // The additive term's gradient is rewired with it (a keep term has none).
  // (dbias is the caller's packed tensor: its keys contiguous unless broadcast.)
  const bool with_grad = grad != nullptr && grad->stride_q != 0 && grad->stride_k == 1 && nq >= kMinQueries;
  int64_t floats = 0;  // at most (only the first additive term takes the gradient)
  for (const MaskTermView& t : p.terms)
    if (has_query_rows(t, nq)) floats += planes_b(t) * planes_h(t) * plane * (with_grad && t.additive ? 2 : 1);
  if (floats == 0) return;
  float* next = thread_workspace(slot).floats(static_cast<size_t>(floats));
  for (MaskTermView& t : p.terms) {
    if (!has_query_rows(t, nq)) continue;
    const MaskTermView from = t;
    const int64_t pb = planes_b(t), ph = planes_h(t), planes = pb * ph;
    float* copy = next;
    next += planes * plane;
    float* grad_copy = nullptr;
    if (with_grad && t.additive && !key_major_grad_) {  // the first additive term's, as the problem's
      grad_copy = next;
      next += planes * plane;
      dbias_ = *grad;
      key_major_grad_ = grad_copy;
      planes_b_ = pb;
      planes_h_ = ph;
      q_len_ = nq;
      kv_len_ = nk;
    }
    for_each_panel(planes, nq, (grad_copy ? 2 : 1) * planes * plane, [&](int64_t at, int64_t i0, int64_t i1) {
      const float* data = from.data + at / ph * from.stride_b + at % ph * from.stride_h;
      to_key_major(data, from.stride_q, from.stride_k, copy + at * plane, nq, nk, i0, i1);
      if (grad_copy)
        for (int64_t j = 0; j < nk; ++j) std::fill_n(grad_copy + at * plane + j * nq + i0, i1 - i0, 0.0f);
    });
    const int64_t stride_b = pb > 1 ? ph * plane : 0, stride_h = ph > 1 ? plane : 0;
    t = MaskTermView{copy, stride_b, stride_h, 1, nq, t.additive};
    if (grad_copy) *grad = BiasGradView{grad_copy, stride_b, stride_h, 1, nq};
  }
}

void KeyMajorTerms::finish() const {
  if (!key_major_grad_) return;
  const int64_t plane = q_len_ * kv_len_, planes_h = planes_h_, nq = q_len_, nk = kv_len_;
  const BiasGradView to = dbias_;
  for_each_panel(planes_b_ * planes_h_, nq, 2 * planes_b_ * planes_h_ * plane, [&](int64_t at, int64_t i0, int64_t i1) {
    from_key_major(key_major_grad_ + at * plane, to.row(at / planes_h, at % planes_h, 0), to.stride_q, nq, nk, i0, i1);
  });
}

}  // namespace qkv::detail
#endif  // HWY_ONCE
