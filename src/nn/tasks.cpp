// qkv::train: the synthetic tasks (copy, reverse, recall), the training loop (AdamW with warm-up
// and cosine decay, cross-entropy on the answer positions) and held-out evaluation.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <numbers>

#include "qkv/train.hpp"
#include "random.hpp"

namespace qkv::train {

namespace {

constexpr int64_t kIgnore = -100;  // nn::CrossEntropyLoss's default ignore_index

void check(const TaskOptions& t) {
  if (t.symbols < 2 || t.symbols > 26)
    throw Error("task: symbols must be in [2, 26] (drawn as letters), got " + std::to_string(t.symbols));
  if (t.task == Task::Recall && (t.pairs < 1 || t.pairs > t.symbols))
    throw Error("recall: pairs (" + std::to_string(t.pairs) + ") must be in [1, symbols (" +
                std::to_string(t.symbols) + ")]: keys are distinct");
  if (t.task != Task::Recall && t.length < 1)
    throw Error(to_string(t.task) + ": length must be at least 1, got " + std::to_string(t.length));
}

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

// Argmax of each row of logits (rows, classes).
int64_t argmax(const float* row, int64_t classes) { return std::max_element(row, row + classes) - row; }

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
  check(task);
  Batch b;
  b.batch = batch;
  b.length = sequence_length(task);
  b.ids.resize(static_cast<size_t>(batch * b.length));
  b.targets.resize(b.ids.size());
  for (int64_t s = 0; s < batch; ++s) {
    detail::SplitMix64 rng(detail::mix64(seed * 1000003 + static_cast<uint64_t>(s)));
    make_sequence(task, rng, b.ids.data() + s * b.length, b.targets.data() + s * b.length);
  }
  return b;
}

uint64_t held_out_seed(uint64_t seed) { return detail::mix64(seed ^ 0x68656c646f7574ULL); }  // "heldout"

TrainResult train(AttentionModel& model, const TrainOptions& o, const std::function<void(const TrainStep&)>& progress) {
  check(o.task);
  if (o.steps < 0 || o.batch < 1 || o.checkpoint_every < 0)
    throw Error("train: steps (" + std::to_string(o.steps) + ") must be >= 0, batch (" + std::to_string(o.batch) +
                ") >= 1 and checkpoint_every (" + std::to_string(o.checkpoint_every) + ") >= 0");
  if ((o.checkpoint_every > 0 || o.stop_requested) && o.checkpoint_path.empty())
    throw Error("train: checkpoint_every or stop_requested needs a checkpoint_path");
  if (model.config().vocab_size < vocab_size(o.task) || model.config().max_len < sequence_length(o.task))
    throw Error("train: the model (vocab " + std::to_string(model.config().vocab_size) + ", max_len " +
                std::to_string(model.config().max_len) + ") is too small for " + to_string(o.task.task) + " (vocab " +
                std::to_string(vocab_size(o.task)) + ", length " + std::to_string(sequence_length(o.task)) + ")");
  model.zero_grad();
  nn::AdamW optimizer(model.parameters(), o.adamw);
  int64_t first_step = 1;
  if (o.resume) {
    if (o.resume->step > o.steps)
      throw Error("train: the checkpoint is at step " + std::to_string(o.resume->step) + ", past the run's " +
                  std::to_string(o.steps) + " steps");
    optimizer.load_state(o.resume->optimizer);
    first_step = o.resume->step + 1;
  }
  auto save_checkpoint = [&](int64_t step) {
    const Checkpoint checkpoint{.step = step, .optimizer = optimizer.state()};
    model.save(o.checkpoint_path, &checkpoint);
  };
  nn::CrossEntropyLoss loss;
  const auto start = std::chrono::steady_clock::now();
  int64_t tokens = 0;
  TrainResult result{.step = first_step - 1};
  for (int64_t step = first_step; step <= o.steps; ++step) {
    // Learning rate: linear warm-up, then cosine from lr down to lr / 10 at the last step.
    const float peak = o.adamw.lr;
    float lr = peak;
    if (step <= o.warmup_steps) {
      lr = peak * static_cast<float>(step) / static_cast<float>(o.warmup_steps);
    } else if (o.steps > o.warmup_steps) {
      const double progress_fraction = static_cast<double>(step - o.warmup_steps) / static_cast<double>(o.steps - o.warmup_steps);
      lr = static_cast<float>(peak * (0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi * progress_fraction))));
    }
    optimizer.options().lr = lr;

    const Batch batch = make_batch(o.task, o.batch, detail::mix64(o.seed) + static_cast<uint64_t>(step));
    const Tensor logits = model.forward(batch.ids, batch.batch, batch.length, o.mask);
    const float value = loss.forward(logits, batch.targets);
    optimizer.zero_grad();
    model.backward(loss.backward());
    optimizer.step();
    result.step = step;

    tokens += batch.batch * batch.length;
    if (progress) {
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      progress({.step = step, .loss = value, .lr = lr, .seconds = seconds, .tokens = tokens});
    }
    if (o.stop_requested && o.stop_requested()) {
      save_checkpoint(step);
      result.interrupted = true;
      return result;
    }
    if (o.checkpoint_every > 0 && step % o.checkpoint_every == 0) save_checkpoint(step);
  }
  return result;
}

Evaluation evaluate(const AttentionModel& model, const TaskOptions& task, int64_t sequences, uint64_t seed,
                    const Mask& mask) {
  check(task);
  constexpr int64_t kChunk = 256;  // sequences per forward
  const int64_t classes = model.config().vocab_size;
  int64_t right = 0, scored = 0, right_sequences = 0;
  double loss_sum = 0;
  nn::CrossEntropyLoss loss;
  for (int64_t done = 0, chunk = 0; done < sequences; done += kChunk, ++chunk) {
    const int64_t count = std::min(kChunk, sequences - done);
    const Batch b = make_batch(task, count, seed + static_cast<uint64_t>(chunk));
    const Tensor logits = model.forward(b.ids, b.batch, b.length, mask);
    loss_sum += static_cast<double>(loss.forward(logits, b.targets)) * static_cast<double>(loss.count());
    const float* z = logits.data();
    for (int64_t s = 0; s < count; ++s) {
      bool all = true;
      for (int64_t i = 0; i < b.length; ++i) {
        const int64_t row = s * b.length + i, target = b.targets[static_cast<size_t>(row)];
        if (target == kIgnore) continue;
        const bool ok = argmax(z + row * classes, classes) == target;
        right += ok;
        all = all && ok;
        ++scored;
      }
      right_sequences += all;
    }
  }
  Evaluation e;
  e.accuracy = scored ? static_cast<double>(right) / static_cast<double>(scored) : 0;
  e.sequence_accuracy = sequences ? static_cast<double>(right_sequences) / static_cast<double>(sequences) : 0;
  e.loss = scored ? static_cast<float>(loss_sum / static_cast<double>(scored)) : 0;
  return e;
}

}  // namespace qkv::train
