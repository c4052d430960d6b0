// Rotary tables as attention options (rotary.hpp): where each token of q and k sits, checked
// against the tables before anything is rotated, then core/rotary_rows.hpp's rotation, the loop and
// arithmetic of nn::RotaryTable: rotating here or with RotaryTable gives the same bits.
#include "attention/rotary.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "attention/varlen.hpp"  // is_varlen, checked_sequences
#include "attention/paged.hpp"   // is_paged
#include "core/rotary_rows.hpp"
#include "qkv/error.hpp"

namespace qkv::detail {
namespace {

[[noreturn]] void fail(const std::string& who, const std::string& message) { throw Error(who + message); }

std::string str(int64_t v) { return std::to_string(v); }

// Where the tokens of q (or of k) sit, part by part: a part is batch element s of the tensor viewed
// as (B, H, N, D) (unpacked), or sequence s's rows [starts[s], starts[s] + lengths[s]) of the
// (total, H, D) tensor (packed); its token n at position offsets[s] + n. A part of queries that see
// no key at all (a sequence without keys) is left as it is: it adds nothing to any output or
// gradient, wherever it would sit.
struct Placement {
  bool packed = false;
  std::vector<int64_t> offsets, starts, lengths;
  std::vector<bool> skip;
  void add(int64_t offset, bool skipped, int64_t start = 0, int64_t length = 0) {
    offsets.push_back(offset);
    skip.push_back(skipped);
    starts.push_back(start);
    lengths.push_back(length);
  }
};

struct Placements {
  Placement q, k;  // k is empty unless rotary_keys
};

// x of rank 2, 3 or 4 as (B, H, N, D): (N, D) and (B, N, D) are one head, as attention reads them.
Tensor as_four(const Tensor& x) {
  if (x.dim() == 4) return x;
  if (x.dim() == 3) return x.unsqueeze(1);
  return x.unsqueeze(0).unsqueeze(0);
}

std::string shape_of(const Tensor& t) { return t.defined() ? t.shape().str() : std::string("undefined"); }

// Plain (B, H, N, D) operands: the queries are the last Nq of the Nk keys, query i at Nk - Nq + i
// (where ALiBi measures from). Refused where the mask would place them elsewhere: a band whose
// last visible key is not the query's own position, or per-batch key lengths with Nq != Nk (a
// padded cache, whose rows end at different positions: a paged call gives each its own).
Placements unpacked(const std::string& who, const Tensor& q, const Tensor& k, const AttentionOptions& options) {
  if (q.dim() < 2 || q.dim() > 4 || k.dim() != q.dim())
    fail(who, "q is " + q.shape().str() + " and k " + k.shape().str() +
                  ": with rotary tables they must be (B, H, N, D), (B, N, D) or (N, D), of the same rank");
  const Tensor q4 = as_four(q), k4 = as_four(k);
  const int64_t batch = q4.size(0), nq = q4.size(2), nk = k4.size(2);
  if (k4.size(0) != batch) fail(who, "q is " + q.shape().str() + " but k is " + k.shape().str() + ": batches differ");
  const Mask& mask = options.mask;
  if (nq != nk && mask.band_hi() < Mask::kUnbounded && mask.band_hi() != nk - nq)
    fail(who, "the mask " + mask.str() + " lets query i see keys up to i + " + str(mask.band_hi()) +
                  ", but rotary tables put it at position Nk - Nq + i = i + " + str(nk - nq) + " (Nq " + str(nq) +
                  ", Nk " + str(nk) + "): align the band to the end of the keys (Mask::causal(" + str(nk - nq) +
                  "), window(left, 0, " + str(nk - nq) + "))");
  if (nq != nk && mask.has_key_lengths())
    fail(who, "key_lengths with " + str(nq) + " queries over " + str(nk) +
                  " keys: each batch element's queries would sit at its own length, which the mask's positions "
                  "do not follow; give the cache as pages (block_table, cache_seqlens), or rotate q with "
                  "nn::RotaryTable::apply_inplace(q, lengths) and pass rotary_keys = false");
  Placements p;
  for (int64_t b = 0; b < batch; ++b) {
    p.q.add(nk - nq, nk == 0);
    if (options.rotary_keys) p.k.add(0, false);
  }
  return p;
}

// Paged K/V: q (B, Hq, Nq, Dk), sequence b's queries the last Nq of its cache_seqlens[b] keys.
Placements paged(const std::string& who, const Tensor& q, const AttentionOptions& options) {
  if (q.dim() != 4) fail(who, "q is " + q.shape().str() + ": with block_table it must be (B, Hq, Nq, Dk)");
  if (options.rotary_keys)
    fail(who, "rotary_keys is set with block_table: the page pools are a cache whose keys were rotated when they "
              "were appended; set rotary_keys = false (q alone is rotated)");
  const int64_t batch = q.size(0), nq = q.size(2);
  if (static_cast<int64_t>(options.cache_seqlens.size()) != batch)
    fail(who, "cache_seqlens has " + str(static_cast<int64_t>(options.cache_seqlens.size())) +
                  " entries but q's batch is " + str(batch) + ": one length per sequence");
  if (nq > 1 && !options.mask.has_band())
    fail(who, "rotary tables with block_table and " + str(nq) + " queries need a band (causal or window): "
              "qkv puts query i at position cache_seqlens[b] - Nq + i, FlashAttention's flash_attn_with_kvcache "
              "puts every query of a call without a band at one position; rotate q yourself (nn::RotaryTable, "
              "qkv.apply_rotary) for either");
  Placements p;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t keys = options.cache_seqlens[static_cast<size_t>(b)];
    p.q.add(keys - nq, keys == 0);
  }
  return p;
}

// A packed batch: each sequence's queries the last of its keys.
Placements packed(const std::string& who, const Tensor& q, const Tensor& k, const Tensor& v,
                  const AttentionOptions& options) {
  const PackedSequences seqs = checked_sequences(who.c_str(), q, k, v, options);
  Placements p;
  p.q.packed = p.k.packed = true;
  for (size_t s = 0; s + 1 < seqs.q_starts.size(); ++s) {
    const int64_t nq = seqs.q_starts[s + 1] - seqs.q_starts[s], nk = seqs.k_starts[s + 1] - seqs.k_starts[s];
    p.q.add(nk - nq, nk == 0, seqs.q_starts[s], nq);
    if (options.rotary_keys) p.k.add(0, false, seqs.k_starts[s], nk);
  }
  return p;
}

// Each rotated token's position: [first, last] over every part with tokens, negative and past-the-
// table positions refused by name.
struct Span {
  int64_t first = std::numeric_limits<int64_t>::max(), last = -1;
};

void extend(const std::string& who, Span& span, const Placement& p, const Tensor& x, const char* name,
            int64_t seqlen_ro) {
  const Tensor four = p.packed ? Tensor() : as_four(x);
  for (size_t s = 0; s < p.offsets.size(); ++s) {
    const int64_t count = p.packed ? p.lengths[s] : four.size(2);
    if (count == 0 || p.skip[s]) continue;
    const int64_t first = p.offsets[s], last = first + count - 1;
    const std::string unit = std::string(p.packed ? "sequence " : "batch element ") + str(static_cast<int64_t>(s));
    if (first < 0)  // only queries sit before their keys' end; keys start at 0
      fail(who, unit + " has " + str(count) + " queries but " + str(count + first) +
                    " keys: its query 0 would sit at position " + str(first) +
                    " (the queries are the last tokens of their sequence; a sequence with keys needs at least as many "
                    "keys as queries)");
    if (last >= seqlen_ro)
      fail(who, unit + "'s " + name + " reach position " + str(last) + ", but the rotary tables hold positions 0 to " +
                    str(seqlen_ro - 1) + " (seqlen_ro " + str(seqlen_ro) + ")");
    span.first = std::min(span.first, first);
    span.last = std::max(span.last, last);
  }
}

// The table rows the call reaches, in double (core/rotary_rows.hpp): position p's pair i at
// (p - first) * half + i.
struct Tables {
  std::vector<double> cos, sin;
  int64_t first = 0, half = 0;
  bool interleaved = false;
};

Tables tables_for(const std::string& who, const Tensor& q, const Tensor& k, const AttentionOptions& options,
                  const Placements& p) {
  const std::string tables_who = who + "rotary tables: ";
  Tables t;
  t.half = rotary_table_half(tables_who, options.rotary_cos, options.rotary_sin, q.size(-1));
  t.interleaved = options.rotary_interleaved;
  if (q.dtype() != DType::F32) fail(who, "q is " + std::string(to_string(q.dtype())) + ": rotary tables rotate f32");
  if (options.rotary_keys) {
    if (k.dtype() != DType::F32)
      fail(who, "k is " + std::string(to_string(k.dtype())) + " with rotary_keys set: 16-bit and quantized keys are "
                "a cache whose keys were rotated when they were appended; set rotary_keys = false (q alone is rotated)");
    if (k.size(-1) != q.size(-1))
      fail(who, "q is " + q.shape().str() + " but k is " + k.shape().str() + ": head dims differ");
  }
  const int64_t seqlen_ro = options.rotary_cos.size(0);
  Span span;
  extend(who, span, p.q, q, "queries", seqlen_ro);
  extend(who, span, p.k, k, "keys", seqlen_ro);
  if (span.last < span.first) return t;  // no token to rotate
  t.first = span.first;
  const int64_t rows = span.last - span.first + 1;
  t.cos = widened_table_rows(tables_who, options.rotary_cos, "cos", t.first, rows);
  t.sin = widened_table_rows(tables_who, options.rotary_sin, "sin", t.first, rows);
  return t;
}

// Rotates x (q, k or their gradient, shaped as q or k) in place where p places its tokens.
void rotate(const Tensor& x, const Placement& p, const Tables& t, bool inverse) {
  const auto cos_sin = [&](int64_t position, int64_t i, double& c, double& s) {
    const size_t at = static_cast<size_t>((position - t.first) * t.half + i);
    c = t.cos[at];
    s = t.sin[at];
  };
  const Tensor four = p.packed ? Tensor() : as_four(x);
  for (size_t s = 0; s < p.offsets.size(); ++s) {
    if (p.skip[s] || (p.packed && p.lengths[s] == 0)) continue;
    const Tensor part = p.packed ? x.narrow(0, p.starts[s], p.lengths[s]).transpose(0, 1).unsqueeze(0)  // (1, H, n, D)
                                 : four.narrow(0, static_cast<int64_t>(s), 1);
    rotate_pairs(part, {p.offsets[s]}, 2 * t.half, t.interleaved, inverse, cos_sin);
  }
}

Placements placements(const std::string& who, const Tensor& q, const Tensor& k, const Tensor& v,
                      const AttentionOptions& options) {
  if (!q.defined() || !k.defined() || !v.defined())
    fail(who, "q is " + shape_of(q) + ", k " + shape_of(k) + " and v " + shape_of(v) + ": all must be defined");
  if (is_varlen(options)) return packed(who, q, k, v, options);
  if (is_paged(options)) return paged(who, q, options);
  return unpacked(who, q, k, options);
}

}  // namespace

void check_outputs_apart(const char* who, std::initializer_list<std::pair<const Tensor*, const char*>> outputs,
                         const Tensor& q, const Tensor& k) {
  for (const auto& [t, name] : outputs)
    for (const auto& [input, input_name] : {std::pair{&q, "q"}, {&k, "k"}})
      if (t->defined() && input->defined() && t->shares_storage_with(*input))
        fail(who, std::string(name) + " shares storage with " + input_name + ": outputs must not overwrite inputs");
}

RotatedInputs rotated_inputs(const char* who, const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionOptions& options) {
  const Placements p = placements(who, q, k, v, options);
  const Tables t = tables_for(who, q, k, options, p);
  RotatedInputs r{q.clone(), options.rotary_keys ? k.clone() : k, options};
  rotate(r.q, p.q, t, false);
  if (options.rotary_keys) rotate(r.k, p.k, t, false);
  r.options.rotary_cos = Tensor();
  r.options.rotary_sin = Tensor();
  return r;
}

void unrotate_gradients(const char* who, const Tensor& q, const Tensor& k, const Tensor& v,
                        const AttentionOptions& options, AttentionGrads& grads) {
  const Placements p = placements(who, q, k, v, options);
  const Tables t = tables_for(who, q, k, options, p);
  rotate(grads.dq, p.q, t, true);
  if (options.rotary_keys) rotate(grads.dk, p.k, t, true);
}

}  // namespace qkv::detail
