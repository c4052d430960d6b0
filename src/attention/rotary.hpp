// Rotary positions from tables as attention options (AttentionOptions::rotary_cos / rotary_sin,
// rotary_interleaved, rotary_keys): the entry points of dispatch.cpp rotate copies of q and k here,
// then attend to the copies with the rotary fields cleared; the backward attends likewise and turns
// dq and dk back (a rotation's transpose is its inverse), so every kernel, mask and layout (plain,
// packed, paged) serves rotary calls unchanged.
#pragma once

#include <initializer_list>
#include <utility>

#include "qkv/attention.hpp"

namespace qkv::detail {

inline bool has_rotary(const AttentionOptions& options) {
  return options.rotary_cos.defined() || options.rotary_sin.defined();
}

// q rotated, and k when options.rotary_keys (else k itself), each a new contiguous tensor; options
// without the rotary fields. Checks the tables, the layouts and every position before anything is
// rotated; errors start with `who`.
struct RotatedInputs {
  Tensor q, k;
  AttentionOptions options;
};
RotatedInputs rotated_inputs(const char* who, const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionOptions& options);

// The caller's outputs must not share storage with its q and k: the kernels check their outputs
// against the tensors they are given, which are the rotated copies.
void check_outputs_apart(const char* who, std::initializer_list<std::pair<const Tensor*, const char*>> outputs,
                         const Tensor& q, const Tensor& k);

// The backward's last step: grads.dq (and grads.dk when rotary_keys), the gradients of the rotated
// q and k, turned back in place into those of the caller's q and k.
void unrotate_gradients(const char* who, const Tensor& q, const Tensor& k, const Tensor& v,
                        const AttentionOptions& options, AttentionGrads& grads);

}  // namespace qkv::detail
