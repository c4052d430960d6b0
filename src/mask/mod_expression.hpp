// Score and mask functions written as text (FlexAttention's score_mod / mask_mod without a
// compiler): `s - 0.1 * abs(q - k)`, `30 * tanh(s / 30)`, `doc(q) == doc(k)`. Parsed once into a
// program of whole-line operations; a kernel evaluates it over one line of a tile at a time (n
// scores whose coordinates are a pipeline line: query i0 + x * query_step, key j0 + x * key_step)
// and, for a score function, gets d score' / d s alongside (forward-mode dual numbers: each
// operation carries its value and its derivative line).
//
// Grammar (lowest precedence first; `&&`, `||` and comparisons give 1 or 0):
//   expr    := and ("||" and)*
//   and     := compare ("&&" compare)*
//   compare := sum (("==" | "!=" | "<" | "<=" | ">" | ">=") sum)?
//   sum     := product (("+" | "-") product)*
//   product := unary (("*" | "/") unary)*
//   unary   := ("-" | "!") unary | primary
//   primary := number | variable | function "(" expr ("," expr)* ")" | input "(" index ")" | "(" expr ")"
//   variable: s (the score, score functions only), q, k (positions), b, h (batch, query head)
//   function: abs, exp, log, sqrt, tanh, floor (1 argument), min, max (2), where(cond, a, b)
//   input:    a caller's named per-token or per-head tensor, indexed by q, k, h or b
// Numbers are float32; positions and input values are exact integers below 2^24.
// Errors are MaskParseError (a qkv::Error) naming the column and the token.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <map>

#include "qkv/mask.hpp"

namespace qkv::detail {

enum class ModKind { Score, Mask };

// One named input as a kernel reads it: element [b, i] at data[b * batch_stride + i], i < length
// (batch_stride 0: one row for every batch).
struct ModInput {
  const float* data = nullptr;
  int64_t batch_stride = 0;
  int64_t length = 0;
};

// The coordinates of a line of n scores (the pipeline's Line).
struct ModLine {
  int64_t b, h, i0, j0, query_step, key_step;
};

class ModExpression {
 public:
  enum class Index { Query, Key, Head, Batch };
  // What an input is read at, for the caller's shape checks.
  struct Use {
    std::string input;
    Index index;
  };

  ModExpression() = default;
  // Parses `text` from its byte `skip` on (a prefix such as "mask:" before it; error columns
  // count from the start of `text`); `inputs` are the names the caller provides (in the order
  // evaluate() takes them).
  static ModExpression parse(const std::string& text, ModKind kind, const std::vector<std::string>& inputs = {},
                             size_t skip = 0);

  bool empty() const { return program_.empty(); }
  ModKind kind() const { return kind_; }
  const std::string& text() const { return text_; }
  const std::vector<Use>& uses() const { return uses_; }
  // Whether the score function reads s at all (a mask never does).
  bool reads_score() const { return reads_score_; }
  // Floats of scratch evaluate() needs for lines of up to n elements.
  size_t scratch_floats(size_t n) const { return 2 * program_.size() * n; }

  // out[x] = f(s[x], coordinates of x) for x < n; for a score function with d_out set,
  // d_out[x] = df/ds. For a mask, out[x] is 1 where the key is shown, 0 where hidden (s unused,
  // may be null). `inputs` in the order of parse()'s names; `scratch` has scratch_floats(n).
  void evaluate(const ModLine& line, size_t n, const float* s, const ModInput* inputs, float* out, float* d_out,
                float* scratch) const;

  enum class Op : uint8_t {
    Constant, Score, Query, Key, Batch, Head, Input,
    Neg, Not, Abs, Exp, Log, Sqrt, Tanh, Floor,
    Add, Sub, Mul, Div, Min, Max, Eq, Ne, Lt, Le, Gt, Ge, And, Or, Where
  };
  // One whole-line operation; its result is the line of the same index. a, b, c: earlier lines.
  struct Instruction {
    Op op;
    uint32_t a = 0, b = 0, c = 0;
    float constant = 0;      // Constant
    uint32_t input = 0;      // Input: which one
    Index index = Index::Query;
    bool has_derivative = false;  // depends on s (score functions): carries d/ds
  };
  // The program, for a kernel's own evaluation of it (attention/steps/score_mod-inl.h, SIMD over a
  // line): instruction i's result is line i, the last one's is f; evaluate() is its definition.
  const std::vector<Instruction>& program() const { return program_; }

 private:
  friend class ModParser;
  ModKind kind_ = ModKind::Score;
  std::string text_;
  std::vector<Instruction> program_;
  std::vector<Use> uses_;
  bool reads_score_ = false;
};

// The inputs of `e` (parsed with the names of `inputs`, in the map's order) as views for a problem
// (B, Hq, Nq, Nk), each checked against what `e` indexes it by: (L) or (B, L) with L >= Nq for q,
// L >= Nk for k, L >= Hq for h; (L) with L >= B for b. Packed copies go to `held`. Errors are
// qkv::Error starting with `who`.
std::vector<ModInput> bind_mod_inputs(const std::string& who, const ModExpression& e,
                                      const std::map<std::string, Tensor>& inputs, int64_t batch, int64_t q_heads,
                                      int64_t q_len, int64_t kv_len, std::vector<Tensor>& held);
// The names of `inputs`, in the order bind_mod_inputs() binds them.
std::vector<std::string> mod_input_names(const std::map<std::string, Tensor>& inputs);

}  // namespace qkv::detail
