// qkv::Mask: the builders normalise what the user says into one rule the kernels implement
// (a band of visible keys around each query, per-batch key lengths, tensor terms).
#include "qkv/mask.hpp"

#include <algorithm>

namespace qkv {

namespace {
// "(2, 5)": lengths as the user gave them, negative ones included (the core reports those).
std::string list_str(const std::vector<int64_t>& values) {
  std::string s = "(";
  for (size_t i = 0; i < values.size(); ++i) s += (i ? ", " : "") + std::to_string(values[i]);
  return s + ")";
}

std::string join(const std::vector<std::string>& parts) {
  std::string s;
  for (const auto& p : parts) s += (s.empty() ? "" : " & ") + p;
  return s.empty() ? "none" : s;
}
}  // namespace

namespace {
// Offsets beyond +-kUnbounded would overflow query + edge; no sequence is that long anyway.
int64_t checked_offset(int64_t offset, const char* who) {
  if (offset <= -Mask::kUnbounded || offset >= Mask::kUnbounded)
    throw Error(std::string(who) + ": offset " + std::to_string(offset) + " is outside (-2^60, 2^60)");
  return offset;
}
}  // namespace

Mask Mask::causal(int64_t offset) {
  checked_offset(offset, "Mask::causal");
  Mask m;
  m.band_hi_ = offset;
  m.parts_.push_back("causal(offset=" + std::to_string(offset) + ")");
  return m;
}

Mask Mask::window(int64_t left, int64_t right, int64_t offset) {
  if (left < 0 || right < 0)
    throw Error("Mask::window: left (" + std::to_string(left) + ") and right (" + std::to_string(right) +
                ") must be >= 0");
  checked_offset(offset, "Mask::window");
  Mask m;
  m.band_lo_ = offset - std::min(left, kUnbounded);
  m.band_hi_ = offset + std::min(right, kUnbounded);
  m.parts_.push_back("window(left=" + std::to_string(left) + ", right=" + std::to_string(right) +
                     (offset ? ", offset=" + std::to_string(offset) : "") + ")");
  return m;
}

Mask Mask::key_lengths(std::vector<int64_t> lengths) {
  Mask m;
  m.has_key_lengths_ = true;
  m.lengths_ = std::move(lengths);
  m.parts_.push_back("key_lengths" + list_str(m.lengths_));
  return m;
}

Mask Mask::keep(Tensor keep) {
  if (!keep.defined()) throw Error("Mask::keep: the tensor is undefined");
  Mask m;
  m.parts_.push_back("keep" + keep.shape().str());
  m.terms_.push_back({std::move(keep), false});
  return m;
}

Mask Mask::additive(Tensor scores) {
  if (!scores.defined()) throw Error("Mask::additive: the tensor is undefined");
  Mask m;
  m.parts_.push_back("additive" + scores.shape().str());
  m.terms_.push_back({std::move(scores), true});
  return m;
}

Mask& Mask::operator&=(const Mask& other) {
  // Bands intersect: the later lower edge and the earlier upper edge.
  band_lo_ = std::max(band_lo_, other.band_lo_);
  band_hi_ = std::min(band_hi_, other.band_hi_);
  if (other.has_key_lengths_) {
    if (!has_key_lengths_) {
      lengths_ = other.lengths_;
    } else {
      if (lengths_.size() != other.lengths_.size())
        throw Error("Mask: cannot combine key_lengths" + list_str(lengths_) + " with key_lengths" +
                    list_str(other.lengths_) + ": different batch sizes");
      for (size_t b = 0; b < lengths_.size(); ++b) lengths_[b] = std::min(lengths_[b], other.lengths_[b]);
    }
    has_key_lengths_ = true;
  }
  terms_.insert(terms_.end(), other.terms_.begin(), other.terms_.end());
  parts_.insert(parts_.end(), other.parts_.begin(), other.parts_.end());
  return *this;
}

Mask operator&(const Mask& a, const Mask& b) {
  Mask m = a;
  m &= b;
  return m;
}

bool Mask::is_none() const { return !has_band() && !has_key_lengths_ && terms_.empty(); }

std::string Mask::str() const { return join(parts_); }

Tensor create_causal_mask(int64_t n) {
  if (n < 0) throw Error("create_causal_mask: n = " + std::to_string(n) + " must be >= 0");
  Tensor mask = Tensor::zeros({n, n});
  float* m = mask.data();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j <= i; ++j) m[i * n + j] = 1.0f;
  return mask;
}

Tensor create_padding_mask(const std::vector<int64_t>& lengths, int64_t max_len) {
  if (max_len < 0) throw Error("create_padding_mask: max_len = " + std::to_string(max_len) + " must be >= 0");
  const int64_t batch = static_cast<int64_t>(lengths.size());
  Tensor mask = Tensor::zeros({batch, 1, 1, max_len});
  float* m = mask.data();
  for (int64_t b = 0; b < batch; ++b) {
    if (lengths[b] < 0 || lengths[b] > max_len)
      throw Error("create_padding_mask: lengths[" + std::to_string(b) + "] = " + std::to_string(lengths[b]) +
                  " is outside [0, " + std::to_string(max_len) + "]");
    std::fill_n(m + b * max_len, lengths[b], 1.0f);
  }
  return mask;
}

}  // namespace qkv
