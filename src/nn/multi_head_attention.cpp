// qkv::nn::MultiHeadAttention: project, split into heads, attend (through the functional core),
// concatenate, project. Laid out and initialised as torch.nn.MultiheadAttention. Forward keeps the
// split projections (views) and the core's result (output, lse, row stats); backward walks the five
// steps in reverse. No step copies: heads are strided views, and the core reads and writes them in place.
#include <algorithm>
#include <cmath>
#include <set>

#include "nn/grad.hpp"
#include "nn/module_lock.hpp"
#include "qkv/nn.hpp"
#include "core/random.hpp"

namespace qkv::detail {
ModuleLock::ModuleLock() : mutex_(std::make_unique<ModuleMutex>()) {}
ModuleLock::ModuleLock(const ModuleLock&) : ModuleLock() {}
ModuleLock& ModuleLock::operator=(const ModuleLock&) { return *this; }  // each module keeps its own
ModuleLock::~ModuleLock() = default;
}  // namespace qkv::detail

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
  if (!(o.softcap >= 0 && std::isfinite(o.softcap)))
    throw Error(std::string(kWho) + "softcap must be finite and >= 0 (0 = off), got " + std::to_string(o.softcap));
  if (o.attention == AttentionKind::Linear && (o.dropout > 0 || o.softcap > 0 || o.alibi || o.sinks))
    throw Error(std::string(kWho) + "linear attention takes no dropout, softcap, alibi or sinks (they act on softmax "
                "scores it never forms)");
  if (o.attention == AttentionKind::Linear && o.relative_position_bias)
    throw Error(std::string(kWho) + "linear attention takes no relative_position_bias (it forms no scores)");
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

// Rows [first, first + count) of a fused (rows, ...) tensor: a view, writable in place. Copies
// `initial` (the projection's own starting values) into them, then returns the view.
Tensor fused_rows(const Tensor& fused, int64_t first, const Tensor& initial) {
  if (!fused.defined()) return Tensor();
  const Tensor rows = fused.narrow(0, first, initial.size(0));
  std::copy_n(initial.data(), initial.numel(), rows.data());
  return rows;
}

// The standard ALiBi slopes of `heads` heads: 2^(-8 (h + 1) / heads) for head h.
Tensor alibi_slopes_for(int64_t heads) {
  Tensor slopes = Tensor::empty({heads});
  for (int64_t h = 0; h < heads; ++h)
    slopes.data()[h] = static_cast<float>(std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(heads)));
  return slopes;
}

// The relative-position bias's term for a call with the caller's `mask`: the bias gets its
// gradient only as the call's one additive term (attention/bias_gradient.hpp).
Mask relative_bias_mask(const RelativePositionBias& bias, const Mask& mask, int64_t q_len, int64_t kv_len) {
  for (const Mask::Term& term : mask.terms())
    if (term.additive)
      throw Error(std::string(kWho) + "a float mask (" + mask.str() +
                  ") with relative_position_bias: the bias must be the call's only additive term");
  return Mask::additive(bias.bias(q_len, kv_len));
}

// The forward's checks of one input: batch-first (B, N, features) or unbatched (N, features).
void check_features(const Tensor& t, const char* name, const char* dim_name, int64_t expected) {
  if (!t.defined() || t.dim() < 2 || t.dim() > 3 || t.size(-1) != expected)
    throw Error(std::string(kWho) + name + " is " + shape_of(t) + " but " + dim_name + " is " +
                std::to_string(expected) + (t.defined() && (t.dim() < 2 || t.dim() > 3)
                                                ? " (expected (B, N, features) or (N, features))" : ""));
}

// need_weights=average: the mean over heads of per-head weights (B, H, Nq, Nk), as (B, Nq, Nk).
Tensor average_heads(const Tensor& per_head_weights) {
  const int64_t batch = per_head_weights.size(0), heads = per_head_weights.size(1);
  const int64_t plane = per_head_weights.size(2) * per_head_weights.size(3);
  Tensor mean = Tensor::zeros({batch, per_head_weights.size(2), per_head_weights.size(3)});
  const float* per_head = per_head_weights.data();
  float* out = mean.data();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t e = 0; e < plane; ++e) out[b * plane + e] += per_head[(b * heads + h) * plane + e];
  for (int64_t e = 0; e < mean.numel(); ++e) out[e] /= static_cast<float>(heads);
  return mean;
}

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
  if (o.alibi) alibi_slopes_ = alibi_slopes_for(num_heads);
  if (o.rotary) rotary_.emplace(embed_dim / num_heads, *o.rotary);
  if (o.relative_position_bias) relative_position_bias.emplace(num_heads, *o.relative_position_bias);
  if (o.sinks) {
    sinks = Tensor::zeros({num_heads});
    sinks_grad = Tensor::zeros({num_heads});
  }
  if (o.kdim != embed_dim || o.vdim != embed_dim) return;
  // One (E + 2 Hkv hd, E) in-projection; q_proj, k_proj and v_proj become views of its row blocks
  // (weights, biases and grads), keeping the values initialise() gave them.
  const int64_t kv_features = k_proj.out_features();
  in_proj_.emplace(embed_dim, embed_dim + 2 * kv_features, o.bias, stream_seed(o.seed, 8));
  Linear& in = *in_proj_;
  int64_t first = 0;
  for (Linear* proj : {&q_proj, &k_proj, &v_proj}) {
    proj->weight = fused_rows(in.weight, first, proj->weight);
    proj->bias = fused_rows(in.bias, first, proj->bias);
    proj->weight_grad = fused_rows(in.weight_grad, first, proj->weight_grad);
    proj->bias_grad = fused_rows(in.bias_grad, first, proj->bias_grad);
    first += proj->out_features();
  }
}

bool MultiHeadAttention::fused() const {
  if (!in_proj_) return false;
  const Linear& in = *in_proj_;
  int64_t first = 0;  // the row block of in_proj_ the next projection should view
  // part is rows [first, first + rows) of whole (or both undefined).
  const auto views = [&](const Tensor& part, const Tensor& whole, int64_t rows) {
    if (!part.defined() || !whole.defined()) return part.defined() == whole.defined();
    const int64_t width = whole.numel() / whole.size(0);
    return part.shares_storage_with(whole) && part.is_contiguous() && part.numel() == rows * width &&
           part.view_data() == whole.view_data() + first * width;
  };
  for (const Linear* proj : {&q_proj, &k_proj, &v_proj}) {
    if (!proj->weight.defined() || proj->weight.dim() != 2) return false;
    const int64_t rows = proj->weight.size(0);
    if (!views(proj->weight, in.weight, rows) || !views(proj->bias, in.bias, rows) ||
        !views(proj->weight_grad, in.weight_grad, rows) || !views(proj->bias_grad, in.bias_grad, rows))
      return false;
    first += rows;
  }
  return first == in.out_features();
}

void MultiHeadAttention::train(bool training) {
  const std::unique_lock lock(lock_.mutex().mutex);
  training_ = training;
}

bool MultiHeadAttention::is_training() const {
  const std::shared_lock lock(lock_.mutex().mutex);
  return training_;
}

MultiHeadAttentionOutput MultiHeadAttention::forward(const Tensor& x, const Mask& mask, Weights weights) const {
  const detail::ForwardHold hold(lock_.mutex(), training_);
  return self_forward(x, mask, weights);
}

MultiHeadAttentionOutput MultiHeadAttention::forward(const Tensor& query, const Tensor& key, const Tensor& value,
                                                     const Mask& mask, Weights weights) const {
  const detail::ForwardHold hold(lock_.mutex(), training_);
  return cross_forward(query, key, value, mask, weights);
}

MultiHeadAttentionOutput MultiHeadAttention::self_forward(const Tensor& x, const Mask& mask, Weights weights) const {
  if (!fused()) {
    MultiHeadAttentionOutput out = cross_forward(x, x, x, mask, weights);
    if (training_) saved_.self_attention = true;
    return out;
  }
  check_features(x, "query", "embed_dim", embed_dim_);
  const bool unbatched = x.dim() == 2;
  const Tensor x_in = unbatched ? x.unsqueeze(0) : x;
  if (forward_by_heads_applies(x_in, mask, weights)) return forward_by_heads(x_in, mask, unbatched);
  const int64_t batch = x_in.size(0), len = x_in.size(1), hd = head_dim();
  // ---- 1. project once (eval() keeps nothing: include/qkv/nn.hpp), 2. split:
  // (B, N, (H + 2 Hkv) hd) -> q, k, v (B, heads, N, hd), views
  const Tensor projected = training_ ? in_proj_->forward(x_in) : in_proj_->apply(x_in);
  const Tensor heads = projected.reshape({batch, len, num_heads_ + 2 * num_kv_heads_, hd});
  const Tensor q = heads.narrow(2, 0, num_heads_).transpose(1, 2);
  const Tensor k = heads.narrow(2, num_heads_, num_kv_heads_).transpose(1, 2);
  const Tensor v = heads.narrow(2, num_heads_ + num_kv_heads_, num_kv_heads_).transpose(1, 2);
  MultiHeadAttentionOutput out = attend(q, k, v, mask, weights, unbatched, /*fused=*/true);
  if (training_) saved_.self_attention = true;
  return out;
}

LinearAttentionOptions MultiHeadAttention::linear_options() const {
  LinearAttentionOptions linear;
  linear.feature_map = options_.feature_map;
  linear.causal = options_.causal;
  return linear;
}

MultiHeadAttentionOutput MultiHeadAttention::cross_forward(const Tensor& query, const Tensor& key,
                                                           const Tensor& value, const Mask& mask,
                                                           Weights weights) const {
  // ---- check: batch-first (B, N, features) or unbatched (N, features), all three alike
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
  return attend(q, k, v, mask, weights, unbatched, /*fused=*/false);
}

MultiHeadAttentionOutput MultiHeadAttention::attend(const Tensor& q, const Tensor& k, const Tensor& v,
                                                    const Mask& mask, Weights weights, bool unbatched,
                                                    bool fused) const {
  const int64_t batch = q.size(0), q_len = q.size(2), kv_len = k.size(2), hd = head_dim();
  // ---- 2b. rotary positions, in place on the fresh projections' head views
  if (rotary_) {
    rotary_->apply_inplace(q, {0});
    rotary_->apply_inplace(k, {0});
  }
  // ---- 3. attend, through the one functional core
  AttentionOptions attention;
  attention.mask = options_.causal ? mask & Mask::causal() : mask;
  if (relative_position_bias) attention.mask &= relative_bias_mask(*relative_position_bias, mask, q_len, kv_len);
  attention.need_weights = weights != Weights::None;
  attention.softcap = options_.softcap;
  attention.alibi_slopes = alibi_slopes_;
  attention.sinks = sinks;
  attention.precision = options_.precision;
  if (training_ && options_.dropout > 0) {
    attention.dropout_p = options_.dropout;
    attention.seed = stream_seed(options_.seed, 7) + dropout_calls_++;
  }
  // ---- 4. concatenate heads: the core writes head h of row i straight to concatenated[b, i, h]
  const Tensor concatenated = Tensor::empty({batch, q_len, num_heads_, hd});
  AttentionResult attended;
  attended.output = concatenated.transpose(1, 2);
  if (options_.attention == AttentionKind::Linear && (!mask.is_none() || weights != Weights::None))
    throw Error(std::string(kWho) + "linear attention takes no mask (only the causal option) and has no weights; got "
                "mask " + mask.str() + (weights != Weights::None ? " and a request for weights" : ""));
  if (concatenated.numel() == 0) {
    // No query (an empty batch or sequence): an empty output, as PyTorch returns; no row to attend.
    if (attention.need_weights) attended.weights = Tensor::zeros({batch, num_heads_, q_len, kv_len});
  } else if (options_.attention == AttentionKind::Linear) {
    linear_attention_into(q, k, v, attended.output, linear_options());
  } else {
    scaled_dot_product_attention_into(q, k, v, attended, attention);
  }
  // Training keeps what backward needs; eval() keeps nothing, so concurrent inference on one
  // module only reads it (include/qkv/nn.hpp).
  if (training_)
    saved_ = {.valid = true, .self_attention = false, .fused = fused, .unbatched = unbatched, .q = q, .k = k, .v = v,
              .attended = attended, .attention = attention};

  // ---- 5. output projection
  MultiHeadAttentionOutput result;
  const Tensor flat = concatenated.reshape({batch, q_len, embed_dim_});
  result.output = training_ ? out_proj.forward(flat) : out_proj.apply(flat);

  if (weights == Weights::Averaged) {
    result.weights = average_heads(attended.weights);
  } else if (weights == Weights::PerHead) {
    result.weights = attended.weights;
  }
  if (unbatched) {
    result.output = result.output.squeeze(0);
    if (result.weights.defined()) result.weights = result.weights.squeeze(0);
  }
  return result;
}

std::vector<Tensor> MultiHeadAttention::backward_to_projections(const Tensor& grad_output) {
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
  // ---- 4. concatenated = the heads side by side: a view, as in the forward
  const Tensor d_attended = d_concatenated.reshape({batch, q_len, num_heads_, hd}).transpose(1, 2);
  // ---- 3. attended = scaled_dot_product_attention(q, k, v, attention), its gradients written
  // straight into the (B, N, heads, hd) layout of the projections' outputs
  std::vector<Tensor> projected;
  AttentionGrads d;
  const bool nothing_attended = batch * q_len * kv_len == 0;  // no kernel ran or runs (see attend)
  if (s.fused) {
    const Tensor heads = Tensor::empty({batch, q_len, num_heads_ + 2 * num_kv_heads_, hd});
    d.dq = heads.narrow(2, 0, num_heads_).transpose(1, 2);
    d.dk = heads.narrow(2, num_heads_, num_kv_heads_).transpose(1, 2);
    d.dv = heads.narrow(2, num_heads_ + num_kv_heads_, num_kv_heads_).transpose(1, 2);
    projected = {heads.reshape({batch, q_len, (num_heads_ + 2 * num_kv_heads_) * hd})};
  } else {
    // With no query or no key the heads' output is constant (empty, or zeros): zero gradients.
    const auto grad = [nothing_attended](const Shape& shape) {
      return nothing_attended ? Tensor::zeros(shape) : Tensor::empty(shape);
    };
    const Tensor dq = grad({batch, q_len, num_heads_, hd});
    const Tensor dk = grad({batch, kv_len, num_kv_heads_, hd});
    const Tensor dv = grad({batch, kv_len, num_kv_heads_, hd});
    d = {.dq = dq.transpose(1, 2), .dk = dk.transpose(1, 2), .dv = dv.transpose(1, 2), .dsinks = {}, .dbias = {}};
    projected = {dq.reshape({batch, q_len, embed_dim_}), dk.reshape({batch, kv_len, num_kv_heads_ * hd}),
                 dv.reshape({batch, kv_len, num_kv_heads_ * hd})};
  }
  // The relative-position bias's gradient: dbias of its (1, H, Nq, Nk) term, written whole.
  if (relative_position_bias) d.dbias = Tensor::empty({1, num_heads_, q_len, kv_len});
  if (nothing_attended) {
    // the gradients stay the zeros they were made
  } else if (options_.attention == AttentionKind::Linear) {
    linear_attention_backward_into(s.q, s.k, s.v, d_attended, d, linear_options());
  } else {
    scaled_dot_product_attention_backward_into(d_attended, s.q, s.k, s.v, s.attended, d, s.attention);
  }
  if (rotary_) {  // 2b. the rotation's backward is its transpose: the inverse rotation
    rotary_->apply_inplace(d.dq, {0}, /*inverse=*/true);
    rotary_->apply_inplace(d.dk, {0}, /*inverse=*/true);
  }
  if (relative_position_bias && !nothing_attended) relative_position_bias->backward(d.dbias);
  if (sinks_grad.defined() && d.dsinks.defined()) {
    float* total = sinks_grad.data();
    const Tensor dsinks = d.dsinks.contiguous();
    for (int64_t h = 0; h < num_heads_; ++h) total[h] += dsinks.data()[h];
  }
  return projected;
}

MultiHeadAttentionGrads MultiHeadAttention::backward_cross(const Tensor& grad_output) {
  const std::unique_lock lock(lock_.mutex().mutex);
  return cross_backward(grad_output);
}

Tensor MultiHeadAttention::backward(const Tensor& grad_output) {
  const std::unique_lock lock(lock_.mutex().mutex);
  return self_backward(grad_output);
}

MultiHeadAttentionGrads MultiHeadAttention::cross_backward(const Tensor& grad_output) {
  const std::vector<Tensor> projected = backward_to_projections(grad_output);
  // ---- 2. the head split was a view; 1. the projections
  MultiHeadAttentionGrads grads;
  if (saved_.fused) {
    // One GEMM for the three weight gradients; the three input gradients apart.
    const Tensor& d = projected[0];
    const int64_t kv_features = k_proj.out_features();
    in_proj_->accumulate_parameter_gradients(d);
    grads.query = q_proj.input_gradient(d.narrow(-1, 0, embed_dim_));
    grads.key = k_proj.input_gradient(d.narrow(-1, embed_dim_, kv_features));
    grads.value = v_proj.input_gradient(d.narrow(-1, embed_dim_ + kv_features, kv_features));
  } else {
    grads.query = q_proj.backward(projected[0]);
    grads.key = k_proj.backward(projected[1]);
    grads.value = v_proj.backward(projected[2]);
  }
  if (saved_.unbatched) {
    grads.query = grads.query.squeeze(0);
    grads.key = grads.key.squeeze(0);
    grads.value = grads.value.squeeze(0);
  }
  return grads;
}

Tensor MultiHeadAttention::self_backward(const Tensor& grad_output) {
  if (saved_.valid && !saved_.self_attention)
    throw Error(std::string(kWho) + "backward() follows forward(x) (self-attention); the last forward was "
                "forward(query, key, value): use backward_cross()");
  if (saved_.valid && saved_.fused) {
    // x fed the one fused projection: its backward sums the three paths in one GEMM.
    const Tensor dx = in_proj_->backward(backward_to_projections(grad_output)[0]);
    return saved_.unbatched ? dx.squeeze(0) : dx;
  }
  MultiHeadAttentionGrads grads = cross_backward(grad_output);
  // x fed all three projections: its gradient is the sum of the three paths.
  float* dx = grads.query.data();
  const float* dk = grads.key.data();
  const float* dv = grads.value.data();
  const int64_t count = grads.query.numel();
  for (int64_t e = 0; e < count; ++e) dx[e] += dk[e] + dv[e];
  return grads.query;
}

void MultiHeadAttention::zero_grad() {
  const std::unique_lock lock(lock_.mutex().mutex);
  for (Linear* proj : {&q_proj, &k_proj, &v_proj, &out_proj}) proj->zero_grad();
  grad::reset_grad(sinks_grad, sinks);
  if (relative_position_bias) relative_position_bias->zero_grad();
}

std::vector<NamedTensor> MultiHeadAttention::parameters() const {
  const std::shared_lock lock(lock_.mutex().mutex);
  return named_parameters();
}

std::vector<NamedTensor> MultiHeadAttention::named_parameters() const {
  std::vector<NamedTensor> params;
  for (auto [name, proj] : {std::pair{"q_proj.", &q_proj}, {"k_proj.", &k_proj}, {"v_proj.", &v_proj},
                            {"out_proj.", &out_proj}}) {
    auto p = proj->parameters(name);
    params.insert(params.end(), p.begin(), p.end());
  }
  if (sinks.defined()) params.push_back({"sinks", sinks, sinks_grad});
  if (relative_position_bias)
    params.push_back({"relative_position_bias.weight", relative_position_bias->weight,
                      relative_position_bias->weight_grad});
  return params;
}

int64_t MultiHeadAttention::parameter_count() const {
  int64_t count = 0;
  for (const auto& p : parameters()) count += p.tensor.numel();
  return count;
}

void MultiHeadAttention::load_state_dict(const std::map<std::string, Tensor>& state) {
  const std::unique_lock lock(lock_.mutex().mutex);
  const std::string who = "MultiHeadAttention::load_state_dict: ";
  std::map<std::string, Tensor> targets;
  for (const auto& p : named_parameters()) targets[p.name] = p.tensor;

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
