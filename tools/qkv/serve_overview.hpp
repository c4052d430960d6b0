// The explorer's overview of a long document (POST /api/overview): for one layer of a loaded
// model folder and every head, what the attention weights say without computing them - each
// token's entropy, the strongest links and the keys that collect the most attention - from the
// attention summaries of the fused kernel (AttentionOptions::summary_top_k): server memory
// O(N k), never N x N. The page draws it (explorer/overview.js) and asks /api/attention for the
// exact weights of a window only.
//
//   POST /api/overview {"model": name, "ids": [...] (or "text": "..."), "layer": 0,
//                       "top_k": 8, "links": 200, "collectors": 16}
//     -> {"model", "layer", "layers", "n", "heads", "kv_heads", "top_k", "mask": "causal" | "none",
//         "entropy": [head][token] (nats, 3 decimals), "uniform": [token] (ln of the keys it sees),
//         "received": [head][key] (sum over queries of the weights it gets, 4 significant digits),
//         "links": [head][[query, key, weight]] (the `links` largest of each row's top_k, by weight),
//         "collectors": [head][[key, received]] (the `collectors` keys of most received mass)}
//   The document has at most kMaxOverviewTokens tokens and the model's positions. Bad input: 400
//   with {"error": "..."} naming the field, as /api/attention answers.
#pragma once

#include <cstdint>
#include <string>

#include "serve_api.hpp"

namespace qkv::cli {

inline constexpr int64_t kMaxOverviewTokens = 8192;
inline constexpr size_t kMaxOverviewBodyBytes = 64 * 1024;  // 8192 ids of up to 6 digits

// POST /api/overview with this body. Never throws: bad input is a 400, a failure of ours a 500.
ApiResponse attention_overview(const ExplorerApi& api, const std::string& request_body);

}  // namespace qkv::cli
