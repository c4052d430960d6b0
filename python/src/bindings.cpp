// qkv._core: the pybind11 bindings of qkv's C++ API, numpy in and numpy out. Thin on purpose:
// the PyTorch-style argument conventions (bool mask True = attend, nn.MultiheadAttention's
// True = masked, batch_first, ...) live in python/qkv/__init__.py; this file only moves arrays
// across and calls the one functional core.
//
// Arrays in: float32 C-contiguous numpy arrays are wrapped without copying (Tensor::from_blob,
// the Tensor holding a reference to the array); others are converted by numpy first. Arrays out:
// zero-copy too; the numpy array keeps the Tensor's storage alive. Every computation runs with
// the GIL released; inputs are wrapped before it is released.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <qkv/qkv.hpp>

#include "models_bindings.hpp"

namespace py = pybind11;

namespace {

// A float32 C-contiguous array: given one, pybind11 passes it through untouched; a strided
// float32 view, or a bool array (masks), is converted by numpy into a fresh array of this kind.
// Any other dtype is refused as PyTorch refuses it (its caster, below): float64 and float16 are a
// qkv.Error (python/qkv/__init__.py casts them first when the caller passes allow_cast=True),
// integer arrays always are.
struct FloatArray : py::array_t<float, py::array::c_style | py::array::forcecast> {
  using array_t::array_t;
  FloatArray() = default;
  explicit FloatArray(array_t&& a) : array_t(std::move(a)) {}
};

}  // namespace

namespace pybind11::detail {
template <>
struct type_caster<FloatArray> {
  PYBIND11_TYPE_CASTER(FloatArray, const_name("numpy.ndarray[float32]"));

  // The dtype rule, then numpy's conversion (layout only: float32 stays float32, bool -> 0/1).
  bool load(handle src, bool convert) {
    using Exact = py::array_t<float, py::array::c_style>;
    if (!convert) {
      if (!Exact::check_(src)) return false;
    } else {
      const py::array a = py::array::ensure(src);
      if (!a) return false;
      const char kind = a.dtype().kind();
      if (kind == 'f' && a.itemsize() != 4)
        throw qkv::Error("qkv: got a " + std::string(py::str(a.dtype())) + " array, but qkv computes in float32 " +
                         "(as PyTorch, it does not mix dtypes): pass allow_cast=True, or convert with " +
                         ".astype(numpy.float32)");
      if (kind != 'f' && kind != 'b')
        throw qkv::Error("qkv: got a " + std::string(py::str(a.dtype())) +
                         " array: attention needs float32 inputs (PyTorch refuses integer inputs too)");
    }
    value = FloatArray(FloatArray::array_t::ensure(src));
    return static_cast<bool>(value);
  }
  static handle cast(const FloatArray& array, return_value_policy, handle) { return array.inc_ref(); }
};
}  // namespace pybind11::detail

namespace {

// A float32 C-contiguous array as a Tensor over the same memory, with the GIL held. The Tensor
// (and whatever keeps it: a Mask, a module's backward cache) holds a reference to the array, so
// the memory outlives the Python name; dropping that reference takes the GIL, since the last
// Tensor may die in a section that released it. qkv only reads its inputs: the const_cast
// never leads to a write.
qkv::Tensor to_tensor(const FloatArray& a) {
  std::shared_ptr<void> owner(new py::object(a), [](void* p) {
    py::gil_scoped_acquire gil;
    delete static_cast<py::object*>(p);
  });
  return qkv::Tensor::from_blob(const_cast<float*>(a.data()),
                                qkv::Shape(std::vector<int64_t>(a.shape(), a.shape() + a.ndim())), std::move(owner));
}

// A Tensor as a numpy array over the same storage; the array holds a Tensor handle, so the
// storage lives as long as the array (and as long as the module, for parameters). None when
// the tensor is undefined.
py::object to_numpy(const qkv::Tensor& tensor) {
  if (!tensor.defined()) return py::none();
  auto* owner = new qkv::Tensor(tensor.contiguous());
  py::capsule keep_alive(owner, [](void* p) { delete static_cast<qkv::Tensor*>(p); });
  std::vector<py::ssize_t> shape(owner->shape().begin(), owner->shape().end());
  std::vector<py::ssize_t> strides;
  for (int64_t s : owner->strides()) strides.push_back(static_cast<py::ssize_t>(s * sizeof(float)));
  return py::array_t<float>(shape, strides, owner->numel() > 0 ? owner->data() : nullptr, keep_alive);
}

// 16-bit K/V arrive as their raw bits (python/qkv/__init__.py views numpy float16 and torch
// bfloat16 / float16 as uint16), wrapped without copying, with the dtype they hold.
using BitsArray = py::array_t<uint16_t, py::array::c_style>;

qkv::Tensor bits_tensor(const BitsArray& a, qkv::DType dtype) {
  std::shared_ptr<void> owner(new py::object(a), [](void* p) {
    py::gil_scoped_acquire gil;
    delete static_cast<py::object*>(p);
  });
  return qkv::Tensor::from_blob(const_cast<uint16_t*>(a.data()),
                                qkv::Shape(std::vector<int64_t>(a.shape(), a.shape() + a.ndim())), dtype,
                                std::move(owner));
}

// ---- the functional core

// The options every attention call takes, gathered from the keywords (the score modifiers
// included: alibi_slopes and sinks are (Hq) arrays or None).
qkv::AttentionOptions make_options(const qkv::Mask& mask, std::optional<float> scale, float dropout_p, uint64_t seed,
                                   qkv::Backend backend, float softcap, const std::optional<FloatArray>& alibi_slopes,
                                   const std::optional<FloatArray>& sinks) {
  qkv::AttentionOptions options;
  options.mask = mask;
  options.scale = scale;
  options.dropout_p = dropout_p;
  options.seed = seed;
  options.backend = backend;
  options.softcap = softcap;
  if (alibi_slopes) options.alibi_slopes = to_tensor(*alibi_slopes);
  if (sinks) options.sinks = to_tensor(*sinks);
  return options;
}

// scaled_dot_product_attention with every option spelled out. Returns (output, weights, lse,
// row_max, row_sum); weights is None unless need_weights. The backward needs output and the row
// statistics (row_max and row_sum keep it exact under huge biases; lse alone serves otherwise).
py::tuple attention(const FloatArray& q, const FloatArray& k, const FloatArray& v, const qkv::Mask& mask,
                    std::optional<float> scale, float dropout_p, uint64_t seed, bool need_weights,
                    qkv::Backend backend, float softcap, const std::optional<FloatArray>& alibi_slopes,
                    const std::optional<FloatArray>& sinks, const std::string& precision) {
  qkv::AttentionOptions options = make_options(mask, scale, dropout_p, seed, backend, softcap, alibi_slopes, sinks);
  options.need_weights = need_weights;
  options.precision = qkv::matmul_precision_from_string(precision);
  const qkv::Tensor qt = to_tensor(q), kt = to_tensor(k), vt = to_tensor(v);
  qkv::AttentionResult result;
  {
    py::gil_scoped_release release;
    result = qkv::scaled_dot_product_attention(qt, kt, vt, options);
  }
  return py::make_tuple(to_numpy(result.output), to_numpy(result.weights), to_numpy(result.lse),
                        to_numpy(result.row_max), to_numpy(result.row_sum));
}

// Forward with 16-bit K/V ("bf16" or "f16" bits): returns (output, lse). Inference only: no
// weights, no dropout (the backward refuses 16-bit K/V).
py::tuple attention_half_kv(const FloatArray& q, const BitsArray& k, const BitsArray& v, const std::string& dtype,
                            const qkv::Mask& mask, std::optional<float> scale, qkv::Backend backend, float softcap,
                            const std::optional<FloatArray>& alibi_slopes, const std::optional<FloatArray>& sinks,
                            const std::string& precision) {
  qkv::AttentionOptions options = make_options(mask, scale, 0.0f, 0, backend, softcap, alibi_slopes, sinks);
  options.precision = qkv::matmul_precision_from_string(precision);
  const qkv::DType type = qkv::dtype_from_string(dtype);
  const qkv::Tensor qt = to_tensor(q), kt = bits_tensor(k, type), vt = bits_tensor(v, type);
  qkv::AttentionResult result;
  {
    py::gil_scoped_release release;
    result = qkv::scaled_dot_product_attention(qt, kt, vt, options);
  }
  return py::make_tuple(to_numpy(result.output), to_numpy(result.lse));
}

// qkv::scaled_dot_product_attention_backward: (dq, dk, dv, dsinks or None) from the forward's
// output and row statistics (row_max and row_sum when given, else lse), with the same mask and
// options as that forward (the dropout seed and the score modifiers included).
py::tuple attention_backward(const FloatArray& grad_output, const FloatArray& q, const FloatArray& k,
                             const FloatArray& v, const FloatArray& output, const FloatArray& lse,
                             const std::optional<FloatArray>& row_max, const std::optional<FloatArray>& row_sum,
                             const qkv::Mask& mask, std::optional<float> scale, float dropout_p, uint64_t seed,
                             qkv::Backend backend, float softcap, const std::optional<FloatArray>& alibi_slopes,
                             const std::optional<FloatArray>& sinks, const std::string& precision) {
  qkv::AttentionOptions options = make_options(mask, scale, dropout_p, seed, backend, softcap, alibi_slopes, sinks);
  options.precision = qkv::matmul_precision_from_string(precision);
  const qkv::Tensor gt = to_tensor(grad_output), qt = to_tensor(q), kt = to_tensor(k), vt = to_tensor(v);
  qkv::AttentionResult forward;
  forward.output = to_tensor(output);
  forward.lse = to_tensor(lse);
  if (row_max) forward.row_max = to_tensor(*row_max);
  if (row_sum) forward.row_sum = to_tensor(*row_sum);
  qkv::AttentionGrads grads;
  {
    py::gil_scoped_release release;
    grads = qkv::scaled_dot_product_attention_backward(gt, qt, kt, vt, forward, options);
  }
  return py::make_tuple(to_numpy(grads.dq), to_numpy(grads.dk), to_numpy(grads.dv), to_numpy(grads.dsinks));
}

// ---- linear attention (qkv/linear_attention.hpp)

qkv::LinearAttentionOptions linear_options(const std::string& feature_map, bool causal, float eps,
                                           int64_t causal_offset) {
  qkv::LinearAttentionOptions options;
  options.feature_map = qkv::feature_map_from_string(feature_map);
  options.causal = causal;
  options.eps = eps;
  options.causal_offset = causal_offset;
  return options;
}

py::object linear_attention(const FloatArray& q, const FloatArray& k, const FloatArray& v,
                            const std::string& feature_map, bool causal, float eps, int64_t causal_offset) {
  const qkv::LinearAttentionOptions options = linear_options(feature_map, causal, eps, causal_offset);
  const qkv::Tensor qt = to_tensor(q), kt = to_tensor(k), vt = to_tensor(v);
  qkv::Tensor output;
  {
    py::gil_scoped_release release;
    output = qkv::linear_attention(qt, kt, vt, options);
  }
  return to_numpy(output);
}

py::tuple linear_attention_backward(const FloatArray& q, const FloatArray& k, const FloatArray& v,
                                    const FloatArray& grad_output, const std::string& feature_map, bool causal,
                                    float eps, int64_t causal_offset) {
  const qkv::LinearAttentionOptions options = linear_options(feature_map, causal, eps, causal_offset);
  const qkv::Tensor qt = to_tensor(q), kt = to_tensor(k), vt = to_tensor(v), gt = to_tensor(grad_output);
  qkv::AttentionGrads grads;
  {
    py::gil_scoped_release release;
    grads = qkv::linear_attention_backward(qt, kt, vt, gt, options);
  }
  return py::make_tuple(to_numpy(grads.dq), to_numpy(grads.dk), to_numpy(grads.dv));
}

// ---- nn::MultiHeadAttention

qkv::nn::AttentionKind attention_kind_from_string(const std::string& name) {
  if (name == "softmax") return qkv::nn::AttentionKind::Softmax;
  if (name == "linear") return qkv::nn::AttentionKind::Linear;
  throw qkv::Error("MultiHeadAttention: attention must be \"softmax\" or \"linear\", got \"" + name + "\"");
}

// rotary: none, or (base, interleaved), the fields of RotaryEmbeddingOptions (python/qkv/__init__.py
// reads them from a dict or a qkv.RotaryEmbedding).
qkv::nn::MultiHeadAttention make_mha(int64_t embed_dim, int64_t num_heads, int64_t num_kv_heads, int64_t kdim,
                                     int64_t vdim, bool bias, float dropout, bool causal,
                                     std::optional<uint64_t> seed, float softcap, bool alibi, bool sinks,
                                     const std::string& attention, const std::string& feature_map,
                                     std::optional<std::pair<double, bool>> rotary, const std::string& precision) {
  std::optional<qkv::nn::RotaryEmbeddingOptions> rotary_options;
  if (rotary) rotary_options = qkv::nn::RotaryEmbeddingOptions{.base = rotary->first, .interleaved = rotary->second};
  return qkv::nn::MultiHeadAttention(embed_dim, num_heads,
                                     {.num_kv_heads = num_kv_heads, .kdim = kdim, .vdim = vdim, .bias = bias,
                                      .dropout = dropout, .causal = causal, .softcap = softcap, .alibi = alibi,
                                      .sinks = sinks, .rotary = rotary_options, .seed = seed,
                                      .attention = attention_kind_from_string(attention),
                                      .feature_map = qkv::feature_map_from_string(feature_map),
                                      .precision = qkv::matmul_precision_from_string(precision)});
}

// The module's rotary options as (base, interleaved), or None.
py::object mha_rotary(const qkv::nn::MultiHeadAttention& mha) {
  if (!mha.options().rotary) return py::none();
  return py::make_tuple(mha.options().rotary->base, mha.options().rotary->interleaved);
}

// Returns (output, weights or None). key and value None: self-attention, forward(query) (one
// fused projection; backward_self follows it). The GIL is released, except while training with
// dropout: forward() then advances the module's dropout counter, which two threads must not do at once.
py::tuple mha_forward(const qkv::nn::MultiHeadAttention& mha, const FloatArray& query,
                      const std::optional<FloatArray>& key, const std::optional<FloatArray>& value,
                      const qkv::Mask& mask, qkv::nn::Weights weights) {
  if (key.has_value() != value.has_value())
    throw qkv::Error("MultiHeadAttention: give both key and value, or neither (self-attention)");
  const qkv::Tensor qt = to_tensor(query);
  const qkv::Tensor kt = key ? to_tensor(*key) : qkv::Tensor(), vt = value ? to_tensor(*value) : qkv::Tensor();
  qkv::nn::MultiHeadAttentionOutput out;
  {
    std::optional<py::gil_scoped_release> release;
    if (!(mha.is_training() && mha.options().dropout > 0)) release.emplace();
    out = key ? mha.forward(qt, kt, vt, mask, weights) : mha.forward(qt, mask, weights);
  }
  return py::make_tuple(to_numpy(out.output), to_numpy(out.weights));
}

// d query of the last forward(query) (self-attention: the three paths summed); adds the
// parameter gradients to the module's.
py::object mha_backward_self(qkv::nn::MultiHeadAttention& mha, const FloatArray& grad_output) {
  const qkv::Tensor gt = to_tensor(grad_output);
  qkv::Tensor dx;
  {
    py::gil_scoped_release release;
    dx = mha.backward(gt);
  }
  return to_numpy(dx);
}

// [(name, array)] in the module's order; each array is a writable view of the parameter.
py::list mha_parameters(const qkv::nn::MultiHeadAttention& mha) {
  py::list params;
  for (const auto& p : mha.parameters()) params.append(py::make_tuple(p.name, to_numpy(p.tensor)));
  return params;
}

// (d query, d key, d value) of the last forward; adds the parameter gradients to the module's.
py::tuple mha_backward(qkv::nn::MultiHeadAttention& mha, const FloatArray& grad_output) {
  const qkv::Tensor gt = to_tensor(grad_output);
  qkv::nn::MultiHeadAttentionGrads grads;
  {
    py::gil_scoped_release release;
    grads = mha.backward_cross(gt);
  }
  return py::make_tuple(to_numpy(grads.query), to_numpy(grads.key), to_numpy(grads.value));
}

// [(name, grad)] in the module's order; each array is a view of the parameter's gradient, which
// backward adds to and zero_grad clears in place.
py::list mha_gradients(const qkv::nn::MultiHeadAttention& mha) {
  py::list grads;
  for (const auto& p : mha.parameters()) grads.append(py::make_tuple(p.name, to_numpy(p.grad)));
  return grads;
}

void mha_load_state_dict(qkv::nn::MultiHeadAttention& mha, const std::map<std::string, FloatArray>& state) {
  std::map<std::string, qkv::Tensor> tensors;
  for (const auto& [name, array] : state) tensors[name] = to_tensor(array);
  mha.load_state_dict(tensors);
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "qkv's C++ core (numpy in, numpy out). Use the functions of the package qkv.";
  m.attr("__version__") = qkv::version();

  // qkv::Error is a std::invalid_argument: it arrives as qkv.Error, a ValueError subclass that
  // carries the library's message unchanged.
  const auto& error = py::register_exception<qkv::Error>(m, "Error", PyExc_ValueError);
  // Mask.parse's errors: a qkv.Error whose message quotes the expression and points at the column.
  py::register_exception<qkv::MaskParseError>(m, "MaskParseError", error.ptr());
  bind_models(m);  // the real models: models_bindings.cpp

  py::enum_<qkv::Backend>(m, "Backend")
      .value("Auto", qkv::Backend::Auto)
      .value("Reference", qkv::Backend::Reference)
      .value("Flash", qkv::Backend::Flash)
      .value("Decode", qkv::Backend::Decode);

  py::class_<qkv::Mask>(m, "Mask", R"doc(
Which keys each query may attend to, kept symbolic (no n x n matrix for structured parts).
Combine with `&` (a key is visible only where every part allows it) and `|` (where either
does; `&` binds tighter). A union with an additive array is an error.

  Mask.causal(offset=0)           query i sees keys j <= offset + i
  Mask.window(left, right=0)      query i sees keys i - left <= j <= i + right
  Mask.key_lengths([5, 3])        batch b sees its first lengths[b] keys (padding)
  Mask.keep(array)                nonzero / True = attend (PyTorch SDPA's bool convention)
  Mask.additive(array)            added to the scaled scores; -inf = masked (PyTorch float)
  Mask.strided(stride, offset=0)  query i sees keys j with (offset + i - j) % stride == 0
  Mask.global_tokens(count)       the first count keys are seen by all, the first count queries see all
  Mask.block_sparse(layout, block_q, block_k)  block (a, c) of layout (nonzero = visible) lets
                                  queries a*block_q.. see keys c*block_k..
  Mask.parse("causal & (window(127) | strided(128)) | global(16)")  the same in text; str() prints it
)doc")
      .def(py::init<>(), "A mask that hides nothing.")
      .def_static("causal", &qkv::Mask::causal, py::arg("offset") = 0)
      .def_static("window", &qkv::Mask::window, py::arg("left"), py::arg("right") = 0, py::arg("offset") = 0)
      .def_static("key_lengths", &qkv::Mask::key_lengths, py::arg("lengths"))
      .def_static("keep", [](const FloatArray& keep) { return qkv::Mask::keep(to_tensor(keep)); }, py::arg("keep"))
      .def_static("additive", [](const FloatArray& scores) { return qkv::Mask::additive(to_tensor(scores)); },
                  py::arg("scores"))
      .def("__and__", [](const qkv::Mask& a, const qkv::Mask& b) { return a & b; }, py::is_operator())
      .def("__or__", [](const qkv::Mask& a, const qkv::Mask& b) { return a | b; }, py::is_operator())
      .def_static("strided", &qkv::Mask::strided, py::arg("stride"), py::arg("offset") = 0)
      .def_static("global_tokens", &qkv::Mask::global_tokens, py::arg("count"))
      .def_static("block_sparse",
                  [](const FloatArray& layout, int64_t block_q, int64_t block_k) {
                    return qkv::Mask::block_sparse(to_tensor(layout), block_q, block_k);
                  },
                  py::arg("layout"), py::arg("block_q"), py::arg("block_k"))
      .def_static("parse", &qkv::Mask::parse, py::arg("expression"))
      .def("__str__", &qkv::Mask::str)
      .def("is_none", &qkv::Mask::is_none)
      .def("__repr__", [](const qkv::Mask& mask) { return "Mask(" + mask.str() + ")"; });

  m.def("attention", &attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"), py::arg("scale"),
        py::arg("dropout_p"), py::arg("seed"), py::arg("need_weights"), py::arg("backend"), py::arg("softcap") = 0.0f,
        py::arg("alibi_slopes") = py::none(), py::arg("sinks") = py::none(), py::arg("precision") = "highest",
        "qkv::scaled_dot_product_attention: returns (output, weights or None, lse, row_max, row_sum).");
  m.def("attention_backward", &attention_backward, py::arg("grad_output"), py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("output"), py::arg("lse"), py::arg("row_max"), py::arg("row_sum"), py::arg("mask"),
        py::arg("scale"), py::arg("dropout_p"), py::arg("seed"), py::arg("backend"), py::arg("softcap") = 0.0f,
        py::arg("alibi_slopes") = py::none(), py::arg("sinks") = py::none(), py::arg("precision") = "highest",
        "qkv::scaled_dot_product_attention_backward: returns (dq, dk, dv, dsinks or None).");
  m.def("linear_attention", &linear_attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("feature_map"),
        py::arg("causal"), py::arg("eps"), py::arg("causal_offset"), "qkv::linear_attention.");
  m.def("linear_attention_backward", &linear_attention_backward, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("grad_output"), py::arg("feature_map"), py::arg("causal"), py::arg("eps"), py::arg("causal_offset"),
        "qkv::linear_attention_backward: returns (dq, dk, dv).");
  m.def("attention_half_kv", &attention_half_kv, py::arg("q"), py::arg("k_bits"), py::arg("v_bits"),
        py::arg("dtype"), py::arg("mask"), py::arg("scale"), py::arg("backend"), py::arg("softcap") = 0.0f,
        py::arg("alibi_slopes") = py::none(), py::arg("sinks") = py::none(), py::arg("precision") = "highest",
        "qkv::scaled_dot_product_attention with K and V given as bf16 or f16 bits: returns (output, lse).");
  m.def("create_causal_mask", [](int64_t n) { return to_numpy(qkv::create_causal_mask(n)); }, py::arg("n"));
  m.def("create_padding_mask",
        [](const std::vector<int64_t>& lengths, int64_t max_len) {
          return to_numpy(qkv::create_padding_mask(lengths, max_len));
        },
        py::arg("lengths"), py::arg("max_len"));
  m.def("manual_seed", &qkv::nn::manual_seed, py::arg("seed"),
        "Restarts the sequence that modules built without a seed draw their weights from (torch.manual_seed).");
  m.def("dropout_keeps", &qkv::dropout_keeps, py::arg("seed"), py::arg("batch"), py::arg("head"), py::arg("query"),
        py::arg("key"), py::arg("p"),
        "True when dropout keeps weight (batch, head, query, key) for this seed: the same on every kernel.");

  py::enum_<qkv::nn::Weights>(m, "Weights")
      .value("None_", qkv::nn::Weights::None)
      .value("PerHead", qkv::nn::Weights::PerHead)
      .value("Averaged", qkv::nn::Weights::Averaged);

  py::class_<qkv::nn::MultiHeadAttention>(m, "MultiHeadAttentionCore")
      .def(py::init(&make_mha), py::arg("embed_dim"), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("kdim"), py::arg("vdim"), py::arg("bias"), py::arg("dropout"), py::arg("causal"), py::arg("seed"),
           py::arg("softcap") = 0.0f, py::arg("alibi") = false, py::arg("sinks") = false,
           py::arg("attention") = "softmax", py::arg("feature_map") = "elu+1", py::arg("rotary") = py::none(),
           py::arg("precision") = "highest")
      .def("forward", &mha_forward, py::arg("query"), py::arg("key"), py::arg("value"), py::arg("mask"),
           py::arg("weights"))
      .def("parameters", &mha_parameters)
      .def("backward", &mha_backward, py::arg("grad_output"))
      .def("backward_self", &mha_backward_self, py::arg("grad_output"))
      .def("gradients", &mha_gradients)
      .def("zero_grad", &qkv::nn::MultiHeadAttention::zero_grad)
      .def("load_state_dict", &mha_load_state_dict, py::arg("state"))
      .def("train", &qkv::nn::MultiHeadAttention::train, py::arg("training") = true)
      .def_property_readonly("training", &qkv::nn::MultiHeadAttention::is_training)
      .def_property_readonly("embed_dim", &qkv::nn::MultiHeadAttention::embed_dim)
      .def_property_readonly("num_heads", &qkv::nn::MultiHeadAttention::num_heads)
      .def_property_readonly("num_kv_heads", &qkv::nn::MultiHeadAttention::num_kv_heads)
      .def_property_readonly("head_dim", &qkv::nn::MultiHeadAttention::head_dim)
      .def_property_readonly("kdim", [](const qkv::nn::MultiHeadAttention& m) { return m.options().kdim; })
      .def_property_readonly("vdim", [](const qkv::nn::MultiHeadAttention& m) { return m.options().vdim; })
      .def_property_readonly("parameter_count", &qkv::nn::MultiHeadAttention::parameter_count)
      .def_property_readonly("causal", [](const qkv::nn::MultiHeadAttention& m) { return m.options().causal; })
      .def_property_readonly("attention",
                             [](const qkv::nn::MultiHeadAttention& m) {
                               return m.options().attention == qkv::nn::AttentionKind::Linear ? "linear" : "softmax";
                             })
      .def_property_readonly(
          "feature_map", [](const qkv::nn::MultiHeadAttention& m) { return std::string(qkv::to_string(m.options().feature_map)); })
      .def_property_readonly("rotary", &mha_rotary)
      .def_property_readonly("precision",
                             [](const qkv::nn::MultiHeadAttention& m) { return std::string(to_string(m.options().precision)); })
      .def("make_cache",
           [](const qkv::nn::MultiHeadAttention& m, int64_t batch, int64_t capacity, const std::string& dtype,
              int64_t window) { return m.make_cache(batch, capacity, qkv::dtype_from_string(dtype), window); },
           py::arg("batch"), py::arg("capacity"), py::arg("dtype") = "f32", py::arg("window") = 0)
      .def("forward_cached",
           [](const qkv::nn::MultiHeadAttention& m, const FloatArray& x, qkv::nn::KVCache& cache,
              const std::vector<int64_t>& counts) {
             const qkv::Tensor xt = to_tensor(x);
             qkv::Tensor out;
             {
               py::gil_scoped_release release;
               out = m.forward(xt, cache, counts).output;
             }
             return to_numpy(out);
           },
           py::arg("x"), py::arg("cache"), py::arg("counts") = std::vector<int64_t>());

  // ---- inference (include/qkv/inference.hpp)
  py::class_<qkv::nn::KVCache>(m, "KVCache", R"doc(
One attention layer's keys and values, (batch, kv_heads, capacity, head_dim) each, allocated once
in dtype "f32", "bf16" or "f16"; window > 0 makes it a ring buffer of window slots.
)doc")
      .def(py::init([](int64_t batch, int64_t kv_heads, int64_t capacity, int64_t head_dim, const std::string& dtype,
                       int64_t window) {
             return qkv::nn::KVCache(batch, kv_heads, capacity, head_dim, qkv::dtype_from_string(dtype), window);
           }),
           py::arg("batch"), py::arg("kv_heads"), py::arg("capacity"), py::arg("head_dim"), py::arg("dtype") = "f32",
           py::arg("window") = 0)
      .def_property_readonly("length", [](const qkv::nn::KVCache& c) { return c.length(); })
      .def_property_readonly("lengths", &qkv::nn::KVCache::lengths)
      .def_property_readonly("capacity", &qkv::nn::KVCache::capacity)
      .def_property_readonly("window", &qkv::nn::KVCache::window)
      .def_property_readonly("dtype", [](const qkv::nn::KVCache& c) { return std::string(qkv::to_string(c.dtype())); })
      .def("reset", &qkv::nn::KVCache::reset)
      .def("keys", [](const qkv::nn::KVCache& c) { return to_numpy(c.keys(c.capacity()).to(qkv::DType::F32)); },
           "The whole key storage as float32 (a copy).");

  py::class_<qkv::nn::RotaryEmbedding>(m, "RotaryEmbedding", R"doc(
Rotary position embedding: pair i of a head vector at position p rotated by p * base^(-2i/D);
half-split pairs (x_i, x_{i+D/2}) by default (GPT-NeoX, LLaMA), adjacent pairs with interleaved.
)doc")
      .def(py::init([](int64_t head_dim, double base, bool interleaved) {
             return qkv::nn::RotaryEmbedding(head_dim, {.base = base, .interleaved = interleaved});
           }),
           py::arg("head_dim"), py::arg("base") = 10000.0, py::arg("interleaved") = false)
      .def_property_readonly("head_dim", &qkv::nn::RotaryEmbedding::head_dim)
      .def_property_readonly("base", [](const qkv::nn::RotaryEmbedding& r) { return r.options().base; })
      .def_property_readonly("interleaved", [](const qkv::nn::RotaryEmbedding& r) { return r.options().interleaved; })
      .def("apply",
           [](const qkv::nn::RotaryEmbedding& r, const FloatArray& x, int64_t position_offset) {
             return to_numpy(r.apply(to_tensor(x), position_offset));
           },
           py::arg("x"), py::arg("position_offset") = 0);
}
