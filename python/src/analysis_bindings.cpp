// qkv._core's bindings of qkv::analysis (include/qkv/analysis.hpp): the entropy of attention
// weights, computed by the same C++ function the explorer (`qkv serve`) and `qkv heads` use, so
// the three agree to the float. python/qkv/__init__.py checks the dtype (float32, or a cast with
// allow_cast=True) and wraps these as qkv.entropy and qkv.head_entropy.
#include "analysis_bindings.hpp"

#include <pybind11/numpy.h>

#include <cstring>
#include <utility>
#include <vector>

#include <qkv/analysis.hpp>
#include <qkv/attention.hpp>
#include <qkv/tensor.hpp>

namespace py = pybind11;

namespace {

using Floats = py::array_t<float, py::array::c_style | py::array::forcecast>;

qkv::Tensor copy_in(const Floats& a) {
  std::vector<int64_t> dims(a.shape(), a.shape() + a.ndim());
  std::vector<float> values(static_cast<size_t>(a.size()));
  if (!values.empty()) std::memcpy(values.data(), a.data(), values.size() * sizeof(float));
  return qkv::Tensor::from(std::move(values), qkv::Shape(std::move(dims)));
}

py::array_t<float> copy_out(const qkv::Tensor& t) {
  const qkv::Tensor packed = t.contiguous();
  std::vector<py::ssize_t> shape(packed.shape().begin(), packed.shape().end());
  py::array_t<float> out(shape);
  if (packed.numel() > 0) std::memcpy(out.mutable_data(), packed.data(), packed.numel() * sizeof(float));
  return out;
}

template <qkv::Tensor (*F)(const qkv::Tensor&)>
py::array_t<float> run(const Floats& weights) {
  const qkv::Tensor in = copy_in(weights);
  qkv::Tensor result;
  {
    py::gil_scoped_release release;
    result = F(in);
  }
  return copy_out(result);
}

// Attention with summaries (AttentionOptions::summary_top_k = top_k): a dict of output, lse,
// entropy, top_keys (int64), top_weights and received. python/qkv/__init__.py's
// attention_summary checks and converts the arguments and fills the options.
py::dict attention_summary(const Floats& q, const Floats& k, const Floats& v, int64_t top_k,
                           qkv::AttentionOptions options) {
  const qkv::Tensor qt = copy_in(q), kt = copy_in(k), vt = copy_in(v);
  options.summary_top_k = top_k;
  qkv::AttentionResult result;
  {
    py::gil_scoped_release release;
    result = qkv::scaled_dot_product_attention(qt, kt, vt, options);
  }
  std::vector<py::ssize_t> top_shape(result.top_weights.shape().begin(), result.top_weights.shape().end());
  py::array_t<int64_t> top_keys(top_shape);
  if (!result.top_keys.empty())
    std::memcpy(top_keys.mutable_data(), result.top_keys.data(), result.top_keys.size() * sizeof(int64_t));
  py::dict out;
  out["output"] = copy_out(result.output);
  out["lse"] = copy_out(result.lse);
  out["entropy"] = copy_out(result.entropy);
  out["top_keys"] = top_keys;
  out["top_weights"] = copy_out(result.top_weights);
  out["received"] = copy_out(result.received);
  return out;
}

}  // namespace

void bind_analysis(py::module_& m) {
  m.def("row_entropy", &run<qkv::analysis::row_entropy>, py::arg("weights"),
        "qkv::analysis::row_entropy: (..., Nq, Nk) -> (..., Nq), -sum_j w ln w in nats (0 ln 0 = 0).");
  m.def("head_entropy", &run<qkv::analysis::head_entropy>, py::arg("weights"),
        "qkv::analysis::head_entropy: (B, H, Nq, Nk) -> (B, H) or (H, Nq, Nk) -> (H), the mean row entropy.");
  m.def("attention_summary", &attention_summary, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("top_k"),
        py::arg("options"),
        "scaled_dot_product_attention with summaries (AttentionOptions::summary_top_k): a dict of output, lse, "
        "entropy, top_keys, top_weights, received.");
}
