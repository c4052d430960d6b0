// A text score function (AttentionOptions::score_mod, parsed by mask/mod_expression.hpp) as the
// kernels' one interface for score functions, qkv::ScoreFunction (qkv/flex.hpp), which C++
// callables implement too: its line() runs the program with SIMD on the dispatched target
// (TextScoreLine, attention/steps/score_mod-inl.h), its derivative alongside.
#pragma once

#include <memory>
#include <vector>

#include "mask/mod_expression.hpp"
#include "qkv/flex.hpp"

namespace qkv::detail {

// `inputs` view tensors the caller keeps alive (bind_mod_inputs' held tensors).
std::shared_ptr<const ScoreFunction> text_score_function(ModExpression e, std::vector<ModInput> inputs);

}  // namespace qkv::detail
