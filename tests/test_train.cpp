// Training: AdamW against hand-computed steps, the .qkv file (round trip, and every way a file
// can be wrong), the synthetic tasks, and learning itself: a short fixed-seed run on recall
// reaches an accuracy that the same model with each token restricted to itself cannot.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "oracle.hpp"

namespace {

using ::testing::HasSubstr;
using qkv::Mask;
using qkv::Tensor;
using qkv::train::AttentionModel;
using qkv::train::ModelConfig;

// ---------------------------------------------------------------------------------------------
// AdamW

TEST(AdamW, OneStepByHand) {
  // torch.optim.AdamW defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01.
  // Step 1: m = 0.1 g, v = 0.001 g^2, so m / (1 - 0.9) = g and v / (1 - 0.999) = g^2:
  //   p <- p (1 - 1e-3 * 0.01) - 1e-3 * g / (|g| + 1e-8)
  //   p = 1.0,  g = 0.5:   0.99999 - 0.00099999998 = 0.99899000002
  //   p = -2.0, g = -0.1: -1.99998 + 0.0009999999  = -1.9989800001
  //   p = 0.5,  g = 0:     0.499995 (decay alone)
  Tensor p = Tensor::from({1.0f, -2.0f, 0.5f}, {3});
  Tensor g = Tensor::from({0.5f, -0.1f, 0.0f}, {3});
  qkv::nn::AdamW adamw({{"p", p, g}});
  EXPECT_FLOAT_EQ(adamw.options().lr, 1e-3f);
  EXPECT_FLOAT_EQ(adamw.options().weight_decay, 0.01f);
  adamw.step();
  EXPECT_NEAR(p.at({0}), 0.99899000002, 1e-7);
  EXPECT_NEAR(p.at({1}), -1.9989800001, 1e-7);
  EXPECT_NEAR(p.at({2}), 0.499995, 1e-7);

  // Step 2 with g = 0.25 for the first element, worked out:
  //   m = 0.9 * 0.05 + 0.1 * 0.25 = 0.07,  v = 0.999 * 0.00025 + 0.001 * 0.0625 = 0.00031225
  //   m_hat = 0.07 / 0.19 = 0.368421...,  v_hat = 0.00031225 / 0.001999 = 0.156203...
  //   p = 0.99899000002 * (1 - 1e-5) - 1e-3 * 0.368421 / (sqrt(0.156203) + 1e-8)
  g.at({0}) = 0.25f;
  adamw.step();
  const double m_hat = 0.07 / 0.19, v_hat = 0.00031225 / (1 - 0.999 * 0.999);
  EXPECT_NEAR(p.at({0}), 0.99899000002 * (1 - 1e-5) - 1e-3 * m_hat / (std::sqrt(v_hat) + 1e-8), 1e-7);
  EXPECT_EQ(adamw.steps(), 2);

  adamw.zero_grad();
  for (float x : g.to_vector()) EXPECT_EQ(x, 0.0f);
}

TEST(AdamW, Errors) {
  EXPECT_THAT([] { qkv::nn::AdamW({{"w", Tensor::zeros({2, 3}), Tensor::zeros({3, 2})}}); },
              ::testing::ThrowsMessage<qkv::Error>(HasSubstr("parameter 'w' is (2, 3) with grad (3, 2)")));
  EXPECT_THAT([] { qkv::nn::AdamW({}, {.beta1 = 1.0f}); }, ::testing::ThrowsMessage<qkv::Error>(HasSubstr("beta1")));
}

// ---------------------------------------------------------------------------------------------
// The .qkv file

class ModelFile : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = (std::filesystem::temp_directory_path() /
             ("qkv_test_" + std::string(info->name()) + "_" + std::to_string(::getpid()) + ".qkv"))
                .string();
  }
  void TearDown() override { std::filesystem::remove(path_); }

  std::vector<char> bytes() const {
    std::ifstream in(path_, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }
  void write(const std::vector<char>& data) const {
    std::ofstream out(path_, std::ios::binary | std::ios::trunc);
    out.write(data.data(), static_cast<std::streamsize>(data.size()));
  }
  void expect_load_error(const std::string& message) const {
    EXPECT_THAT([&] { (void)AttentionModel::load(path_); },
                ::testing::ThrowsMessage<qkv::Error>(::testing::AllOf(HasSubstr(path_), HasSubstr(message))));
  }

  const ModelConfig config_{.vocab_size = 9, .max_len = 7, .d_model = 8, .num_heads = 2, .num_layers = 2};
  std::string path_;
};

TEST_F(ModelFile, RoundTripKeepsEveryBit) {
  const AttentionModel model(config_, 11);
  model.save(path_);
  const AttentionModel loaded = AttentionModel::load(path_);
  EXPECT_EQ(loaded.config().vocab_size, 9);
  EXPECT_EQ(loaded.config().num_layers, 2);
  const auto a = model.parameters(), b = loaded.parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].name, b[i].name);
    EXPECT_EQ(a[i].tensor.to_vector(), b[i].tensor.to_vector()) << a[i].name;
  }
  const std::vector<int64_t> ids{1, 2, 3, 4, 5, 6, 7, 8, 0, 1};
  EXPECT_EQ(model.forward(ids, 2, 5).to_vector(), loaded.forward(ids, 2, 5).to_vector());
  // The documented layout: magic, version 1, then the five config integers.
  const std::vector<char> data = bytes();
  ASSERT_GE(data.size(), 52u);
  EXPECT_EQ(std::string(data.begin(), data.begin() + 8), "QKVMODEL");
  EXPECT_EQ(data[8], 1);
  EXPECT_EQ(data[12], 9);  // vocab_size, little-endian
}

TEST_F(ModelFile, TruncatedAnywhereIsAClearError) {
  AttentionModel(config_, 3).save(path_);
  const std::vector<char> whole = bytes();
  for (size_t cut : {size_t{0}, size_t{5}, size_t{10}, size_t{30}, size_t{56}, size_t{70}, whole.size() / 2, whole.size() - 1}) {
    SCOPED_TRACE("cut at " + std::to_string(cut));
    write({whole.begin(), whole.begin() + static_cast<std::ptrdiff_t>(cut)});
    expect_load_error(cut < 8 ? "not a qkv model file" : "truncated");
  }
}

TEST_F(ModelFile, ForeignVersionShapeAndTrailingBytes) {
  write({'#', '!', '/', 'b', 'i', 'n', '/', 's', 'h', '\n', 'e', 'c', 'h', 'o'});
  expect_load_error("not a qkv model file (no QKVMODEL magic number)");

  AttentionModel(config_, 3).save(path_);
  const std::vector<char> good = bytes();
  std::vector<char> data = good;
  data[8] = 7;  // version
  write(data);
  expect_load_error("format version 7, but this qkv reads version 1");

  data = good;
  data[36] = 3;  // num_heads 3 does not divide d_model 8
  write(data);
  expect_load_error("bad config");

  // The embedding's first dim (vocab 9) changed to 10: found by name and shape.
  data = good;
  const std::string name = "embedding.weight";
  const auto at = std::search(data.begin(), data.end(), name.begin(), name.end()) - data.begin();
  data[static_cast<size_t>(at) + name.size() + 4] = 10;
  write(data);
  expect_load_error("embedding.weight is (10, 8) in the file but (9, 8)");

  data = good;
  data.push_back(0);
  write(data);
  expect_load_error("1 unexpected bytes after the last tensor");

  EXPECT_THAT([] { (void)AttentionModel::load("/nonexistent/dir/model.qkv"); },
              ::testing::ThrowsMessage<qkv::Error>(HasSubstr("cannot open")));
}

// ---------------------------------------------------------------------------------------------
// Tasks

TEST(Tasks, SequencesAreWhatTheyClaim) {
  using qkv::train::Task;
  const qkv::train::TaskOptions recall{.task = Task::Recall, .symbols = 16, .pairs = 8};
  const qkv::train::Batch b = qkv::train::make_batch(recall, 20, 5);
  ASSERT_EQ(b.length, 17);
  for (int64_t s = 0; s < 20; ++s) {
    const int64_t* ids = b.ids.data() + s * 17;
    const int64_t* targets = b.targets.data() + s * 17;
    std::vector<int64_t> keys;
    for (int64_t p = 0; p < 8; ++p) keys.push_back(ids[2 * p]);
    std::sort(keys.begin(), keys.end());
    EXPECT_EQ(std::unique(keys.begin(), keys.end()), keys.end()) << "keys are distinct";
    for (int64_t i = 0; i < 16; ++i) EXPECT_EQ(targets[i], -100);
    // The answer is the value after the queried key.
    int64_t value = -1;
    for (int64_t p = 0; p < 8; ++p)
      if (ids[2 * p] == ids[16]) value = ids[2 * p + 1];
    EXPECT_EQ(targets[16], value);
  }
  // Deterministic in the seed.
  EXPECT_EQ(qkv::train::make_batch(recall, 20, 5).ids, b.ids);
  EXPECT_NE(qkv::train::make_batch(recall, 20, 6).ids, b.ids);

  const qkv::train::TaskOptions reverse{.task = Task::Reverse, .symbols = 5, .length = 4};
  const qkv::train::Batch r = qkv::train::make_batch(reverse, 1, 1);
  ASSERT_EQ(r.length, 8);
  EXPECT_EQ(r.ids[4], 5);  // the separator
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(r.targets[static_cast<size_t>(4 + i)], r.ids[static_cast<size_t>(3 - i)]);
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(r.targets[static_cast<size_t>(i)], -100);
  EXPECT_THAT([] { (void)qkv::train::parse_task("sort"); },
              ::testing::ThrowsMessage<qkv::Error>(HasSubstr("unknown task 'sort'")));
}

// ---------------------------------------------------------------------------------------------
// Learning: attention is what learns. Recall needs the query to find its key among the pairs,
// which only attention to other positions can do; with each token restricted to itself (a
// diagonal keep mask), the last position knows only the key and must guess the value.

TEST(Learning, RecallNeedsAttention) {
  const qkv::train::TaskOptions task{.task = qkv::train::Task::Recall, .symbols = 8, .pairs = 4};
  const ModelConfig config{.vocab_size = qkv::train::vocab_size(task), .max_len = qkv::train::sequence_length(task),
                           .d_model = 32, .num_heads = 2, .num_layers = 2};
  qkv::train::TrainOptions options;
  options.task = task;
  options.steps = 200;
  options.batch = 32;
  options.seed = 1;
  options.adamw.lr = 1e-2f;
  options.warmup_steps = 20;

  const int64_t n = qkv::train::sequence_length(task);
  Tensor diagonal = Tensor::zeros({n, n});
  for (int64_t i = 0; i < n; ++i) diagonal.at({i, i}) = 1;
  constexpr double kBar = 0.5;  // chance is 1/8

  AttentionModel attending(config, options.seed);
  qkv::train::train(attending, options);
  const double accuracy = qkv::train::evaluate(attending, task, 512, qkv::train::held_out_seed(1)).accuracy;

  options.mask = Mask::keep(diagonal);
  AttentionModel self_only(config, options.seed);
  qkv::train::train(self_only, options);
  const double self_only_accuracy =
      qkv::train::evaluate(self_only, task, 512, qkv::train::held_out_seed(1), options.mask).accuracy;

  std::printf("recall %lld pairs over %lld symbols, %lld steps: held-out accuracy %.1f%% with attention, %.1f%% "
              "with each token seeing only itself (bar %.0f%%, chance %.1f%%)\n",
              static_cast<long long>(task.pairs), static_cast<long long>(task.symbols),
              static_cast<long long>(options.steps), 100 * accuracy, 100 * self_only_accuracy, 100 * kBar,
              100.0 / static_cast<double>(task.symbols));
  EXPECT_GE(accuracy, kBar);
  EXPECT_LT(self_only_accuracy, kBar);
}

}  // namespace
