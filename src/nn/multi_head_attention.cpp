// qkv::nn::MultiHeadAttention: project, split into heads, attend (through the functional core),
// concatenate, project. Laid out and initialised as torch.nn.MultiheadAttention. Forward keeps the
// split projections and the core's result (output, lse); backward walks the five steps in reverse.
#include <algorithm>
#include <cmath>
#include <set>

#include "grad.hpp"
#include "qkv/nn.hpp"
#include "random.hpp"

namespace qkv::nn {

namespace {

constexpr const char* kWho = "MultiHeadAttention: ";

// Checks the constructor's arguments and fills in the defaults (0 = "same as embed_dim").
MultiHeadAttentionOptions resolved(int64_t embed_dim, int64_t num_heads, MultiHeadAttentionOptions o) {
  if (embed_dim < 1 || num_heads < 1)
    throw Error(std::string(kWho) + "embed_dim (" + std::to_string(embed_dim) + ") and num_heads (" +
                std::to_string(num_heads) + ") must be at least 1");
  if (embed_dim % num_heads != 0)
    throw Error(std::string(kWho) + "embed_dim (" + std::to_string(embed_dim) + ") must be divisible by num_heads (" +
                std::to_string(num_heads) + ")");
  if (o.num_kv_heads < 0 || o.kdim < 0 || o.vdim < 0)
    throw Error(std::string(kWho) + "num_kv_heads (" + std::to_string(o.num_kv_heads) + "), kdim (" +
                std::to_string(o.kdim) + ") and vdim (" + std::to_string(o.vdim) + ") must be >= 0");
  if (o.num_kv_heads == 0) o.num_kv_heads = num_heads;
  if (num_heads % o.num_kv_heads != 0)
    throw Error(std::string(kWho) + "num_heads (" + std::to_string(num_heads) + ") must be a multiple of num_kv_heads (" +
                std::to_string(o.num_kv_heads) + ")");
  if (o.kdim == 0) o.kdim = embed_dim;
  if (o.vdim == 0) o.vdim = embed_dim;
  if (!(o.dropout >= 0 && o.dropout < 1))
    throw Error(std::string(kWho) + "dropout must be in [0, 1), got " + std::to_string(o.dropout));
  if (!o.seed) o.seed = detail::next_seed();
  return o;
}

// A distinct, reproducible seed for each of the module's random streams (weights of the four
// projections, their biases, dropout): the module's seed mixed with the stream's number.
uint64_t stream_seed(std::optional<uint64_t> seed, uint64_t stream) { return detail::mix64(*seed * 8 + stream); }

// torch.nn.MultiheadAttention's start: xavier-uniform q/k/v weights (over the fused (3E, E)
// in_proj_weight when the three are the same shape, else each on its own), zero biases; the
// out projection keeps Linear's default weight but a zero bias.
void initialise(MultiHeadAttention& m) {
  const auto& o = m.options();
  const bool fused = o.kdim == m.embed_dim() && o.vdim == m.embed_dim() && o.num_kv_heads == m.num_heads();
  auto xavier = [&](Linear& proj, uint64_t stream) {
    const double fan_out = fused ? 3.0 * m.embed_dim() : static_cast<double>(proj.out_features());
    const auto bound = static_cast<float>(std::sqrt(6.0 / (proj.in_features() + fan_out)));
    proj.weight = Tensor::uniform(proj.weight.shape(), -bound, bound, stream_seed(o.seed, stream));
  };
  xavier(m.q_proj, 0);
  xavier(m.k_proj, 1);
  xavier(m.v_proj, 2);
  for (Linear* proj : {&m.q_proj, &m.k_proj, &m.v_proj, &m.out_proj})
    if (proj->bias.defined()) proj->bias = Tensor::zeros(proj->bias.shape());
}

std::string shape_of(const Tensor& t) { return t.defined() ? t.shape().str() : "undefined"; }

}  // namespace

MultiHeadAttention::MultiHeadAttention(int64_t embed_dim, int64_t num_heads, const MultiHeadAttentionOptions& options)
    : MultiHeadAttention(embed_dim, num_heads, resolved(embed_dim, num_heads, options), Checked{}) {}

MultiHeadAttention::MultiHeadAttention(int64_t embed_dim, int64_t num_heads, const MultiHeadAttentionOptions& o, Checked)
    : q_proj(embed_dim, embed_dim, o.bias, stream_seed(o.seed, 3)),
      k_proj(o.kdim, o.num_kv_heads * (embed_dim / num_heads), o.bias, stream_seed(o.seed, 4)),
      v_proj(o.vdim, o.num_kv_heads * (embed_dim / num_heads), o.bias, stream_seed(o.seed, 5)),
      out_proj(embed_dim, embed_dim, o.bias, stream_seed(o.seed, 6)),
      embed_dim_(embed_dim),
      num_heads_(num_heads),
      num_kv_heads_(o.num_kv_heads),
      options_(o) {
  initialise(*this);
}

MultiHeadAttentionOutput MultiHeadAttention::forward(const Tensor& x, const Mask& mask, Weights weights) const {
  MultiHeadAttentionOutput out = forward(x, x, x, mask, weights);
  if (training_) saved_.self_attention = true;
  return out;
}

MultiHeadAttentionOutput MultiHeadAttention::forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                                     const Mask& mask, Weights weights) const {
  // ---- check: batch-first (B, N, features) or unbatched (N, features), all three alike
  auto check_features = [&](const Tensor& t, const char* name, const char* dim_name, int64_t expected) {
    if (!t.defined() || t.dim() < 2 || t.dim() > 3 || t.size(-1) != expected)
      throw Error(std::string(kWho) + name + " is " + shape_of(t) + " but " + dim_name + " is " +
                  std::to_string(expected) + (t.defined() && (t.dim() < 2 || t.dim() > 3)
                                                  ? " (expected (B, N, features) or (N, features))" : ""));
  };
  check_features(query, "query", "embed_dim", embed_dim_);
  check_features(key, "key", "kdim", options_.kdim);
  check_features(value, "value", "vdim", options_.vdim);
  if (key.dim() != query.dim() || value.dim() != query.dim())
    throw Error(std::string(kWho) + "query is " + shape_of(query) + ", key is " + shape_of(key) + ", value is " +
                shape_of(value) + ": all batched (B, N, features) or all unbatched (N, features)");
  if (key.size(-2) != value.size(-2) || (query.dim() == 3 && (key.size(0) != query.size(0) || value.size(0) != query.size(0))))
    throw Error(std::string(kWho) + "query is " + shape_of(query) + ", key is " + shape_of(key) + ", value is " +
                shape_of(value) + ": batch sizes or key/value lengths differ");

  const bool unbatched = query.dim() == 2;
  const Tensor q_in = unbatched ? query.unsqueeze(0) : query;
  const Tensor k_in = unbatched ? key.unsqueeze(0) : key;
  const Tensor v_in = unbatched ? value.unsqueeze(0) : value;
  const int64_t batch = q_in.size(0), q_len = q_in.size(1), kv_len = k_in.size(1), hd = head_dim();

  // Training keeps what backward needs; eval() keeps nothing, so concurrent inference on one
  // module only reads it (include/qkv/nn.hpp).
  const bool remember = training_;
  auto project = [remember](const Linear& proj, const Tensor& in) { return remember ? proj.forward(in) : proj.apply(in); };

  // ---- 1. project, 2. split into heads: (B, N, H * hd) -> (B, H, N, hd), views
  const Tensor q = project(q_proj, q_in).reshape({batch, q_len, num_heads_, hd}).transpose(1, 2);
  const Tensor k = project(k_proj, k_in).reshape({batch, kv_len, num_kv_heads_, hd}).transpose(1, 2);
  const Tensor v = project(v_proj, v_in).reshape({batch, kv_len, num_kv_heads_, hd}).transpose(1, 2);

  // ---- 3. attend, through the one functional core
  AttentionOptions attention;
  attention.mask = options_.causal ? mask & Mask::causal() : mask;
  attention.need_weights = weights != Weights::None;
  if (training_ && options_.dropout > 0) {
    attention.dropout_p = options_.dropout;
    attention.seed = stream_seed(options_.seed, 7) + dropout_calls_++;
  }
  AttentionResult attended = scaled_dot_product_attention(q, k, v, attention);
  if (remember)
    saved_ = {.valid = true, .self_attention = false, .unbatched = unbatched, .q = q, .k = k, .v = v,
              .attended = attended, .attention = attention};

  // ---- 4. concatenate heads: (B, H, Nq, hd) -> (B, Nq, E), 5. output projection
  Tensor concatenated = attended.output.transpose(1, 2).reshape({batch, q_len, embed_dim_});
  MultiHeadAttentionOutput result;
  result.output = project(out_proj, concatenated);

  if (weights == Weights::Averaged) {
    Tensor mean = Tensor::zeros({batch, q_len, kv_len});
    const float* per_head = attended.weights.data();
    float* out = mean.data();
    const int64_t plane = q_len * kv_len;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t h = 0; h < num_heads_; ++h)
        for (int64_t e = 0; e < plane; ++e) out[b * plane + e] += per_head[(b * num_heads_ + h) * plane + e];
    for (int64_t e = 0; e < mean.numel(); ++e) out[e] /= static_cast<float>(num_heads_);
    result.weights = mean;
  } else if (weights == Weights::PerHead) {
    result.weights = attended.weights;
  }
  if (unbatched) {
    result.output = result.output.squeeze(0);
    if (result.weights.defined()) result.weights = result.weights.squeeze(0);
  }
  return result;
}

MultiHeadAttentionGrads MultiHeadAttention::backward_cross(const Tensor& grad_output) {
  if (!saved_.valid)
    throw Error(std::string(kWho) + "backward: no forward to differentiate (call forward first, in train() mode: "
                "eval() forwards keep nothing)");
  const Saved& s = saved_;
  const int64_t batch = s.q.size(0), q_len = s.q.size(2), kv_len = s.k.size(2), hd = head_dim();
  const Shape expected = s.unbatched ? Shape{q_len, embed_dim_} : Shape{batch, q_len, embed_dim_};
  if (!grad_output.defined() || grad_output.shape() != expected)
    throw Error(std::string(kWho) + "backward: grad_output is " + shape_of(grad_output) +
                " but the forward's output was " + expected.str());
  const Tensor g = s.unbatched ? grad_output.unsqueeze(0) : grad_output;

  // ---- 5. output = out_proj(concatenated)
  const Tensor d_concatenated = out_proj.backward(g);
  // ---- 4. concatenated = attended.output.transpose(1, 2).reshape({B, Nq, E})
  const Tensor d_attended = d_concatenated.reshape({batch, q_len, num_heads_, hd}).transpose(1, 2).contiguous();
  // ---- 3. attended = scaled_dot_product_attention(q, k, v, attention)
  const AttentionGrads d = scaled_dot_product_attention_backward(d_attended, s.q, s.k, s.v, s.attended, s.attention);
  // ---- 2. q = q_proj(q_in).reshape({B, N, H, hd}).transpose(1, 2), and k, v alike
  // ---- 1. the projections
  MultiHeadAttentionGrads grads;
  grads.query = q_proj.backward(d.dq.transpose(1, 2).reshape({batch, q_len, embed_dim_}));
  grads.key = k_proj.backward(d.dk.transpose(1, 2).reshape({batch, kv_len, num_kv_heads_ * hd}));
  grads.value = v_proj.backward(d.dv.transpose(1, 2).reshape({batch, kv_len, num_kv_heads_ * hd}));
  if (s.unbatched) {
    grads.query = grads.query.squeeze(0);
    grads.key = grads.key.squeeze(0);
    grads.value = grads.value.squeeze(0);
  }
  return grads;
}

Tensor MultiHeadAttention::backward(const Tensor& grad_output) {
  if (saved_.valid && !saved_.self_attention)
    throw Error(std::string(kWho) + "backward() follows forward(x) (self-attention); the last forward was "
                "forward(query, key, value): use backward_cross()");
  MultiHeadAttentionGrads grads = backward_cross(grad_output);
  // x fed all three projections: its gradient is the sum of the three paths.
  float* dx = grads.query.data();
  const float* dk = grads.key.data();
  const float* dv = grads.value.data();
  const int64_t count = grads.query.numel();
  for (int64_t e = 0; e < count; ++e) dx[e] += dk[e] + dv[e];
  return grads.query;
}

void MultiHeadAttention::zero_grad() {
  for (Linear* proj : {&q_proj, &k_proj, &v_proj, &out_proj}) proj->zero_grad();
}

std::vector<NamedTensor> MultiHeadAttention::parameters() const {
  std::vector<NamedTensor> params;
  for (auto [name, proj] : {std::pair{"q_proj.", &q_proj}, {"k_proj.", &k_proj}, {"v_proj.", &v_proj},
                            {"out_proj.", &out_proj}}) {
    auto p = proj->parameters(name);
    params.insert(params.end(), p.begin(), p.end());
  }
  return params;
}

int64_t MultiHeadAttention::parameter_count() const {
  int64_t count = 0;
  for (const auto& p : parameters()) count += p.tensor.numel();
  return count;
}

void MultiHeadAttention::load_state_dict(const std::map<std::string, Tensor>& state) {
  const std::string who = "MultiHeadAttention::load_state_dict: ";
  std::map<std::string, Tensor> targets;
  for (const auto& p : parameters()) targets[p.name] = p.tensor;

  // Translate PyTorch's names into ours; the fused in_proj tensors split by rows into q, k, v.
  std::map<std::string, Tensor> sources;
  auto rows = [](const Tensor& t, int64_t first, int64_t count) {
    const int64_t width = t.numel() / t.size(0);
    const std::vector<float> all = t.to_vector();
    std::vector<int64_t> dims(t.shape().begin(), t.shape().end());
    dims[0] = count;
    return Tensor::from({all.begin() + first * width, all.begin() + (first + count) * width}, Shape(dims));
  };
  for (const auto& [name, tensor] : state) {
    if (!tensor.defined()) throw Error(who + name + " is undefined");
    if (name == "in_proj_weight" || name == "in_proj_bias") {
      // PyTorch packs the three biases (3E) always, the three weights (3E, E) only when
      // kdim = vdim = embed_dim; both need every projection to have E outputs (no GQA).
      const bool is_weight = name == "in_proj_weight";
      const int64_t third = embed_dim_;
      const Shape packed = is_weight ? Shape{3 * third, third} : Shape{3 * third};
      if (num_kv_heads_ != num_heads_ || (is_weight && (options_.kdim != embed_dim_ || options_.vdim != embed_dim_)))
        throw Error(who + name + " packs q, k and v, which needs " +
                    (is_weight ? "kdim = vdim = embed_dim and " : "") +
                    "num_kv_heads = num_heads; give the q_proj, k_proj and v_proj tensors one by one");
      if (tensor.shape() != packed)
        throw Error(who + name + " is " + tensor.shape().str() + " but should be " + packed.str() +
                    " (q, k and v stacked)");
      const std::string suffix = is_weight ? ".weight" : ".bias";
      sources["q_proj" + suffix] = rows(tensor, 0, third);
      sources["k_proj" + suffix] = rows(tensor, third, third);
      sources["v_proj" + suffix] = rows(tensor, 2 * third, third);
    } else if (name == "q_proj_weight" || name == "k_proj_weight" || name == "v_proj_weight") {
      sources[name.substr(0, 6) + ".weight"] = tensor;
    } else if (targets.count(name)) {
      sources[name] = tensor;
    } else {
      throw Error(who + "unknown parameter '" + name + "'");
    }
  }
  // Check everything before writing anything, so a failed load leaves the module unchanged.
  for (const auto& [name, target] : targets) {
    auto found = sources.find(name);
    if (found == sources.end()) throw Error(who + "missing " + name);
    if (found->second.shape() != target.shape())
      throw Error(who + name + " is " + target.shape().str() + " but the state gives " + found->second.shape().str());
  }
  for (const auto& [name, target] : targets) {
    const std::vector<float> values = sources[name].to_vector();
    std::copy(values.begin(), values.end(), target.data());
  }
}

}  // namespace qkv::nn
