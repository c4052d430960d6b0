// libFuzzer target: the public attention call (qkv::scaled_dot_product_attention and its
// backward) on arguments decoded from the fuzz input - ranks, shapes (zero sizes included),
// grouped-query heads, strided views, every kind of mask and their combinations, scale,
// dropout, need_weights, backend and matmul precision (AMX tiles where the CPU has them). Every
// outcome must be a result or a qkv::Error; a crash, a sanitizer report or any other exception
// is a bug (docs/reliability.md). The input is read with FuzzedDataProvider, so any bytes decode
// to some call.
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "qkv/qkv.hpp"

namespace {

using qkv::Mask;
using qkv::Tensor;

// A tensor of `shape` whose values come from the input (or a seed when it runs out), with a
// few specials (NaN, +-inf, huge) when the input asks.
Tensor values(FuzzedDataProvider& in, const std::vector<int64_t>& dims) {
  Tensor t = Tensor::randn(qkv::Shape(dims), in.ConsumeIntegral<uint8_t>());
  if (t.numel() > 0 && in.ConsumeBool()) {
    static const float kSpecial[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                                     -std::numeric_limits<float>::infinity(), 3e38f, -3e38f, 0.0f, 1e-45f};
    float* data = t.data();
    const int count = in.ConsumeIntegralInRange<int>(1, 4);
    for (int i = 0; i < count; ++i)
      data[in.ConsumeIntegralInRange<int64_t>(0, t.numel() - 1)] = kSpecial[in.ConsumeIntegralInRange<size_t>(0, 6)];
  }
  return t;
}

// q, k or v of the given logical shape; sometimes built transposed and transposed back, so the
// kernels see non-contiguous strides.
Tensor operand(FuzzedDataProvider& in, std::vector<int64_t> dims) {
  if (dims.size() >= 2 && in.ConsumeBool()) {
    const size_t a = dims.size() - 2, b = dims.size() - 1;
    std::swap(dims[a], dims[b]);
    return values(in, dims).transpose(static_cast<int64_t>(a), static_cast<int64_t>(b));
  }
  return values(in, dims);
}

int64_t small(FuzzedDataProvider& in, int64_t high) { return in.ConsumeIntegralInRange<int64_t>(0, high); }

// One mask part of each kind the API has, sized near the problem (sometimes wrongly sized).
Mask mask_part(FuzzedDataProvider& in, int64_t batch, int64_t heads, int64_t nq, int64_t nk) {
  switch (in.ConsumeIntegralInRange<int>(0, 5)) {
    case 0: return Mask::causal(in.ConsumeIntegralInRange<int64_t>(-3, 60));
    case 1: return Mask::window(in.ConsumeIntegralInRange<int64_t>(-1, 20), in.ConsumeIntegralInRange<int64_t>(-1, 20),
                                in.ConsumeIntegralInRange<int64_t>(-3, 40));
    case 2: {
      std::vector<int64_t> lengths(static_cast<size_t>(in.ConsumeBool() ? batch : small(in, 4)));
      for (auto& l : lengths) l = in.ConsumeIntegralInRange<int64_t>(-1, nk + 2);
      return Mask::key_lengths(lengths);
    }
    case 3:
    case 4: {
      // 2-D, 3-D or 4-D, each dim the problem's, 1 (broadcast) or off by one.
      auto pick = [&](int64_t d) {
        const int c = in.ConsumeIntegralInRange<int>(0, 5);
        return c == 0 ? 1 : c == 1 ? d + 1 : d;
      };
      std::vector<int64_t> dims;
      const int rank = in.ConsumeIntegralInRange<int>(1, 5);
      if (rank >= 4) dims.push_back(pick(batch));
      if (rank >= 4) dims.push_back(pick(heads));
      if (rank == 3) dims.push_back(pick(batch));
      if (rank >= 2) dims.push_back(pick(nq));
      dims.push_back(pick(nk));
      if (dims.size() > 5) dims.resize(5);
      Tensor t = values(in, dims);
      if (in.ConsumeBool()) {
        float* data = t.data();
        for (int64_t e = 0; e < t.numel(); ++e) data[e] = data[e] > 0.5f ? -std::numeric_limits<float>::infinity() : 0.0f;
        return Mask::additive(t);
      }
      return in.ConsumeBool() ? Mask::keep(t) : Mask::additive(t);
    }
    default: return Mask();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // A ceiling far above what these shapes need: a runaway allocation is a qkv::Error, not an OOM.
  qkv::set_memory_limit(int64_t{512} << 20);
  FuzzedDataProvider in(data, size);
  try {
    const int rank = in.ConsumeIntegralInRange<int>(1, 5);  // 1 and 5 are errors
    const int64_t batch = small(in, 3), hkv = in.ConsumeIntegralInRange<int64_t>(0, 3);
    const int64_t heads = hkv * in.ConsumeIntegralInRange<int64_t>(0, 3) + (in.ConsumeBool() ? 0 : small(in, 2));
    const int64_t nq = small(in, 40), nk = small(in, 40), dk = small(in, 24);
    const int64_t dv = in.ConsumeBool() ? dk : small(in, 24);
    auto shape_of = [&](int64_t h, int64_t n, int64_t d) {
      std::vector<int64_t> dims{batch, h, n, d};
      dims.erase(dims.begin(), dims.begin() + (4 - std::min(rank, 4)));
      if (rank == 5) dims.insert(dims.begin(), 1);
      return dims;
    };
    const Tensor q = operand(in, shape_of(heads, nq, dk));
    const Tensor k = operand(in, shape_of(hkv, nk, in.ConsumeIntegralInRange<int>(0, 9) == 0 ? dk + 1 : dk));
    const Tensor v = operand(in, shape_of(hkv, in.ConsumeIntegralInRange<int>(0, 9) == 0 ? nk + 1 : nk, dv));

    qkv::AttentionOptions options;
    const int parts = in.ConsumeIntegralInRange<int>(0, 3);
    for (int p = 0; p < parts; ++p) options.mask &= mask_part(in, batch, heads, nq, nk);
    switch (in.ConsumeIntegralInRange<int>(0, 5)) {
      case 0: options.scale = in.ConsumeFloatingPoint<float>(); break;
      case 1: options.scale = in.ConsumeFloatingPointInRange<float>(-2.0f, 2.0f); break;
      default: break;
    }
    if (in.ConsumeIntegralInRange<int>(0, 3) == 0) {
      options.dropout_p = in.ConsumeBool() ? in.ConsumeFloatingPointInRange<float>(0.0f, 0.99f)
                                           : in.ConsumeFloatingPoint<float>();
      options.seed = in.ConsumeIntegral<uint64_t>();
    }
    options.need_weights = in.ConsumeBool();
    options.backend = static_cast<qkv::Backend>(in.ConsumeIntegralInRange<int>(0, 3));
    options.precision = static_cast<qkv::MatmulPrecision>(in.ConsumeIntegralInRange<int>(0, 2));

    const qkv::AttentionResult result = qkv::scaled_dot_product_attention(q, k, v, options);
    // The documented shapes: output L + (Nq, Dv), lse L + (Nq).
    if (result.output.size(-1) != v.size(-1) || result.output.size(-2) != q.size(-2) ||
        result.lse.size(-1) != q.size(-2))
      __builtin_trap();
    if (in.ConsumeBool() && options.backend != qkv::Backend::Decode) {
      const Tensor grad = Tensor::full(result.output.shape(), 1.0f);
      (void)qkv::scaled_dot_product_attention_backward(grad, q, k, v, result, options);
    }
  } catch (const qkv::Error&) {
    // A clear refusal is a fine outcome; anything else escapes and libFuzzer reports it.
  }
  return 0;
}
