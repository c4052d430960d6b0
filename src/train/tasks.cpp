// qkv::train's synthetic tasks (copy, reverse, recall): their checks, sequences and batches.
// The training loop that learns them lives in train.cpp.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <numbers>

#include "qkv/train.hpp"
#include "core/allocator.hpp"  // check_request
#include "core/random.hpp"
#include "train/tasks.hpp"

namespace qkv::train {

void check_task(const TaskOptions& t) {
  if (t.symbols < 2 || t.symbols > 26)
    throw Error("task: symbols must be in [2, 26] (drawn as letters), got " + std::to_string(t.symbols));
  if (t.task == Task::Recall && (t.pairs < 1 || t.pairs > t.symbols))
    throw Error("recall: pairs (" + std::to_string(t.pairs) + ") must be in [1, symbols (" +
                std::to_string(t.symbols) + ")]: keys are distinct");
  if (t.task != Task::Recall && t.length < 1)
    throw Error(to_string(t.task) + ": length must be at least 1, got " + std::to_string(t.length));
}

namespace {

// Fills one sequence: `ids` (what the model reads) and `targets` (its next token, or kIgnore).
void make_sequence(const TaskOptions& t, detail::SplitMix64& rng, int64_t* ids, int64_t* targets) {
  const int64_t separator = t.symbols, n = sequence_length(t);
  auto draw = [&](int64_t below) { return static_cast<int64_t>(rng.next() % static_cast<uint64_t>(below)); };
  std::vector<int64_t> tokens;  // the full sequence, answer included: n + 1 tokens
  if (t.task == Task::Recall) {
    std::vector<int64_t> keys(static_cast<size_t>(t.symbols));
    for (int64_t s = 0; s < t.symbols; ++s) keys[static_cast<size_t>(s)] = s;
    for (int64_t s = 0; s < t.pairs; ++s) std::swap(keys[static_cast<size_t>(s)], keys[static_cast<size_t>(s + draw(t.symbols - s))]);
    std::vector<int64_t> values;
    for (int64_t p = 0; p < t.pairs; ++p) {
      values.push_back(draw(t.symbols));
      tokens.push_back(keys[static_cast<size_t>(p)]);
      tokens.push_back(values.back());
    }
    const int64_t asked = draw(t.pairs);
    tokens.push_back(keys[static_cast<size_t>(asked)]);
    tokens.push_back(values[static_cast<size_t>(asked)]);
  } else {
    std::vector<int64_t> items;
    for (int64_t i = 0; i < t.length; ++i) items.push_back(draw(t.symbols));
    tokens = items;
    tokens.push_back(separator);
    if (t.task == Task::Reverse) std::reverse(items.begin(), items.end());
    tokens.insert(tokens.end(), items.begin(), items.end());
  }
  // Position i reads tokens[i] and predicts tokens[i + 1], scored only where the answer starts:
  // recall's last position; copy/reverse from the separator on.
  const int64_t first_scored = t.task == Task::Recall ? n - 1 : t.length;
  for (int64_t i = 0; i < n; ++i) {
    ids[i] = tokens[static_cast<size_t>(i)];
    targets[i] = i >= first_scored ? tokens[static_cast<size_t>(i + 1)] : kIgnore;
  }
}


}  // namespace

Task parse_task(const std::string& name) {
  if (name == "copy") return Task::Copy;
  if (name == "recall") return Task::Recall;
  if (name == "reverse") return Task::Reverse;
  throw Error("unknown task '" + name + "': choose copy, recall or reverse");
}

std::string to_string(Task task) {
  switch (task) {
    case Task::Copy: return "copy";
    case Task::Recall: return "recall";
    case Task::Reverse: return "reverse";
  }
  return "?";
}

Positions parse_positions(const std::string& name) {
  if (name == "sinusoidal") return Positions::Sinusoidal;
  if (name == "rotary") return Positions::Rotary;
  if (name == "t5") return Positions::T5;
  throw Error("unknown positions '" + name + "': choose sinusoidal, rotary or t5");
}

std::string to_string(Positions positions) {
  return positions == Positions::Rotary ? "rotary" : positions == Positions::T5 ? "t5" : "sinusoidal";
}

nn::AttentionKind parse_attention_kind(const std::string& name) {
  if (name == "softmax") return nn::AttentionKind::Softmax;
  if (name == "linear") return nn::AttentionKind::Linear;
  throw Error("unknown attention kind '" + name + "': choose softmax or linear");
}

std::string to_string(nn::AttentionKind kind) { return kind == nn::AttentionKind::Linear ? "linear" : "softmax"; }

int64_t vocab_size(const TaskOptions& task) { return task.symbols + 1; }

int64_t sequence_length(const TaskOptions& task) {
  return task.task == Task::Recall ? 2 * task.pairs + 1 : 2 * task.length;
}

std::string token_text(const TaskOptions& task, int64_t id) {
  if (id == task.symbols) return "|";
  if (id >= 0 && id < task.symbols) return std::string(1, static_cast<char>('a' + id));
  return "?";
}

Batch make_batch(const TaskOptions& task, int64_t batch, uint64_t seed) {
  check_task(task);
  const int64_t length = sequence_length(task);
  if (batch < 1) throw Error("make_batch: batch must be at least 1, got " + std::to_string(batch));
  // The ids and targets: std::vectors, which the memory limit does not count.
  detail::check_request("make_batch", "batch " + std::to_string(batch) + " of length " + std::to_string(length),
                        {0.0, 2.0 * sizeof(int64_t) * static_cast<double>(batch) * static_cast<double>(length)},
                        "token ids and targets", "a smaller batch");
  Batch b;
  b.batch = batch;
  b.length = length;
  b.ids.resize(static_cast<size_t>(batch * b.length));
  b.targets.resize(b.ids.size());
  for (int64_t s = 0; s < batch; ++s) {
    detail::SplitMix64 rng(detail::mix64(seed * 1000003 + static_cast<uint64_t>(s)));
    make_sequence(task, rng, b.ids.data() + s * b.length, b.targets.data() + s * b.length);
  }
  return b;
}

uint64_t held_out_seed(uint64_t seed) { return detail::mix64(seed ^ 0x68656c646f7574ULL); }  // "heldout"

}  // namespace qkv::train
