// Mask::parse: the text form of a qkv::Mask (grammar in include/qkv/mask.hpp), read by
// recursive descent. Every error is a MaskParseError that quotes the expression and names the
// bad token and its 1-based column.
#include <algorithm>
#include <cctype>
#include <string>
#include <vector>

#include "qkv/mask.hpp"

#include "mask/mod_expression.hpp"

namespace qkv {
namespace {

constexpr const char* kExpected =
    "none, causal, window(left), window(left, right), padding(length), key_lengths(n, ...), strided(stride), "
    "strided(stride, offset), global(count) or a parenthesised expression";
// Largest number an argument takes: far beyond any sequence, far from overflowing int64.
constexpr int64_t kMaxArgument = 1000000000;
// Deepest nesting of parentheses read (the parser recurses once per level).
constexpr int kMaxDepth = 64;

enum class TokenKind { Name, Number, LeftParen, RightParen, Comma, And, Or, End };

struct Token {
  TokenKind kind;
  std::string text;
  size_t column;  // 1-based
};

std::string describe(const Token& token) {
  return token.kind == TokenKind::End ? std::string("the end") : "'" + token.text + "'";
}

// `text` with its control characters written as escapes (\0, \t, \n, \x1b): a message is read
// through what(), a C string, which a NUL would cut, and a terminal would act on the others.
std::string printable(const std::string& text) {
  static const char* const kHex = "0123456789abcdef";
  std::string out;
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (c >= 0x20 && c != 0x7f) {
      out += ch;
    } else if (c == 0) {
      out += "\\0";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += std::string("\\x") + kHex[c >> 4] + kHex[c & 15];
    }
  }
  return out;
}

std::string where(const std::string& expression, size_t column) {
  return "mask '" + printable(expression) + "': column " + std::to_string(column) + ", found ";
}

// Splits the expression into names, numbers and punctuation; anything else is an error.
std::vector<Token> lex(const std::string& expression) {
  std::vector<Token> tokens;
  size_t i = 0;
  auto word = [&](auto is_part) {
    size_t j = i;
    while (j < expression.size() && is_part(static_cast<unsigned char>(expression[j]))) ++j;
    return j;
  };
  while (i < expression.size()) {
    const auto c = static_cast<unsigned char>(expression[i]);
    const size_t column = i + 1;
    if (std::isspace(c)) {
      ++i;
    } else if (std::isalpha(c) || c == '_') {
      const size_t j = word([](unsigned char x) { return std::isalnum(x) || x == '_'; });
      tokens.push_back({TokenKind::Name, expression.substr(i, j - i), column});
      i = j;
    } else if (std::isdigit(c)) {
      const size_t j = word([](unsigned char x) { return std::isdigit(x) != 0; });
      tokens.push_back({TokenKind::Number, expression.substr(i, j - i), column});
      i = j;
    } else if (c == '(' || c == ')' || c == ',' || c == '&' || c == '|') {
      const TokenKind kind = c == '(' ? TokenKind::LeftParen
                             : c == ')' ? TokenKind::RightParen
                             : c == ',' ? TokenKind::Comma
                             : c == '&' ? TokenKind::And
                                        : TokenKind::Or;
      tokens.push_back({kind, std::string(1, static_cast<char>(c)), column});
      ++i;
    } else {
      // Show the whole UTF-8 character, not its first byte.
      const size_t length = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
      throw MaskParseError(where(expression, column) + "'" + printable(expression.substr(i, length)) +
                               "': not part of a mask; a mask is " + kExpected + ", joined with & and |",
                           column);
    }
  }
  tokens.push_back({TokenKind::End, "", expression.size() + 1});
  return tokens;
}

class Parser {
 public:
  Parser(const std::string& expression, std::vector<Token> tokens) : expression_(expression), tokens_(std::move(tokens)) {}

  Mask parse() {
    if (peek().kind == TokenKind::End) return Mask();
    Mask mask = expression(0);
    if (peek().kind != TokenKind::End) fail(peek(), "expected &, | or the end");
    return mask;
  }

 private:
  const Token& peek() const { return tokens_[position_]; }
  const Token& next() { return tokens_[position_++]; }

  [[noreturn]] void fail(const Token& token, const std::string& what) const {
    throw MaskParseError(where(expression_, token.column) + describe(token) + ": " + what, token.column);
  }

  void expect(TokenKind kind, const std::string& what) {
    if (peek().kind != kind) fail(peek(), "expected " + what);
    next();
  }

  // mask &= other (or |=), a refusal (key lengths of different batch sizes) reported at the operator.
  void combine(const Token& op, Mask& mask, const Mask& other, bool intersect) const {
    try {
      if (intersect) mask &= other;
      else mask |= other;
    } catch (const MaskParseError&) {
      throw;
    } catch (const Error& e) {
      fail(op, e.what());
    }
  }

  // expression := conjunction ("|" conjunction)*
  Mask expression(int depth) {
    Mask mask = conjunction(depth);
    while (peek().kind == TokenKind::Or) {
      const Token& op = next();
      combine(op, mask, conjunction(depth), false);
    }
    return mask;
  }

  // conjunction := primary ("&" primary)*
  Mask conjunction(int depth) {
    Mask mask = primary(depth);
    while (peek().kind == TokenKind::And) {
      const Token& op = next();
      combine(op, mask, primary(depth), true);
    }
    return mask;
  }

  // A whole number argument of `name`, at least `least`, at most kMaxArgument.
  int64_t number(const std::string& name, const std::string& argument, int64_t least = 0) {
    const Token& token = peek();
    if (token.kind != TokenKind::Number)
      fail(token, "expected " + name + "'s " + argument + " (a whole number >= " + std::to_string(least) + ")");
    next();
    if (token.text.size() > 10 || std::stoll(token.text) > kMaxArgument)
      fail(token, name + "'s " + argument + " is at most " + std::to_string(kMaxArgument));
    const int64_t value = std::stoll(token.text);
    if (value < least) fail(token, name + "'s " + argument + " must be at least " + std::to_string(least));
    return value;
  }

  // "(" first ["," second] ")": one required argument and an optional second (-1 when absent).
  std::pair<int64_t, int64_t> arguments(const std::string& name, const std::string& first, int64_t least,
                                        const std::string& second, const std::string& example) {
    expect(TokenKind::LeftParen, "'(' after " + name + ", as in " + example);
    const int64_t a = number(name, first, least);
    int64_t b = -1;
    if (!second.empty() && peek().kind == TokenKind::Comma) {
      next();
      b = number(name, second);
    }
    expect(TokenKind::RightParen, "')' to close " + name + "(");
    return {a, b};
  }

  Mask primary(int depth) {
    const Token& token = peek();
    if (token.kind == TokenKind::LeftParen) {
      if (depth >= kMaxDepth) fail(token, "parentheses nest deeper than " + std::to_string(kMaxDepth));
      next();
      Mask inner = expression(depth + 1);
      expect(TokenKind::RightParen, "&, | or ')' to close the '(' at column " + std::to_string(token.column));
      return inner;
    }
    if (token.kind != TokenKind::Name) fail(token, std::string("expected a mask (") + kExpected + ")");
    next();
    const std::string& name = token.text;
    if (name == "none") return Mask();
    if (name == "causal") return Mask::causal();
    if (name == "window") {
      const auto [left, right] = arguments("window", "left", 0, "right", "window(3)");
      return Mask::window(left, right < 0 ? 0 : right);
    }
    if (name == "padding") {
      const Token& length_token = tokens_[std::min(position_ + 1, tokens_.size() - 1)];
      const int64_t length = arguments("padding", "length", 0, "", "padding(4)").first;
      if (length < 1) fail(length_token, "padding's length must be at least 1 (a query must see some key)");
      return Mask::key_lengths({length});
    }
    if (name == "strided") {
      const auto [stride, offset] = arguments("strided", "stride", 1, "offset", "strided(128)");
      return Mask::strided(stride, offset < 0 ? 0 : offset);
    }
    if (name == "global") return Mask::global_tokens(arguments("global", "count", 0, "", "global(16)").first);
    if (name == "key_lengths") {
      expect(TokenKind::LeftParen, "'(' after key_lengths, as in key_lengths(5, 3)");
      std::vector<int64_t> lengths{number("key_lengths", "length")};
      while (peek().kind == TokenKind::Comma) {
        next();
        lengths.push_back(number("key_lengths", "length"));
      }
      expect(TokenKind::RightParen, "')' to close key_lengths(");
      return Mask::key_lengths(std::move(lengths));
    }
    fail(token, std::string("unknown mask; expected ") + kExpected);
  }

  const std::string& expression_;
  std::vector<Token> tokens_;
  size_t position_ = 0;
};

}  // namespace

Mask Mask::parse(const std::string& expression) {
  // "mask: <function>": the whole text is a mask function (mask/mod_expression.hpp), whose
  // errors count columns in the whole text.
  const size_t first = expression.find_first_not_of(" \t");
  if (first != std::string::npos && expression.compare(first, 5, "mask:") == 0) {
    detail::ModExpression::parse(expression, detail::ModKind::Mask, {}, first + 5);
    const size_t body = expression.find_first_not_of(" \t", first + 5);
    return Mask::expression(body == std::string::npos ? std::string() : expression.substr(body));
  }
  return Parser(expression, lex(expression)).parse();
}

}  // namespace qkv
