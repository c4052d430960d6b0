// Training: AdamW against hand-computed steps, the .qkv file (round trip, and every way a file
// can be wrong), the synthetic tasks, and learning itself: a short fixed-seed run on recall
// reaches an accuracy that the same model with each token restricted to itself cannot.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <pthread.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cstring>

#include "core/crc32c.hpp"
#include "harness/oracle.hpp"

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
  // Writes `data` with its last 4 bytes replaced by the CRC-32C of the rest, so a test can edit
  // one field and reach the check behind the checksum.
  void write_resealed(std::vector<char> data) const {
    const uint32_t crc = qkv::detail::crc32c_update(0, data.data(), data.size() - 4);
    std::memcpy(data.data() + data.size() - 4, &crc, 4);
    write(data);
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
  // The documented layout: magic, version 3, flags 0, the five config integers, ..., CRC-32C.
  const std::vector<char> data = bytes();
  ASSERT_GE(data.size(), 60u);
  EXPECT_EQ(std::string(data.begin(), data.begin() + 8), "QKVMODEL");
  EXPECT_EQ(data[8], 3);
  EXPECT_EQ(data[12], 0);
  EXPECT_EQ(data[16], 9);  // vocab_size, little-endian
  uint32_t stored;
  std::memcpy(&stored, data.data() + data.size() - 4, 4);
  EXPECT_EQ(stored, qkv::detail::crc32c_update(0, data.data(), data.size() - 4));
  // The save left no temporary file beside the model.
  for (const auto& entry : std::filesystem::directory_iterator(std::filesystem::path(path_).parent_path()))
    EXPECT_EQ(entry.path().string().find(path_ + ".tmp-"), std::string::npos) << entry.path();
}

TEST(Crc32c, KnownAnswers) {
  // The check value of the CRC catalogue (CRC-32/ISCSI) and RFC 3720's 32 zero bytes.
  EXPECT_EQ(qkv::detail::crc32c_update(0, "123456789", 9), 0xE3069283u);
  const std::vector<char> zeros(32, 0);
  EXPECT_EQ(qkv::detail::crc32c_update(0, zeros.data(), zeros.size()), 0x8A9136AAu);
  // Chunked equals whole.
  EXPECT_EQ(qkv::detail::crc32c_update(qkv::detail::crc32c_update(0, "12345", 5), "6789", 4), 0xE3069283u);
}

TEST_F(ModelFile, AFlippedBitIsCaughtByTheChecksum) {
  AttentionModel(config_, 3).save(path_);
  std::vector<char> data = bytes();
  data[data.size() / 2] ^= 0x10;  // one bit in some tensor's values: shapes and names still fine
  write(data);
  expect_load_error("corrupt or truncated: the CRC-32C of its");
}

TEST_F(ModelFile, Version1FilesStillLoad) {
  // A version 1 file is version 2 without the flags and the checksum; version 2 is version 3
  // without the attention kind, the positions and the mask (12 bytes at 56 when the mask is empty).
  const AttentionModel model(config_, 5);
  model.save(path_);
  std::vector<char> data = bytes();
  data.erase(data.end() - 4, data.end());
  data.erase(data.begin() + 56, data.begin() + 68);
  data.erase(data.begin() + 12, data.begin() + 16);
  data[8] = 1;
  write(data);
  const AttentionModel loaded = AttentionModel::load(path_);
  const auto a = model.parameters(), b = loaded.parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].tensor.to_vector(), b[i].tensor.to_vector()) << a[i].name;
  // It loads, but not silently: nothing could have caught a flipped weight.
  EXPECT_EQ(loaded.file_version(), 1u);
  EXPECT_THAT(loaded.file_warning(), HasSubstr("carries no checksum"));
  // Saved again, it is the current version, checksummed, and loads without a warning.
  loaded.save(path_);
  EXPECT_EQ(bytes()[8], static_cast<char>(qkv::train::kModelFormatVersion));
  const AttentionModel resaved = AttentionModel::load(path_);
  EXPECT_EQ(resaved.file_version(), qkv::train::kModelFormatVersion);
  EXPECT_EQ(resaved.file_warning(), "");
  EXPECT_EQ(AttentionModel(config_, 5).file_warning(), "");
}

TEST_F(ModelFile, Version2FilesLoadAsSoftmaxSinusoidalUnmasked) {
  const AttentionModel model(config_, 6);
  model.save(path_);
  std::vector<char> data = bytes();
  ASSERT_EQ(std::vector<char>(data.begin() + 56, data.begin() + 68), std::vector<char>(12, 0));
  data.erase(data.begin() + 56, data.begin() + 68);
  data[8] = 2;
  write_resealed(data);
  const AttentionModel loaded = AttentionModel::load(path_);
  EXPECT_EQ(loaded.config().attention, qkv::nn::AttentionKind::Softmax);
  EXPECT_EQ(loaded.config().positions, qkv::train::Positions::Sinusoidal);
  EXPECT_EQ(loaded.config().mask, "");
  const std::vector<int64_t> ids{1, 2, 3, 4, 5, 6, 7};
  EXPECT_EQ(model.forward(ids, 1, 7).to_vector(), loaded.forward(ids, 1, 7).to_vector());
}

// Version 3's fields: every attention kind, both positions and a mask expression survive a
// save, and the loaded model computes what the saved one did.
TEST_F(ModelFile, EveryKindRoundTrips) {
  using qkv::nn::AttentionKind;
  using qkv::train::Positions;
  const std::vector<ModelConfig> configs{
      {.vocab_size = 9, .max_len = 7, .d_model = 8, .num_heads = 2, .num_layers = 2},
      {.vocab_size = 9, .max_len = 7, .d_model = 8, .num_heads = 2, .num_layers = 2, .attention = AttentionKind::Linear},
      {.vocab_size = 9, .max_len = 7, .d_model = 8, .num_heads = 2, .num_layers = 2, .positions = Positions::Rotary},
      {.vocab_size = 9, .max_len = 7, .d_model = 8, .num_heads = 2, .num_layers = 2, .attention = AttentionKind::Linear,
       .positions = Positions::Rotary},
      {.vocab_size = 9, .max_len = 7, .d_model = 8, .num_heads = 2, .num_layers = 2, .mask = "window(1) | strided(3)"},
      {.vocab_size = 9, .max_len = 7, .d_model = 8, .num_heads = 2, .num_layers = 2, .positions = Positions::T5},
  };
  const std::vector<int64_t> ids{1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4, 5};
  std::vector<std::vector<float>> outputs;
  for (const ModelConfig& config : configs) {
    SCOPED_TRACE(qkv::train::to_string(config.attention) + " " + qkv::train::to_string(config.positions) + " '" +
                 config.mask + "'");
    const AttentionModel model(config, 12);
    model.save(path_);
    const AttentionModel loaded = AttentionModel::load(path_);
    EXPECT_EQ(loaded.config().attention, config.attention);
    EXPECT_EQ(loaded.config().positions, config.positions);
    EXPECT_EQ(loaded.config().mask, config.mask);
    const std::vector<float> out = model.forward(ids, 2, 7).to_vector();
    EXPECT_EQ(out, loaded.forward(ids, 2, 7).to_vector());
    for (const auto& other : outputs) EXPECT_NE(out, other) << "the field changes what the model computes";
    outputs.push_back(out);
  }
  // The mask is honoured: with window(0) | strided(7) each token sees only itself, which the
  // unmasked model does not compute.
  ModelConfig self_only = configs[0];
  self_only.mask = "window(0)";
  Tensor diagonal = Tensor::zeros({7, 7});
  for (int64_t i = 0; i < 7; ++i) diagonal.at({i, i}) = 1;
  EXPECT_EQ(AttentionModel(self_only, 12).forward(ids, 2, 7).to_vector(),
            AttentionModel(configs[0], 12).forward(ids, 2, 7, Mask::keep(diagonal)).to_vector());
  // Configs the format cannot honour are refused when built.
  ModelConfig bad = configs[1];
  bad.mask = "window(2)";
  EXPECT_THAT([&] { AttentionModel(bad, 1); }, ::testing::ThrowsMessage<qkv::Error>(HasSubstr("linear attention takes no mask")));
  bad = configs[0];
  bad.mask = "window(2";
  EXPECT_THAT([&] { AttentionModel(bad, 1); }, ::testing::ThrowsMessage<qkv::Error>(HasSubstr("mask")));
}

// A linear model's head weights, phi(q_i).phi(k_j) / (sum_{j' <= i} phi(q_i).phi(k_j') + eps),
// against a float64 evaluation from the layer's own projections.
TEST(LinearModel, HeadWeightsAreTheNormalisedFeatureProducts) {
  const ModelConfig config{.vocab_size = 7, .max_len = 6, .d_model = 8, .num_heads = 2, .num_layers = 1,
                           .attention = qkv::nn::AttentionKind::Linear};
  const AttentionModel model(config, 4);
  const std::vector<int64_t> ids{3, 1, 6, 0, 2, 5};
  const int64_t n = 6, d = 8, hd = 4;
  std::vector<Tensor> weights;
  const Tensor logits = model.forward(ids, 1, n, {}, &weights);
  EXPECT_EQ(logits.to_vector(), model.forward(ids, 1, n).to_vector()) << "asking for weights changes nothing";
  ASSERT_EQ(weights.size(), 1u);
  ASSERT_EQ(weights[0].shape(), qkv::Shape({1, 2, n, n}));
  const Tensor normed = model.layers[0].norm.forward(model.positions.forward(model.embedding.forward(ids, {1, n})));
  const auto& attention = model.layers[0].attention;
  auto features = [&](const qkv::nn::Linear& proj, int64_t i, int64_t h) {
    std::vector<double> phi(static_cast<size_t>(hd));
    for (int64_t c = 0; c < hd; ++c) {
      double sum = proj.bias.at({h * hd + c});
      for (int64_t e = 0; e < d; ++e) sum += static_cast<double>(normed.at({0, i, e})) * proj.weight.at({h * hd + c, e});
      phi[static_cast<size_t>(c)] = sum > 0 ? sum + 1 : std::exp(sum);
    }
    return phi;
  };
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t i = 0; i < n; ++i) {
      const std::vector<double> q = features(attention.q_proj, i, h);
      std::vector<double> products;
      double total = 0;
      for (int64_t j = 0; j <= i; ++j) {
        const std::vector<double> k = features(attention.k_proj, j, h);
        double dot = 0;
        for (int64_t c = 0; c < hd; ++c) dot += q[static_cast<size_t>(c)] * k[static_cast<size_t>(c)];
        products.push_back(dot);
        total += dot;
      }
      for (int64_t j = 0; j < n; ++j) {
        const double expected = j <= i ? products[static_cast<size_t>(j)] / (total + 1e-6) : 0.0;
        EXPECT_NEAR(weights[0].at({0, h, i, j}), expected, 1e-5) << "head " << h << " query " << i << " key " << j;
      }
    }
}

TEST_F(ModelFile, CorruptVersion3FieldsAreClearErrors) {
  const ModelConfig masked{.vocab_size = 9, .max_len = 7, .d_model = 8, .num_heads = 2, .num_layers = 1,
                           .mask = "strided(3)"};
  AttentionModel(masked, 3).save(path_);
  const std::vector<char> good = bytes();
  ASSERT_EQ(good[64], 10);  // the mask's length, then "strided(3)"
  ASSERT_EQ(std::string(good.begin() + 68, good.begin() + 78), "strided(3)");
  std::vector<char> data = good;
  data[56] = 5;
  write_resealed(data);
  expect_load_error("unknown attention kind 5 (0 softmax, 1 linear)");
  data = good;
  data[60] = 9;
  write_resealed(data);
  expect_load_error("unknown positions 9 (0 sinusoidal, 1 rotary, 2 t5)");
  data = good;
  data[66] = 1;  // 65546 bytes
  write_resealed(data);
  expect_load_error("a mask expression of 65546 bytes (at most 4096)");
  data = good;
  data[64] = static_cast<char>(0xA0);  // 4000 bytes: more than follow the config
  data[65] = 0x0F;
  write_resealed(data);
  expect_load_error("is truncated: the mask expression needs 4000 bytes at offset 68");
  data = good;
  data[64] = 14;  // the mask runs into the tensor count's bytes
  write_resealed(data);
  expect_load_error("bad config: AttentionModel: mask: ");
  data = good;
  data[75] = 'x';  // "stridedx3)"
  write_resealed(data);
  expect_load_error("bad config: AttentionModel: mask: ");
  data = good;
  data[56] = 1;  // linear with a mask
  write_resealed(data);
  expect_load_error("linear attention takes no mask");
}

TEST_F(ModelFile, AFailedSaveKeepsThePreviousFile) {
  const AttentionModel old_model(config_, 1), new_model(config_, 2);
  old_model.save(path_);
  const std::vector<char> before = bytes();
  // A full disk, as the kernel reports it to a process over its file size limit: EFBIG.
  rlimit saved{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &saved), 0);
  auto* previous_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit small = saved;
  small.rlim_cur = 1000;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  EXPECT_THAT([&] { new_model.save(path_); },
              ::testing::ThrowsMessage<qkv::Error>(::testing::AllOf(HasSubstr("failed"),
                                                                    HasSubstr("the previous file, if any, is unchanged"))));
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &saved), 0);
  std::signal(SIGXFSZ, previous_handler);
  EXPECT_EQ(bytes(), before);
  (void)AttentionModel::load(path_);
  for (const auto& entry : std::filesystem::directory_iterator(std::filesystem::path(path_).parent_path()))
    EXPECT_EQ(entry.path().string().find(path_ + ".tmp-"), std::string::npos) << "left behind: " << entry.path();
  // Saving into a folder that does not exist names it.
  EXPECT_THAT([&] { new_model.save("/nonexistent/dir/model.qkv"); },
              ::testing::ThrowsMessage<qkv::Error>(HasSubstr("cannot create a temporary file in '/nonexistent/dir'")));
}

// Past the file size limit (ulimit -f) the kernel sends SIGXFSZ, whose default action kills the
// process; save() must turn it into EFBIG and an error. In a child process, with the signal's
// default action, so that the old behaviour (death by SIGXFSZ) fails the test instead of the run.
TEST_F(ModelFile, TheFileSizeLimitIsAnErrorNotASignal) {
  const AttentionModel old_model(config_, 1), new_model(config_, 2);
  old_model.save(path_);
  const std::vector<char> before = bytes();
  EXPECT_EXIT(
      {
        std::signal(SIGXFSZ, SIG_DFL);
        rlimit small{};
        getrlimit(RLIMIT_FSIZE, &small);
        small.rlim_cur = 1000;
        setrlimit(RLIMIT_FSIZE, &small);
        try {
          new_model.save(path_);
        } catch (const qkv::Error& e) {
          std::fprintf(stderr, "%s\n", e.what());
          std::_Exit(std::strstr(e.what(), std::strerror(EFBIG)) != nullptr ? 0 : 3);
        }
        std::_Exit(4);
      },
      ::testing::ExitedWithCode(0), "the previous file, if any, is unchanged");
  EXPECT_EQ(bytes(), before);
  // The saving thread's signal mask is as it was: SIGXFSZ not left blocked.
  sigset_t mask;
  ASSERT_EQ(pthread_sigmask(SIG_BLOCK, nullptr, &mask), 0);
  EXPECT_FALSE(sigismember(&mask, SIGXFSZ));
}

// Renaming over a FIFO, a device or a folder would replace it: such a target is refused, and the
// FIFO is still there afterwards.
TEST_F(ModelFile, SaveRefusesWhatIsNotARegularFile) {
  const AttentionModel model(config_, 1);
  ASSERT_EQ(::mkfifo(path_.c_str(), 0600), 0);
  EXPECT_THAT([&] { model.save(path_); }, ::testing::ThrowsMessage<qkv::Error>(::testing::AllOf(
                                              HasSubstr(path_), HasSubstr("it is a FIFO: a model is saved only to a "
                                                                          "regular file or a new one"))));
  struct stat st {};
  ASSERT_EQ(::lstat(path_.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode));
  std::filesystem::remove(path_);
  std::filesystem::create_directory(path_);
  EXPECT_THAT([&] { model.save(path_); }, ::testing::ThrowsMessage<qkv::Error>(HasSubstr("it is a directory")));
  EXPECT_TRUE(std::filesystem::is_directory(path_));
  std::filesystem::remove(path_);
}

// Through a symbolic link (a relative one, into another folder), the link stays and its target
// gets the new model, written the same atomic way; a link to a device is refused like the device.
TEST_F(ModelFile, SaveThroughASymlinkReplacesItsTarget) {
  const std::filesystem::path folder = path_ + ".d";
  std::filesystem::create_directories(folder / "models");
  const std::filesystem::path target = folder / "models" / "real.qkv", link = folder / "link.qkv";
  AttentionModel(config_, 1).save(target.string());
  std::filesystem::create_symlink("models/real.qkv", link);
  const AttentionModel model(config_, 2);
  model.save(link.string());
  EXPECT_TRUE(std::filesystem::is_symlink(link));
  EXPECT_EQ(std::filesystem::read_symlink(link), "models/real.qkv");
  EXPECT_EQ(AttentionModel::load(target.string()).forward({1, 2, 3}, 1, 3).to_vector(),
            model.forward({1, 2, 3}, 1, 3).to_vector());
  // A dangling link: its target is created.
  std::filesystem::remove(target);
  model.save(link.string());
  EXPECT_TRUE(std::filesystem::is_regular_file(target));
  const std::filesystem::path device_link = folder / "null.qkv";
  std::filesystem::create_symlink("/dev/null", device_link);
  EXPECT_THAT([&] { model.save(device_link.string()); },
              ::testing::ThrowsMessage<qkv::Error>(HasSubstr("its link's target '/dev/null' is a character device")));
  EXPECT_TRUE(std::filesystem::is_symlink(device_link));
  std::filesystem::remove_all(folder);
}

// load() reads regular files only: a folder is an error naming it (it was "std::bad_alloc"), and a
// FIFO with no writer is refused at once instead of blocking (the child's alarm fails the test
// if the open waits).
TEST_F(ModelFile, LoadRefusesFoldersAndFifosAtOnce) {
  std::filesystem::create_directory(path_);
  expect_load_error("is a directory, not a model file");
  std::filesystem::remove(path_);
  ASSERT_EQ(::mkfifo(path_.c_str(), 0600), 0);
  EXPECT_EXIT(
      {
        ::alarm(10);
        try {
          (void)AttentionModel::load(path_);
        } catch (const qkv::Error& e) {
          std::fprintf(stderr, "%s\n", e.what());
          std::_Exit(0);
        }
        std::_Exit(4);
      },
      ::testing::ExitedWithCode(0), "is a FIFO, not a model file");
}

// A config may imply memory the file does not carry: the sinusoidal table, max_len x d_model.
// A 16 KB file (vocab 1, no layers, d_model 1028) whose max_len says 65536 would need a 269 MB
// table: refused before anything is allocated, as is a max_len over the bound.
TEST_F(ModelFile, AConfigIsBoundedByTheMemoryItImplies) {
  const ModelConfig small{.vocab_size = 1, .max_len = 4, .d_model = 1028, .num_heads = 4, .num_layers = 0};
  AttentionModel(small, 1).save(path_);
  std::vector<char> data = bytes();
  EXPECT_LT(data.size(), 20000u);
  const int64_t huge_len = 65536;
  std::memcpy(data.data() + 24, &huge_len, 8);  // max_len, the config's second integer
  write_resealed(data);
  expect_load_error("needs a positional table of 269484032 bytes, over the limit of 268435456");
  const int64_t over = int64_t{1} << 20;
  std::memcpy(data.data() + 24, &over, 8);
  write_resealed(data);
  expect_load_error("max_len in [1, 65536]");
  EXPECT_THAT([&] { AttentionModel(ModelConfig{.vocab_size = 1, .max_len = huge_len, .d_model = 1028, .num_heads = 4,
                                               .num_layers = 0},
                                   1); },
              ::testing::ThrowsMessage<qkv::Error>(HasSubstr("needs a positional table")));
}

// A NaN or infinite weight is refused at load with the tensor named (such a model generated
// "a a a"), and save() refuses to write one.
TEST_F(ModelFile, NonFiniteWeightsAreRefused) {
  const AttentionModel model(config_, 1);
  model.save(path_);
  const std::vector<char> good = bytes();
  // head.bias is the last tensor: its 9 floats end 4 bytes before the file does.
  for (const float bad : {std::nanf(""), INFINITY}) {
    std::vector<char> data = good;
    std::memcpy(data.data() + data.size() - 4 - 9 * 4 + 2 * 4, &bad, 4);
    write_resealed(data);
    expect_load_error(std::string("tensor 'head.bias' holds ") + (std::isnan(bad) ? "nan" : "inf") + " at index 2");
  }
  AttentionModel broken(config_, 1);
  broken.final_norm.weight.data()[3] = -INFINITY;
  std::filesystem::remove(path_);
  EXPECT_THAT([&] { broken.save(path_); },
              ::testing::ThrowsMessage<qkv::Error>(HasSubstr("tensor 'final_norm.weight' holds -inf at index 3")));
  EXPECT_FALSE(std::filesystem::exists(path_));
}

// Too high a learning rate: the weights overflow within a few steps. train() stops at the step
// that made them non-finite, naming it, and writes no checkpoint from them (the last one on disk,
// from before, loads). The rate is absurd on purpose: at 100 whether and when training overflows
// depends on the last bits of every kernel's sums; at 1e30 the first update does.
TEST_F(ModelFile, DivergedTrainingIsAnErrorAndSavesNothingNonFinite) {
  const qkv::train::TaskOptions task{.task = qkv::train::Task::Copy, .symbols = 4, .length = 3};
  const ModelConfig config{.vocab_size = qkv::train::vocab_size(task), .max_len = qkv::train::sequence_length(task),
                           .d_model = 16, .num_heads = 2, .num_layers = 1};
  qkv::train::TrainOptions options;
  options.task = task;
  options.steps = 40;
  options.batch = 2;
  options.warmup_steps = 0;
  options.adamw.lr = 1e30f;
  options.checkpoint_path = path_;
  options.checkpoint_every = 1;
  int64_t last_progress = 0;
  AttentionModel model(config, 0);
  std::string message;
  try {
    qkv::train::train(model, options, [&](const qkv::train::TrainStep& s) { last_progress = s.step; });
  } catch (const qkv::Error& e) {
    message = e.what();
  }
  EXPECT_THAT(message, HasSubstr("training diverged at step " + std::to_string(last_progress + 1) + ": "));
  EXPECT_LT(last_progress, options.steps);
  if (last_progress > 0) {
    qkv::train::Checkpoint checkpoint;
    (void)AttentionModel::load(path_, &checkpoint);
    EXPECT_EQ(checkpoint.step, last_progress);
  }
}

TEST_F(ModelFile, CheckpointRoundTripAndResumeEqualsAnUninterruptedRun) {
  const qkv::train::TaskOptions task{.task = qkv::train::Task::Copy, .symbols = 4, .length = 3};
  const ModelConfig config{.vocab_size = qkv::train::vocab_size(task), .max_len = qkv::train::sequence_length(task),
                           .d_model = 16, .num_heads = 2, .num_layers = 1};
  qkv::train::TrainOptions options;
  options.task = task;
  options.steps = 12;
  options.batch = 8;
  options.warmup_steps = 3;
  AttentionModel straight(config, 4);
  qkv::train::train(straight, options);

  // The same run, stopped after step 5 (as Ctrl-C would) and resumed from its checkpoint.
  AttentionModel first_half(config, 4);
  options.checkpoint_path = path_;
  int64_t calls = 0;
  options.stop_requested = [&calls] { return ++calls == 5; };
  const qkv::train::TrainResult stopped = qkv::train::train(first_half, options);
  EXPECT_TRUE(stopped.interrupted);
  EXPECT_EQ(stopped.step, 5);
  qkv::train::Checkpoint checkpoint;
  AttentionModel resumed = AttentionModel::load(path_, &checkpoint);
  EXPECT_EQ(checkpoint.step, 5);
  EXPECT_EQ(checkpoint.optimizer.steps, 5);
  ASSERT_EQ(checkpoint.optimizer.first_moment.size(), resumed.parameters().size());
  options.stop_requested = {};
  options.resume = &checkpoint;
  const qkv::train::TrainResult finished = qkv::train::train(resumed, options);
  EXPECT_FALSE(finished.interrupted);
  EXPECT_EQ(finished.step, 12);
  const auto a = straight.parameters(), b = resumed.parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].tensor.to_vector(), b[i].tensor.to_vector()) << a[i].name;

  // A plain model file read as a checkpoint: step 0, no optimizer state.
  straight.save(path_);
  (void)AttentionModel::load(path_, &checkpoint);
  EXPECT_EQ(checkpoint.step, 0);
  EXPECT_TRUE(checkpoint.optimizer.first_moment.empty());
}

TEST_F(ModelFile, TruncatedAnywhereIsAClearError) {
  AttentionModel(config_, 3).save(path_);
  const std::vector<char> whole = bytes();
  for (size_t cut : {size_t{0}, size_t{5}, size_t{10}, size_t{30}, size_t{56}, size_t{70}, whole.size() / 2, whole.size() - 1}) {
    SCOPED_TRACE("cut at " + std::to_string(cut));
    write({whole.begin(), whole.begin() + static_cast<std::ptrdiff_t>(cut)});
    expect_load_error(cut < 8 ? "not a qkv model file" : cut < 16 ? "is truncated" : "corrupt or truncated");
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
  expect_load_error("format version 7, but this qkv reads versions 1 to 3");

  data = good;
  data[40] = 3;  // num_heads 3 does not divide d_model 8
  write_resealed(data);
  expect_load_error("bad config");

  // A config that asks for far more parameters than the file holds: refused before allocating.
  data = good;
  data[16 + 2] = 0x08;  // vocab_size 9 + 2^19
  write_resealed(data);
  expect_load_error("truncated: its config describes");

  // The embedding's first dim (vocab 9) changed to 10: found by name and shape.
  data = good;
  const std::string name = "embedding.weight";
  const auto at = std::search(data.begin(), data.end(), name.begin(), name.end()) - data.begin();
  data[static_cast<size_t>(at) + name.size() + 4] = 10;
  write_resealed(data);
  expect_load_error("embedding.weight is (10, 8) in the file but (9, 8)");

  data = good;
  data.insert(data.end() - 4, 0);
  write_resealed(data);
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
  // A batch it cannot hold is a qkv::Error before any vector grows (it was std::length_error
  // for a negative one and bad_alloc, or an overflowed size, for a huge one).
  EXPECT_THAT([&] { (void)qkv::train::make_batch(recall, 0, 5); },
              ::testing::ThrowsMessage<qkv::Error>(HasSubstr("make_batch: batch must be at least 1, got 0")));
  EXPECT_THAT([&] { (void)qkv::train::make_batch(recall, -3, 5); },
              ::testing::ThrowsMessage<qkv::Error>(HasSubstr("got -3")));
  // 2 x 8 x 2^60 x 17 bytes, past 2^62: printed as the need itself, not a cap.
  EXPECT_THAT([&] { (void)qkv::train::make_batch(recall, int64_t{1} << 60, 5); },
              ::testing::ThrowsMessage<qkv::Error>(::testing::AllOf(
                  HasSubstr("make_batch: batch 1152921504606846976 of length 17 need 3.136e+20 bytes"),
                  HasSubstr("physical memory"))));
  // The vectors are not tensors: a memory limit neither counts them nor lifts the machine's bound.
  {
    struct NoLimitAfter {
      ~NoLimitAfter() { qkv::set_memory_limit(0); }
    } no_limit_after;
    qkv::set_memory_limit(qkv::memory_stats().current_bytes + 1);
    EXPECT_EQ(qkv::train::make_batch(recall, 20, 5).ids, b.ids);
    EXPECT_THAT([&] { (void)qkv::train::make_batch(recall, int64_t{1} << 60, 5); },
                ::testing::ThrowsMessage<qkv::Error>(HasSubstr("physical memory")));
  }

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

// A model whose only positions are T5 relative-position biases (Positions::T5) learns the copy
// task, which needs positions (copy the symbol L tokens back): the bias tables move from their
// zeros through the backward's dbias, and held-out accuracy beats what the same model reaches
// with its tables frozen at zero.
TEST(Learning, T5PositionsLearnTheCopyTask) {
  const qkv::train::TaskOptions task{.task = qkv::train::Task::Copy, .symbols = 8, .length = 6};
  const ModelConfig config{.vocab_size = qkv::train::vocab_size(task), .max_len = qkv::train::sequence_length(task),
                           .d_model = 32, .num_heads = 2, .num_layers = 2, .positions = qkv::train::Positions::T5};
  qkv::train::TrainOptions options;
  options.task = task;
  options.steps = 200;
  options.batch = 32;
  options.seed = 3;
  options.adamw.lr = 1e-2f;
  options.warmup_steps = 20;
  AttentionModel model(config, options.seed);
  std::vector<float> losses;
  qkv::train::train(model, options, [&](const qkv::train::TrainStep& s) { losses.push_back(s.loss); });
  double moved = 0;
  for (const auto& p : model.parameters())
    if (p.name.find("relative_position_bias") != std::string::npos)
      for (float w : p.tensor.to_vector()) moved = std::max(moved, static_cast<double>(std::fabs(w)));
  const double accuracy = qkv::train::evaluate(model, task, 512, qkv::train::held_out_seed(3)).accuracy;
  std::printf("copy %lld symbols with T5 positions, %lld steps: loss %.3f -> %.3f, held-out accuracy %.1f%%, "
              "largest bias %.3f\n",
              static_cast<long long>(task.length), static_cast<long long>(options.steps), losses.front(),
              losses.back(), 100 * accuracy, moved);
  EXPECT_GT(moved, 0.05) << "the bias tables did not learn";
  EXPECT_LT(losses.back(), 0.5 * losses.front());
  EXPECT_GE(accuracy, 0.9);

  // The same model with its tables put back to zero after every step: no positions at all.
  AttentionModel frozen(config, options.seed);
  const auto zero_tables = [&frozen] {
    for (const auto& p : frozen.parameters())
      if (p.name.find("relative_position_bias") != std::string::npos)
        std::fill_n(p.tensor.data(), p.tensor.numel(), 0.0f);
  };
  qkv::train::train(frozen, options, [&](const qkv::train::TrainStep&) { zero_tables(); });
  const double frozen_accuracy = qkv::train::evaluate(frozen, task, 512, qkv::train::held_out_seed(3)).accuracy;
  std::printf("the same with the tables frozen at zero: held-out accuracy %.1f%%\n", 100 * frozen_accuracy);
  EXPECT_LT(frozen_accuracy, accuracy - 0.2);
}

}  // namespace
