// ggml's CPU flash attention (ggml_flash_attn_ext) timed on qkv's standard workloads, for
// bench/peers/run.py, which builds it against a ggml checkout of your choosing (never part of
// this repository) and passes the shapes:
//
//   ggml_attention --threads 2 [--check] SPEC...
//   SPEC = id:kind:batch:q_heads:kv_heads:q_len:kv_len:head_dim:mask:kv_dtype
//          kind attention|module, mask causal|none, kv_dtype f32|f16|bf16|int8|int4
//          (ggml's K/V: f32, f16 for both 16-bit rows, q8_0 for int8, q4_0 for int4)
//
// Per workload: the graph is built once (inputs random, filled beforehand) and run by
// ggml_graph_compute on a ggml threadpool of --threads threads (what the CPU backend runs);
// one warm-up, then calls until at least 10 calls and 0.2 s (3 calls when one takes over 1 s),
// and the median is printed as one JSON line:
//   {"peer": "ggml", "workload": "W4-f16", "variant": "flash_attn_ext f16 K/V", "ms": 1.23, "runs": 10}
// --check adds "max_err": the largest difference from a float64 softmax(q k^T / sqrt(d) + mask) v
// on a few (batch, head, query) rows of an attention workload.
//
// Layouts are ggml's (flash_attn_ext's comment in ggml.h): q [d, Nq, Hq, B], k and v
// [d, Nk, Hkv, B], the causal mask [Nk, Nq] in f16 (0 or -inf), the result [d, Hq, Nq, B]. The
// module workload (W5) is one graph: x W_in^T + b_in, the heads as views of it, flash attention,
// the output projection.
#include <ggml-cpu.h>
#include <ggml.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct Spec {
  std::string id, kind;
  int64_t batch = 0, q_heads = 0, kv_heads = 0, q_len = 0, kv_len = 0, head_dim = 0;
  bool causal = false;
  ggml_type kv_type = GGML_TYPE_F32;
};

Spec parse_spec(const std::string& text) {
  std::vector<std::string> f;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, ':');) f.push_back(part);
  if (f.size() != 10) {
    std::fprintf(stderr, "ggml_attention: bad spec '%s'\n", text.c_str());
    std::exit(2);
  }
  Spec s;
  s.id = f[0];
  s.kind = f[1];
  s.batch = std::stoll(f[2]);
  s.q_heads = std::stoll(f[3]);
  s.kv_heads = std::stoll(f[4]);
  s.q_len = std::stoll(f[5]);
  s.kv_len = std::stoll(f[6]);
  s.head_dim = std::stoll(f[7]);
  s.causal = f[8] == "causal";
  if (f[9] == "f16" || f[9] == "bf16") {
    s.kv_type = GGML_TYPE_F16;  // ggml's 16-bit K/V cache type
  } else if (f[9] == "int8") {
    s.kv_type = GGML_TYPE_Q8_0;
  } else if (f[9] == "int4") {
    s.kv_type = GGML_TYPE_Q4_0;
  } else if (f[9] != "f32") {
    std::fprintf(stderr, "ggml_attention: unknown kv_dtype '%s'\n", f[9].c_str());
    std::exit(2);
  }
  return s;
}

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// The protocol every peer of run.py follows: one warm-up, then at least 10 calls and 0.2 s
// (3 calls when one call takes over 1 s); the median.
template <typename Call>
std::pair<double, int> time_median(Call call) {
  call();
  std::vector<double> times;
  double spent = 0;
  for (;;) {
    const Clock::time_point start = Clock::now();
    call();
    times.push_back(ms_since(start));
    spent += times.back();
    const size_t n = times.size();
    if (times.front() > 1000 && n >= 3) break;
    if (n >= 10 && spent >= 200) break;
    if (n >= 2000) break;
  }
  std::sort(times.begin(), times.end());
  const size_t n = times.size();
  const double median = n % 2 ? times[n / 2] : 0.5 * (times[n / 2 - 1] + times[n / 2]);
  return {median, static_cast<int>(n)};
}

void fill_random(ggml_tensor* t, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> normal(0.0f, scale);
  const int64_t n = ggml_nelements(t);
  if (t->type == GGML_TYPE_F32) {
    float* data = static_cast<float*>(t->data);
    for (int64_t i = 0; i < n; ++i) data[i] = normal(rng);
    return;
  }
  std::vector<float> values(static_cast<size_t>(n));
  for (float& x : values) x = normal(rng);
  if (t->type == GGML_TYPE_F16) {
    ggml_fp32_to_fp16_row(values.data(), static_cast<ggml_fp16_t*>(t->data), n);
    return;
  }
  const int64_t row = t->ne[0];  // quantized: blocks along the row (head_dim, a multiple of 32)
  ggml_quantize_chunk(t->type, values.data(), t->data, 0, n / row, row, nullptr);
}

float element(const ggml_tensor* t, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
  const char* p = static_cast<const char*>(t->data) + i0 * t->nb[0] + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
  if (t->type == GGML_TYPE_F32) return *reinterpret_cast<const float*>(p);
  if (t->type == GGML_TYPE_F16) return ggml_fp16_to_fp32(*reinterpret_cast<const ggml_fp16_t*>(p));
  // quantized: dequantise the block holding i0 (rows are whole blocks)
  const int64_t block = ggml_blck_size(t->type);
  const char* row = static_cast<const char*>(t->data) + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
  float values[256];
  ggml_get_type_traits(t->type)->to_float(row + (i0 / block) * ggml_type_size(t->type), values, block);
  return values[i0 % block];
}

// Largest |ggml - float64 reference| over a few (batch, head, query) rows.
double check_attention(const Spec& s, const ggml_tensor* q, const ggml_tensor* k, const ggml_tensor* v,
                       const ggml_tensor* out) {
  double worst = 0;
  const int64_t group = s.q_heads / s.kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  for (int64_t b : {int64_t{0}, s.batch - 1})
    for (int64_t h : {int64_t{0}, s.q_heads - 1})
      for (int64_t i : {int64_t{0}, s.q_len / 2, s.q_len - 1}) {
        const int64_t visible = s.causal ? i + (s.kv_len - s.q_len) + 1 : s.kv_len;
        std::vector<double> p(static_cast<size_t>(visible));
        double top = -INFINITY, sum = 0;
        for (int64_t j = 0; j < visible; ++j) {
          double dot = 0;
          for (int64_t c = 0; c < s.head_dim; ++c) dot += element(q, c, i, h, b) * element(k, c, j, h / group, b);
          p[j] = dot * scale;
          top = std::max(top, p[j]);
        }
        for (double& x : p) sum += (x = std::exp(x - top));
        for (int64_t c = 0; c < s.head_dim; ++c) {
          double o = 0;
          for (int64_t j = 0; j < visible; ++j) o += p[j] * element(v, c, j, h / group, b);
          worst = std::max(worst, std::abs(o / sum - element(out, c, h, i, b)));
        }
      }
  return worst;
}

struct Graph {
  ggml_context* ctx = nullptr;
  ggml_cgraph* graph = nullptr;
  ggml_tensor *q = nullptr, *k = nullptr, *v = nullptr, *out = nullptr;
  std::string variant;
};

Graph build_attention(const Spec& s, std::mt19937& rng) {
  const ggml_type kv_type = s.kv_type;
  const size_t kv_bytes = ggml_row_size(kv_type, s.head_dim) * static_cast<size_t>(s.kv_len * s.kv_heads * s.batch);
  const size_t bytes = 4 * static_cast<size_t>(s.head_dim * s.q_len * s.q_heads * s.batch) * 2 + 2 * kv_bytes +
                       2 * static_cast<size_t>(s.kv_len * s.q_len) + 16 * ggml_tensor_overhead() +
                       ggml_graph_overhead() + (size_t{1} << 20);
  Graph g;
  g.ctx = ggml_init({bytes, nullptr, false});
  g.q = ggml_new_tensor_4d(g.ctx, GGML_TYPE_F32, s.head_dim, s.q_len, s.q_heads, s.batch);
  g.k = ggml_new_tensor_4d(g.ctx, kv_type, s.head_dim, s.kv_len, s.kv_heads, s.batch);
  g.v = ggml_new_tensor_4d(g.ctx, kv_type, s.head_dim, s.kv_len, s.kv_heads, s.batch);
  fill_random(g.q, rng);
  fill_random(g.k, rng);
  fill_random(g.v, rng);
  ggml_tensor* mask = nullptr;
  if (s.causal) {
    mask = ggml_new_tensor_4d(g.ctx, GGML_TYPE_F16, s.kv_len, s.q_len, 1, 1);
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.0f), minus_inf = ggml_fp32_to_fp16(-INFINITY);
    auto* m = static_cast<ggml_fp16_t*>(mask->data);
    for (int64_t i = 0; i < s.q_len; ++i)
      for (int64_t j = 0; j < s.kv_len; ++j) m[i * s.kv_len + j] = j <= i + (s.kv_len - s.q_len) ? zero : minus_inf;
  }
  g.out = ggml_flash_attn_ext(g.ctx, g.q, g.k, g.v, mask, 1.0f / std::sqrt(static_cast<float>(s.head_dim)), 0.0f,
                              0.0f);
  ggml_flash_attn_ext_set_prec(g.out, GGML_PREC_F32);
  g.graph = ggml_new_graph(g.ctx);
  ggml_build_forward_expand(g.graph, g.out);
  g.variant = std::string("flash_attn_ext ") + ggml_type_name(kv_type) + " K/V";
  return g;
}

// W5: y = (attention of the heads of x W_in^T + b_in) W_out^T + b_out, self-attention, no mask.
Graph build_module(const Spec& s, std::mt19937& rng) {
  const int64_t e = s.q_heads * s.head_dim, n = s.q_len, b = s.batch, d = s.head_dim, h = s.q_heads;
  const size_t bytes = 4 * static_cast<size_t>(e * n * b * 8 + 4 * e * e + 4 * e) + 32 * ggml_tensor_overhead() +
                       ggml_graph_overhead() + (size_t{1} << 20);
  Graph g;
  g.ctx = ggml_init({bytes, nullptr, false});
  ggml_tensor* x = ggml_new_tensor_3d(g.ctx, GGML_TYPE_F32, e, n, b);
  ggml_tensor* w_in = ggml_new_tensor_2d(g.ctx, GGML_TYPE_F32, e, 3 * e);
  ggml_tensor* b_in = ggml_new_tensor_1d(g.ctx, GGML_TYPE_F32, 3 * e);
  ggml_tensor* w_out = ggml_new_tensor_2d(g.ctx, GGML_TYPE_F32, e, e);
  ggml_tensor* b_out = ggml_new_tensor_1d(g.ctx, GGML_TYPE_F32, e);
  const float init = 1.0f / std::sqrt(static_cast<float>(e));
  fill_random(x, rng);
  fill_random(w_in, rng, init);
  fill_random(b_in, rng, 0.02f);
  fill_random(w_out, rng, init);
  fill_random(b_out, rng, 0.02f);
  ggml_tensor* qkv = ggml_add(g.ctx, ggml_mul_mat(g.ctx, w_in, x), b_in);  // [3E, N, B]
  const auto heads = [&](int part) {  // [d, H, N, B] view of one third, then [d, N, H, B]
    ggml_tensor* view = ggml_view_4d(g.ctx, qkv, d, h, n, b, qkv->nb[0] * d, qkv->nb[1], qkv->nb[2],
                                     static_cast<size_t>(part) * e * qkv->nb[0]);
    return ggml_permute(g.ctx, view, 0, 2, 1, 3);
  };
  ggml_tensor* attention =
      ggml_flash_attn_ext(g.ctx, heads(0), heads(1), heads(2), nullptr, 1.0f / std::sqrt(static_cast<float>(d)), 0.0f,
                          0.0f);  // [d, H, N, B]
  ggml_flash_attn_ext_set_prec(attention, GGML_PREC_F32);
  g.out = ggml_add(g.ctx, ggml_mul_mat(g.ctx, w_out, ggml_reshape_3d(g.ctx, attention, e, n, b)), b_out);
  g.graph = ggml_new_graph(g.ctx);
  ggml_build_forward_expand(g.graph, g.out);
  g.variant = "mul_mat + flash_attn_ext + mul_mat";
  return g;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2;
  bool check = false;
  std::vector<Spec> specs;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--threads" && i + 1 < argc) {
      threads = std::atoi(argv[++i]);
    } else if (arg == "--check") {
      check = true;
    } else if (arg == "--help" || arg == "-h") {
      std::printf("usage: ggml_attention [--threads N] [--check] id:kind:B:Hq:Hkv:Nq:Nk:d:mask:kv_dtype...\n");
      return 0;
    } else {
      specs.push_back(parse_spec(arg));
    }
  }
  ggml_cpu_init();
  ggml_threadpool_params params = ggml_threadpool_params_default(threads);
  ggml_threadpool* pool = ggml_threadpool_new(&params);
  std::mt19937 rng(1);
  for (const Spec& s : specs) {
    Graph g = s.kind == "module" ? build_module(s, rng) : build_attention(s, rng);
    ggml_cplan plan = ggml_graph_plan(g.graph, threads, pool);
    std::vector<uint8_t> work(plan.work_size + 64);
    plan.work_data = work.data();
    bool failed = false;
    const auto [ms, runs] = time_median([&] { failed = failed || ggml_graph_compute(g.graph, &plan) != GGML_STATUS_SUCCESS; });
    if (failed) {
      std::fprintf(stderr, "ggml_attention: %s: ggml_graph_compute failed\n", s.id.c_str());
      return 1;
    }
    std::printf("{\"peer\": \"ggml\", \"version\": \"%s (%s)\", \"workload\": \"%s\", \"variant\": \"%s\", "
                "\"ms\": %.6g, \"runs\": %d",
                ggml_version(), ggml_commit(), s.id.c_str(), g.variant.c_str(), ms, runs);
    if (check && s.kind != "module") std::printf(", \"max_err\": %.3g", check_attention(s, g.q, g.k, g.v, g.out));
    std::printf("}\n");
    std::fflush(stdout);
    ggml_free(g.ctx);
  }
  ggml_threadpool_free(pool);
  return 0;
}
