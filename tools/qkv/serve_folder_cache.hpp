// What `qkv serve` keeps per loaded model folder so a request does not redo work another request
// already did (tools/qkv/serve_api.cpp uses it). Requests run concurrently (serve_slots.hpp), so
// every member is safe to call from several threads at once.
//
//   roles        every head's role scores on a text, exactly measure_roles' (pretrained.hpp):
//                the text's attention is the request's own forward (passed in), and the other
//                half, the model's attention on the repeated random sequence of the induction
//                score, depends only on the model (and on the special token a text starts with),
//                so it is run once per model and prefix, not once per request.
//   query_keys   Model::query_keys(ids, layer) for the neuron view, whose hovering asks for rows
//                of the same text and layer again and again: the last kQueryKeysEntries answers
//                kept (least recently used dropped).
//
// The first request to need an entry computes it outside the lock; two at once may both compute
// it (the same values), and the first to finish keeps its copy.
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "qkv/models/head_roles.hpp"
#include "qkv/models/pretrained.hpp"

namespace qkv::cli {

class FolderCache {
 public:
  static constexpr size_t kQueryKeysEntries = 8;

  // Role scores of every head (layer by layer) on `ids`, whose attention (the model's forward on
  // ids, need_attention) the caller has; ids within the model's positions, at least 2 of them.
  std::vector<models::HeadRoleScores> roles(const models::Pretrained& model, const std::vector<int64_t>& ids,
                                            const std::vector<Tensor>& text_attention);

  std::shared_ptr<const models::QueryKeys> query_keys(const models::Pretrained& model,
                                                      const std::vector<int64_t>& ids, int64_t layer);

  // How often each was computed rather than found (for the tests).
  struct Counts {
    int64_t repeated_runs = 0, query_keys_runs = 0, query_keys_hits = 0;
  };
  Counts counts() const;

 private:
  std::shared_ptr<const models::RepeatedAttention> repeated(const models::Pretrained& model,
                                                            const std::vector<int64_t>& prefix);

  mutable std::mutex mutex_;
  std::shared_ptr<const std::vector<int64_t>> candidates_;  // the vocabulary's ordinary tokens
  std::map<std::vector<int64_t>, std::shared_ptr<const models::RepeatedAttention>> repeated_;  // by prefix
  struct QueryKeysEntry {
    std::vector<int64_t> ids;
    int64_t layer;
    std::shared_ptr<const models::QueryKeys> value;
  };
  std::list<QueryKeysEntry> query_keys_;  // most recently used first
  Counts counts_;
};

}  // namespace qkv::cli
