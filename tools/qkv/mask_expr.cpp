// Mask expressions to qkv::Mask; the grammar is in mask_expr.hpp.
#include "mask_expr.hpp"

#include <cctype>
#include <string_view>
#include <vector>

#include <fmt/core.h>

namespace qkv::cli {
namespace {

constexpr const char* kExpected = "none, causal, window(left), window(left, right) or padding(length)";

enum class TokenKind { Name, Number, LeftParen, RightParen, Comma, And, End };

struct Token {
  TokenKind kind;
  std::string text;
  size_t column;  // 1-based
};

// What the user sees for a token in a message: the end is "the end", the rest quoted.
std::string describe(const Token& token) {
  return token.kind == TokenKind::End ? std::string("the end") : fmt::format("'{}'", token.text);
}

// Splits the expression into names, numbers and punctuation; anything else is an error.
std::vector<Token> lex(const std::string& expression) {
  std::vector<Token> tokens;
  size_t i = 0;
  while (i < expression.size()) {
    const auto c = static_cast<unsigned char>(expression[i]);
    const size_t column = i + 1;
    if (std::isspace(c)) {
      ++i;
    } else if (std::isalpha(c) || c == '_') {
      size_t j = i;
      while (j < expression.size() &&
             (std::isalnum(static_cast<unsigned char>(expression[j])) || expression[j] == '_')) {
        ++j;
      }
      tokens.push_back({TokenKind::Name, expression.substr(i, j - i), column});
      i = j;
    } else if (std::isdigit(c)) {
      size_t j = i;
      while (j < expression.size() && std::isdigit(static_cast<unsigned char>(expression[j]))) ++j;
      tokens.push_back({TokenKind::Number, expression.substr(i, j - i), column});
      i = j;
    } else if (c == '(' || c == ')' || c == ',' || c == '&') {
      const TokenKind kind = c == '(' ? TokenKind::LeftParen
                             : c == ')' ? TokenKind::RightParen
                             : c == ',' ? TokenKind::Comma
                                        : TokenKind::And;
      tokens.push_back({kind, std::string(1, static_cast<char>(c)), column});
      ++i;
    } else {
      // Show the whole UTF-8 character, not its first byte.
      size_t length = 1;
      if (c >= 0xF0) length = 4;
      else if (c >= 0xE0) length = 3;
      else if (c >= 0xC0) length = 2;
      throw MaskExpressionError(fmt::format("mask '{}': column {}, found '{}': not part of a mask; a mask is {}, "
                                            "joined with &",
                                            expression, column, expression.substr(i, length), kExpected),
                                column);
    }
  }
  tokens.push_back({TokenKind::End, "", expression.size() + 1});
  return tokens;
}

// A recursive-descent reader over the tokens of one expression.
class Parser {
 public:
  Parser(const std::string& expression, std::vector<Token> tokens)
      : expression_(expression), tokens_(std::move(tokens)) {}

  // expression := term ("&" term)*
  Mask parse() {
    if (peek().kind == TokenKind::End) return Mask();
    Mask mask = parse_term();
    while (peek().kind == TokenKind::And) {
      next();
      mask &= parse_term();
    }
    if (peek().kind != TokenKind::End) fail(peek(), "expected & or the end");
    return mask;
  }

 private:
  const Token& peek() const { return tokens_[position_]; }
  const Token& next() { return tokens_[position_++]; }

  [[noreturn]] void fail(const Token& token, const std::string& what) const {
    throw MaskExpressionError(
        fmt::format("mask '{}': column {}, found {}: {}", expression_, token.column, describe(token), what),
        token.column);
  }

  void expect(TokenKind kind, const std::string& what) {
    if (peek().kind != kind) fail(peek(), "expected " + what);
    next();
  }

  // A non-negative integer argument of `name`, at most kMaxMaskArgument.
  int64_t number(const std::string& name, const std::string& argument) {
    const Token& token = peek();
    if (token.kind != TokenKind::Number) fail(token, fmt::format("expected {}'s {} (a whole number >= 0)", name, argument));
    next();
    if (token.text.size() > 7 || std::stoll(token.text) > kMaxMaskArgument) {
      fail(token, fmt::format("{}'s {} is at most {}", name, argument, kMaxMaskArgument));
    }
    return std::stoll(token.text);
  }

  // term := none | causal | window(L) | window(L, R) | padding(N)
  Mask parse_term() {
    const Token& token = peek();
    if (token.kind != TokenKind::Name) fail(token, fmt::format("expected a mask ({})", kExpected));
    next();
    if (token.text == "none") return Mask();
    if (token.text == "causal") return Mask::causal();
    if (token.text == "window") {
      expect(TokenKind::LeftParen, "'(' after window, as in window(3)");
      const int64_t left = number("window", "left");
      int64_t right = 0;
      if (peek().kind == TokenKind::Comma) {
        next();
        right = number("window", "right");
      }
      expect(TokenKind::RightParen, "')' to close window(");
      return Mask::window(left, right);
    }
    if (token.text == "padding") {
      expect(TokenKind::LeftParen, "'(' after padding, as in padding(4)");
      const Token& length_token = peek();
      const int64_t length = number("padding", "length");
      if (length < 1) fail(length_token, "padding's length must be at least 1 (a query must see some key)");
      expect(TokenKind::RightParen, "')' to close padding(");
      return Mask::key_lengths({length});
    }
    fail(token, fmt::format("unknown mask; expected {}", kExpected));
  }

  const std::string& expression_;
  std::vector<Token> tokens_;
  size_t position_ = 0;
};

}  // namespace

Mask parse_mask_expression(const std::string& expression) {
  if (expression.size() > kMaxMaskExpressionLength) {
    throw MaskExpressionError(fmt::format("mask expression has {} characters; the limit is {}", expression.size(),
                                          kMaxMaskExpressionLength),
                              kMaxMaskExpressionLength + 1);
  }
  return Parser(expression, lex(expression)).parse();
}

}  // namespace qkv::cli
