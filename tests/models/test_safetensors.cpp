// Safetensors: what write_safetensors writes, SafetensorsWeights reads back in place, in every
// dtype and across shards; every kind of bad file is a qkv::Error naming the file and tensor.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>
#include <random>

#include "model_test_support.hpp"
#include "qkv/models/safetensors.hpp"

namespace qkv::models {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::error_of;
using testing::ScratchFolder;
using testing::write_file;

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> bytes(n);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  return bytes;
}

// A file from a header's text and its data section, as the format lays them out.
std::string raw_file(const std::string& header, const std::string& data) {
  std::string file(8, '\0');
  const uint64_t length = header.size();
  std::memcpy(file.data(), &length, 8);
  return file + header + data;
}

struct Stored {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
  SafetensorsTensor tensor() const { return {name, dtype, shape, bytes}; }
};

std::vector<Stored> sample_tensors() {
  return {{"embed.weight", "F32", {2, 3}, random_bytes(24, 1)},
          {"layers.0.norm.weight", "BF16", {4}, random_bytes(8, 2)},
          {"layers.0.attn.q.weight", "F16", {1, 2, 2}, random_bytes(8, 3)},
          {"scale", "F32", {}, random_bytes(4, 4)},
          {"empty", "F16", {0, 3}, {}},
          {"position_ids", "I64", {3}, random_bytes(24, 5)}};
}

std::vector<SafetensorsTensor> views(const std::vector<Stored>& stored) {
  std::vector<SafetensorsTensor> out;
  for (const Stored& s : stored) out.push_back(s.tensor());
  return out;
}

void expect_holds(const SafetensorsWeights& weights, const Stored& s) {
  SCOPED_TRACE(s.name);
  const WeightView* view = weights.find(s.name);
  ASSERT_NE(view, nullptr);
  EXPECT_EQ(std::string(safetensors_dtype(view->dtype)), s.dtype);
  EXPECT_EQ(view->shape, s.shape);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(view->data) % element_size(view->dtype), 0u);
  if (!s.bytes.empty()) EXPECT_EQ(std::memcmp(view->data, s.bytes.data(), s.bytes.size()), 0);
}

TEST(Safetensors, RoundTripEveryDtype) {
  ScratchFolder folder;
  const std::vector<Stored> stored = sample_tensors();
  write_safetensors(folder / "model.safetensors", views(stored));
  const SafetensorsWeights weights = SafetensorsWeights::open_file(folder / "model.safetensors");
  for (const Stored& s : stored)
    if (s.dtype != "I64") expect_holds(weights, s);
  EXPECT_THAT(weights.names(), ElementsAre("embed.weight", "empty", "layers.0.attn.q.weight", "layers.0.norm.weight",
                                           "position_ids", "scale"));
  EXPECT_EQ(weights.find("missing"), nullptr);
  EXPECT_EQ(weights.stored_dtype("position_ids"), "I64");
  EXPECT_THAT(error_of([&] { weights.find("position_ids"); }),
              AllOf(HasSubstr("model.safetensors"), HasSubstr("'position_ids'"), HasSubstr("dtype I64")));
  EXPECT_THAT(weights.describe("scale"), AllOf(HasSubstr("model.safetensors"), HasSubstr("tensor 'scale'")));
  EXPECT_THAT(weights.describe("nope"), HasSubstr("no tensor 'nope'"));
  // Written atomically: nothing but the file is left in the folder.
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(folder.path()), {}), 1);
}

TEST(Safetensors, ViewsStayValidAfterMove) {
  ScratchFolder folder;
  const std::vector<Stored> stored = sample_tensors();
  write_safetensors(folder / "model.safetensors", views(stored));
  SafetensorsWeights first = SafetensorsWeights::open_file(folder / "model.safetensors");
  const WeightView* view = first.find("embed.weight");
  SafetensorsWeights moved = std::move(first);
  EXPECT_EQ(moved.find("embed.weight"), view);
  expect_holds(moved, stored[0]);
}

TEST(Safetensors, MisalignedTensorIsCopiedAligned) {
  ScratchFolder folder;
  // One BF16 element puts the F32 tensor after it 2 bytes into the (8-aligned) data section.
  const std::vector<Stored> stored = {{"a", "BF16", {1}, random_bytes(2, 7)}, {"b", "F32", {3}, random_bytes(12, 8)}};
  write_safetensors(folder / "x.safetensors", views(stored));
  const SafetensorsWeights weights = SafetensorsWeights::open_file(folder / "x.safetensors");
  expect_holds(weights, stored[0]);
  expect_holds(weights, stored[1]);
}

TEST(Safetensors, ShardsAndIndex) {
  ScratchFolder folder;
  std::vector<Stored> stored = sample_tensors();
  stored.push_back({"lm_head.weight", "F32", {3, 2}, random_bytes(24, 9)});
  write_safetensors_shards(folder.path(), views(stored), 3);
  for (const char* name : {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                           "model-00003-of-00003.safetensors", "model.safetensors.index.json"})
    EXPECT_TRUE(std::filesystem::is_regular_file(folder / name)) << name;
  const SafetensorsWeights weights = SafetensorsWeights::open_folder(folder.path());
  for (const Stored& s : stored)
    if (s.dtype != "I64") expect_holds(weights, s);
  EXPECT_EQ(weights.names().size(), stored.size());
  EXPECT_THAT(weights.describe("embed.weight"), HasSubstr("model-00001-of-00003.safetensors"));
  EXPECT_THAT(weights.describe("lm_head.weight"), HasSubstr("model-00003-of-00003.safetensors"));
}

TEST(Safetensors, WriterRejectsBadTensors) {
  ScratchFolder folder;
  const std::vector<uint8_t> eight(8);
  const auto write = [&](SafetensorsTensor t) {
    return error_of([&] { write_safetensors(folder / "w.safetensors", std::vector<SafetensorsTensor>{t}); });
  };
  EXPECT_THAT(write({"w", "F32", {3}, eight}), AllOf(HasSubstr("'w'"), HasSubstr("8 bytes"), HasSubstr("need 12")));
  EXPECT_THAT(write({"w", "Q7", {2}, eight}), HasSubstr("unknown dtype 'Q7'"));
  EXPECT_THAT(write({"w", "F32", {-2}, eight}), HasSubstr("negative dim -2"));
  EXPECT_THAT(write({"", "F32", {2}, eight}), HasSubstr("cannot be called ''"));
  const std::vector<SafetensorsTensor> twice = {{"w", "F32", {2}, eight}, {"w", "F32", {2}, eight}};
  EXPECT_THAT(error_of([&] { write_safetensors(folder / "w.safetensors", twice); }), HasSubstr("'w' given twice"));
  EXPECT_FALSE(std::filesystem::exists(folder / "w.safetensors"));
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(folder.path()), {}), 0);
}

// A bad file's error names the file and, where there is one, the tensor.
class BadSafetensors : public ::testing::Test {
 protected:
  std::string open_error(const std::string& bytes) {
    write_file(path(), bytes);
    return error_of([&] { SafetensorsWeights::open_file(path()); });
  }
  std::filesystem::path path() const { return folder_ / "bad.safetensors"; }
  ScratchFolder folder_;
};

TEST_F(BadSafetensors, Truncated) {
  EXPECT_THAT(open_error("abc"), AllOf(HasSubstr("bad.safetensors"), HasSubstr("3 bytes, too short")));
  EXPECT_THAT(open_error(""), HasSubstr("0 bytes, too short"));
}

TEST_F(BadSafetensors, HeaderLengthPastTheEnd) {
  std::string file = raw_file("{}", "");
  const uint64_t length = 1000;
  std::memcpy(file.data(), &length, 8);
  EXPECT_THAT(open_error(file), AllOf(HasSubstr("bad.safetensors"), HasSubstr("header length 1000 runs past the end")));
  const uint64_t huge = uint64_t{1} << 62;
  std::memcpy(file.data(), &huge, 8);
  EXPECT_THAT(open_error(file), HasSubstr("more than the"));
}

TEST_F(BadSafetensors, NotJson) {
  EXPECT_THAT(open_error(raw_file("{\"a\": ", "")), AllOf(HasSubstr("bad.safetensors"), HasSubstr("not valid JSON")));
  EXPECT_THAT(open_error(raw_file("[1, 2]", "")), HasSubstr("must be a JSON object"));
  EXPECT_THAT(open_error(raw_file(std::string(200, '[') + std::string(200, ']'), "")), HasSubstr("nests deeper"));
}

TEST_F(BadSafetensors, FieldsOfATensor) {
  const auto with = [](const std::string& entry) { return raw_file("{\"w\": " + entry + "}", std::string(8, 'x')); };
  EXPECT_THAT(open_error(with(R"({"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]})")),
              AllOf(HasSubstr("bad.safetensors"), HasSubstr("tensor 'w'"), HasSubstr("unknown dtype 'Q7'")));
  EXPECT_THAT(open_error(with(R"({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]})")),
              AllOf(HasSubstr("tensor 'w'"), HasSubstr("non-negative")));
  EXPECT_THAT(open_error(with(R"({"dtype": "F32", "shape": [1099511627776, 1099511627776], "data_offsets": [0, 8]})")),
              AllOf(HasSubstr("tensor 'w'"), HasSubstr("more bytes than 2^64")));
  EXPECT_THAT(open_error(with(R"({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]})")),
              AllOf(HasSubstr("tensor 'w'"), HasSubstr("hold 4 bytes but F32 (2,) needs 8")));
  EXPECT_THAT(open_error(with(R"({"dtype": "F16", "shape": [2, 3], "data_offsets": [0, 8]})")),
              HasSubstr("hold 8 bytes but F16 (2, 3) needs 12"));
  EXPECT_THAT(open_error(with(R"({"dtype": "F32", "shape": [4], "data_offsets": [0, 16]})")),
              AllOf(HasSubstr("tensor 'w'"), HasSubstr("run past the data section's 8 bytes")));
  EXPECT_THAT(open_error(with(R"({"dtype": "F32", "shape": [0], "data_offsets": [8, 0]})")),
              HasSubstr("end before they begin"));
  EXPECT_THAT(open_error(with(R"({"dtype": "F32", "shape": [2]})")), AllOf(HasSubstr("tensor 'w'"), HasSubstr("no 'data_offsets'")));
  EXPECT_THAT(open_error(with(R"({"dtype": "F32", "shape": [2], "data_offsets": [0, -8]})")),
              HasSubstr("two non-negative integers"));
  EXPECT_THAT(open_error(with(R"({"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]})")),
              HasSubstr("non-negative integers"));
  EXPECT_THAT(open_error(with("7")), AllOf(HasSubstr("tensor 'w'"), HasSubstr("expected an object")));
}

TEST_F(BadSafetensors, OverlapsAndHoles) {
  const std::string overlap = R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                  "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})";
  EXPECT_THAT(open_error(raw_file(overlap, std::string(12, 'x'))),
              AllOf(HasSubstr("bad.safetensors"), HasSubstr("tensor 'b'"), HasSubstr("overlap tensor 'a'")));
  const std::string hole = R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})";
  EXPECT_THAT(open_error(raw_file(hole, std::string(8, 'x'))), HasSubstr("bytes [4, 8) of the data section belong to no tensor"));
  const std::string gap = R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})";
  EXPECT_THAT(open_error(raw_file(gap, std::string(8, 'x'))), HasSubstr("bytes [0, 4)"));
  // __metadata__ is skipped, whatever it holds; an empty file of tensors is fine.
  const SafetensorsWeights ok = [&] {
    write_file(path(), raw_file(R"({"__metadata__": {"format": "pt"}})", ""));
    return SafetensorsWeights::open_file(path());
  }();
  EXPECT_TRUE(ok.names().empty());
}

TEST_F(BadSafetensors, NotARegularFile) {
  EXPECT_THAT(error_of([&] { SafetensorsWeights::open_file(folder_ / "none.safetensors"); }),
              AllOf(HasSubstr("none.safetensors"), HasSubstr("no such file")));
  EXPECT_THAT(error_of([&] { SafetensorsWeights::open_file(folder_.path()); }), HasSubstr("is a folder"));
  ASSERT_EQ(::mkfifo((folder_ / "fifo").c_str(), 0600), 0);
  EXPECT_THAT(error_of([&] { SafetensorsWeights::open_file(folder_ / "fifo"); }), HasSubstr("is a FIFO"));
  EXPECT_THAT(error_of([&] { SafetensorsWeights::open_folder(folder_.path()); }),
              AllOf(HasSubstr("no weights"), HasSubstr("model.safetensors.index.json and model.safetensors")));
}

class BadIndex : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::vector<uint8_t> eight(8, 1);
    write_safetensors(folder_ / "shard.safetensors", std::vector<SafetensorsTensor>{{"a", "F32", {2}, eight}});
  }
  std::string open_error(const std::string& index) {
    write_file(folder_ / "model.safetensors.index.json", index);
    return error_of([&] { SafetensorsWeights::open_folder(folder_.path()); });
  }
  ScratchFolder folder_;
};

TEST_F(BadIndex, NamesAMissingShard) {
  EXPECT_THAT(open_error(R"({"weight_map": {"a": "shard.safetensors", "b": "gone.safetensors"}})"),
              AllOf(HasSubstr("model.safetensors.index.json"), HasSubstr("'gone.safetensors'"), HasSubstr("no such file")));
}

TEST_F(BadIndex, PathsOutsideTheFolder) {
  for (const char* shard : {"../shard.safetensors", "..", "sub/shard.safetensors", "/etc/passwd", ""}) {
    EXPECT_THAT(open_error(std::string(R"({"weight_map": {"a": ")") + shard + "\"}}"),
                AllOf(HasSubstr("index.json"), HasSubstr("tensor 'a'"), HasSubstr("not a plain file name")))
        << shard;
  }
}

TEST_F(BadIndex, TensorNotInItsShard) {
  EXPECT_THAT(open_error(R"({"weight_map": {"a": "shard.safetensors", "z": "shard.safetensors"}})"),
              AllOf(HasSubstr("tensor 'z'"), HasSubstr("does not hold it")));
}

TEST_F(BadIndex, TensorInTwoShards) {
  const std::vector<uint8_t> eight(8, 2);
  write_safetensors(folder_ / "other.safetensors", std::vector<SafetensorsTensor>{{"a", "F32", {2}, eight}});
  EXPECT_THAT(open_error(R"({"weight_map": {"a": "shard.safetensors", "b": "other.safetensors"}})"),
              AllOf(HasSubstr("tensor 'a' is in both"), HasSubstr("other.safetensors")));
}

TEST_F(BadIndex, Malformed) {
  EXPECT_THAT(open_error("{"), HasSubstr("not valid JSON"));
  EXPECT_THAT(open_error(R"({"metadata": {}})"), HasSubstr("'weight_map'"));
  EXPECT_THAT(open_error(R"({"weight_map": {"a": 3}})"), HasSubstr("must be a file name"));
  EXPECT_THAT(open_error(R"({"weight_map": {}})"), HasSubstr("names no tensor"));
}

}  // namespace
}  // namespace qkv::models
