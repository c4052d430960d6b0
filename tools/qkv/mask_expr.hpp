// Mask expressions: the text form of a qkv::Mask that `qkv serve` accepts from the page.
//
//   expression := term ( "&" term )*          an empty expression is "none"
//   term       := "none"                      attend everywhere
//               | "causal"                    token i sees tokens 0..i        (Mask::causal())
//               | "window(" L ")"             token i sees tokens i-L..i      (Mask::window(L))
//               | "window(" L "," R ")"       token i sees tokens i-L..i+R    (Mask::window(L, R))
//               | "padding(" N ")"            every token sees the first N    (Mask::key_lengths({N}))
//
// L, R and N are non-negative decimal integers (N at least 1); spaces are free between tokens;
// names are lower case. `&` is the library's: a key is visible only when every term allows it.
// A bad expression throws MaskExpressionError, whose message quotes the expression and names
// the bad token and its column. A later term kind goes into parse_term (mask_expr.cpp).
#pragma once

#include <cstddef>
#include <string>

#include "qkv/error.hpp"
#include "qkv/mask.hpp"

namespace qkv::cli {

class MaskExpressionError : public Error {
 public:
  MaskExpressionError(const std::string& message, size_t column) : Error(message), column_(column) {}
  size_t column() const { return column_; }  // 1-based column of the bad token

 private:
  size_t column_;
};

// Longest expression accepted; anything longer is refused before it is read.
inline constexpr size_t kMaxMaskExpressionLength = 200;
// Largest integer a term takes: far beyond any sequence the explorer shows.
inline constexpr long long kMaxMaskArgument = 1000000;

// The Mask an expression describes; throws MaskExpressionError on bad syntax.
Mask parse_mask_expression(const std::string& expression);

}  // namespace qkv::cli
