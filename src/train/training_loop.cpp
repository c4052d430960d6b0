// qkv::train's training loop (AdamW with warm-up and cosine decay, cross-entropy on the answer
// positions, checkpoints and resume) and held-out evaluation, on the tasks of tasks.cpp.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <numbers>
#include <string>

#include "qkv/train.hpp"
#include "core/random.hpp"
#include "train/tasks.hpp"

namespace qkv::train {

namespace {
// Argmax of each row of logits (rows, classes).
int64_t argmax(const float* row, int64_t classes) { return std::max_element(row, row + classes) - row; }

// Throws when a step left a non-finite loss or weight: training diverged (too high a learning
// rate, usually). Stopping here means no checkpoint or model is ever written from such weights.
void check_finite(const AttentionModel& model, int64_t step, float loss, float lr) {
  std::string what;
  if (!std::isfinite(loss)) what = "the loss is " + std::to_string(loss);
  for (const auto& p : model.parameters()) {
    if (!what.empty()) break;
    const Tensor values = p.tensor.contiguous();
    const float* v = values.data();
    if (!std::all_of(v, v + values.numel(), [](float x) { return std::isfinite(x); }))
      what = "'" + p.name + "' holds a non-finite weight";
  }
  if (!what.empty())
    throw Error("train: training diverged at step " + std::to_string(step) + ": " + what + " (learning rate " +
                std::to_string(lr) + " at that step); stopped without saving: lower the learning rate");
}

// Throws when the options cannot train this model (the task's own options are check_task's).
void check_options(const AttentionModel& model, const TrainOptions& o) {
  if (o.steps < 0 || o.batch < 1 || o.checkpoint_every < 0)
    throw Error("train: steps (" + std::to_string(o.steps) + ") must be >= 0, batch (" + std::to_string(o.batch) +
                ") >= 1 and checkpoint_every (" + std::to_string(o.checkpoint_every) + ") >= 0");
  if ((o.checkpoint_every > 0 || o.stop_requested) && o.checkpoint_path.empty())
    throw Error("train: checkpoint_every or stop_requested needs a checkpoint_path");
  if (model.config().vocab_size < vocab_size(o.task) || model.config().max_len < sequence_length(o.task))
    throw Error("train: the model (vocab " + std::to_string(model.config().vocab_size) + ", max_len " +
                std::to_string(model.config().max_len) + ") is too small for " + to_string(o.task.task) + " (vocab " +
                std::to_string(vocab_size(o.task)) + ", length " + std::to_string(sequence_length(o.task)) + ")");
}

// Learning rate: linear warm-up, then cosine from lr down to lr / 10 at the last step.
float learning_rate(const TrainOptions& o, int64_t step) {
  const float peak = o.adamw.lr;
  float lr = peak;
  if (step <= o.warmup_steps) {
    lr = peak * static_cast<float>(step) / static_cast<float>(o.warmup_steps);
  } else if (o.steps > o.warmup_steps) {
    const double progress_fraction = static_cast<double>(step - o.warmup_steps) / static_cast<double>(o.steps - o.warmup_steps);
    lr = static_cast<float>(peak * (0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi * progress_fraction))));
  }
  return lr;
}
}  // namespace

TrainResult train(AttentionModel& model, const TrainOptions& o, const std::function<void(const TrainStep&)>& progress) {
  check_task(o.task);
  check_options(model, o);
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
    const float lr = learning_rate(o, step);
    optimizer.options().lr = lr;

    const Batch batch = make_batch(o.task, o.batch, detail::mix64(o.seed) + static_cast<uint64_t>(step));
    const Tensor logits = model.forward(batch.ids, batch.batch, batch.length, o.mask);
    const float value = loss.forward(logits, batch.targets);
    optimizer.zero_grad();
    model.backward(loss.backward());
    optimizer.step();
    check_finite(model, step, value, lr);
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
  check_task(task);
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
