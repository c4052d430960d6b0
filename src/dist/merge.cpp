// Ring attention's merges (dist/merge.hpp).
#include "dist/merge.hpp"

#include <cstdint>
#include <limits>
#include <vector>

#include "attention/lse_merge.hpp"

namespace qkv::dist::ring {

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// o1, lse1 (accumulated) <- the log-sum-exp merge with o2, lse2, row by row
// (merge_softmax_parts, attention/lse_merge.hpp: a result (O, lse) is the part (lse, 1, O)); a row
// with both -inf stays (0, -inf), never NaN.
void merge(const Tensor& o1, const Tensor& lse1, const Tensor& o2, const Tensor& lse2) {
  const int64_t rows = lse1.numel(), d = o1.size(3);
  float* a = o1.data();
  float* la = lse1.data();
  const float* b = o2.data();
  const float* lb = lse2.data();
#pragma omp parallel for schedule(static) if (rows * d > 65536)
  for (int64_t row = 0; row < rows; ++row) {
    if (lb[row] == kMinusInf) continue;  // nothing new for this row
    float* x = a + row * d;
    const detail::SoftmaxPart parts[2] = {{la[row], 1.0f, x}, {lb[row], 1.0f, b + row * d}};
    la[row] = detail::merge_softmax_parts(2, [&](int64_t c) { return parts[c]; }, static_cast<size_t>(d), x).lse;
  }
}

// The sinks join each row's softmax once, after the ring: a part (sinks[h], 1, zeros). out
// (B, H, rows, D) and lse (B, H, rows) are merged with it in place; a row that saw no key gets
// output 0 and lse = sinks[h], as in a single call.
void merge_sinks(const Tensor& out, const Tensor& lse, const Tensor& sinks) {
  const int64_t heads = out.size(1), rows = out.size(2), d = out.size(3);
  const int64_t all_rows = out.size(0) * heads * rows;
  const std::vector<float> sink = sinks.to_vector();
  float* x = out.data();
  float* la = lse.data();
  for (int64_t row = 0; row < all_rows; ++row) {
    const detail::SoftmaxPart parts[2] = {{la[row], 1.0f, x + row * d},
                                          {sink[static_cast<size_t>(row / rows % heads)], 1.0f, nullptr}};
    la[row] = detail::merge_softmax_parts(2, [&](int64_t c) { return parts[c]; }, static_cast<size_t>(d), x + row * d).lse;
  }
}

// dsinks[h] = -sum over the rows of head h of exp(sinks[h] - lse) (dO . O) (sink_gradient_of_row,
// attention/lse_merge.hpp, as every backward kernel's). go4, o4 (B, H, n, Dv) and lse4 (B, H, n, 1)
// are this rank's rows; the sum over every rank's is returned on every rank.
Tensor ring_sink_gradients(const Tensor& go4, const Tensor& o4, const Tensor& lse4, const Tensor& sinks,
                           const Comm& comm) {
  const int64_t heads = o4.size(1), rows = o4.size(2), d = o4.size(3);
  const std::vector<float> sink = sinks.to_vector();
  std::vector<double> sums(static_cast<size_t>(heads), 0.0);
  const float* go = go4.data();
  const float* o = o4.data();
  const float* lse = lse4.data();
  for (int64_t row = 0; row < o4.size(0) * heads * rows; ++row) {
    const size_t h = static_cast<size_t>(row / rows % heads);
    sums[h] += detail::sink_gradient_of_row(sink[h], lse[row], 1.0f, go + row * d, o + row * d, d);
  }
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, sums.data(), static_cast<int>(heads), MPI_DOUBLE, MPI_SUM, comm.get()),
            "MPI_Allreduce of dsinks");
  Tensor dsinks = Tensor::empty(sinks.shape());
  for (int64_t h = 0; h < heads; ++h) dsinks.data()[h] = static_cast<float>(sums[static_cast<size_t>(h)]);
  return dsinks;
}

}  // namespace qkv::dist::ring
