// A mask function's block map (src/mask/mod_blocks.hpp) against the function evaluated on every
// pair: on random tiles of random problems, a tile the map calls Hidden shows no pair and one it
// calls Full shows every pair; on tiles aligned to its blocks it is exact; it is per batch and
// head only when the function reads them; and too large a problem gets no map.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "harness/oracle.hpp"
#include "mask/mod_blocks.hpp"
#include "qkv/qkv.hpp"

namespace qkv::detail {
namespace {

struct Problem {
  int64_t batch, heads, nq, nk;
};

// Whether the function shows key j to query i of head h, batch b (one element).
bool shown(const ModExpression& e, const std::vector<ModInput>& inputs, int64_t b, int64_t h, int64_t i, int64_t j) {
  std::vector<float> out(1), scratch(e.scratch_floats(1));
  e.evaluate({b, h, i, j, 0, 1}, 1, nullptr, inputs.data(), out.data(), nullptr, scratch.data());
  return out[0] != 0.0f;
}

TileVisibility brute_force(const ModExpression& e, const std::vector<ModInput>& inputs, int64_t b, int64_t h,
                           int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
  bool any = false, all = true;
  for (int64_t i = i0; i <= i1; ++i)
    for (int64_t j = j0; j <= j1; ++j) {
      const bool on = shown(e, inputs, b, h, i, j);
      any = any || on;
      all = all && on;
    }
  return !any ? TileVisibility::Hidden : all ? TileVisibility::Full : TileVisibility::Partial;
}

TEST(ModBlocks, AgreesWithTheFunctionOnRandomTiles) {
  qkv_test::Random rng;
  SCOPED_TRACE(rng.note());
  const char* const functions[] = {"doc(q) == doc(k)", "doc(q) == doc(k) && k <= q", "k < 5 || (k <= q + 20 && h != 1)",
                                   "floor(q / 24) == floor(k / 40) || b == 1", "prefix(b) > k || k <= q"};
  for (const char* text : functions) {
    const Problem p{rng.integer(1, 2), rng.integer(1, 3), rng.integer(1, 150), rng.integer(1, 150)};
    const int64_t length = std::max(p.nq, p.nk);
    std::vector<float> docs(static_cast<size_t>(length));
    for (int64_t x = 0, doc = 0; x < length; ++x) {
      if (rng.chance(0.04)) ++doc;
      docs[static_cast<size_t>(x)] = static_cast<float>(doc);
    }
    const std::map<std::string, Tensor> inputs = {{"doc", Tensor::from(docs, Shape{length})},
                                                  {"prefix", rng.uniform_tensor(Shape{2}, 0.0, 100.0)}};
    const ModExpression e = ModExpression::parse(text, ModKind::Mask, mod_input_names(inputs));
    std::vector<Tensor> held;
    const std::vector<ModInput> views = bind_mod_inputs("test: ", e, inputs, p.batch, p.heads, p.nq, p.nk, held);
    const std::shared_ptr<const ModBlocks> map = ModBlocks::build(e, views, p.batch, p.heads, p.nq, p.nk);
    ASSERT_NE(map, nullptr) << text;
    for (int repeat = 0; repeat < 200; ++repeat) {
      const int64_t b = rng.integer(0, p.batch - 1), h = rng.integer(0, p.heads - 1);
      const bool aligned = repeat % 2 == 0;
      const int64_t block = ModBlocks::kBlock;
      int64_t i0 = rng.integer(0, p.nq - 1), j0 = rng.integer(0, p.nk - 1);
      if (aligned) i0 -= i0 % block, j0 -= j0 % block;
      const int64_t i1 = aligned ? std::min(p.nq, i0 + block * rng.integer(1, 3)) - 1 : rng.integer(i0, p.nq - 1);
      const int64_t j1 = aligned ? std::min(p.nk, j0 + block * rng.integer(1, 4)) - 1 : rng.integer(j0, p.nk - 1);
      const std::optional<TileVisibility> got = map->classify(b, h, i0, i1, j0, j1);
      ASSERT_TRUE(got.has_value());
      const TileVisibility want = brute_force(e, views, b, h, i0, i1, j0, j1);
      const std::string where = std::string(text) + " b=" + std::to_string(b) + " h=" + std::to_string(h) + " tile [" +
                                std::to_string(i0) + ", " + std::to_string(i1) + "] x [" + std::to_string(j0) + ", " +
                                std::to_string(j1) + "]";
      if (aligned) {
        EXPECT_EQ(static_cast<int>(*got), static_cast<int>(want)) << where;
      } else if (*got != TileVisibility::Partial) {
        EXPECT_EQ(static_cast<int>(*got), static_cast<int>(want)) << where;
      }
    }
    EXPECT_FALSE(map->classify(0, 0, 0, p.nq, 0, 0).has_value()) << "a tile past Nq";
  }
}

TEST(ModBlocks, TooLargeAProblemGetsNoMap) {
  const ModExpression e = ModExpression::parse("k <= q", ModKind::Mask);
  EXPECT_NE(ModBlocks::build(e, {}, 64, 64, 512, 512), nullptr) << "reads neither b nor h: one map";
  const ModExpression by_head = ModExpression::parse("k <= q + h", ModKind::Mask);
  EXPECT_EQ(ModBlocks::build(by_head, {}, 64, 128, 512, 512), nullptr) << "128 maps of 512 x 512";
}

// A C++ mask function (qkv::mask_function) gets the map of its text twin, block for block, and
// one map for every batch and head only when it says it reads neither.
TEST(ModBlocks, CallableGetsItsTextTwinsMap) {
  qkv_test::Random rng;
  SCOPED_TRACE(rng.note());
  const Problem p{2, 3, rng.integer(40, 150), rng.integer(40, 150)};
  const int64_t length = std::max(p.nq, p.nk);
  std::vector<float> docs(static_cast<size_t>(length));
  for (int64_t x = 0, doc = 0; x < length; ++x) {
    if (rng.chance(0.04)) ++doc;
    docs[static_cast<size_t>(x)] = static_cast<float>(doc);
  }
  const std::map<std::string, Tensor> inputs = {{"doc", Tensor::from(docs, Shape{length})}};
  const ModExpression e = ModExpression::parse("doc(q) == doc(k) && k <= q + h || b == 1 && k < 7", ModKind::Mask,
                                               mod_input_names(inputs));
  std::vector<Tensor> held;
  const std::vector<ModInput> views = bind_mod_inputs("test: ", e, inputs, p.batch, p.heads, p.nq, p.nk, held);
  const std::shared_ptr<const ModBlocks> want = ModBlocks::build(e, views, p.batch, p.heads, p.nq, p.nk);
  const auto callable = qkv::mask_function([&docs](int64_t b, int64_t h, int64_t q, int64_t k) {
    return (docs[static_cast<size_t>(q)] == docs[static_cast<size_t>(k)] && k <= q + h) || (b == 1 && k < 7);
  });
  const std::shared_ptr<const ModBlocks> got = ModBlocks::build(*callable, p.batch, p.heads, p.nq, p.nk);
  ASSERT_NE(want, nullptr);
  ASSERT_NE(got, nullptr);
  const int64_t block = ModBlocks::kBlock;
  for (int64_t b = 0; b < p.batch; ++b)
    for (int64_t h = 0; h < p.heads; ++h)
      for (int64_t i0 = 0; i0 < p.nq; i0 += block)
        for (int64_t j0 = 0; j0 < p.nk; j0 += block) {
          const int64_t i1 = std::min(p.nq, i0 + block) - 1, j1 = std::min(p.nk, j0 + block) - 1;
          EXPECT_EQ(static_cast<int>(*got->classify(b, h, i0, i1, j0, j1)),
                    static_cast<int>(*want->classify(b, h, i0, i1, j0, j1)))
              << "b=" << b << " h=" << h << " block [" << i0 << ", " << j0 << "]";
        }
  const auto causal = [](int64_t, int64_t, int64_t q, int64_t k) { return k <= q; };
  EXPECT_EQ(ModBlocks::build(*qkv::mask_function(causal), 64, 128, 512, 512), nullptr) << "a map per b and h";
  EXPECT_NE(ModBlocks::build(*qkv::mask_function(causal, {false, false}), 64, 128, 512, 512), nullptr)
      << "reads neither b nor h: one map";
}

}  // namespace
}  // namespace qkv::detail
