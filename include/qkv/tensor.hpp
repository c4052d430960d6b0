// qkv::Shape and qkv::Tensor: N-dimensional, 64-byte aligned storage of float32 (or bfloat16 /
// float16, qkv/dtype.hpp: for keys and values read by attention) shared between
// copies (a Tensor is a handle, like a torch tensor: copying it does not copy the numbers).
// Only what attention needs: factories, views (transpose, reshape), contiguous copies and
// numpy-like printing. No arithmetic: that belongs to the kernels and modules that use it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "qkv/dtype.hpp"
#include "qkv/error.hpp"

namespace qkv {

// The sizes of a tensor's dimensions, outermost first: Shape{2, 8, 16, 64}.
class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  explicit Shape(std::vector<int64_t> dims);

  size_t size() const { return dims_.size(); }  // the rank
  int64_t operator[](int64_t i) const;          // dim i; negative i counts from the end (checked)
  int64_t numel() const;                        // product of the dims (1 for rank 0)
  const std::vector<int64_t>& dims() const { return dims_; }
  auto begin() const { return dims_.begin(); }
  auto end() const { return dims_.end(); }
  bool operator==(const Shape&) const = default;

  std::string str() const;  // "(2, 8, 16, 64)"

 private:
  std::vector<int64_t> dims_;
};

std::ostream& operator<<(std::ostream& os, const Shape& shape);

class Tensor {
 public:
  Tensor() = default;  // undefined: no storage; defined() is false

  // Factories. Every one allocates fresh 64-byte aligned storage.
  static Tensor empty(const Shape& shape, DType dtype = DType::F32);  // uninitialised
  static Tensor zeros(const Shape& shape, DType dtype = DType::F32);
  static Tensor full(const Shape& shape, float value);
  static Tensor from(std::vector<float> values, const Shape& shape);  // row-major values
  static Tensor randn(const Shape& shape, uint64_t seed);  // standard normal, same seed same numbers
  static Tensor uniform(const Shape& shape, float low, float high, uint64_t seed);  // U[low, high)
  // A tensor over memory qkv does not own (a numpy array, a memory-mapped file): `data` holds
  // shape.numel() floats, row-major, any alignment, and stays valid while `owner` lives; the
  // tensor and every copy or view of it keep `owner` alive. Not counted in memory_stats().
  static Tensor from_blob(float* data, const Shape& shape, std::shared_ptr<void> owner);
  // The same for elements of any dtype (`data` holds shape.numel() elements of it).
  static Tensor from_blob(void* data, const Shape& shape, DType dtype, std::shared_ptr<void> owner);

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  // A packed copy with elements of `dtype` (float to 16 bits rounds to nearest even, NaN stays
  // NaN, F16 overflows to inf), or this tensor itself when it already has that dtype.
  Tensor to(DType dtype) const;
  const Shape& shape() const { return shape_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t size(int64_t i) const;  // size of dim i; negative i counts from the end
  int64_t numel() const { return shape_.numel(); }
  const std::vector<int64_t>& strides() const { return strides_; }  // in elements
  bool is_contiguous() const;

  // The first element. A Tensor is a handle, so a const Tensor still gives a writable pointer,
  // as torch's data_ptr() does. Throws unless the tensor is contiguous (call contiguous()) and
  // F32: every arithmetic of qkv but attention's K and V reads floats, and says so through here.
  float* data() const;
  // The first element of this tensor or view, whatever its strides: element (i0, i1, ...) is at
  // view_data()[i0 * strides()[0] + i1 * strides()[1] + ...]. For code that reads views in place
  // (the attention kernels); everything else should use data().
  float* view_data() const;  // F32 only, as data()
  // The first element of any dtype, contiguous (raw_data) or through the strides (raw_view_data).
  void* raw_data() const;
  void* raw_view_data() const;
  // One element, bounds-checked: t.at({b, h, i, j}). For tests, demos and printing, not loops.
  float& at(std::initializer_list<int64_t> index) const;

  // Views share storage with this tensor.
  Tensor transpose(int64_t a, int64_t b) const;  // swaps dims a and b (negative counts from end)
  Tensor reshape(const Shape& shape) const;      // a view when contiguous, else a packed copy
  Tensor unsqueeze(int64_t d) const;             // inserts a dim of size 1 before dim d
  Tensor squeeze(int64_t d) const;               // removes dim d, which must have size 1
  Tensor narrow(int64_t d, int64_t start, int64_t length) const;  // elements [start, start + length) of dim d
  // This tensor when already contiguous, else a packed row-major copy.
  Tensor contiguous() const;
  Tensor clone() const;  // a packed copy with storage of its own (one pass over the elements)
  std::vector<float> to_vector() const;  // the elements in row-major order, as floats (exact)
  bool shares_storage_with(const Tensor& other) const;

  // numpy-like text: "[[ 0.1235 -1.2000]\n [ 2.0000  0.0000]]" with `precision` decimals.
  std::string str(int precision = 4) const;

 private:
  struct Storage;
  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;
  Shape shape_;
  std::vector<int64_t> strides_;
  DType dtype_ = DType::F32;

  void copy_to(void* destination) const;  // the elements (of dtype_) in row-major order, one pass
  template <class T>
  void copy_elements(const T* data, T* destination) const;
  std::byte* element_bytes() const;         // the first element of this view, any dtype
  void expect_f32(const char* who) const;
};

std::ostream& operator<<(std::ostream& os, const Tensor& tensor);

}  // namespace qkv
