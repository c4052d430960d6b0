// qkv._core's rotary tables: qkv::nn::RotaryTable (include/qkv/inference.hpp), FlashAttention's
// rotary_cos / rotary_sin / rotary_interleaved as one options class, RotaryTableOptions, whose
// fields python/qkv/rotary.py fills from the keywords. Thin, as bindings.cpp is: the arrays'
// dtypes are checked in rotary.py; tables of any float dtype are rounded to float32 here (as
// FlashAttention casts them to the dtype of x), x arrives float32.
#include "rotary_bindings.hpp"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include <qkv/error.hpp>
#include <qkv/inference.hpp>
#include <qkv/tensor.hpp>

namespace py = pybind11;

namespace {

using Floats = py::array_t<float, py::array::c_style | py::array::forcecast>;

// A float32 copy of a float array (the caller's array is never kept or written).
qkv::Tensor copy_in(const Floats& a) {
  std::vector<int64_t> shape(a.shape(), a.shape() + a.ndim());
  qkv::Tensor t = qkv::Tensor::empty(qkv::Shape(shape));
  if (t.numel() > 0) std::memcpy(t.data(), a.data(), static_cast<size_t>(t.numel()) * sizeof(float));
  return t;
}

py::array_t<float> copy_out(const qkv::Tensor& t) {
  const qkv::Tensor packed = t.contiguous();
  py::array_t<float> out(std::vector<py::ssize_t>(packed.shape().begin(), packed.shape().end()));
  if (packed.numel() > 0)
    std::memcpy(out.mutable_data(), packed.data(), static_cast<size_t>(packed.numel()) * sizeof(float));
  return out;
}

std::optional<py::array_t<float>> table_of(const qkv::Tensor& t) {
  return t.defined() ? std::optional(copy_out(t)) : std::nullopt;
}

}  // namespace

void bind_rotary_tables(py::module_& m) {
  using O = qkv::nn::RotaryTableOptions;
  using T = qkv::nn::RotaryTable;
  py::class_<O>(m, "RotaryTableOptions", "qkv::nn::RotaryTableOptions (include/qkv/inference.hpp).")
      .def(py::init<>())
      .def_property(
          "rotary_cos", [](const O& o) { return table_of(o.cos); },
          [](O& o, const Floats& a) { o.cos = copy_in(a); }, "a float array (seqlen_ro, rotary_dim / 2)")
      .def_property(
          "rotary_sin", [](const O& o) { return table_of(o.sin); },
          [](O& o, const Floats& a) { o.sin = copy_in(a); }, "a float array (seqlen_ro, rotary_dim / 2)")
      .def_readwrite("rotary_interleaved", &O::interleaved, "True or False");
  py::class_<T>(m, "RotaryTableCore")
      .def(py::init([](int64_t head_dim, const O& options) { return T(head_dim, options); }), py::arg("head_dim"),
           py::arg("options"))
      .def_static("from_base",
                  [](int64_t head_dim, int64_t length, double base, bool interleaved, int64_t rotary_dim) {
                    qkv::nn::RotaryEmbeddingOptions options;
                    options.base = base;
                    options.interleaved = interleaved;
                    return T::from_base(head_dim, length, options, rotary_dim);
                  },
                  py::arg("head_dim"), py::arg("length"), py::arg("base"), py::arg("interleaved"),
                  py::arg("rotary_dim"))
      .def(
          "apply",
          [](const T& table, const Floats& x, const std::vector<int64_t>& offsets) {
            qkv::Tensor four = copy_in(x);
            if (four.dim() < 2 || four.dim() > 4)
              throw qkv::Error("RotaryTable.apply: x is " + four.shape().str() +
                               ": expected (B, H, N, D), (H, N, D) or (N, D)");
            const qkv::Shape shape = four.shape();
            while (four.dim() < 4) four = four.unsqueeze(0);
            {
              py::gil_scoped_release release;
              table.apply_inplace(four, offsets);
            }
            return copy_out(four.reshape(shape));
          },
          py::arg("x"), py::arg("offsets"), "x rotated (a new array): batch element b's token n at offsets[b] + n")
      .def_property_readonly("head_dim", &T::head_dim)
      .def_property_readonly("rotary_dim", &T::rotary_dim)
      .def_property_readonly("length", &T::length)
      .def_property_readonly("interleaved", &T::interleaved)
      .def_property_readonly("cos", [](const T& t) { return copy_out(t.cos()); })
      .def_property_readonly("sin", [](const T& t) { return copy_out(t.sin()); });
}
