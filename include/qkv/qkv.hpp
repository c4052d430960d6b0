// The umbrella header: everything qkv offers. Pulls in no SIMD, threading or BLAS header.
#pragma once

#include "qkv/analysis.hpp"
#include "qkv/attention.hpp"
#include "qkv/cascade.hpp"
#include "qkv/dtype.hpp"
#include "qkv/error.hpp"
#include "qkv/flex.hpp"
#include "qkv/linear_attention.hpp"
#include "qkv/inference.hpp"
#include "qkv/mask.hpp"
#include "qkv/memory.hpp"
#include "qkv/nn.hpp"
#include "qkv/quantize.hpp"
#include "qkv/tensor.hpp"
#include "qkv/train.hpp"

namespace qkv {
const char* version();  // "0.1.0"
}  // namespace qkv
