// ModBlocks: a mask function evaluated once over every pair of the problem, a query's keys at a
// time, folded into per-block "any shown" / "all shown" flags.
#include "mask/mod_blocks.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace qkv::detail {

namespace {
// Whether the function reads the batch (b, an input indexed by b, or an input with a row per
// batch) or the head (h, an input indexed by h): else one map serves every batch or head.
void what_it_reads(const ModExpression& e, const std::vector<ModInput>& inputs, bool& batch, bool& head) {
  batch = head = false;
  for (const ModExpression::Instruction& in : e.program()) {
    batch = batch || in.op == ModExpression::Op::Batch;
    head = head || in.op == ModExpression::Op::Head;
    if (in.op != ModExpression::Op::Input) continue;
    batch = batch || in.index == ModExpression::Index::Batch || inputs[in.input].batch_stride != 0;
    head = head || in.index == ModExpression::Index::Head;
  }
}
}  // namespace

std::shared_ptr<const ModBlocks> ModBlocks::build(const ModExpression& e, const std::vector<ModInput>& inputs,
                                                  int64_t batch, int64_t q_heads, int64_t q_len, int64_t kv_len) {
  bool reads_batch = false, reads_head = false;
  what_it_reads(e, inputs, reads_batch, reads_head);
  const LineFunction line = [&](const ModLine& at, size_t count, float* out, std::vector<float>& scratch) {
    if (scratch.size() < e.scratch_floats(count)) scratch.resize(e.scratch_floats(count));
    e.evaluate(at, count, nullptr, inputs.data(), out, nullptr, scratch.data());
  };
  return build_from(line, reads_batch, reads_head, batch, q_heads, q_len, kv_len);
}

std::shared_ptr<const ModBlocks> ModBlocks::build(const MaskFunction& f, int64_t batch, int64_t q_heads,
                                                  int64_t q_len, int64_t kv_len) {
  const LineFunction line = [&f](const ModLine& at, size_t count, float* out, std::vector<float>&) {
    f.line({at.b, at.h, at.i0, at.j0, at.query_step, at.key_step}, count, out);
  };
  return build_from(line, f.reads().batch, f.reads().head, batch, q_heads, q_len, kv_len);
}

std::shared_ptr<const ModBlocks> ModBlocks::build_from(const LineFunction& line, bool reads_batch, bool reads_head,
                                                       int64_t batch, int64_t q_heads, int64_t q_len,
                                                       int64_t kv_len) {
  auto map = std::make_shared<ModBlocks>();
  map->batches_ = reads_batch ? batch : 1;
  map->heads_ = reads_head ? q_heads : 1;
  const double pairs = static_cast<double>(map->batches_ * map->heads_) * static_cast<double>(q_len) *
                       static_cast<double>(kv_len);
  if (pairs == 0 || pairs > kMaxPairs) return nullptr;
  map->q_len_ = q_len, map->kv_len_ = kv_len;
  map->q_blocks_ = (q_len + kBlock - 1) / kBlock, map->k_blocks_ = (kv_len + kBlock - 1) / kBlock;
  const int64_t heads = map->heads_, q_blocks = map->q_blocks_, k_blocks = map->k_blocks_;
  map->blocks_.resize(static_cast<size_t>(map->batches_ * heads * q_blocks * k_blocks));
  const int64_t block_rows = map->batches_ * heads * q_blocks;
  const size_t keys = static_cast<size_t>(kv_len);
  // Block rows over the threads (the map costs a pass over every pair: one thread would spend on
  // it a fifth of a 4-document W2's time), each with its own lines.
#pragma omp parallel if (pairs >= kParallelPairs)
  {
    std::vector<float> shown(keys), scratch;
    std::vector<int64_t> count(static_cast<size_t>(k_blocks));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < block_rows; ++r) {
      const int64_t b = r / (heads * q_blocks), h = r / q_blocks % heads, a = r % q_blocks;
      std::fill(count.begin(), count.end(), int64_t{0});
      const int64_t first = a * kBlock, last = std::min(q_len, first + kBlock);
      for (int64_t i = first; i < last; ++i) {
        line({b, h, i, 0, 0, 1}, keys, shown.data(), scratch);
        for (int64_t c = 0; c < k_blocks; ++c) {
          const size_t begin = static_cast<size_t>(c * kBlock), end = std::min(keys, begin + kBlock);
          int64_t on = 0;
          for (size_t j = begin; j < end; ++j) on += shown[j] != 0.0f;
          count[static_cast<size_t>(c)] += on;
        }
      }
      for (int64_t c = 0; c < k_blocks; ++c) {
        const int64_t pairs_in_block = (last - first) * (std::min(kv_len, (c + 1) * kBlock) - c * kBlock);
        const int64_t on = count[static_cast<size_t>(c)];
        map->blocks_[static_cast<size_t>(r * k_blocks + c)] =
            on == 0 ? TileVisibility::Hidden : on == pairs_in_block ? TileVisibility::Full : TileVisibility::Partial;
      }
    }
  }
  return map;
}

std::optional<TileVisibility> ModBlocks::classify(int64_t b, int64_t h, int64_t i0, int64_t i1, int64_t j0,
                                                  int64_t j1) const {
  if (i0 < 0 || j0 < 0 || i1 >= q_len_ || j1 >= kv_len_ || i0 > i1 || j0 > j1) return std::nullopt;
  const int64_t head = (batches_ > 1 ? b : 0) * heads_ + (heads_ > 1 ? h : 0);
  bool hidden = true, full = true;
  for (int64_t a = i0 / kBlock; a <= i1 / kBlock; ++a) {
    const TileVisibility* row = blocks_.data() + (head * q_blocks_ + a) * k_blocks_;
    for (int64_t c = j0 / kBlock; c <= j1 / kBlock; ++c) {
      hidden = hidden && row[c] == TileVisibility::Hidden;
      full = full && row[c] == TileVisibility::Full;
    }
    if (!hidden && !full) return TileVisibility::Partial;
  }
  return hidden ? TileVisibility::Hidden : full ? TileVisibility::Full : TileVisibility::Partial;
}

}  // namespace qkv::detail
