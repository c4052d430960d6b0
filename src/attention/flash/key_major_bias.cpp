// KeyMajorBias (key_major_bias.hpp): the transposed copies, by blocks of kBlock queries x kBlock
// keys (both sides of a block stay in cache), the blocks of query rows dealt to the launch's
// workers.
#include "attention/flash/key_major_bias.hpp"

#include <algorithm>
#include <vector>

#include "attention/launch.hpp"

namespace qkv::detail {

namespace {

constexpr int64_t kBlock = 32;

// The storage of this thread's key-major copies, kept for the next call (no fresh pages).
std::vector<float>& storage() {
  thread_local std::vector<float> floats;
  return floats;
}

// body(plane, i0, i1) for each block of query rows [i0, i1) of each (b, h) plane, on the
// workers of a launch sized for `elements` copied floats.
template <class Body>
void for_each_row_block(int64_t planes, int64_t q_len, int64_t elements, const Body& body) {
  const int64_t blocks = (q_len + kBlock - 1) / kBlock;
  const Launch launch(WorkspaceSlot::FlashScratch, 8.0 * static_cast<double>(elements), planes * blocks, 0);
  launch.for_each_run(planes * blocks, 1, [&](int64_t item, int64_t) {
    const int64_t i0 = item % blocks * kBlock;
    body(item / blocks, i0, std::min(q_len, i0 + kBlock));
  });
}

}  // namespace

KeyMajorBias::KeyMajorBias(AttentionBackwardProblem& bp) : dbias_(bp.grad_bias) {
  const AttentionProblem& p = bp.forward;
  auto term = std::find_if(bp.forward.terms.begin(), bp.forward.terms.end(),
                           [](const MaskTermView& t) { return t.additive; });
  // Keys broadcast (stride 0) would add into one element from several key-major ones: left as is.
  if (!dbias_.data || term == bp.forward.terms.end() || term->stride_q == 0 || term->stride_k == 0 || p.q_len < 2)
    return;
  const MaskTermView bias = *term;
  planes_b_ = bias.stride_b != 0 ? p.batch : 1;
  planes_h_ = bias.stride_h != 0 ? p.q_heads : 1;
  q_len_ = p.q_len;
  kv_len_ = p.kv_len;
  const int64_t plane = q_len_ * kv_len_, planes = planes_b_ * planes_h_;
  std::vector<float>& floats = storage();
  floats.resize(static_cast<size_t>(2 * planes * plane));
  float* key_major_bias = floats.data();
  key_major_grad_ = key_major_bias + planes * plane;
  float* grad = key_major_grad_;
  const int64_t planes_h = planes_h_, nq = q_len_, nk = kv_len_;
  for_each_row_block(planes, nq, 2 * planes * plane, [&](int64_t at, int64_t i0, int64_t i1) {
    const float* from = bias.data + at / planes_h * bias.stride_b + at % planes_h * bias.stride_h;
    float* to = key_major_bias + at * plane;
    for (int64_t j0 = 0; j0 < nk; j0 += kBlock)
      for (int64_t j = j0; j < std::min(nk, j0 + kBlock); ++j) {
        for (int64_t i = i0; i < i1; ++i) to[j * nq + i] = from[i * bias.stride_q + j * bias.stride_k];
        std::fill(grad + at * plane + j * nq + i0, grad + at * plane + j * nq + i1, 0.0f);
      }
  });
  const int64_t stride_b = planes_b_ > 1 ? planes_h_ * plane : 0, stride_h = planes_h_ > 1 ? plane : 0;
  *term = MaskTermView{key_major_bias, stride_b, stride_h, 1, nq, true};
  bp.grad_bias = BiasGradView{key_major_grad_, stride_b, stride_h, 1, nq};
}

void KeyMajorBias::finish() const {
  if (!key_major_grad_) return;
  const int64_t plane = q_len_ * kv_len_, planes_h = planes_h_, nq = q_len_, nk = kv_len_;
  const BiasGradView to = dbias_;
  const float* grad = key_major_grad_;
  for_each_row_block(planes_b_ * planes_h_, nq, 2 * planes_b_ * planes_h_ * plane,
                     [&](int64_t at, int64_t i0, int64_t i1) {
                       const float* from = grad + at * plane;
                       for (int64_t j0 = 0; j0 < nk; j0 += kBlock)
                         for (int64_t i = i0; i < i1; ++i) {
                           float* row = to.row(at / planes_h, at % planes_h, i);
                           for (int64_t j = j0; j < std::min(nk, j0 + kBlock); ++j)
                             row[j * to.stride_k] = from[j * nq + i];
                         }
                     });
}

}  // namespace qkv::detail
