// qkv::Error: the one exception qkv throws for bad input. Its message names the argument and
// the actual shapes or values, e.g.
//   scaled_dot_product_attention: q is (2, 4, 8) but k is (2, 4, 6): head dims differ
#pragma once

#include <stdexcept>

namespace qkv {

class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

}  // namespace qkv
