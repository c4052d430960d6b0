// Ring attention's collective check: every rank checks its own arguments, then all ranks gather
// what they must agree on (shapes, mask, options) before any ring traffic, and every rank throws
// the same qkv::Error when one of them found a problem or they disagree.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dist/comm.hpp"

namespace qkv::dist::ring {

// What every rank must agree on, gathered from all ranks before any ring traffic.
struct Descriptor {
  int32_t ok = 1;             // 0: this rank found a problem, described in `message`
  int32_t ranks[5] = {};      // tensor ranks of q, k, v, grad_output / output, lse
  int64_t dims[5][4] = {};
  int64_t band_lo = 0, band_hi = 0;
  uint64_t lengths_hash = 0;
  int32_t has_lengths = 0, backend = 0;
  float scale = 0;
  int32_t has_scale = 0;
  float softcap = 0;
  uint64_t modifiers_hash = 0;  // alibi_slopes and sinks: defined or not, and their bits
  uint64_t terms_hash = 0;      // the tensor terms: how many, their kind and (B, H, Nq, Nk) sizes
  char message[400] = {};
};

// Local checks of q, k, v and the options, and of the key lengths and tensor terms against the
// whole sequence of `ranks` shards; an empty string when they are fine.
std::string shard_problem(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionOptions& options,
                          int ranks);

Descriptor describe(const std::vector<Tensor>& tensors, const AttentionOptions& options, const std::string& problem);

// Gathers every rank's descriptor and throws the same qkv::Error on every rank when any rank
// reported a problem or the ranks disagree. `names` label the tensors in messages.
void agree(const Descriptor& mine, const Comm& comm, const char* who, const std::vector<const char*>& names);

}  // namespace qkv::dist::ring
