// qkv._core's real models (include/qkv/models/): a Hugging Face folder loaded whole
// (load_pretrained), its tokenizer, forward, generate and head roles, and write_safetensors.
// Thin, as bindings.cpp is: argument checks and Python conventions live in python/qkv/models.py;
// this file converts, releases the GIL around the C++ work and hands arrays back.
//
// Text crosses as UTF-8: str in, bytes out (a byte-level tokenizer may decode a lone token to
// part of a UTF-8 character; models.py decodes with errors="replace").
#include "models_bindings.hpp"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <qkv/dtype.hpp>
#include <qkv/error.hpp>
#include <qkv/models/head_roles.hpp>
#include <qkv/models/pretrained.hpp>
#include <qkv/models/safetensors.hpp>
#include <qkv/tensor.hpp>

namespace py = pybind11;

namespace {

using qkv::models::Architecture;

// A float32 copy-free numpy view of a Tensor (converted to float32 first if it is not), the
// array keeping the Tensor's storage alive; None for an undefined tensor.
py::object tensor_to_numpy(const qkv::Tensor& tensor) {
  if (!tensor.defined()) return py::none();
  const qkv::Tensor f32 =
      tensor.dtype() == qkv::DType::F32 ? tensor.contiguous() : tensor.to(qkv::DType::F32).contiguous();
  auto* owner = new qkv::Tensor(f32);
  py::capsule keep_alive(owner, [](void* p) { delete static_cast<qkv::Tensor*>(p); });
  std::vector<py::ssize_t> shape(owner->shape().begin(), owner->shape().end());
  return py::array_t<float>(shape, owner->numel() > 0 ? owner->data() : nullptr, keep_alive);
}

std::string activation_name(qkv::models::Activation activation) {
  switch (activation) {
    case qkv::models::Activation::GeluTanh: return "gelu_tanh";
    case qkv::models::Activation::GeluErf: return "gelu";
    case qkv::models::Activation::Silu: return "silu";
    case qkv::models::Activation::Relu: return "relu";
  }
  return "?";
}

py::dict config_dict(const qkv::models::ModelConfig& c) {
  py::dict d;
  d["architecture"] = std::string(qkv::models::to_string(c.architecture));
  d["vocab_size"] = c.vocab_size;
  d["hidden_size"] = c.hidden_size;
  d["num_layers"] = c.num_layers;
  d["num_heads"] = c.num_heads;
  d["num_kv_heads"] = c.num_kv_heads;
  d["head_dim"] = c.head_dim;
  d["intermediate_size"] = c.intermediate_size;
  d["max_positions"] = c.max_positions;
  d["type_vocab_size"] = c.type_vocab_size;
  d["norm_eps"] = c.norm_eps;
  d["activation"] = activation_name(c.activation);
  d["rope_theta"] = c.is_llama_family() ? py::object(py::float_(c.rope_theta)) : py::object(py::none());
  d["sliding_window"] = c.sliding_window;
  d["sliding_window_from_layer"] = c.sliding_window_from_layer;
  d["tie_word_embeddings"] = c.tie_word_embeddings;
  d["attention_bias"] = c.attention_bias;
  d["eos_token_ids"] = c.eos_token_ids;
  d["bos_token_id"] = c.bos_token_id < 0 ? py::object(py::none()) : py::object(py::int_(c.bos_token_id));
  d["is_causal"] = c.is_causal();
  d["has_lm_head"] = c.has_lm_head();
  return d;
}

// One loaded folder. Model's methods are const and keep no state between calls, so calls from
// several Python threads may run at once.
struct LoadedModel {
  std::unique_ptr<qkv::models::Pretrained> pretrained;

  const qkv::models::Tokenizer& tokenizer() const {
    if (!pretrained->tokenizer)
      throw qkv::Error("qkv.Model: " + pretrained->path.string() +
                       " was loaded without a tokenizer (tokenizer=False): pass token ids");
    return *pretrained->tokenizer;
  }
};

LoadedModel load(const std::string& path, const std::string& kv_dtype, bool tokenizer, int64_t page_size) {
  qkv::models::PretrainedOptions options;
  options.model.kv_dtype = qkv::dtype_from_string(kv_dtype);
  options.model.page_size = page_size;
  options.require_tokenizer = tokenizer;
  py::gil_scoped_release release;
  return LoadedModel{std::make_unique<qkv::models::Pretrained>(qkv::models::load_pretrained(path, options))};
}

py::dict special_tokens(const LoadedModel& m) {
  py::dict d;
  if (!m.pretrained->tokenizer) return d;
  const auto& s = m.pretrained->tokenizer->special_tokens();
  const std::pair<const char*, const std::optional<int64_t>*> roles[] = {
      {"bos", &s.bos}, {"eos", &s.eos}, {"unk", &s.unk}, {"pad", &s.pad},
      {"cls", &s.cls}, {"sep", &s.sep}, {"mask", &s.mask}};
  for (const auto& [name, id] : roles) d[name] = *id ? py::object(py::int_(**id)) : py::object(py::none());
  return d;
}

// (logits or None, hidden, [attention per layer]).
py::tuple forward(const LoadedModel& m, std::vector<std::vector<int64_t>> ids,
                  std::vector<std::vector<int64_t>> token_type_ids, bool need_attention) {
  qkv::models::ModelInput input{std::move(ids), std::move(token_type_ids)};
  qkv::models::ModelOutput output;
  {
    py::gil_scoped_release release;
    output = m.pretrained->model.forward(input, need_attention);
  }
  py::list attention;
  for (const qkv::Tensor& a : output.attention) attention.append(tensor_to_numpy(a));
  return py::make_tuple(tensor_to_numpy(output.logits), tensor_to_numpy(output.hidden), attention);
}

qkv::models::GenerationOptions generation_options(int64_t max_new_tokens, float temperature, int64_t top_k,
                                                  float top_p, uint64_t seed, bool stop_at_eos) {
  qkv::models::GenerationOptions options;
  options.max_new_tokens = max_new_tokens;
  options.temperature = temperature;
  options.top_k = top_k;
  options.top_p = top_p;
  options.seed = seed;
  options.stop_at_eos = stop_at_eos;
  return options;
}

py::dict result_dict(const qkv::models::GenerationResult& result) {
  py::dict d;
  d["tokens"] = result.tokens;
  d["stopped_at_eos"] = result.stopped_at_eos;
  d["prompt_tokens"] = result.prompt_tokens;
  d["prefill_seconds"] = result.prefill_seconds;
  d["decode_seconds"] = result.decode_seconds;
  d["prefill_tokens_per_second"] = result.prefill_tokens_per_second();
  d["decode_tokens_per_second"] = result.decode_tokens_per_second();
  return d;
}

// A C++ token callback calling on_token (a Python callable or None) with the GIL held; an
// exception it raises is kept in `raised` and stops the generation. None and true go on.
template <typename... Args>
std::function<bool(Args...)> python_callback(const py::object& on_token, std::exception_ptr& raised) {
  if (on_token.is_none()) return {};
  return [&on_token, &raised](Args... args) {
    py::gil_scoped_acquire gil;
    try {
      const py::object answer = on_token(args...);
      return answer.is_none() || answer.cast<bool>();
    } catch (...) {
      raised = std::current_exception();
      return false;
    }
  };
}

// generate with on_token(token), the GIL released meanwhile; on_token's exception raised again here.
py::dict generate(const LoadedModel& m, const std::vector<int64_t>& prompt, int64_t max_new_tokens, float temperature,
                  int64_t top_k, float top_p, uint64_t seed, bool stop_at_eos, const py::object& on_token) {
  const auto options = generation_options(max_new_tokens, temperature, top_k, top_p, seed, stop_at_eos);
  std::exception_ptr raised;
  const qkv::models::TokenCallback callback = python_callback<int64_t>(on_token, raised);
  qkv::models::GenerationResult result;
  {
    py::gil_scoped_release release;
    result = m.pretrained->model.generate(prompt, options, callback);
  }
  if (raised) std::rethrow_exception(raised);
  return result_dict(result);
}

// generate_batch with on_token(index, token): after an exception every sequence stops at its next
// token (those before it in that step have already gone on), and it is raised again here.
py::list generate_batch(const LoadedModel& m, const std::vector<std::vector<int64_t>>& prompts,
                        int64_t max_new_tokens, float temperature, int64_t top_k, float top_p, uint64_t seed,
                        bool stop_at_eos, const py::object& on_token) {
  const auto options = generation_options(max_new_tokens, temperature, top_k, top_p, seed, stop_at_eos);
  std::exception_ptr raised;
  const auto python = python_callback<int64_t, int64_t>(on_token, raised);
  qkv::models::BatchTokenCallback callback;
  if (python)
    callback = [&](int64_t index, int64_t token) { return !raised && python(index, token); };
  std::vector<qkv::models::GenerationResult> results;
  {
    py::gil_scoped_release release;
    results = m.pretrained->model.generate_batch(prompts, options, callback);
  }
  if (raised) std::rethrow_exception(raised);
  py::list out;
  for (const auto& result : results) out.append(result_dict(result));
  return out;
}

py::list head_roles(const LoadedModel& m, const std::vector<int64_t>& text_ids, const std::vector<int64_t>& prefix_ids,
                    const std::vector<int64_t>& candidate_ids, int64_t repeat_length, uint64_t seed) {
  std::vector<qkv::models::HeadRoleScores> scores;
  {
    py::gil_scoped_release release;
    scores = qkv::models::measure_head_roles(m.pretrained->model, text_ids, prefix_ids, candidate_ids,
                                             {.repeat_length = repeat_length, .seed = seed});
  }
  py::list out;
  for (const auto& s : scores) {
    py::dict d;
    d["layer"] = s.layer;
    d["head"] = s.head;
    py::dict score;
    score["previous-token"] = s.previous_token;
    score["first-token"] = s.first_token;
    score["self"] = s.self;
    score["induction"] = s.induction;
    score["broad"] = s.broad;
    d["scores"] = score;
    const std::string role(qkv::models::to_string(s.role));
    d["role"] = s.role == qkv::models::HeadRole::None ? py::object(py::none()) : py::object(py::str(role));
    out.append(d);
  }
  return out;
}

// The candidates of head_roles' repeated sequence: every id of the model's vocabulary that the
// tokenizer has and does not call special.
std::vector<int64_t> ordinary_ids(const LoadedModel& m) {
  const auto& tokenizer = m.tokenizer();
  const int64_t n = std::min(tokenizer.vocab_size(), m.pretrained->config.vocab_size);
  std::vector<int64_t> ids;
  for (int64_t id = 0; id < n; ++id)
    if (!tokenizer.is_special(id)) ids.push_back(id);
  return ids;
}

using ByteArray = py::array_t<uint8_t, py::array::c_style>;
// (name, safetensors dtype, shape, the bytes as a uint8 array).
using TensorEntry = std::tuple<std::string, std::string, std::vector<int64_t>, ByteArray>;

void write_safetensors(const std::string& path, const std::vector<TensorEntry>& tensors) {
  std::vector<qkv::models::SafetensorsTensor> views;
  for (const auto& [name, dtype, shape, bytes] : tensors)
    views.push_back({name, dtype, shape, std::span<const uint8_t>(bytes.data(), static_cast<size_t>(bytes.size()))});
  py::gil_scoped_release release;  // `tensors` holds the arrays, so their bytes stay put
  qkv::models::write_safetensors(path, views);
}

}  // namespace

void bind_models(py::module_& m) {
  py::class_<LoadedModel>(m, "ModelCore", "A Hugging Face model folder loaded by qkv::models::load_pretrained.")
      .def(py::init(&load), py::arg("path"), py::arg("kv_dtype") = "bf16", py::arg("tokenizer") = true,
           py::arg("page_size") = 64)
      .def_property_readonly("path", [](const LoadedModel& self) { return self.pretrained->path.string(); })
      .def_property_readonly("config", [](const LoadedModel& self) { return config_dict(self.pretrained->config); })
      .def_property_readonly("has_tokenizer", [](const LoadedModel& self) { return !!self.pretrained->tokenizer; })
      .def_property_readonly("tokenizer_vocab_size",
                             [](const LoadedModel& self) { return self.tokenizer().vocab_size(); })
      .def_property_readonly("special_tokens", &special_tokens)
      .def(
          "encode",
          [](const LoadedModel& self, const std::string& text, bool add_special_tokens) {
            const auto& tokenizer = self.tokenizer();
            py::gil_scoped_release release;
            return tokenizer.encode(text, add_special_tokens);
          },
          py::arg("text"), py::arg("add_special_tokens") = true)
      .def(
          "decode",
          [](const LoadedModel& self, const std::vector<int64_t>& ids, bool skip_special_tokens) {
            const auto& tokenizer = self.tokenizer();
            std::string text;
            {
              py::gil_scoped_release release;
              text = tokenizer.decode(ids, skip_special_tokens);
            }
            return py::bytes(text);
          },
          py::arg("ids"), py::arg("skip_special_tokens") = false)
      .def(
          "id_to_token",
          [](const LoadedModel& self, const std::vector<int64_t>& ids) {
            const auto& tokenizer = self.tokenizer();
            py::list out;
            for (const int64_t id : ids) out.append(py::bytes(tokenizer.id_to_token(id)));
            return out;
          },
          py::arg("ids"))
      .def(
          "token_to_id",
          [](const LoadedModel& self, const std::string& token) {
            const auto id = self.tokenizer().token_to_id(token);
            return id ? py::object(py::int_(*id)) : py::object(py::none());
          },
          py::arg("token"))
      .def(
          "is_special", [](const LoadedModel& self, int64_t id) { return self.tokenizer().is_special(id); },
          py::arg("id"))
      .def("forward", &forward, py::arg("ids"), py::arg("token_type_ids"), py::arg("need_attention"),
           "(logits or None, hidden, [attention per layer]) of a batch of sequences.")
      .def("generate", &generate, py::arg("prompt"), py::arg("max_new_tokens"), py::arg("temperature"),
           py::arg("top_k"), py::arg("top_p"), py::arg("seed"), py::arg("stop_at_eos"), py::arg("on_token"))
      .def("generate_batch", &generate_batch, py::arg("prompts"), py::arg("max_new_tokens"), py::arg("temperature"),
           py::arg("top_k"), py::arg("top_p"), py::arg("seed"), py::arg("stop_at_eos"), py::arg("on_token"))
      .def("head_roles", &head_roles, py::arg("text_ids"), py::arg("prefix_ids"), py::arg("candidate_ids"),
           py::arg("repeat_length"), py::arg("seed"))
      .def("ordinary_ids", &ordinary_ids,
           "Every id of the vocabulary the tokenizer does not call special (head_roles' candidates).");
  m.def("write_safetensors", &write_safetensors, py::arg("path"), py::arg("tensors"),
        "qkv::models::write_safetensors: tensors as (name, dtype, shape, bytes as a uint8 array).");
  m.def("is_model_folder", [](const std::string& path) { return qkv::models::is_model_folder(path); },
        py::arg("path"));
}
