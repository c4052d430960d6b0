// qkv::Tensor: a handle on shared, 64-byte aligned storage plus a view (offset, shape, strides
// in elements) and the element type (F32, or BF16 / F16 for keys and values).
#include "qkv/tensor.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <new>
#include <numeric>
#include <ostream>
#include <sstream>

#include "core/allocator.hpp"
#include "core/huge_pages.hpp"
#include "core/random.hpp"

namespace qkv {

// ---------------------------------------------------------------------------------------------
// Shape

namespace {
// Every dim >= 0, and the bytes of a float tensor of that shape countable in an int64.
void check_dims(const Shape& shape) {
  int64_t bytes = sizeof(float);
  for (int64_t d : shape.dims()) {
    if (d < 0) throw Error("Shape: dimension " + std::to_string(d) + " is negative in " + shape.str());
    if (__builtin_mul_overflow(bytes, d, &bytes))
      throw Error("Shape " + shape.str() + " has too many elements to store");
  }
}
}  // namespace

Shape::Shape(std::initializer_list<int64_t> dims) : dims_(dims) { check_dims(*this); }

Shape::Shape(std::vector<int64_t> dims) : dims_(std::move(dims)) { check_dims(*this); }

int64_t Shape::operator[](int64_t i) const {
  const auto rank = static_cast<int64_t>(dims_.size());
  if (i < -rank || i >= rank)
    throw Error("Shape: index " + std::to_string(i) + " is out of range for " + str());
  return dims_[static_cast<size_t>(i < 0 ? i + rank : i)];
}

int64_t Shape::numel() const {
  return std::accumulate(dims_.begin(), dims_.end(), int64_t{1}, std::multiplies<>());
}

std::string Shape::str() const {
  std::string s = "(";
  for (size_t i = 0; i < dims_.size(); ++i) s += (i ? ", " : "") + std::to_string(dims_[i]);
  return s + ")";
}

std::ostream& operator<<(std::ostream& os, const Shape& shape) { return os << shape.str(); }

// ---------------------------------------------------------------------------------------------
// Storage

struct Tensor::Storage {
  explicit Storage(int64_t count) : data(detail::allocate_floats(static_cast<size_t>(count))), count(count) {}
  Storage(float* borrowed, int64_t count, std::shared_ptr<void> owner)
      : data(borrowed), count(count), owner(std::move(owner)) {}
  ~Storage() {
    if (!owner) detail::free_floats(data, static_cast<size_t>(count));
  }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  float* data;  // ours: 64-byte aligned, counted in qkv::memory_stats(); borrowed: as given
  int64_t count;
  std::shared_ptr<void> owner;  // set for borrowed memory (from_blob): keeps it alive
};

namespace {
std::vector<int64_t> row_major_strides(const Shape& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t stride = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= shape[i];
  }
  return strides;
}
}  // namespace

// ---------------------------------------------------------------------------------------------
// Factories

Tensor Tensor::empty(const Shape& shape, DType dtype) {
  Tensor t;
  // Allocation failures name the shape that asked (qkv/memory.hpp: no std::bad_alloc escapes).
  // Storage is counted in floats: a 16-bit tensor takes half as many, a 1-byte one a quarter, rounded up.
  try {
    const int64_t size = static_cast<int64_t>(element_size(dtype));
    t.storage_ = std::make_shared<Storage>((shape.numel() * size + 3) / 4);
  } catch (const Error& e) {
    std::string what = e.what();  // "qkv: cannot allocate ..." (src/core/allocator.cpp)
    if (what.rfind("qkv: ", 0) == 0) what.erase(0, 5);
    throw Error("Tensor " + shape.str() + ": " + what);
  } catch (const std::bad_alloc&) {
    throw Error("Tensor " + shape.str() + ": cannot allocate " + std::to_string(shape.numel() * 4) +
                " bytes: the system refused (out of memory)");
  }
  t.shape_ = shape;
  t.strides_ = row_major_strides(shape);
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype) {
  if (dtype == DType::F32) return full(shape, 0.0f);
  Tensor t = empty(shape, dtype);  // +0 is all zero bits in every dtype
  std::memset(t.storage_->data, 0, static_cast<size_t>(t.numel()) * element_size(dtype));
  return t;
}

namespace detail {

Tensor zeros_on_huge_pages(const Shape& shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype);
  const size_t bytes = static_cast<size_t>(t.numel()) * element_size(dtype);
  advise_huge_pages(t.raw_data(), bytes);
  std::memset(t.raw_data(), 0, bytes);  // +0 in every dtype
  return t;
}

}  // namespace detail

Tensor Tensor::full(const Shape& shape, float value) {
  Tensor t = empty(shape);
  std::fill_n(t.storage_->data, t.numel(), value);
  return t;
}

Tensor Tensor::from(std::vector<float> values, const Shape& shape) {
  if (static_cast<int64_t>(values.size()) != shape.numel())
    throw Error("Tensor::from: " + std::to_string(values.size()) + " values do not fill shape " +
                shape.str() + " of " + std::to_string(shape.numel()) + " elements");
  Tensor t = empty(shape);
  std::copy(values.begin(), values.end(), t.storage_->data);
  return t;
}

Tensor Tensor::from_blob(float* data, const Shape& shape, std::shared_ptr<void> owner) {
  if (data == nullptr && shape.numel() > 0) throw Error("Tensor::from_blob: null data for shape " + shape.str());
  if (!owner) throw Error("Tensor::from_blob: an owner must keep the memory of " + shape.str() + " alive");
  Tensor t;
  t.storage_ = std::make_shared<Storage>(data, shape.numel(), std::move(owner));
  t.shape_ = shape;
  t.strides_ = row_major_strides(shape);
  return t;
}

Tensor Tensor::from_blob(void* data, const Shape& shape, DType dtype, std::shared_ptr<void> owner) {
  if (dtype == DType::F32) return from_blob(static_cast<float*>(data), shape, std::move(owner));
  if (data == nullptr && shape.numel() > 0) throw Error("Tensor::from_blob: null data for shape " + shape.str());
  if (!owner) throw Error("Tensor::from_blob: an owner must keep the memory of " + shape.str() + " alive");
  Tensor t;
  const int64_t size = static_cast<int64_t>(element_size(dtype));
  t.storage_ = std::make_shared<Storage>(static_cast<float*>(data), (shape.numel() * size + 3) / 4, std::move(owner));
  t.shape_ = shape;
  t.strides_ = row_major_strides(shape);
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::randn(const Shape& shape, uint64_t seed) {
  Tensor t = empty(shape);
  detail::SplitMix64 rng(seed);
  for (int64_t i = 0; i < t.numel(); ++i) t.storage_->data[i] = static_cast<float>(rng.normal());
  return t;
}

Tensor Tensor::uniform(const Shape& shape, float low, float high, uint64_t seed) {
  if (!(low <= high)) throw Error("Tensor::uniform: low (" + std::to_string(low) + ") > high (" + std::to_string(high) + ")");
  Tensor t = empty(shape);
  detail::SplitMix64 rng(seed);
  // Drawn in double, rounded to float: a draw within half a float ulp of high rounds up to high,
  // which [low, high) excludes, so it becomes the float below high (low itself when low == high).
  const float below_high = std::nextafter(high, low);
  for (int64_t i = 0; i < t.numel(); ++i)
    t.storage_->data[i] = std::min(static_cast<float>(low + (double(high) - low) * rng.uniform()), below_high);
  return t;
}

// ---------------------------------------------------------------------------------------------
// Accessors

namespace {
int64_t normalise_dim(int64_t d, int64_t rank, const char* who, const Shape& shape) {
  const int64_t n = d < 0 ? d + rank : d;
  if (n < 0 || n >= rank)
    throw Error(std::string(who) + ": dim " + std::to_string(d) + " is out of range for a tensor of shape " + shape.str());
  return n;
}

std::string strides_str(const std::vector<int64_t>& strides) {
  return Shape(std::vector<int64_t>(strides.begin(), strides.end())).str();
}
}  // namespace

int64_t Tensor::size(int64_t i) const { return shape_[normalise_dim(i, dim(), "Tensor::size", shape_)]; }

bool Tensor::is_contiguous() const { return strides_ == row_major_strides(shape_); }

void Tensor::expect_f32(const char* who) const {
  if (dtype_ != DType::F32)
    throw Error(std::string(who) + ": this operation needs an f32 tensor, got " + std::string(to_string(dtype_)) +
                " " + shape_.str() + " (only attention's k and v may be bf16 or f16; convert with to(DType::F32))");
}

std::byte* Tensor::element_bytes() const {
  return reinterpret_cast<std::byte*>(storage_->data) + offset_ * static_cast<int64_t>(element_size(dtype_));
}

float* Tensor::data() const {
  if (!defined()) throw Error("Tensor::data: the tensor is undefined");
  expect_f32("Tensor::data");
  if (!is_contiguous())
    throw Error("Tensor::data: tensor " + shape_.str() + " with strides " + strides_str(strides_) +
                " is not contiguous; call contiguous()");
  return storage_->data + offset_;
}

float* Tensor::view_data() const {
  if (!defined()) throw Error("Tensor::view_data: the tensor is undefined");
  expect_f32("Tensor::view_data");
  return storage_->data + offset_;
}

void* Tensor::raw_data() const {
  if (!defined()) throw Error("Tensor::raw_data: the tensor is undefined");
  if (!is_contiguous())
    throw Error("Tensor::raw_data: tensor " + shape_.str() + " with strides " + strides_str(strides_) +
                " is not contiguous; call contiguous()");
  return element_bytes();
}

void* Tensor::raw_view_data() const {
  if (!defined()) throw Error("Tensor::raw_view_data: the tensor is undefined");
  return element_bytes();
}

Tensor Tensor::to(DType dtype) const {
  if (!defined() || dtype == dtype_) return *this;
  const Tensor packed = contiguous();
  Tensor t = empty(shape_, dtype);
  convert(packed.element_bytes(), dtype_, t.element_bytes(), dtype, static_cast<size_t>(numel()));
  return t;
}

float& Tensor::at(std::initializer_list<int64_t> index) const {
  if (!defined()) throw Error("Tensor::at: the tensor is undefined");
  expect_f32("Tensor::at");
  if (static_cast<int64_t>(index.size()) != dim())
    throw Error("Tensor::at: " + std::to_string(index.size()) + " indices for a tensor of shape " + shape_.str());
  int64_t offset = offset_;
  size_t d = 0;
  for (int64_t i : index) {
    if (i < 0 || i >= shape_[d])
      throw Error("Tensor::at: index " + std::to_string(i) + " is out of range for dim " + std::to_string(d) +
                  " of shape " + shape_.str());
    offset += i * strides_[d++];
  }
  return storage_->data[offset];
}

// ---------------------------------------------------------------------------------------------
// Views and copies

Tensor Tensor::transpose(int64_t a, int64_t b) const {
  const int64_t da = normalise_dim(a, dim(), "Tensor::transpose", shape_);
  const int64_t db = normalise_dim(b, dim(), "Tensor::transpose", shape_);
  Tensor t = *this;
  std::vector<int64_t> dims = shape_.dims();
  std::swap(dims[da], dims[db]);
  std::swap(t.strides_[da], t.strides_[db]);
  t.shape_ = Shape(std::move(dims));
  return t;
}

Tensor Tensor::reshape(const Shape& shape) const {
  if (shape.numel() != numel())
    throw Error("Tensor::reshape: cannot reshape " + shape_.str() + " (" + std::to_string(numel()) +
                " elements) to " + shape.str() + " (" + std::to_string(shape.numel()) + " elements)");
  Tensor t = contiguous();
  t.shape_ = shape;
  t.strides_ = row_major_strides(shape);
  return t;
}

Tensor Tensor::unsqueeze(int64_t d) const {
  const int64_t at_dim = normalise_dim(d, dim() + 1, "Tensor::unsqueeze", shape_);
  std::vector<int64_t> dims = shape_.dims();
  dims.insert(dims.begin() + at_dim, 1);
  Tensor t = *this;
  // A dim of size 1 can have any stride; give it the one a packed tensor would have.
  t.strides_.insert(t.strides_.begin() + at_dim, at_dim < dim() ? strides_[at_dim] * shape_[at_dim] : 1);
  t.shape_ = Shape(std::move(dims));
  return t;
}

Tensor Tensor::squeeze(int64_t d) const {
  const int64_t at_dim = normalise_dim(d, dim(), "Tensor::squeeze", shape_);
  if (shape_[at_dim] != 1)
    throw Error("Tensor::squeeze: dim " + std::to_string(d) + " of " + shape_.str() + " has size " +
                std::to_string(shape_[at_dim]) + ", not 1");
  std::vector<int64_t> dims = shape_.dims();
  dims.erase(dims.begin() + at_dim);
  Tensor t = *this;
  t.strides_.erase(t.strides_.begin() + at_dim);
  t.shape_ = Shape(std::move(dims));
  return t;
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  const int64_t at_dim = normalise_dim(d, dim(), "Tensor::narrow", shape_);
  if (start < 0 || length < 0 || start > shape_[at_dim] - length)
    throw Error("Tensor::narrow: [" + std::to_string(start) + ", " + std::to_string(start) + " + " +
                std::to_string(length) + ") is outside dim " + std::to_string(d) + " of " + shape_.str());
  std::vector<int64_t> dims = shape_.dims();
  dims[at_dim] = length;
  Tensor t = *this;
  t.offset_ += start * strides_[at_dim];
  t.shape_ = Shape(std::move(dims));
  return t;
}

Tensor Tensor::contiguous() const {
  if (!defined() || is_contiguous()) return *this;
  return clone();
}

Tensor Tensor::clone() const {
  if (!defined()) return *this;
  Tensor t = empty(shape_, dtype_);
  copy_to(t.storage_->data);
  return t;
}

std::vector<float> Tensor::to_vector() const {
  std::vector<float> values;
  if (!defined()) return values;
  values.resize(static_cast<size_t>(numel()));
  if (dtype_ == DType::F32) {
    copy_to(values.data());
  } else {
    std::vector<uint16_t> bits(static_cast<size_t>(numel()));
    copy_to(bits.data());
    convert(bits.data(), dtype_, values.data(), DType::F32, bits.size());
  }
  return values;
}

void Tensor::copy_to(void* destination) const {
  if (dtype_ == DType::F32) {
    copy_elements(static_cast<const float*>(static_cast<void*>(element_bytes())), static_cast<float*>(destination));
  } else if (element_size(dtype_) == 1) {
    copy_elements(reinterpret_cast<const uint8_t*>(element_bytes()), static_cast<uint8_t*>(destination));
  } else {
    copy_elements(static_cast<const uint16_t*>(static_cast<void*>(element_bytes())), static_cast<uint16_t*>(destination));
  }
}

template <class T>
void Tensor::copy_elements(const T* data, T* destination) const {
  const int64_t count = numel();
  if (count == 0) return;
  if (is_contiguous()) {
    std::copy_n(data, count, destination);
    return;
  }
  // Walk the elements in row-major order: the last dim in an inner loop, an odometer over the
  // others that keeps the running offset (so the offset is never recomputed per element).
  const std::vector<int64_t>& dims = shape_.dims();
  const size_t rank = dims.size();
  const int64_t inner = dims[rank - 1], inner_stride = strides_[rank - 1];
  std::vector<int64_t> index(rank, 0);
  int64_t offset = 0;  // of element index[0 .. rank - 2], 0, from `data`
  for (int64_t n = 0; n < count; n += inner) {
    for (int64_t e = 0; e < inner; ++e) destination[n + e] = data[offset + e * inner_stride];
    for (size_t d = rank - 1; d-- > 0;) {
      offset += strides_[d];
      if (++index[d] < dims[d]) break;
      offset -= index[d] * strides_[d];
      index[d] = 0;
    }
  }
}

bool Tensor::shares_storage_with(const Tensor& other) const {
  return defined() && storage_ == other.storage_;
}

// ---------------------------------------------------------------------------------------------
// Printing, numpy style: nested brackets, one row per line, columns aligned.

std::string Tensor::str(int precision) const {
  if (!defined()) return "Tensor(undefined)";
  const std::vector<float> values = to_vector();
  auto format = [&](float x) {
    std::ostringstream os;
    os << std::fixed << std::setprecision(precision) << x;
    return os.str();
  };
  size_t width = 0;
  for (float x : values) width = std::max(width, format(x).size());

  std::ostringstream os;
  if (dim() == 0) return format(values.empty() ? 0.0f : values[0]);
  // Each element opens the brackets of the dims whose index just wrapped to 0 and closes those
  // about to wrap; as numpy does, k opening brackets follow k newlines (rows on their own line,
  // a blank line between matrices).
  std::vector<int64_t> index(shape_.size(), 0);
  const int64_t rank = dim();
  if (numel() == 0) return std::string(rank, '[') + std::string(rank, ']');
  for (int64_t n = 0; n < numel(); ++n) {
    int64_t opening = 0;
    for (int64_t d = rank - 1; d >= 0 && index[d] == 0; --d) ++opening;
    if (n > 0) {
      if (opening == 0) {
        os << ' ';
      } else {
        os << std::string(static_cast<size_t>(opening), '\n') << std::string(rank - opening, ' ');
      }
    }
    os << std::string(opening, '[');
    const std::string text = format(values[n]);
    os << std::string(width - text.size(), ' ') << text;
    int64_t closing = 0;
    for (int64_t d = rank - 1; d >= 0; --d) {
      if (++index[d] < shape_[d]) break;
      index[d] = 0;
      ++closing;
    }
    os << std::string(closing, ']');
  }
  return os.str();
}

std::ostream& operator<<(std::ostream& os, const Tensor& tensor) { return os << tensor.str(); }

}  // namespace qkv
