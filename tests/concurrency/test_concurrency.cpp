// Concurrency: the library called from 8 threads at once gives, call for call, what a single
// thread gives. Each thread runs every workload of a fixed list (different shapes, backends
// Reference / Flash / Decode, every kind of mask, dropout, strided views, and MultiHeadAttention
// inference on ONE module shared by all threads) in its own rotated order, several rounds, and
// compares every result with the single-threaded run; and one module is trained from 4 threads
// at once. Built a second time under ThreadSanitizer (make test-tsan), where a data race fails
// the test even when numbers agree.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "qkv/qkv.hpp"

namespace {

using qkv::AttentionOptions;
using qkv::Backend;
using qkv::Mask;
using qkv::Tensor;

struct Workload {
  std::string name;
  std::function<std::vector<float>()> run;  // the result's output, weights and lse, flattened
};

// The values of every defined tensor of a result, one after another.
std::vector<float> flatten(const qkv::AttentionResult& r) {
  std::vector<float> all = r.output.to_vector();
  for (const Tensor* t : {&r.weights, &r.lse})
    if (t->defined()) {
      const std::vector<float> more = t->to_vector();
      all.insert(all.end(), more.begin(), more.end());
    }
  return all;
}

// The fixed list. Inputs are made here, once, and only read by the threads.
std::vector<Workload> make_workloads(const qkv::nn::MultiHeadAttention& shared_module) {
  std::vector<Workload> list;
  auto attention = [&list](std::string name, const Tensor& q, const Tensor& k, const Tensor& v,
                           const AttentionOptions& options) {
    list.push_back({std::move(name), [q, k, v, options] { return flatten(qkv::scaled_dot_product_attention(q, k, v, options)); }});
  };
  uint64_t seed = 1;
  auto randn = [&seed](qkv::Shape shape) { return Tensor::randn(shape, seed++); };

  AttentionOptions o;
  o.backend = Backend::Reference;
  o.need_weights = true;
  o.mask = Mask::causal();
  attention("reference causal weights", randn({2, 4, 33, 16}), randn({2, 4, 33, 16}), randn({2, 4, 33, 16}), o);

  o = {};
  o.backend = Backend::Flash;
  o.mask = Mask::key_lengths({70, 13});
  attention("flash padding", randn({2, 2, 100, 32}), randn({2, 2, 100, 32}), randn({2, 2, 100, 24}), o);

  o = {};
  o.backend = Backend::Flash;
  o.mask = Mask::window(8, 2) & Mask::causal();
  attention("flash window, grouped-query", randn({1, 8, 200, 64}), randn({1, 2, 200, 64}), randn({1, 2, 200, 64}), o);

  o = {};
  o.backend = Backend::Decode;
  o.mask = Mask::causal(999);
  attention("decode over a long cache", randn({2, 4, 1, 64}), randn({2, 4, 1000, 64}), randn({2, 4, 1000, 64}), o);

  o = {};
  o.backend = Backend::Reference;
  Tensor keep = Tensor::zeros({17, 23});
  for (int64_t i = 0; i < 17; ++i)
    for (int64_t j = 0; j < 23; ++j) keep.at({i, j}) = static_cast<float>((i * 7 + j * 3) % 5 != 0);
  o.mask = Mask::keep(keep);
  o.dropout_p = 0.25f;
  o.seed = 42;
  o.need_weights = true;
  attention("reference keep tensor, dropout", randn({3, 17, 8}), randn({3, 23, 8}), randn({3, 23, 8}), o);

  o = {};
  Tensor bias = randn({1, 3, 40, 40});
  o.mask = Mask::additive(bias);
  // Strided views: q read through a transpose, k and v through a slice of a wider tensor.
  const Tensor wide = randn({1, 40, 3, 16}).transpose(1, 2);
  attention("auto additive mask on views", wide, wide, randn({1, 3, 40, 16}), o);

  // MultiHeadAttention inference: one module (eval mode), all threads.
  const Tensor x = randn({2, 12, shared_module.embed_dim()});
  list.push_back({"MultiHeadAttention eval, shared module", [&shared_module, x] {
                    qkv::nn::MultiHeadAttentionOutput out =
                        shared_module.forward(x, Mask::key_lengths({12, 7}), qkv::nn::Weights::Averaged);
                    std::vector<float> all = out.output.to_vector();
                    const std::vector<float> w = out.weights.to_vector();
                    all.insert(all.end(), w.begin(), w.end());
                    return all;
                  }});
  // No weights asked for: with 2 or 4 OpenMP threads (the module's 4 KV heads) this forward goes
  // by heads, each caller opening its own region (src/nn/mha_by_heads.cpp).
  list.push_back({"MultiHeadAttention eval by heads, shared module", [&shared_module, x] {
                    return shared_module.forward(x, Mask::key_lengths({12, 7})).output.to_vector();
                  }});
  const Tensor memory = randn({2, 30, shared_module.embed_dim()});
  list.push_back({"MultiHeadAttention eval, cross", [&shared_module, x, memory] {
                    return shared_module.forward(x, memory, memory).output.to_vector();
                  }});
  return list;
}

TEST(Concurrency, EightThreadsAgreeWithOneThread) {
  qkv::nn::MultiHeadAttention module(32, 4, {.causal = false, .seed = 7});
  module.eval();
  const std::vector<Workload> list = make_workloads(module);
  std::vector<std::vector<float>> expected;
  for (const Workload& w : list) expected.push_back(w.run());

  constexpr int kThreads = 8, kRounds = 3;
  std::vector<std::string> failures(kThreads);
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      ready.fetch_add(1);
      while (ready.load() < kThreads) std::this_thread::yield();  // start together
      try {
        for (int round = 0; round < kRounds; ++round)
          for (size_t i = 0; i < list.size(); ++i) {
            const size_t w = (i + static_cast<size_t>(t)) % list.size();  // each thread its own order
            const std::vector<float> got = list[w].run();
            bool same = got.size() == expected[w].size();
            for (size_t e = 0; same && e < got.size(); ++e)
              same = got[e] == expected[w][e] || (std::isnan(got[e]) && std::isnan(expected[w][e])) ||
                     std::fabs(got[e] - expected[w][e]) <= 1e-6f * (1 + std::fabs(expected[w][e]));
            if (!same && failures[static_cast<size_t>(t)].empty())
              failures[static_cast<size_t>(t)] = list[w].name + " (round " + std::to_string(round) + ")";
          }
      } catch (const std::exception& e) {
        failures[static_cast<size_t>(t)] = std::string("threw: ") + e.what();
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(failures[static_cast<size_t>(t)], "") << "thread " << t;
}

// One module in training mode (dropout on), 4 threads: self- and cross-attention forwards,
// backwards, zero_grad, parameters, load_state_dict and train() interleave on it. The module's
// lock (include/qkv/nn.hpp) makes each call whole: every forward returns a finite output of its
// shape, every backward either returns gradients of the input's shape or refuses with a
// qkv::Error (the module's last forward was another thread's of the other kind), and nothing
// races (ThreadSanitizer) or corrupts the heap (the ASan suite). Without the lock, the forwards'
// writes of the state backward reads corrupted the heap within a few hundred calls.
TEST(Concurrency, TrainingModuleSharedByFourThreads) {
  qkv::nn::MultiHeadAttention module(32, 4, {.dropout = 0.25f, .seed = 3});
  const Tensor x = Tensor::randn({2, 6, 32}, 1), memory = Tensor::randn({2, 9, 32}, 2);
  const std::map<std::string, Tensor> state = [&] {
    std::map<std::string, Tensor> s;
    for (const auto& p : module.parameters()) s[p.name] = p.tensor.clone();
    return s;
  }();
  constexpr int kThreads = 4, kSteps = 40;
  std::vector<std::string> failures(kThreads);
  std::atomic<int> ready{0}, refused{0};
  auto finite = [](const Tensor& t) {
    const std::vector<float> v = t.to_vector();
    return std::all_of(v.begin(), v.end(), [](float e) { return std::isfinite(e); });
  };
  auto step = [&](int t, int i) {
    const bool cross = (t + i) % 2 == 1;
    const Tensor out = cross ? module.forward(x, memory, memory).output : module.forward(x).output;
    if (out.shape() != x.shape() || !finite(out)) throw std::runtime_error("forward gave a bad output");
    try {
      const Tensor dx = cross ? module.backward_cross(out).query : module.backward(out);
      if (dx.shape() != x.shape() || !finite(dx)) throw std::runtime_error("backward gave a bad gradient");
    } catch (const qkv::Error&) {
      refused.fetch_add(1);  // another thread's forward of the other kind came last
    }
    if (i % 8 == t) module.zero_grad();
    if (i % 10 == t) module.load_state_dict(state);
    if (i % 13 == t) module.train(true);
    (void)module.parameters();
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      ready.fetch_add(1);
      while (ready.load() < kThreads) std::this_thread::yield();
      try {
        for (int i = 0; i < kSteps; ++i) step(t, i);
      } catch (const std::exception& e) {
        failures[static_cast<size_t>(t)] = e.what();
      }
    });
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(failures[static_cast<size_t>(t)], "") << "thread " << t;
  EXPECT_LT(refused.load(), kThreads * kSteps);  // backwards ran, not only refusals
  EXPECT_TRUE(module.is_training());
}

// The rule the threads rely on: an eval() forward keeps nothing, so backward has nothing to use.
TEST(Concurrency, EvalForwardKeepsNoStateForBackward) {
  qkv::nn::MultiHeadAttention module(8, 2, {.seed = 1});
  module.eval();
  const Tensor x = Tensor::randn({1, 3, 8}, 2);
  (void)module.forward(x);
  EXPECT_THROW((void)module.backward(Tensor::zeros({1, 3, 8})), qkv::Error);
  module.train();
  (void)module.forward(x);
  EXPECT_NO_THROW((void)module.backward(Tensor::zeros({1, 3, 8})));
}

}  // namespace
