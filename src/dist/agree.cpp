// Ring attention's collective check (dist/agree.hpp).
#include "dist/agree.hpp"

#include <algorithm>
#include <cstring>
#include <sstream>
#include <utility>

#include "attention/problem.hpp"
#include "dist/shards.hpp"

namespace qkv::dist::ring {
namespace {

// FNV-1a, to compare what every rank must agree on in one number.
struct Hash {
  uint64_t value = 1469598103934665603ull;
  void add(uint64_t x) { value = (value ^ x) * 1099511628211ull; }
  void add(const Tensor& t) {
    add(t.defined() ? static_cast<uint64_t>(t.numel()) + 1 : 0);
    if (!t.defined()) return;
    for (float x : t.to_vector()) {
      uint32_t bits = 0;
      std::memcpy(&bits, &x, sizeof bits);
      add(bits);
    }
  }
};

// A tensor term's sizes aligned to the scores (B, H, Nq, Nk), as scaled_dot_product_attention
// broadcasts it: 2-D is (Nq, Nk), 3-D (B, Nq, Nk), 4-D (B, H, Nq, Nk); absent dims are 1.
std::vector<int64_t> term_sizes(const Tensor& values) {
  static constexpr int kPlace[5][4] = {{}, {}, {2, 3}, {0, 2, 3}, {0, 1, 2, 3}};
  std::vector<int64_t> sizes{1, 1, 1, 1};
  const int64_t rank = values.dim();
  if (rank < 2 || rank > 4) return {};
  for (int64_t d = 0; d < rank; ++d) sizes[static_cast<size_t>(kPlace[rank][d])] = values.size(d);
  return sizes;
}

std::string dims_str(const Descriptor& d, int i) {
  std::vector<int64_t> dims(d.dims[i], d.dims[i] + d.ranks[i]);
  return Shape(std::move(dims)).str();
}

void fill_shape(Descriptor& d, int i, const Tensor& t) {
  if (!t.defined()) return;
  d.ranks[i] = static_cast<int32_t>(std::min<int64_t>(t.dim(), 4));
  for (int a = 0; a < d.ranks[i]; ++a) d.dims[i][a] = t.size(a);
}

// Local checks of q, k, v and the options; an empty string when they are fine.
std::string local_problem(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& options) {
  std::ostringstream m;
  if (!q.defined() || !k.defined() || !v.defined()) return "q, k and v must all be defined";
  if (q.dim() < 2 || q.dim() > 4 || k.dim() != q.dim() || v.dim() != q.dim()) {
    m << "q " << q.shape() << ", k " << k.shape() << ", v " << v.shape() << " must all have rank 2, 3 or 4 (the same)";
    return m.str();
  }
  const Tensor q4 = q.dim() == 4 ? q : (q.dim() == 3 ? q.unsqueeze(1) : q.unsqueeze(0).unsqueeze(0));
  const Tensor k4 = k.dim() == 4 ? k : (k.dim() == 3 ? k.unsqueeze(1) : k.unsqueeze(0).unsqueeze(0));
  const Tensor v4 = v.dim() == 4 ? v : (v.dim() == 3 ? v.unsqueeze(1) : v.unsqueeze(0).unsqueeze(0));
  if (q4.size(0) != k4.size(0) || k4.size(0) != v4.size(0) || k4.size(1) != v4.size(1) || k4.size(1) == 0 ||
      q4.size(1) % k4.size(1) != 0 || q4.size(3) != k4.size(3) || q4.size(2) != k4.size(2) ||
      k4.size(2) != v4.size(2) || q4.size(2) == 0) {
    m << "q " << q.shape() << ", k " << k.shape() << ", v " << v.shape()
      << " do not fit: q, k and v must hold the same n > 0 positions of the same batch, q's heads a multiple of k's, "
         "q and k the same head dim";
    return m.str();
  }
  // scale, softcap, alibi_slopes and sinks: the single-process checks and messages, on this shard.
  AttentionOptions modifiers;
  modifiers.scale = options.scale;
  modifiers.softcap = options.softcap;
  modifiers.alibi_slopes = options.alibi_slopes;
  modifiers.sinks = options.sinks;
  try {
    detail::build_problem("", q, k, v, modifiers);
  } catch (const Error& e) {
    return e.what();
  }
  if (options.dropout_p != 0) return "dropout_p = " + std::to_string(options.dropout_p) + " is not supported (0 only)";
  if (options.need_weights) return "need_weights is not supported (the weights are never gathered)";
  if (options.summary_top_k != 0) return "summary_top_k is not supported (each pair sees one block of the keys)";
  // Each pair attends in its own block's positions: a symbolic rule or a function of q and k
  // would be evaluated there, not at the global positions the caller meant.
  if (options.mask.rule())
    return "mask " + options.mask.str() + " is not supported: ring attention takes causal, window, key lengths "
           "and tensor masks (global positions)";
  if (!options.score_mod.empty() || !options.mask_mod.empty() || options.score_function)
    return "score_mod and mask_mod are not supported (each pair would read its block's positions)";
  if (!options.cu_seqlens_q.empty() || !options.cu_seqlens_k.empty() || !options.block_table.empty() ||
      !options.cache_seqlens.empty())
    return "cu_seqlens, block_table and cache_seqlens are not supported (the shards are one sequence each)";
  if (options.rotary_cos.defined() || options.rotary_sin.defined())
    return "rotary tables are not supported: rotate q and k first (nn::RotaryTable)";
  if (options.k_scales.defined() || options.v_scales.defined())
    return "quantized K/V (k_scales, v_scales) are not supported";
  if (options.backend == Backend::Decode) return "backend Decode has no backward and is not offered; use Auto, Flash or Reference";
  return "";
}

// Global key lengths must lie in [0, N]; checked here because each pair sees them clamped.
std::string lengths_problem(const Mask& mask, int64_t batch, int64_t total) {
  if (!mask.has_key_lengths()) return "";
  const auto& lengths = mask.lengths();
  if (static_cast<int64_t>(lengths.size()) != batch)
    return "mask key_lengths has " + std::to_string(lengths.size()) + " lengths but the batch is " + std::to_string(batch);
  for (size_t b = 0; b < lengths.size(); ++b)
    if (lengths[b] < 0 || lengths[b] > total)
      return "mask key_lengths[" + std::to_string(b) + "] = " + std::to_string(lengths[b]) +
             " is outside [0, N = " + std::to_string(total) + "] (global positions)";
  return "";
}

// Tensor mask terms are sharded as the queries: rank r passes the rows of its n queries over all
// N keys, a tensor that broadcasts to (B, Hq, n, N) as a single call's broadcasts to (B, Hq, Nq, Nk).
std::string terms_problem(const Mask& mask, const Tensor& q4, int64_t total) {
  const int64_t n = q4.size(2);
  const std::vector<int64_t> want{q4.size(0), q4.size(1), n, total};
  for (const Mask::Term& term : mask.terms()) {
    const std::vector<int64_t> sizes = term_sizes(term.values);
    bool fits = !sizes.empty();
    for (size_t d = 0; fits && d < 4; ++d) fits = sizes[d] == want[d] || sizes[d] == 1;
    if (!fits)
      return std::string("mask ") + (term.additive ? "additive" : "keep") + term.values.shape().str() +
             " does not broadcast to (B, Hq, n, N) = " + Shape(want).str() +
             ": each rank passes the rows of its own n = " + std::to_string(n) + " queries over all N = " +
             std::to_string(total) + " keys";
  }
  return "";
}

}  // namespace

std::string shard_problem(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& options,
                          int ranks) {
  std::string problem = local_problem(q, k, v, options);
  if (problem.empty()) problem = lengths_problem(options.mask, as4(q).size(0), q.size(-2) * ranks);
  if (problem.empty()) problem = terms_problem(options.mask, as4(q), q.size(-2) * ranks);
  return problem;
}

Descriptor describe(const std::vector<Tensor>& tensors, const AttentionOptions& options, const std::string& problem) {
  Descriptor d;
  for (size_t i = 0; i < tensors.size() && i < 5; ++i) fill_shape(d, static_cast<int>(i), tensors[i]);
  d.band_lo = options.mask.band_lo();
  d.band_hi = options.mask.band_hi();
  d.has_lengths = options.mask.has_key_lengths();
  Hash lengths;
  for (int64_t length : options.mask.lengths()) lengths.add(static_cast<uint64_t>(length));
  d.lengths_hash = lengths.value;
  d.backend = static_cast<int32_t>(options.backend);
  d.has_scale = options.scale.has_value();
  d.scale = options.scale.value_or(0.0f);
  d.softcap = options.softcap;
  Hash modifiers;
  modifiers.add(options.alibi_slopes);
  modifiers.add(options.sinks);
  d.modifiers_hash = modifiers.value;
  Hash terms;
  terms.add(options.mask.terms().size());
  for (const Mask::Term& term : options.mask.terms()) {
    terms.add(term.additive);
    for (int64_t size : term_sizes(term.values)) terms.add(static_cast<uint64_t>(size));
  }
  d.terms_hash = terms.value;
  if (!problem.empty()) {
    d.ok = 0;
    std::strncpy(d.message, problem.c_str(), sizeof(d.message) - 1);
  }
  return d;
}

void agree(const Descriptor& mine, const Comm& comm, const char* who, const std::vector<const char*>& names) {
  std::vector<Descriptor> all(static_cast<size_t>(comm.size()));
  check_mpi(MPI_Allgather(&mine, sizeof(Descriptor), MPI_BYTE, all.data(), sizeof(Descriptor), MPI_BYTE, comm.get()),
            "MPI_Allgather of the shapes");
  for (int r = 0; r < comm.size(); ++r) {
    const Descriptor& d = all[static_cast<size_t>(r)];
    if (!d.ok) throw Error(std::string(who) + ": rank " + std::to_string(r) + ": " + d.message);
  }
  const auto shapes = [&](int r) {
    std::string s;
    for (size_t i = 0; i < names.size(); ++i)
      s += std::string(i ? ", " : "") + names[i] + " " + dims_str(all[static_cast<size_t>(r)], static_cast<int>(i));
    return s;
  };
  for (int r = 1; r < comm.size(); ++r) {
    const Descriptor& a = all[0];
    const Descriptor& b = all[static_cast<size_t>(r)];
    bool same_shapes = std::memcmp(a.ranks, b.ranks, sizeof(a.ranks)) == 0 && std::memcmp(a.dims, b.dims, sizeof(a.dims)) == 0;
    if (!same_shapes)
      throw Error(std::string(who) + ": the shards differ across the " + std::to_string(comm.size()) +
                  " ranks: rank 0 has " + shapes(0) + " but rank " + std::to_string(r) + " has " + shapes(r) +
                  "; every rank must pass N/P positions of the same tensors (N divisible by P = " +
                  std::to_string(comm.size()) + ")");
    if (a.band_lo != b.band_lo || a.band_hi != b.band_hi || a.has_lengths != b.has_lengths ||
        a.lengths_hash != b.lengths_hash || a.backend != b.backend || a.has_scale != b.has_scale ||
        (a.has_scale && a.scale != b.scale) || a.softcap != b.softcap || a.modifiers_hash != b.modifiers_hash)
      throw Error(std::string(who) + ": rank " + std::to_string(r) + " passed different options (mask, scale, "
                  "backend, softcap, alibi_slopes or sinks) than rank 0; every rank must pass the same "
                  "AttentionOptions");
    if (a.terms_hash != b.terms_hash)
      throw Error(std::string(who) + ": rank " + std::to_string(r) + " passed tensor masks of other kinds or "
                  "broadcast shapes than rank 0; every rank must pass the same terms, each holding the rows of "
                  "its own queries over all N keys (or broadcasting the same dims)");
  }
}

}  // namespace qkv::dist::ring
