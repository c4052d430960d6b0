// qkv._core: the pybind11 bindings of qkv's C++ API, numpy in and numpy out. Thin on purpose:
// the PyTorch-style argument conventions (bool mask True = attend, nn.MultiheadAttention's
// True = masked, batch_first, ...) live in python/qkv/__init__.py; this file only moves arrays
// across and calls the one functional core.
//
// Arrays in: float32 C-contiguous numpy arrays are wrapped without copying (Tensor::from_blob,
// the Tensor holding a reference to the array); others are copied into a qkv Tensor, after their
// dtype and rank are checked on the array's metadata (so a bad broadcast view is refused before
// it is expanded, and the copy's allocation is qkv's, refused with a qkv::Error when too large).
// Arrays out: zero-copy too; the numpy array keeps the Tensor's storage alive. Every computation
// runs with the GIL released; inputs are wrapped before it is released. The options every
// attention call takes are one bound class, AttentionOptions (python/qkv/__init__.py fills it
// from the keywords in one place).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cctype>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <qkv/paged_cache.hpp>
#include <qkv/qkv.hpp>

#include "analysis_bindings.hpp"
#include "models_bindings.hpp"
#include "rotary_bindings.hpp"

namespace py = pybind11;

namespace {

// The most dims any array qkv reads has: (B, H, N, D). Checked before an array is copied, so a
// huge broadcast view of more dims is refused on its metadata, never expanded first.
constexpr int kMaxDims = 4;

// A float32 or bool array argument as the caller gave it (a strided view stays a view): the caster
// below checks its dtype and rank on the metadata; to_tensor copies it when it must. Any other
// dtype is refused as PyTorch refuses it: float64 and float16 are a qkv.Error
// (python/qkv/__init__.py casts them first when the caller passes allow_cast=True), integer
// arrays always are. Failures are a qkv.Error naming the dtype and shape, never pybind11's
// TypeError, which prints every argument in full.
struct FloatArray {
  py::array array;
};

// A caster's refusal of an array argument: a qkv.Error (qkv._core.ArrayError) that
// python/qkv/__init__.py prefixes with the function's name, which the caster does not know.
struct ArrayError : qkv::Error {
  using qkv::Error::Error;
};

std::string shape_str(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t d = 0; d < a.ndim(); ++d) {
    if (d > 0) s += ", ";
    s += std::to_string(a.shape(d));
  }
  return s + (a.ndim() == 1 ? ",)" : ")");
}

// A value as an error message shows it: an array by dtype and shape, never its elements;
// anything else by its repr, cut at 80 characters.
std::string brief(const py::handle& value) {
  if (py::isinstance<py::array>(value)) {
    const auto a = py::reinterpret_borrow<py::array>(value);
    return "a " + std::string(py::str(a.dtype())) + " array of shape " + shape_str(a);
  }
  std::string text = py::repr(value);
  return text.size() <= 80 ? text : text.substr(0, 77) + "...";
}

}  // namespace

namespace pybind11::detail {
template <>
struct type_caster<FloatArray> {
  PYBIND11_TYPE_CASTER(FloatArray, const_name("numpy.ndarray[float32]"));

  bool load(handle src, bool) {
    const py::array a = py::array::ensure(src);
    if (!a) throw ArrayError("got " + brief(src) + " where an array is needed");
    const std::string what = "got a " + std::string(py::str(a.dtype())) + " array";
    const std::string shape = " (shape " + shape_str(a) + ")";
    const char kind = a.dtype().kind();
    if (kind == 'f' && a.itemsize() != 4)
      throw ArrayError(what + ", but qkv computes in float32 (as PyTorch, it does not mix dtypes): pass "
                       "allow_cast=True, or convert with .astype(numpy.float32)" + shape);
    if (kind != 'f' && kind != 'b')
      throw ArrayError(what + ": attention needs float32 inputs (PyTorch refuses integer inputs too)" + shape);
    if (a.ndim() > kMaxDims)
      throw ArrayError(what + shape + ": qkv's arrays have at most " + std::to_string(kMaxDims) + " dims (B, H, N, D)");
    value = FloatArray{a};
    return true;
  }
  static handle cast(const FloatArray& array, return_value_policy, handle) { return array.array.inc_ref(); }
};
}  // namespace pybind11::detail

namespace {

py::object to_numpy(const qkv::Tensor& tensor);

qkv::Shape shape_of(const py::array& a) { return qkv::Shape(std::vector<int64_t>(a.shape(), a.shape() + a.ndim())); }

// An array as a Tensor, with the GIL held. A float32 C-contiguous array is wrapped over the same
// memory: the Tensor (and whatever keeps it: a Mask, a module's backward cache) holds a reference
// to the array, so the memory outlives the Python name; dropping that reference takes the GIL,
// since the last Tensor may die in a section that released it. qkv only reads its inputs: the
// const_cast never leads to a write. Any other array (a strided view, a bool mask) is copied
// into a fresh Tensor, which qkv's allocator refuses with a qkv::Error when it is too large.
qkv::Tensor to_tensor(const FloatArray& in) {
  const py::array& a = in.array;
  using Exact = py::array_t<float, py::array::c_style>;
  if (!Exact::check_(a)) {
    qkv::Tensor copy = qkv::Tensor::empty(shape_of(a));
    py::module_::import("numpy").attr("copyto")(to_numpy(copy), a, py::arg("casting") = "unsafe");
    return copy;
  }
  std::shared_ptr<void> owner(new py::object(a), [](void* p) {
    py::gil_scoped_acquire gil;
    delete static_cast<py::object*>(p);
  });
  return qkv::Tensor::from_blob(const_cast<void*>(a.data()), shape_of(a), qkv::DType::F32, std::move(owner));
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

template <class Array>
qkv::Tensor bits_tensor(const Array& a, qkv::DType dtype) {
  std::shared_ptr<void> owner(new py::object(a), [](void* p) {
    py::gil_scoped_acquire gil;
    delete static_cast<py::object*>(p);
  });
  return qkv::Tensor::from_blob(const_cast<void*>(static_cast<const void*>(a.data())),
                                qkv::Shape(std::vector<int64_t>(a.shape(), a.shape() + a.ndim())), dtype,
                                std::move(owner));
}

// Quantized K/V (qkv/quantize.hpp) arrive as their packed bytes (python/qkv/__init__.py's
// QuantizedKV), wrapped without copying as bits_tensor wraps 16-bit ones, and their float32 scales.
using BytesArray = py::array_t<uint8_t, py::array::c_style>;
qkv::Tensor bytes_tensor(const BytesArray& a, qkv::DType dtype) { return bits_tensor(a, dtype); }

// A quantized tensor as (packed bytes as uint8, scales as float32) numpy arrays (copies).
py::tuple quantized_to_numpy(const qkv::QuantizedTensor& q) {
  const qkv::Tensor values = q.values.contiguous();
  BytesArray bytes(std::vector<py::ssize_t>(values.shape().begin(), values.shape().end()));
  if (values.numel() > 0) std::memcpy(bytes.mutable_data(), values.raw_data(), static_cast<size_t>(values.numel()));
  return py::make_tuple(bytes, to_numpy(q.scales));
}

// ---- the functional core

// Each AttentionOptions field as a Python attribute: what it takes is its docstring, which
// python/qkv/__init__.py quotes when a keyword's value cannot be converted.
std::string lowercase(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

qkv::Backend backend_from(const py::object& value) {
  if (py::isinstance<qkv::Backend>(value)) return value.cast<qkv::Backend>();
  static const std::map<std::string, qkv::Backend> names = {
      {"auto", qkv::Backend::Auto}, {"decode", qkv::Backend::Decode}, {"flash", qkv::Backend::Flash},
      {"reference", qkv::Backend::Reference}};
  const auto found = names.find(lowercase(py::str(value)));
  if (!py::isinstance<py::str>(value) || found == names.end())
    throw qkv::Error("backend must be one of ['auto', 'decode', 'flash', 'reference'], got " +
                     std::string(py::repr(value)));
  return found->second;
}

// A per-head array (alibi_slopes, sinks) of any float dtype, as float32; None: off.
qkv::Tensor per_head(const py::object& value, const char* name) {
  if (value.is_none()) return {};
  const py::array a = py::array::ensure(value);
  if (!a || (a.dtype().kind() != 'f' && a.dtype().kind() != 'i' && a.dtype().kind() != 'u'))
    throw qkv::Error(std::string(name) + " must be None or a (heads,) float array, got " + brief(value));
  if (a.ndim() > kMaxDims) throw qkv::Error(std::string(name) + " is " + shape_str(a) + ": it should be (heads,)");
  qkv::Tensor copy = qkv::Tensor::empty(shape_of(a));
  py::module_::import("numpy").attr("copyto")(to_numpy(copy), a, py::arg("casting") = "unsafe");
  return copy;
}

// A page pool as float32: a view when it is f32, a converted copy of 16-bit pools, the dequantised
// values of quantized ones (their scale pool beside them).
qkv::Tensor pool_as_f32(const qkv::Tensor& pool, const qkv::Tensor& scales) {
  return is_quantized(pool.dtype()) ? qkv::dequantize_kv({pool, scales}) : pool.to(qkv::DType::F32);
}

// rotary_cos / rotary_sin: None (off) or a (seqlen_ro, rotary_dim / 2) float array of any float
// dtype (numpy, or a torch tensor), copied as float32; the core checks shapes and values.
qkv::Tensor table_from(const py::object& value, const char* name) {
  if (value.is_none()) return {};
  const py::array a = py::array::ensure(value);
  if (!a || a.dtype().kind() != 'f' || a.ndim() != 2)
    throw qkv::Error(std::string(name) + " must be None or a (seqlen_ro, rotary_dim / 2) float array, got " +
                     brief(value));
  qkv::Tensor copy = qkv::Tensor::empty(shape_of(a));
  py::module_::import("numpy").attr("copyto")(to_numpy(copy), a, py::arg("casting") = "unsafe");
  return copy;
}

// cu_seqlens_q / cu_seqlens_k: None (off) or a (B + 1,) int32 array of offsets (FlashAttention's
// varlen dtype, numpy or torch); the core checks the values.
std::vector<int64_t> offsets_from(const py::object& value, const char* name) {
  if (value.is_none()) return {};
  const py::array a = py::array::ensure(value);
  if (!a || !a.dtype().is(py::dtype::of<int32_t>()) || a.ndim() != 1)
    throw qkv::Error(std::string(name) + " must be None or a (B + 1,) int32 array of offsets, got " + brief(value));
  const auto offsets = a.cast<py::array_t<int32_t, py::array::forcecast>>().unchecked<1>();
  std::vector<int64_t> out(static_cast<size_t>(offsets.shape(0)));
  for (size_t x = 0; x < out.size(); ++x) out[x] = offsets(static_cast<py::ssize_t>(x));
  return out;
}

// block_table: None (off) or a (B, max_pages) int32 array of pool page indices (FlashAttention's
// flash_attn_with_kvcache; int64 too), row-major into B x max_pages entries; cache_seqlens: None or
// a (B,) int32 (or int64) array of key counts. The core checks the values.
std::vector<int64_t> indices_from(const py::object& value, const char* name, int dims, const char* shape) {
  if (value.is_none()) return {};
  const py::array a = py::array::ensure(value);
  // By kind and size, not dtype identity: numpy's int64 may be 'l' or 'q', and either byte order.
  const bool integer = a && a.dtype().kind() == 'i' && (a.itemsize() == 4 || a.itemsize() == 8);
  if (!integer || a.ndim() != dims)
    throw qkv::Error(std::string(name) + " must be None or a " + shape + " int32 array, got " + brief(value));
  const auto flat = a.cast<py::array_t<int64_t, py::array::forcecast | py::array::c_style>>();
  return std::vector<int64_t>(flat.data(), flat.data() + flat.size());
}

// mod_inputs: None or a dict of name -> (L,) or (B, L) number array, copied to float32 tensors
// (the core checks the shapes against what the functions index them by).
std::map<std::string, qkv::Tensor> mod_inputs_from(const py::object& value) {
  std::map<std::string, qkv::Tensor> inputs;
  if (value.is_none()) return inputs;
  if (!py::isinstance<py::dict>(value))
    throw qkv::Error("mod_inputs must be None or a dict of name: (L,) or (B, L) array, got " + brief(value));
  for (const auto& [key, item] : py::reinterpret_borrow<py::dict>(value)) {
    const std::string name = py::str(key);
    const py::array a = py::array::ensure(item);
    if (!a || a.ndim() < 1 || a.ndim() > 2 || std::string("fiub").find(a.dtype().kind()) == std::string::npos)
      throw qkv::Error("mod_inputs['" + name + "'] must be a (L,) or (B, L) number array, got " +
                       brief(py::reinterpret_borrow<py::object>(item)));
    qkv::Tensor copy = qkv::Tensor::empty(shape_of(a));
    py::module_::import("numpy").attr("copyto")(to_numpy(copy), a, py::arg("casting") = "unsafe");
    inputs.emplace(name, std::move(copy));
  }
  return inputs;
}

void bind_attention_options(py::module_& m) {
  using O = qkv::AttentionOptions;
  py::class_<O>(m, "AttentionOptions", "qkv::AttentionOptions (include/qkv/attention.hpp), field by field.")
      .def(py::init<>())
      .def_readwrite("mask", &O::mask, "a qkv.Mask")
      .def_readwrite("scale", &O::scale, "None or a number")
      .def_readwrite("dropout_p", &O::dropout_p, "a number in [0, 1)")
      .def_readwrite("seed", &O::seed, "an integer in [0, 2**64)")
      .def_readwrite("need_weights", &O::need_weights, "True or False")
      .def_property(
          "backend", [](const O& o) { return o.backend; },
          [](O& o, const py::object& value) { o.backend = backend_from(value); },
          "'auto', 'reference', 'flash', 'decode' or a qkv.Backend")
      .def_property(
          "precision", [](const O& o) { return std::string(qkv::to_string(o.precision)); },
          [](O& o, const std::string& name) { o.precision = qkv::matmul_precision_from_string(lowercase(name)); },
          "'highest', 'high' or 'medium'")
      .def_readwrite("softcap", &O::softcap, "a number >= 0 (0 = off)")
      .def_property(
          "alibi_slopes", [](const O& o) { return to_numpy(o.alibi_slopes); },
          [](O& o, const py::object& value) { o.alibi_slopes = per_head(value, "alibi_slopes"); },
          "None or a (heads,) float array")
      .def_property(
          "sinks", [](const O& o) { return to_numpy(o.sinks); },
          [](O& o, const py::object& value) { o.sinks = per_head(value, "sinks"); }, "None or a (heads,) float array")
      .def_readwrite("score_mod", &O::score_mod, "a score function as text, e.g. 's - 0.1 * abs(q - k)' ('' = off)")
      .def_readwrite("mask_mod", &O::mask_mod, "a mask function as text, e.g. 'doc(q) == doc(k)' ('' = off)")
      .def_property(
          "mod_inputs",
          [](const O& o) {
            py::dict out;
            for (const auto& [name, tensor] : o.mod_inputs) out[py::str(name)] = to_numpy(tensor);
            return out;
          },
          [](O& o, const py::object& value) { o.mod_inputs = mod_inputs_from(value); },
          "None or a dict of name: (L,) or (B, L) number array")
      .def_property(
          "cu_seqlens_q", [](const O& o) { return o.cu_seqlens_q; },
          [](O& o, const py::object& value) { o.cu_seqlens_q = offsets_from(value, "cu_seqlens_q"); },
          "None or a (B + 1,) int32 array: the packed queries' sequence offsets")
      .def_property(
          "cu_seqlens_k", [](const O& o) { return o.cu_seqlens_k; },
          [](O& o, const py::object& value) { o.cu_seqlens_k = offsets_from(value, "cu_seqlens_k"); },
          "None or a (B + 1,) int32 array: the packed keys' sequence offsets")
      .def_property(
          "block_table", [](const O& o) { return o.block_table; },
          [](O& o, const py::object& value) { o.block_table = indices_from(value, "block_table", 2, "(B, max_pages)"); },
          "None or a (B, max_pages) int32 array: each sequence's pages of the key/value pools")
      .def_property(
          "cache_seqlens", [](const O& o) { return o.cache_seqlens; },
          [](O& o, const py::object& value) { o.cache_seqlens = indices_from(value, "cache_seqlens", 1, "(B,)"); },
          "None or a (B,) int32 array: the keys each paged sequence holds")
      .def_property(
          "rotary_cos", [](const O& o) { return to_numpy(o.rotary_cos); },
          [](O& o, const py::object& value) { o.rotary_cos = table_from(value, "rotary_cos"); },
          "None or a (seqlen_ro, rotary_dim / 2) float array: the cosines of each position's angles")
      .def_property(
          "rotary_sin", [](const O& o) { return to_numpy(o.rotary_sin); },
          [](O& o, const py::object& value) { o.rotary_sin = table_from(value, "rotary_sin"); },
          "None or a (seqlen_ro, rotary_dim / 2) float array: the sines of each position's angles")
      .def_readwrite("rotary_interleaved", &O::rotary_interleaved,
                     "True (pairs x[2i], x[2i+1], GPT-J) or False (pairs x[i], x[i + rotary_dim / 2], GPT-NeoX)")
      .def_readwrite("rotary_keys", &O::rotary_keys,
                     "True (rotate k too) or False (k is a cache whose keys were rotated when appended)");
}

// scaled_dot_product_attention: returns (output, weights, lse, row_max, row_sum); weights is
// None unless options.need_weights. The backward needs output and the row statistics (row_max
// and row_sum keep it exact under huge biases; lse alone serves otherwise).
py::tuple attention(const FloatArray& q, const FloatArray& k, const FloatArray& v,
                    const qkv::AttentionOptions& options) {
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
                            const qkv::AttentionOptions& options) {
  const qkv::DType type = qkv::dtype_from_string(dtype);
  const qkv::Tensor qt = to_tensor(q), kt = bits_tensor(k, type), vt = bits_tensor(v, type);
  qkv::AttentionResult result;
  {
    py::gil_scoped_release release;
    result = qkv::scaled_dot_product_attention(qt, kt, vt, options);
  }
  return py::make_tuple(to_numpy(result.output), to_numpy(result.lse));
}

// qkv::cascade_attention (qkv/cascade.hpp): each level's K/V as float32 arrays ("f32") or as the
// bits of 16-bit ones ("bf16", "f16", as attention_half_kv takes them). Returns (output, lse).
qkv::Tensor kv_level(const py::object& a, const std::string& dtype) {
  if (dtype == "f32") return to_tensor(a.cast<FloatArray>());
  return bits_tensor(a.cast<BitsArray>(), qkv::dtype_from_string(dtype));
}

py::tuple cascade_attention(const FloatArray& q, const py::object& prefix_k, const py::object& prefix_v,
                            const std::string& prefix_dtype, const py::object& suffix_k, const py::object& suffix_v,
                            const std::string& suffix_dtype, const qkv::AttentionOptions& options) {
  const qkv::Tensor qt = to_tensor(q);
  const qkv::Tensor pk = kv_level(prefix_k, prefix_dtype), pv = kv_level(prefix_v, prefix_dtype);
  const qkv::Tensor sk = kv_level(suffix_k, suffix_dtype), sv = kv_level(suffix_v, suffix_dtype);
  qkv::AttentionResult result;
  {
    py::gil_scoped_release release;
    result = qkv::cascade_attention(qt, pk, pv, sk, sv, options);
  }
  return py::make_tuple(to_numpy(result.output), to_numpy(result.lse));
}

// Forward with quantized K/V ("int8" or "int4": packed bytes and scales): returns (output, lse).
// Inference only, as attention_half_kv.
py::tuple attention_quantized_kv(const FloatArray& q, const BytesArray& k, const FloatArray& k_scales,
                                 const BytesArray& v, const FloatArray& v_scales, const std::string& dtype,
                                 qkv::AttentionOptions options) {
  const qkv::DType type = qkv::dtype_from_string(dtype);
  const qkv::Tensor qt = to_tensor(q), kt = bytes_tensor(k, type), vt = bytes_tensor(v, type);
  options.k_scales = to_tensor(k_scales);
  options.v_scales = to_tensor(v_scales);
  qkv::AttentionResult result;
  {
    py::gil_scoped_release release;
    result = qkv::scaled_dot_product_attention(qt, kt, vt, options);
  }
  return py::make_tuple(to_numpy(result.output), to_numpy(result.lse));
}

// qkv::scaled_dot_product_attention_backward: (dq, dk, dv, dsinks or None, dbias or None: the
// gradient of the mask's one additive tensor, shaped as that tensor) from the forward's
// output and row statistics (row_max and row_sum when given, else lse), with the same options as
// that forward (the mask, dropout seed and score modifiers included).
py::tuple attention_backward(const FloatArray& grad_output, const FloatArray& q, const FloatArray& k,
                             const FloatArray& v, const FloatArray& output, const FloatArray& lse,
                             const std::optional<FloatArray>& row_max, const std::optional<FloatArray>& row_sum,
                             const qkv::AttentionOptions& options) {
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
  return py::make_tuple(to_numpy(grads.dq), to_numpy(grads.dk), to_numpy(grads.dv), to_numpy(grads.dsinks),
                        to_numpy(grads.dbias));
}

// Mask::parse with the whole Python string (NUL bytes included). A NUL is refused here, at its
// column: the parser would quote it in its message, which what() - a C string - cuts short there.
qkv::Mask parse_mask(const std::string& expression) {
  const size_t nul = expression.find('\0');
  if (nul == std::string::npos) return qkv::Mask::parse(expression);
  std::string shown;
  for (char c : expression) shown += c == '\0' ? std::string("\\0") : std::string(1, c);
  throw qkv::MaskParseError("mask '" + shown + "': column " + std::to_string(nul + 1) + ", found a NUL byte", nul + 1);
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

// MultiHeadAttentionOptions as one bound class, as AttentionOptions: a property per field whose
// docstring says what it takes (python/qkv/__init__.py fills it from the constructor's keywords).
// rotary is None or (base, interleaved), the fields of RotaryEmbeddingOptions.
void bind_module_options(py::module_& m) {
  using O = qkv::nn::MultiHeadAttentionOptions;
  using Rotary = std::optional<std::pair<double, bool>>;
  using RelativeBias = std::optional<std::tuple<int64_t, int64_t, bool>>;
  py::class_<O>(m, "MultiHeadAttentionOptions", "qkv::nn::MultiHeadAttentionOptions (include/qkv/nn.hpp).")
      .def(py::init<>())
      .def_readwrite("num_kv_heads", &O::num_kv_heads, "an integer >= 0 (0 = num_heads)")
      .def_readwrite("kdim", &O::kdim, "an integer >= 0 (0 = embed_dim)")
      .def_readwrite("vdim", &O::vdim, "an integer >= 0 (0 = embed_dim)")
      .def_readwrite("bias", &O::bias, "True or False")
      .def_readwrite("dropout", &O::dropout, "a number in [0, 1)")
      .def_readwrite("causal", &O::causal, "True or False")
      .def_readwrite("softcap", &O::softcap, "a number >= 0 (0 = off)")
      .def_readwrite("alibi", &O::alibi, "True or False")
      .def_readwrite("sinks", &O::sinks, "True or False")
      .def_property(
          "rotary",
          [](const O& o) { return o.rotary ? Rotary(std::pair(o.rotary->base, o.rotary->interleaved)) : Rotary(); },
          [](O& o, const Rotary& r) {
            o.rotary.reset();
            if (r) o.rotary = qkv::nn::RotaryEmbeddingOptions{.base = r->first, .interleaved = r->second, .inverse_frequencies = {}};
          },
          "None or (base, interleaved)")
      .def_property(
          "relative_position_bias",
          [](const O& o) {
            return o.relative_position_bias ? RelativeBias(std::tuple(o.relative_position_bias->num_buckets,
                                                                      o.relative_position_bias->max_distance,
                                                                      o.relative_position_bias->bidirectional))
                                            : RelativeBias();
          },
          [](O& o, const RelativeBias& r) {
            o.relative_position_bias.reset();
            if (r) o.relative_position_bias = qkv::nn::RelativePositionBiasOptions{std::get<0>(*r), std::get<1>(*r), std::get<2>(*r)};
          },
          "None or (num_buckets, max_distance, bidirectional): a learned T5 relative-position bias")
      .def_readwrite("seed", &O::seed, "None or an integer in [0, 2**64)")
      .def_property(
          "attention", [](const O& o) { return o.attention == qkv::nn::AttentionKind::Linear ? "linear" : "softmax"; },
          [](O& o, const std::string& name) { o.attention = attention_kind_from_string(name); },
          "'softmax' or 'linear'")
      .def_property(
          "feature_map", [](const O& o) { return std::string(qkv::to_string(o.feature_map)); },
          [](O& o, const std::string& name) { o.feature_map = qkv::feature_map_from_string(name); },
          "'elu+1' or 'relu'")
      .def_property(
          "precision", [](const O& o) { return std::string(qkv::to_string(o.precision)); },
          [](O& o, const std::string& name) { o.precision = qkv::matmul_precision_from_string(lowercase(name)); },
          "'highest', 'high' or 'medium'");
}

// Returns (output, weights or None). key and value None: self-attention, forward(query) (one
// fused projection; backward_self follows it). The GIL is released: the module's own lock makes
// concurrent calls safe in every mode (include/qkv/nn.hpp).
py::tuple mha_forward(const qkv::nn::MultiHeadAttention& mha, const FloatArray& query,
                      const std::optional<FloatArray>& key, const std::optional<FloatArray>& value,
                      const qkv::Mask& mask, qkv::nn::Weights weights) {
  if (key.has_value() != value.has_value())
    throw qkv::Error("MultiHeadAttention: give both key and value, or neither (self-attention)");
  const qkv::Tensor qt = to_tensor(query);
  const qkv::Tensor kt = key ? to_tensor(*key) : qkv::Tensor(), vt = value ? to_tensor(*value) : qkv::Tensor();
  qkv::nn::MultiHeadAttentionOutput out;
  {
    py::gil_scoped_release release;
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

// The module's parameters, read without the GIL. Every call that takes the module's lock lets
// go of the GIL first: a thread holding the lock may need the GIL (to drop the last reference to
// a numpy input the module kept for backward), so no thread may wait for the lock holding it.
std::vector<qkv::nn::NamedTensor> parameters_of(const qkv::nn::MultiHeadAttention& mha) {
  py::gil_scoped_release release;
  return mha.parameters();
}

// [(name, array)] in the module's order; each array is a writable view of the parameter.
py::list mha_parameters(const qkv::nn::MultiHeadAttention& mha) {
  py::list params;
  for (const auto& p : parameters_of(mha)) params.append(py::make_tuple(p.name, to_numpy(p.tensor)));
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
  for (const auto& p : parameters_of(mha)) grads.append(py::make_tuple(p.name, to_numpy(p.grad)));
  return grads;
}

void mha_load_state_dict(qkv::nn::MultiHeadAttention& mha, const std::map<std::string, FloatArray>& state) {
  std::map<std::string, qkv::Tensor> tensors;
  for (const auto& [name, array] : state) tensors[name] = to_tensor(array);
  py::gil_scoped_release release;  // see parameters_of
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
  py::register_exception<ArrayError>(m, "ArrayError", error.ptr());
  bind_models(m);  // the real models: models_bindings.cpp
  bind_analysis(m);  // entropy of weights: analysis_bindings.cpp
  bind_rotary_tables(m);  // rotary from tables: rotary_bindings.cpp

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
  Mask.expression("doc(q) == doc(k)", {"doc": ids})  a mask function (docs/flex.md); inputs (L,) or (B, L)
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
      .def_static(
          "expression",
          [](const std::string& text, const py::object& inputs) { return qkv::Mask::expression(text, mod_inputs_from(inputs)); },
          py::arg("text"), py::arg("inputs") = py::none())
      .def_static("parse", &parse_mask, py::arg("expression"))
      .def("__str__", &qkv::Mask::str)
      .def("is_none", &qkv::Mask::is_none)
      .def("__repr__", [](const qkv::Mask& mask) { return "Mask(" + mask.str() + ")"; });

  bind_attention_options(m);
  m.def("attention", &attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("options"),
        "qkv::scaled_dot_product_attention: returns (output, weights or None, lse, row_max, row_sum).");
  m.def("attention_backward", &attention_backward, py::arg("grad_output"), py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("output"), py::arg("lse"), py::arg("row_max"), py::arg("row_sum"), py::arg("options"),
        "qkv::scaled_dot_product_attention_backward: returns (dq, dk, dv, dsinks or None, dbias or None).");
  m.def("linear_attention", &linear_attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("feature_map"),
        py::arg("causal"), py::arg("eps"), py::arg("causal_offset"), "qkv::linear_attention.");
  m.def("linear_attention_backward", &linear_attention_backward, py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("grad_output"), py::arg("feature_map"), py::arg("causal"), py::arg("eps"), py::arg("causal_offset"),
        "qkv::linear_attention_backward: returns (dq, dk, dv).");
  m.def("attention_half_kv", &attention_half_kv, py::arg("q"), py::arg("k_bits"), py::arg("v_bits"),
        py::arg("dtype"), py::arg("options"),
        "qkv::scaled_dot_product_attention with K and V given as bf16 or f16 bits: returns (output, lse).");
  m.def("cascade_attention", &cascade_attention, py::arg("q"), py::arg("prefix_k"), py::arg("prefix_v"),
        py::arg("prefix_dtype"), py::arg("suffix_k"), py::arg("suffix_v"), py::arg("suffix_dtype"),
        py::arg("options"), "qkv::cascade_attention: shared-prefix attention, returns (output, lse).");
  m.def("attention_quantized_kv", &attention_quantized_kv, py::arg("q"), py::arg("k_values"), py::arg("k_scales"),
        py::arg("v_values"), py::arg("v_scales"), py::arg("dtype"), py::arg("options"),
        "qkv::scaled_dot_product_attention with K and V quantized (int8 / int4 bytes and scales): (output, lse).");
  m.def("quantize_kv",
        [](const FloatArray& x, const std::string& dtype) {
          return quantized_to_numpy(qkv::quantize_kv(to_tensor(x), qkv::dtype_from_string(dtype)));
        },
        py::arg("x"), py::arg("dtype"), "qkv::quantize_kv: (packed bytes uint8, scales float32).");
  m.def("dequantize_kv",
        [](const BytesArray& values, const FloatArray& scales, const std::string& dtype) {
          return to_numpy(qkv::dequantize_kv({bytes_tensor(values, qkv::dtype_from_string(dtype)), to_tensor(scales)}));
        },
        py::arg("values"), py::arg("scales"), py::arg("dtype"), "qkv::dequantize_kv: float32.");
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

  bind_module_options(m);
  py::class_<qkv::nn::MultiHeadAttention>(m, "MultiHeadAttentionCore")
      .def(py::init([](int64_t embed_dim, int64_t num_heads, const qkv::nn::MultiHeadAttentionOptions& options) {
             return qkv::nn::MultiHeadAttention(embed_dim, num_heads, options);
           }),
           py::arg("embed_dim"), py::arg("num_heads"), py::arg("options"))
      .def_property_readonly("options", &qkv::nn::MultiHeadAttention::options, "its options, defaults filled in")
      .def("forward", &mha_forward, py::arg("query"), py::arg("key"), py::arg("value"), py::arg("mask"),
           py::arg("weights"))
      .def("parameters", &mha_parameters)
      .def("backward", &mha_backward, py::arg("grad_output"))
      .def("backward_self", &mha_backward_self, py::arg("grad_output"))
      .def("gradients", &mha_gradients)
      .def("zero_grad", &qkv::nn::MultiHeadAttention::zero_grad, py::call_guard<py::gil_scoped_release>())
      .def("load_state_dict", &mha_load_state_dict, py::arg("state"))
      .def("train", &qkv::nn::MultiHeadAttention::train, py::arg("training") = true,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("training", [](const qkv::nn::MultiHeadAttention& m) {
        py::gil_scoped_release release;  // see parameters_of
        return m.is_training();
      })
      .def_property_readonly("embed_dim", &qkv::nn::MultiHeadAttention::embed_dim)
      .def_property_readonly("num_heads", &qkv::nn::MultiHeadAttention::num_heads)
      .def_property_readonly("num_kv_heads", &qkv::nn::MultiHeadAttention::num_kv_heads)
      .def_property_readonly("head_dim", &qkv::nn::MultiHeadAttention::head_dim)
      .def_property_readonly("parameter_count", [](const qkv::nn::MultiHeadAttention& m) {
        py::gil_scoped_release release;  // see parameters_of
        return m.parameter_count();
      })
      .def("make_cache",
           [](const qkv::nn::MultiHeadAttention& m, int64_t batch, int64_t capacity, const std::string& dtype,
              int64_t window, int64_t page_size) {
             return m.make_cache(batch, capacity, qkv::dtype_from_string(dtype), window, page_size);
           },
           py::arg("batch"), py::arg("capacity"), py::arg("dtype") = "f32", py::arg("window") = 0,
           py::arg("page_size") = 0)
      .def("forward_cached",
           [](const qkv::nn::MultiHeadAttention& m, const FloatArray& x, qkv::nn::KVCache& cache,
              const std::vector<int64_t>& counts) {
             const qkv::Tensor xt = to_tensor(x);
             // A paged cache keeps the GIL, as forward_paged does: its pool (cache.paged, reachable
             // from Python) has no lock of its own.
             if (cache.paged()) return to_numpy(m.forward(xt, cache, counts).output);
             qkv::Tensor out;
             {
               py::gil_scoped_release release;
               out = m.forward(xt, cache, counts).output;
             }
             return to_numpy(out);
           },
           py::arg("x"), py::arg("cache"), py::arg("counts") = std::vector<int64_t>())
      .def("forward_packed",
           [](const qkv::nn::MultiHeadAttention& m, const FloatArray& x, const std::vector<int64_t>& cu_seqlens,
              const qkv::Mask& mask) {
             const qkv::Tensor xt = to_tensor(x);
             qkv::Tensor out;
             {
               py::gil_scoped_release release;
               out = m.forward_packed(xt, cu_seqlens, mask).output;
             }
             return to_numpy(out);
           },
           py::arg("x"), py::arg("cu_seqlens"), py::arg("mask"))
      .def("forward_paged",
           // The GIL stays held: a PagedKVCache has no lock of its own (its doc: one thread at a time).
           [](const qkv::nn::MultiHeadAttention& m, const FloatArray& x, qkv::nn::PagedKVCache& cache,
              const std::vector<int64_t>& sequences) { return to_numpy(m.forward(to_tensor(x), cache, sequences).output); },
           py::arg("x"), py::arg("cache"), py::arg("sequences"));

  // ---- inference (include/qkv/inference.hpp)
  py::class_<qkv::nn::KVCache>(m, "KVCache", R"doc(
One attention layer's keys and values, (batch, kv_heads, capacity, head_dim) each, allocated once
in dtype "f32", "bf16", "f16", "int8" or "int4" (quantized on append, qkv.quantize_kv's format);
window > 0 makes it a ring buffer of window slots; page_size > 0 keeps them in a PagedKVCache pool
of batch x ceil(capacity / page_size) pages instead (paged, its sequences).
)doc")
      .def(py::init([](int64_t batch, int64_t kv_heads, int64_t capacity, int64_t head_dim, const std::string& dtype,
                       int64_t window, int64_t page_size) {
             return qkv::nn::KVCache(batch, kv_heads, capacity, head_dim, qkv::dtype_from_string(dtype), window,
                                     page_size);
           }),
           py::arg("batch"), py::arg("kv_heads"), py::arg("capacity"), py::arg("head_dim"), py::arg("dtype") = "f32",
           py::arg("window") = 0, py::arg("page_size") = 0)
      .def_property_readonly("page_size", &qkv::nn::KVCache::page_size)
      // The pool itself (None when contiguous), alive as long as this cache.
      .def_property_readonly("paged", &qkv::nn::KVCache::paged, py::return_value_policy::reference_internal)
      .def_property_readonly("sequences", &qkv::nn::KVCache::sequences)
      .def_property_readonly("length", [](const qkv::nn::KVCache& c) { return c.length(); })
      .def_property_readonly("lengths", &qkv::nn::KVCache::lengths)
      .def_property_readonly("capacity", &qkv::nn::KVCache::capacity)
      .def_property_readonly("window", &qkv::nn::KVCache::window)
      .def_property_readonly("dtype", [](const qkv::nn::KVCache& c) { return std::string(qkv::to_string(c.dtype())); })
      .def("reset", &qkv::nn::KVCache::reset)
      .def("keys",
           [](const qkv::nn::KVCache& c) {
             const int64_t n = c.capacity();
             return to_numpy(is_quantized(c.dtype()) ? qkv::dequantize_kv({c.keys(n), c.key_scales(n)})
                                                     : c.keys(n).to(qkv::DType::F32));
           },
           "The whole key storage as float32 (a copy; dequantised when int8 / int4).")
      .def("values",
           [](const qkv::nn::KVCache& c) {
             const int64_t n = c.capacity();
             return to_numpy(is_quantized(c.dtype()) ? qkv::dequantize_kv({c.values(n), c.value_scales(n)})
                                                     : c.values(n).to(qkv::DType::F32));
           },
           "The whole value storage as float32 (a copy; dequantised when int8 / int4).");

  using Paged = qkv::nn::PagedKVCache;
  py::class_<Paged>(m, "PagedKVCache", R"doc(
Keys and values of many sequences in one pool of pages (num_pages, page_size, kv_heads, head_dim)
stored in dtype "f32", "bf16", "f16", "int8" or "int4", each sequence a list of pages
(include/qkv/paged_cache.hpp): append takes free pages as a sequence grows, fork shares a
sequence's pages (reference counts), and an append into a shared page copies it first.
key_pool / value_pool are the pools (views when f32; float32 copies of 16-bit pools, dequantised
copies of "int8" / "int4" pools, whose rows are quantized on append), and
paged_options(sequences) the (block_table, cache_seqlens) int32 arrays scaled_dot_product_attention
takes with them; MultiHeadAttention.forward(x, cache=, sequences=) appends and attends in place.
Not safe to call from several threads at once.
)doc")
      .def(py::init([](int64_t num_pages, int64_t page_size, int64_t kv_heads, int64_t head_dim,
                       const std::string& dtype) {
             return Paged(num_pages, page_size, kv_heads, head_dim, qkv::dtype_from_string(dtype));
           }),
           py::arg("num_pages"), py::arg("page_size"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("dtype") = "f32")
      .def_property_readonly("dtype", [](const Paged& c) { return std::string(qkv::to_string(c.key_pool().dtype())); })
      .def("add_sequence", &Paged::add_sequence, "A new empty sequence; returns its id.")
      .def("fork", &Paged::fork, py::arg("parent"), "A new sequence sharing parent's pages; returns its id.")
      .def("release", &Paged::release, py::arg("sequence"), "Ends a sequence; pages no sequence holds are freed.")
      .def("append",
           [](Paged& c, int64_t sequence, const FloatArray& k, const FloatArray& v) {
             c.append(sequence, to_tensor(k), to_tensor(v));
           },
           py::arg("sequence"), py::arg("k"), py::arg("v"), "k, v (kv_heads, N, head_dim) float32 at the sequence's end.")
      .def("length", &Paged::length, py::arg("sequence"))
      .def("pages", &Paged::pages, py::arg("sequence"))
      .def("references", &Paged::references, py::arg("page"))
      .def_property_readonly("free_pages", &Paged::free_pages)
      .def_property_readonly("page_size", &Paged::page_size)
      .def_property_readonly("key_pool", [](const Paged& c) { return to_numpy(pool_as_f32(c.key_pool(), c.key_scale_pool())); })
      .def_property_readonly("value_pool",
                             [](const Paged& c) { return to_numpy(pool_as_f32(c.value_pool(), c.value_scale_pool())); })
      .def("paged_options",
           [](const Paged& c, const std::vector<int64_t>& sequences) {
             qkv::AttentionOptions o;
             c.set_paged_options(sequences, o);
             py::array_t<int32_t> table({static_cast<py::ssize_t>(sequences.size()),
                                         static_cast<py::ssize_t>(o.block_table.size() / std::max<size_t>(1, sequences.size()))});
             py::array_t<int32_t> lengths(static_cast<py::ssize_t>(sequences.size()));
             std::copy(o.block_table.begin(), o.block_table.end(), table.mutable_data());
             std::copy(o.cache_seqlens.begin(), o.cache_seqlens.end(), lengths.mutable_data());
             return py::make_tuple(table, lengths);
           },
           py::arg("sequences"), "(block_table (B, max_pages), cache_seqlens (B,)) int32 for these sequences.");

  py::class_<qkv::nn::RotaryEmbedding>(m, "RotaryEmbedding", R"doc(
Rotary position embedding: pair i of a head vector at position p rotated by p * base^(-2i/D);
half-split pairs (x_i, x_{i+D/2}) by default (GPT-NeoX, LLaMA), adjacent pairs with interleaved.
)doc")
      .def(py::init([](int64_t head_dim, double base, bool interleaved) {
             return qkv::nn::RotaryEmbedding(head_dim, {.base = base, .interleaved = interleaved, .inverse_frequencies = {}});
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
