// qkv::Shape and qkv::Tensor: factories, views, copies, printing.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "harness/oracle.hpp"

namespace {

using ::testing::HasSubstr;
using qkv::Shape;
using qkv::Tensor;
using qkv_test::Random;

// Row-major index of (i0, i1, ...) in a packed tensor of the given dims.
int64_t packed_index(const std::vector<int64_t>& dims, const std::vector<int64_t>& index) {
  int64_t flat = 0;
  for (size_t d = 0; d < dims.size(); ++d) flat = flat * dims[d] + index[d];
  return flat;
}

// Shape keeps its dims, rank and element count, and prints like a Python tuple.
TEST(Shape, InitListIndexingSizeAndStr) {
  const Shape s{2, 8, 16, 64};
  EXPECT_EQ(s.size(), 4u);
  EXPECT_EQ(s[0], 2);
  EXPECT_EQ(s[1], 8);
  EXPECT_EQ(s[2], 16);
  EXPECT_EQ(s[3], 64);
  EXPECT_EQ(s.numel(), 2 * 8 * 16 * 64);
  EXPECT_EQ(s.str(), "(2, 8, 16, 64)");
  EXPECT_EQ(s.dims(), (std::vector<int64_t>{2, 8, 16, 64}));
  std::ostringstream os;
  os << s;
  EXPECT_EQ(os.str(), s.str());
}

// The vector constructor equals the init-list one; equality compares dims; rank 0 has one element.
TEST(Shape, VectorConstructorEqualityAndEmpty) {
  EXPECT_EQ(Shape(std::vector<int64_t>{3, 1, 17}), (Shape{3, 1, 17}));
  EXPECT_NE((Shape{3, 17}), (Shape{17, 3}));
  EXPECT_NE((Shape{3, 17}), (Shape{3, 17, 1}));
  EXPECT_EQ(Shape{}.size(), 0u);
  EXPECT_EQ(Shape{}.numel(), 1);
  EXPECT_EQ((Shape{4, 0, 3}).numel(), 0);
}

// Tensor::from keeps row-major order; size(-1) counts from the end; numel and dim agree.
TEST(Tensor, FromSizeNumelDim) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const std::vector<float> values = rng.normals(2 * 3 * 5);
  const Tensor t = Tensor::from(values, {2, 3, 5});
  EXPECT_TRUE(t.defined());
  EXPECT_EQ(t.shape(), (Shape{2, 3, 5}));
  EXPECT_EQ(t.dim(), 3);
  EXPECT_EQ(t.numel(), 30);
  EXPECT_EQ(t.size(0), 2);
  EXPECT_EQ(t.size(1), 3);
  EXPECT_EQ(t.size(2), 5);
  EXPECT_EQ(t.size(-1), 5);
  EXPECT_EQ(t.size(-2), 3);
  EXPECT_EQ(t.size(-3), 2);
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.strides(), (std::vector<int64_t>{15, 5, 1}));
  EXPECT_EQ(t.to_vector(), values);
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 3; ++j)
      for (int64_t c = 0; c < 5; ++c)
        EXPECT_EQ(t.at({i, j, c}), values[static_cast<size_t>(packed_index({2, 3, 5}, {i, j, c}))]);
}

// A default Tensor is undefined.
TEST(Tensor, DefaultIsUndefined) {
  const Tensor t;
  EXPECT_FALSE(t.defined());
}

// zeros and full fill every element; empty has the right shape.
TEST(Tensor, ZerosFullEmpty) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const float value = static_cast<float>(rng.normal());
  const Tensor z = Tensor::zeros({3, 17});
  const Tensor f = Tensor::full({17, 3}, value);
  const Tensor e = Tensor::empty({1, 3, 113});
  EXPECT_EQ(z.shape(), (Shape{3, 17}));
  EXPECT_EQ(f.shape(), (Shape{17, 3}));
  EXPECT_EQ(e.shape(), (Shape{1, 3, 113}));
  EXPECT_EQ(e.numel(), 3 * 113);
  for (float x : z.to_vector()) EXPECT_EQ(x, 0.0f);
  for (float x : f.to_vector()) EXPECT_EQ(x, value);
}

// randn: same seed, same numbers; another seed, other numbers; roughly standard normal.
TEST(Tensor, RandnIsSeeded) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const uint64_t seed = rng.next_u64();
  const Tensor a = Tensor::randn({4, 1000}, seed);
  const Tensor b = Tensor::randn({4, 1000}, seed);
  const Tensor c = Tensor::randn({4, 1000}, seed + 1);
  EXPECT_EQ(a.to_vector(), b.to_vector());
  EXPECT_NE(a.to_vector(), c.to_vector());
  EXPECT_FALSE(a.shares_storage_with(b));
  // On 200000 draws, mean and mean square each within 6 of their standard errors (1 / sqrt(n) and
  // sqrt(2 / n): 0.013 and 0.019) of 0 and 1; a chance failure is ~2e-9 a run.
  double sum = 0, sum_sq = 0;
  const std::vector<float> x = Tensor::randn({200, 1000}, seed).to_vector();
  for (float v : x) {
    ASSERT_TRUE(std::isfinite(v));
    sum += v;
    sum_sq += double{v} * v;
  }
  const double n = static_cast<double>(x.size());
  EXPECT_NEAR(sum / n, 0.0, 6.0 / std::sqrt(n));
  EXPECT_NEAR(sum_sq / n, 1.0, 6.0 * std::sqrt(2.0 / n));
}

// uniform: same seed, same numbers; every value in [low, high).
TEST(Tensor, UniformIsSeededAndInRange) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const uint64_t seed = rng.next_u64();
  const float low = static_cast<float>(rng.uniform(-3, 0));
  const float high = static_cast<float>(rng.uniform(0.5, 3));
  const Tensor a = Tensor::uniform({17, 113}, low, high, seed);
  EXPECT_EQ(a.to_vector(), Tensor::uniform({17, 113}, low, high, seed).to_vector());
  EXPECT_NE(a.to_vector(), Tensor::uniform({17, 113}, low, high, seed + 1).to_vector());
  for (float x : a.to_vector()) {
    EXPECT_GE(x, low);
    EXPECT_LT(x, high);
  }
}

// A range one float wide: about half the draws, computed in double, round to high; every one
// must be low, the only float in [low, high).
TEST(Tensor, UniformNeverRoundsUpToHigh) {
  Random rng;
  SCOPED_TRACE(rng.note());
  for (const float low : {1.0f, -3.0f, 0.75f}) {
    const float high = std::nextafter(low, 10.0f);
    for (float x : Tensor::uniform({1000}, low, high, rng.next_u64()).to_vector()) ASSERT_EQ(x, low) << "x is low + " << double(x) - low;
  }
}

// Every factory returns 64-byte aligned storage, whatever the size.
TEST(Tensor, DataIs64ByteAligned) {
  for (int64_t n : {1, 3, 17, 113, 1000}) {
    for (const Tensor& t : {Tensor::empty({n}), Tensor::zeros({n, 3}), Tensor::full({3, n}, 1.0f),
                            Tensor::randn({n}, 7), Tensor::from(std::vector<float>(n), {n})}) {
      EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % 64, 0u) << "n = " << n;
    }
  }
}

// Copying a Tensor copies the handle: writes through one show in the other; clone is separate.
TEST(Tensor, CopiesShareStorageCloneDoesNot) {
  Random rng;
  SCOPED_TRACE(rng.note());
  Tensor a = rng.randn({3, 5});
  const Tensor b = a;  // NOLINT(performance-unnecessary-copy-initialization): the point
  const Tensor c = a.clone();
  EXPECT_TRUE(a.shares_storage_with(b));
  EXPECT_FALSE(a.shares_storage_with(c));
  EXPECT_EQ(c.to_vector(), a.to_vector());
  const float before = c.at({1, 2});
  const float value = before + 1.5f;
  b.data()[7] = value;  // element (1, 2)
  EXPECT_EQ(a.at({1, 2}), value);
  EXPECT_EQ(c.at({1, 2}), before);
  a.at({2, 4}) = -value;
  EXPECT_EQ(b.data()[14], -value);
}

// transpose is a strided view of the same storage; contiguous() packs it in the new order.
TEST(Tensor, TransposeViewAndContiguousCopy) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const std::vector<int64_t> dims{2, 3, 5};
  const std::vector<float> values = rng.normals(30);
  const Tensor t = Tensor::from(values, {2, 3, 5});
  const Tensor view = t.transpose(0, 2);  // (5, 3, 2)
  EXPECT_EQ(view.shape(), (Shape{5, 3, 2}));
  EXPECT_TRUE(view.shares_storage_with(t));
  EXPECT_FALSE(view.is_contiguous());
  EXPECT_EQ(t.transpose(-1, -3).shape(), view.shape());  // negative dims count from the end

  const Tensor packed = view.contiguous();
  EXPECT_TRUE(packed.is_contiguous());
  EXPECT_FALSE(packed.shares_storage_with(t));
  const std::vector<float> flat = packed.to_vector();
  ASSERT_EQ(flat.size(), 30u);
  EXPECT_EQ(view.to_vector(), flat);
  for (int64_t a = 0; a < 5; ++a)
    for (int64_t b = 0; b < 3; ++b)
      for (int64_t c = 0; c < 2; ++c) {
        const float want = values[static_cast<size_t>(packed_index(dims, {c, b, a}))];
        EXPECT_EQ(view.at({a, b, c}), want);
        EXPECT_EQ(flat[static_cast<size_t>(packed_index({5, 3, 2}, {a, b, c}))], want);
      }

  // A write through the view lands in the original.
  view.at({4, 1, 0}) = 42.5f;
  EXPECT_EQ(t.at({0, 1, 4}), 42.5f);
  // contiguous() of a contiguous tensor is the tensor itself.
  EXPECT_TRUE(t.contiguous().shares_storage_with(t));
}

// reshape of a contiguous tensor is a view; of a transposed one, a packed copy in logical order.
TEST(Tensor, ReshapeViewOrCopy) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const std::vector<float> values = rng.normals(4 * 6);
  const Tensor t = Tensor::from(values, {4, 6});
  const Tensor r = t.reshape({2, 3, 4});
  EXPECT_EQ(r.shape(), (Shape{2, 3, 4}));
  EXPECT_TRUE(r.shares_storage_with(t));
  EXPECT_EQ(r.to_vector(), values);

  const Tensor tt = t.transpose(0, 1);  // (6, 4)
  const Tensor copy = tt.reshape({24});
  EXPECT_EQ(copy.shape(), (Shape{24}));
  EXPECT_FALSE(copy.shares_storage_with(t));
  std::vector<float> want;
  for (int64_t j = 0; j < 6; ++j)
    for (int64_t i = 0; i < 4; ++i) want.push_back(values[static_cast<size_t>(i * 6 + j)]);
  EXPECT_EQ(copy.to_vector(), want);
  EXPECT_THROW(t.reshape({5, 5}), qkv::Error);
}

// unsqueeze inserts a size-1 dim and squeeze removes one, both as views.
TEST(Tensor, UnsqueezeSqueeze) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const Tensor t = rng.randn({3, 17});
  EXPECT_EQ(t.unsqueeze(0).shape(), (Shape{1, 3, 17}));
  EXPECT_EQ(t.unsqueeze(1).shape(), (Shape{3, 1, 17}));
  EXPECT_EQ(t.unsqueeze(2).shape(), (Shape{3, 17, 1}));
  const Tensor u = t.unsqueeze(1);
  EXPECT_TRUE(u.shares_storage_with(t));
  EXPECT_EQ(u.to_vector(), t.to_vector());
  EXPECT_EQ(u.at({2, 0, 16}), t.at({2, 16}));
  const Tensor s = u.squeeze(1);
  EXPECT_EQ(s.shape(), t.shape());
  EXPECT_TRUE(s.shares_storage_with(t));
  EXPECT_EQ(s.to_vector(), t.to_vector());
  EXPECT_THROW(t.squeeze(0), qkv::Error);  // dim 0 has size 3
}

// data() refuses a strided view; at() and size() check their bounds.
TEST(Tensor, NonContiguousDataAndBoundsThrow) {
  const Tensor t = Tensor::zeros({3, 5});
  EXPECT_THROW(t.transpose(0, 1).data(), qkv::Error);
  EXPECT_NO_THROW(t.transpose(0, 1).contiguous().data());
  EXPECT_THROW(t.at({3, 0}), qkv::Error);
  EXPECT_THROW(t.at({0, 5}), qkv::Error);
  EXPECT_THROW(t.at({-1, 0}), qkv::Error);
  EXPECT_THROW(t.at({0}), qkv::Error);
  EXPECT_THROW(t.size(2), qkv::Error);
  EXPECT_THROW(t.size(-3), qkv::Error);
}

// from() with too few or too many values throws.
TEST(Tensor, FromWrongCountThrows) {
  EXPECT_THROW(Tensor::from(std::vector<float>(5), {2, 3}), qkv::Error);
  EXPECT_THROW(Tensor::from(std::vector<float>(7), {2, 3}), qkv::Error);
  EXPECT_NO_THROW(Tensor::from(std::vector<float>(6), {2, 3}));
}

// Printing shows every number with the requested precision, nested like numpy.
TEST(Tensor, PrintingContainsTheNumbers) {
  Random rng;
  SCOPED_TRACE(rng.note());
  const std::vector<float> values = rng.normals(6, 3.0);
  const Tensor t = Tensor::from(values, {2, 3});
  const std::string text = t.str();
  EXPECT_EQ(text.rfind("[[", 0), 0u) << text;
  EXPECT_THAT(text, HasSubstr("]]"));
  char number[64];
  for (float x : values) {
    std::snprintf(number, sizeof number, "%.4f", double{x});
    EXPECT_THAT(text, HasSubstr(number));
  }
  const std::string short_text = t.str(2);
  for (float x : values) {
    std::snprintf(number, sizeof number, "%.2f", double{x});
    EXPECT_THAT(short_text, HasSubstr(number));
  }
  std::ostringstream os;
  os << t;
  EXPECT_EQ(os.str(), text);
  // A view prints its logical order: the transpose's first row is the original's first column.
  const std::string transposed = t.transpose(0, 1).str();
  char first[64], second[64];
  std::snprintf(first, sizeof first, "%.4f", double{values[0]});
  std::snprintf(second, sizeof second, "%.4f", double{values[3]});
  EXPECT_LT(transposed.find(first), transposed.find(second));
  EXPECT_LT(transposed.find(second), transposed.find("]"));
}

// from_blob reads the caller's memory in place (no copy, any alignment), keeps its owner alive
// as long as any tensor or view uses it, and is not counted as the library's memory.
TEST(Tensor, FromBlobBorrowsMemoryAndKeepsItsOwnerAlive) {
  auto buffer = std::make_shared<std::vector<float>>(1 + 2 * 3);
  float* data = buffer->data() + 1;  // deliberately not 64-byte aligned
  for (int i = 0; i < 6; ++i) data[i] = static_cast<float>(i);
  std::weak_ptr<std::vector<float>> watch = buffer;
  const int64_t counted_before = qkv::memory_stats().current_bytes;
  qkv::Tensor view;
  {
    const qkv::Tensor t = qkv::Tensor::from_blob(data, {2, 3}, buffer);
    EXPECT_EQ(t.data(), data);
    EXPECT_EQ(qkv::memory_stats().current_bytes, counted_before);
    view = t.transpose(0, 1);
  }
  buffer.reset();
  EXPECT_FALSE(watch.expired()) << "a view still uses the memory";
  EXPECT_EQ(view.at({2, 1}), 5.0f);
  view = qkv::Tensor();
  EXPECT_TRUE(watch.expired()) << "the owner outlived the last tensor";
  EXPECT_THROW(qkv::Tensor::from_blob(data, {2, 3}, nullptr), qkv::Error);
}

}  // namespace
