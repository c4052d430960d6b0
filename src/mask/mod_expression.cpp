// ModExpression: parsing by recursive descent straight into a program of line operations (constant
// subexpressions folded as they are read), and the evaluation of that program over one line.
#include "mask/mod_expression.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace qkv::detail {
namespace {

using Op = ModExpression::Op;

constexpr int kMaxDepth = 64;         // nesting the parser recurses through
constexpr size_t kMaxProgram = 1024;  // operations in one expression

struct Token {
  enum Kind { Name, Number, Symbol, End } kind;
  std::string text;
  size_t column;  // 1-based
};

std::string quote(const Token& t) { return t.kind == Token::End ? "the end" : "'" + t.text + "'"; }

std::string label(ModKind kind) { return kind == ModKind::Score ? "score function" : "mask function"; }

// `text` with control characters shown as '?': messages are printed to terminals.
std::string shown(const std::string& text) {
  std::string out;
  for (const char c : text) out += static_cast<unsigned char>(c) < 0x20 || c == 0x7f ? '?' : c;
  return out;
}

[[noreturn]] void fail(const std::string& text, ModKind kind, size_t column, const std::string& found,
                       const std::string& what) {
  throw MaskParseError(label(kind) + " '" + shown(text) + "': column " + std::to_string(column) + ", found " + shown(found) +
                           ": " + what,
                       column);
}

std::vector<Token> lex(const std::string& text, ModKind kind, size_t skip) {
  std::vector<Token> tokens;
  for (size_t i = skip; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    const size_t column = i + 1;
    size_t j = i + 1;
    if (std::isspace(c)) {
      ++i;
      continue;
    }
    if (std::isalpha(c) || c == '_') {
      while (j < text.size() && (std::isalnum(static_cast<unsigned char>(text[j])) || text[j] == '_')) ++j;
      tokens.push_back({Token::Name, text.substr(i, j - i), column});
    } else if (std::isdigit(c) || c == '.') {
      while (j < text.size() && (std::isdigit(static_cast<unsigned char>(text[j])) || text[j] == '.')) ++j;
      if (j < text.size() && (text[j] == 'e' || text[j] == 'E')) {
        size_t k = j + 1;
        if (k < text.size() && (text[k] == '+' || text[k] == '-')) ++k;
        if (k < text.size() && std::isdigit(static_cast<unsigned char>(text[k]))) {
          j = k;
          while (j < text.size() && std::isdigit(static_cast<unsigned char>(text[j]))) ++j;
        }
      }
      tokens.push_back({Token::Number, text.substr(i, j - i), column});
    } else {
      static const char* const kPairs[] = {"==", "!=", "<=", ">=", "&&", "||"};
      std::string symbol(1, static_cast<char>(c));
      for (const char* pair : kPairs)
        if (text.compare(i, 2, pair) == 0) symbol = pair;
      if (symbol.size() == 1 && std::string("+-*/()<>!,").find(static_cast<char>(c)) == std::string::npos)
        fail(text, kind, column, "'" + symbol + "'", "not part of an expression (numbers, names, + - * / ( ) , "
                                                     "== != < <= > >= && || !)");
      j = i + symbol.size();
      tokens.push_back({Token::Symbol, symbol, column});
    }
    i = j;
  }
  tokens.push_back({Token::End, "", text.size() + 1});
  return tokens;
}

struct Function {
  const char* name;
  Op op;
  size_t arity;
};
constexpr Function kFunctions[] = {{"abs", Op::Abs, 1},   {"exp", Op::Exp, 1},   {"log", Op::Log, 1},
                                   {"sqrt", Op::Sqrt, 1}, {"tanh", Op::Tanh, 1}, {"floor", Op::Floor, 1},
                                   {"min", Op::Min, 2},   {"max", Op::Max, 2},   {"where", Op::Where, 3}};

// The value of op on constants (the folding, and the evaluation's scalar definition).
float apply(Op op, float a, float b, float c) {
  switch (op) {
    case Op::Neg: return -a;
    case Op::Not: return a == 0 ? 1.0f : 0.0f;
    case Op::Abs: return std::fabs(a);
    case Op::Exp: return std::exp(a);
    case Op::Log: return std::log(a);
    case Op::Sqrt: return std::sqrt(a);
    case Op::Tanh: return std::tanh(a);
    case Op::Floor: return std::floor(a);
    case Op::Add: return a + b;
    case Op::Sub: return a - b;
    case Op::Mul: return a * b;
    case Op::Div: return a / b;
    case Op::Min: return std::fmin(a, b);
    case Op::Max: return std::fmax(a, b);
    case Op::Eq: return a == b ? 1.0f : 0.0f;
    case Op::Ne: return a != b ? 1.0f : 0.0f;
    case Op::Lt: return a < b ? 1.0f : 0.0f;
    case Op::Le: return a <= b ? 1.0f : 0.0f;
    case Op::Gt: return a > b ? 1.0f : 0.0f;
    case Op::Ge: return a >= b ? 1.0f : 0.0f;
    case Op::And: return a != 0 && b != 0 ? 1.0f : 0.0f;
    case Op::Or: return a != 0 || b != 0 ? 1.0f : 0.0f;
    case Op::Where: return a != 0 ? b : c;
    default: return 0;
  }
}

// d op / ds from the operands' values (a, b, c) and derivatives (da, db, dc); v is op's value.
float derive(Op op, float v, float a, float b, float da, float db, float dc) {
  switch (op) {
    case Op::Neg: return -da;
    case Op::Abs: return a > 0 ? da : a < 0 ? -da : 0.0f;
    case Op::Exp: return v * da;
    case Op::Log: return da / a;
    case Op::Sqrt: return da / (2 * v);
    case Op::Tanh: return (1 - v * v) * da;
    case Op::Add: return da + db;
    case Op::Sub: return da - db;
    case Op::Mul: return da * b + a * db;
    case Op::Div: return (da * b - a * db) / (b * b);
    case Op::Min: return a <= b ? da : db;
    case Op::Max: return a >= b ? da : db;
    case Op::Where: return a != 0 ? db : dc;
    default: return 0;  // constants, positions, inputs, floor, comparisons and logic: flat in s
  }
}

// v[x] = apply(kOp, a[x], b[x], c[x]): one operation over a line, its switch folded away (a
// switch per element made the mask functions' classification cost as much as attention).
template <Op kOp>
void apply_line(size_t n, const float* a, const float* b, const float* c, float* v) {
  for (size_t x = 0; x < n; ++x) v[x] = apply(kOp, a[x], b[x], c[x]);
}

void apply_line(Op op, size_t n, const float* a, const float* b, const float* c, float* v) {
  switch (op) {
#define QKV_APPLY_LINE(name) \
  case Op::name: return apply_line<Op::name>(n, a, b, c, v);
    QKV_APPLY_LINE(Neg) QKV_APPLY_LINE(Not) QKV_APPLY_LINE(Abs) QKV_APPLY_LINE(Exp) QKV_APPLY_LINE(Log)
    QKV_APPLY_LINE(Sqrt) QKV_APPLY_LINE(Tanh) QKV_APPLY_LINE(Floor) QKV_APPLY_LINE(Add) QKV_APPLY_LINE(Sub)
    QKV_APPLY_LINE(Mul) QKV_APPLY_LINE(Div) QKV_APPLY_LINE(Min) QKV_APPLY_LINE(Max) QKV_APPLY_LINE(Eq)
    QKV_APPLY_LINE(Ne) QKV_APPLY_LINE(Lt) QKV_APPLY_LINE(Le) QKV_APPLY_LINE(Gt) QKV_APPLY_LINE(Ge)
    QKV_APPLY_LINE(And) QKV_APPLY_LINE(Or) QKV_APPLY_LINE(Where)
#undef QKV_APPLY_LINE
    default: std::fill_n(v, n, 0.0f);  // the leaves are not operations
  }
}

}  // namespace

class ModParser {
 public:
  ModParser(const std::string& text, ModKind kind, const std::vector<std::string>& inputs, size_t skip)
      : text_(text), kind_(kind), inputs_(inputs), tokens_(lex(text, kind, skip)) {
    e_.kind_ = kind;
    e_.text_ = text.substr(std::min(skip, text.size()));
  }

  ModExpression parse() {
    if (peek().kind == Token::End) fail(text_, kind_, peek().column, "the end", "expected an expression");
    expr(0);
    if (peek().kind != Token::End) error(peek(), "expected an operator or the end");
    return std::move(e_);
  }

 private:
  const Token& peek() const { return tokens_[at_]; }
  const Token& next() { return tokens_[at_++]; }
  bool accept(const char* symbol) {
    if (peek().kind != Token::Symbol || peek().text != symbol) return false;
    ++at_;
    return true;
  }
  [[noreturn]] void error(const Token& t, const std::string& what) const {
    fail(text_, kind_, t.column, quote(t), what);
  }
  void expect(const char* symbol) {
    if (!accept(symbol)) error(peek(), std::string("expected '") + symbol + "'");
  }

  using Instruction = ModExpression::Instruction;
  bool constant(uint32_t i) const { return e_.program_[i].op == Op::Constant; }

  uint32_t emit(Instruction instruction) {
    if (e_.program_.size() >= kMaxProgram)
      fail(text_, kind_, peek().column, quote(peek()), "more than " + std::to_string(kMaxProgram) + " operations");
    e_.program_.push_back(instruction);
    return static_cast<uint32_t>(e_.program_.size() - 1);
  }

  // op on operands a, b, c (arity 1-3), folded when all are constants: then they are the last
  // instructions emitted, and are replaced by one. `at`: the operator's token, for errors.
  uint32_t operation(Op op, const Token& at, uint32_t a, uint32_t b = 0, uint32_t c = 0, size_t arity = 1) {
    const uint32_t operands[] = {a, b, c};
    if (op == Op::Div && constant(b) && e_.program_[b].constant == 0) error(at, "division by zero");
    bool all_constant = true;
    for (size_t i = 0; i < arity; ++i) all_constant = all_constant && constant(operands[i]);
    if (all_constant) {
      const auto value = [&](size_t i) { return i < arity ? e_.program_[operands[i]].constant : 0.0f; };
      if ((op == Op::Log && value(0) <= 0) || (op == Op::Sqrt && value(0) < 0))
        error(at, "outside the function's domain (" + std::to_string(value(0)) + ")");
      const float folded = apply(op, value(0), value(1), value(2));
      e_.program_.resize(e_.program_.size() - arity);
      return emit({Op::Constant, 0, 0, 0, folded});
    }
    Instruction instruction{op, a, b, c};
    for (size_t i = 0; i < arity; ++i) instruction.has_derivative |= e_.program_[operands[i]].has_derivative;
    return emit(instruction);
  }

  uint32_t binary_level(int depth, int level) {
    static const std::vector<std::vector<std::pair<const char*, Op>>> kLevels = {
        {{"||", Op::Or}},
        {{"&&", Op::And}},
        {{"==", Op::Eq}, {"!=", Op::Ne}, {"<=", Op::Le}, {">=", Op::Ge}, {"<", Op::Lt}, {">", Op::Gt}},
        {{"+", Op::Add}, {"-", Op::Sub}},
        {{"*", Op::Mul}, {"/", Op::Div}}};
    if (level == static_cast<int>(kLevels.size())) return unary(depth);
    uint32_t left = binary_level(depth, level + 1);
    for (bool more = true; more;) {
      more = false;
      for (const auto& [symbol, op] : kLevels[static_cast<size_t>(level)]) {
        const Token at = peek();
        if (!accept(symbol)) continue;
        const uint32_t right = binary_level(depth, level + 1);
        left = operation(op, at, left, right, 0, 2);
        more = level != 2;  // comparisons do not chain: a < b < c is an error
        break;
      }
    }
    return left;
  }

  uint32_t expr(int depth) {
    if (depth > kMaxDepth) error(peek(), "nested deeper than " + std::to_string(kMaxDepth));
    return binary_level(depth, 0);
  }

  uint32_t unary(int depth) {
    if (depth > kMaxDepth) error(peek(), "nested deeper than " + std::to_string(kMaxDepth));
    const Token at = peek();
    if (accept("-")) return operation(Op::Neg, at, unary(depth + 1));
    if (accept("!")) return operation(Op::Not, at, unary(depth + 1));
    return primary(depth);
  }

  uint32_t primary(int depth) {
    const Token t = next();
    if (t.kind == Token::Number) {
      char* end = nullptr;
      const float value = std::strtof(t.text.c_str(), &end);
      if (end != t.text.c_str() + t.text.size() || !std::isfinite(value)) error(t, "not a finite number");
      return emit({Op::Constant, 0, 0, 0, value});
    }
    if (t.kind == Token::Symbol && t.text == "(") {
      const uint32_t inner = expr(depth + 1);
      expect(")");
      return inner;
    }
    if (t.kind != Token::Name) error(t, "expected a number, a name or '('");
    if (peek().kind == Token::Symbol && peek().text == "(") return call(t, depth);
    return variable(t);
  }

  uint32_t variable(const Token& t) {
    if (t.text == "s") {
      if (kind_ == ModKind::Mask) error(t, "a mask function does not read the score s");
      e_.reads_score_ = true;
      Instruction score{Op::Score};
      score.has_derivative = true;
      return emit(score);
    }
    const std::pair<const char*, Op> kVariables[] = {{"q", Op::Query}, {"k", Op::Key}, {"b", Op::Batch}, {"h", Op::Head}};
    for (const auto& [name, op] : kVariables)
      if (t.text == name) return emit({op});
    error(t, std::string("unknown name; the variables are ") + (kind_ == ModKind::Score ? "s, " : "") +
                 "q, k, b, h" + inputs_list());
  }

  std::string inputs_list() const {
    if (inputs_.empty()) return " (no inputs were given)";
    std::string list = " and the inputs";
    for (const std::string& name : inputs_) list += " " + name;
    return list;
  }

  uint32_t call(const Token& name, int depth) {
    expect("(");
    for (size_t i = 0; i < inputs_.size(); ++i)
      if (inputs_[i] == name.text) return input(name, static_cast<uint32_t>(i));
    const Function* function = nullptr;
    for (const Function& f : kFunctions)
      if (name.text == f.name) function = &f;
    if (function == nullptr)
      error(name, "unknown function; the functions are abs, exp, log, sqrt, tanh, floor, min, max, where" +
                      inputs_list());
    std::vector<uint32_t> args{expr(depth + 1)};
    while (accept(",")) args.push_back(expr(depth + 1));
    if (args.size() != function->arity)
      error(name, std::string(function->name) + " takes " + std::to_string(function->arity) + " argument" +
                      (function->arity == 1 ? "" : "s") + ", found " + std::to_string(args.size()));
    expect(")");
    args.resize(3, 0);
    return operation(function->op, name, args[0], args[1], args[2], function->arity);
  }

  uint32_t input(const Token& name, uint32_t which) {
    const Token index = next();
    using Index = ModExpression::Index;
    const std::pair<const char*, Index> kIndices[] = {
        {"q", Index::Query}, {"k", Index::Key}, {"h", Index::Head}, {"b", Index::Batch}};
    for (const auto& [var, kind] : kIndices) {
      if (index.kind != Token::Name || index.text != var) continue;
      expect(")");
      Instruction read{Op::Input};
      read.input = which;
      read.index = kind;
      e_.uses_.push_back({name.text, kind});
      return emit(read);
    }
    error(index, "an input is indexed by q, k, h or b: " + name.text + "(q)");
  }

  const std::string& text_;
  ModKind kind_;
  const std::vector<std::string>& inputs_;
  std::vector<Token> tokens_;
  size_t at_ = 0;
  ModExpression e_;
};

ModExpression ModExpression::parse(const std::string& text, ModKind kind, const std::vector<std::string>& inputs,
                                   size_t skip) {
  static const char* const kReserved[] = {"s", "q", "k", "b", "h", "abs", "exp", "log", "sqrt", "tanh", "floor",
                                          "min", "max", "where"};
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::string& name = inputs[i];
    bool identifier = !name.empty() && (std::isalpha(static_cast<unsigned char>(name[0])) || name[0] == '_');
    for (const char c : name) identifier = identifier && (std::isalnum(static_cast<unsigned char>(c)) || c == '_');
    if (!identifier) throw Error(label(kind) + ": input name '" + shown(name) + "' is not a name (letters, digits, _)");
    for (const char* reserved : kReserved)
      if (name == reserved) throw Error(label(kind) + ": input name '" + name + "' is a variable or function of the language");
    for (size_t j = 0; j < i; ++j)
      if (inputs[j] == name) throw Error(label(kind) + ": input name '" + name + "' is given twice");
  }
  return ModParser(text, kind, inputs, skip).parse();
}

std::vector<std::string> mod_input_names(const std::map<std::string, Tensor>& inputs) {
  std::vector<std::string> names;
  for (const auto& [name, tensor] : inputs) names.push_back(name);
  return names;
}

std::vector<ModInput> bind_mod_inputs(const std::string& who, const ModExpression& e,
                                      const std::map<std::string, Tensor>& inputs, int64_t batch, int64_t q_heads,
                                      int64_t q_len, int64_t kv_len, std::vector<Tensor>& held) {
  std::vector<ModInput> views;
  for (const auto& [name, tensor] : inputs) {
    const std::string what = who + label(e.kind()) + " '" + shown(e.text()) + "': input '" + name + "' is " +
                             (tensor.defined() ? tensor.shape().str() : std::string("undefined"));
    if (!tensor.defined() || tensor.dtype() != DType::F32 || (tensor.dim() != 1 && !(tensor.dim() == 2 && tensor.size(0) == batch)))
      throw Error(what + " but should be a float32 (L) or (B, L) with B = " + std::to_string(batch));
    const int64_t length = tensor.size(-1);
    for (const ModExpression::Use& use : e.uses()) {
      if (use.input != name) continue;
      using Index = ModExpression::Index;
      const int64_t need = use.index == Index::Query ? q_len
                           : use.index == Index::Key ? kv_len
                           : use.index == Index::Head ? q_heads
                                                      : batch;
      const char* by = use.index == Index::Query ? "q (Nq = "
                       : use.index == Index::Key ? "k (Nk = "
                       : use.index == Index::Head ? "h (Hq = "
                                                  : "b (B = ";
      if (length < need)
        throw Error(what + ": indexed by " + by + std::to_string(need) + ") it needs L >= " + std::to_string(need));
      if (use.index == Index::Batch && tensor.dim() != 1) throw Error(what + ": indexed by b it should be (L)");
    }
    held.push_back(tensor.contiguous());
    views.push_back({held.back().data(), tensor.dim() == 2 ? length : 0, length});
  }
  return views;
}

void ModExpression::evaluate(const ModLine& line, size_t n, const float* s, const ModInput* inputs, float* out,
                             float* d_out, float* scratch) const {
  const size_t count = program_.size();
  const bool derive_lines = d_out != nullptr && kind_ == ModKind::Score;
  const auto value = [&](uint32_t i) { return scratch + static_cast<size_t>(i) * n; };
  const auto slope = [&](uint32_t i) { return scratch + (count + i) * n; };
  for (uint32_t i = 0; i < count; ++i) {
    const Instruction& in = program_[i];
    float* v = value(i);
    const float *a = value(in.a), *b = value(in.b), *c = value(in.c);
    switch (in.op) {
      case Op::Constant: std::fill_n(v, n, in.constant); break;
      case Op::Score: std::copy_n(s, n, v); break;
      case Op::Query:
      case Op::Key: {
        const bool query = in.op == Op::Query;
        const int64_t first = query ? line.i0 : line.j0, step = query ? line.query_step : line.key_step;
        for (size_t x = 0; x < n; ++x) v[x] = static_cast<float>(first + static_cast<int64_t>(x) * step);
        break;
      }
      case Op::Batch: std::fill_n(v, n, static_cast<float>(line.b)); break;
      case Op::Head: std::fill_n(v, n, static_cast<float>(line.h)); break;
      case Op::Input: {
        const ModInput& input = inputs[in.input];
        const float* row = input.data + line.b * input.batch_stride;
        if (in.index == Index::Head || in.index == Index::Batch) {
          std::fill_n(v, n, row[in.index == Index::Head ? line.h : line.b]);
          break;
        }
        const bool query = in.index == Index::Query;
        const int64_t first = query ? line.i0 : line.j0, step = query ? line.query_step : line.key_step;
        if (step == 1) {
          std::copy_n(row + first, n, v);
          break;
        }
        for (size_t x = 0; x < n; ++x) v[x] = row[first + static_cast<int64_t>(x) * step];
        break;
      }
      default: apply_line(in.op, n, a, b, c, v);
    }
    if (!derive_lines) continue;
    float* dv = slope(i);
    if (in.op == Op::Score) {
      std::fill_n(dv, n, 1.0f);
    } else if (!in.has_derivative) {
      std::fill_n(dv, n, 0.0f);
    } else {
      const float *da = slope(in.a), *db = slope(in.b), *dc = slope(in.c);
      for (size_t x = 0; x < n; ++x) dv[x] = derive(in.op, v[x], a[x], b[x], da[x], db[x], dc[x]);
    }
  }
  const float* result = value(static_cast<uint32_t>(count - 1));
  if (kind_ == ModKind::Mask) {
    for (size_t x = 0; x < n; ++x) out[x] = result[x] != 0 ? 1.0f : 0.0f;
    return;
  }
  std::copy_n(result, n, out);
  if (derive_lines) std::copy_n(slope(static_cast<uint32_t>(count - 1)), n, d_out);
}

}  // namespace qkv::detail
