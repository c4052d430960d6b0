// qkv serve's per-folder cache (tools/qkv/serve_folder_cache.hpp) on qkv_make_tiny_model's gpt2,
// llama and bert folders (QKV_TINY): the roles the API answers are exactly measure_roles' (the
// uncached path `qkv viz` and `qkv heads` use) while the repeated sequence runs once per model
// and prefix; the neuron view's q and k come from the cache, least recently used dropped; and
// many threads asking at once get the answers one thread gets (the TSan lane checks the locking).
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "pretrained.hpp"
#include "qkv/models/pretrained.hpp"
#include "serve_api.hpp"

namespace qkv::cli {
namespace {

using nlohmann::json;

const std::vector<std::string> kNames = {"gpt2", "llama", "bert"};

class ExplorerFolderCache : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tiny = std::getenv("QKV_TINY");
    if (tiny == nullptr) GTEST_SKIP() << "QKV_TINY is not set (ctest sets it to qkv_make_tiny_model's folders)";
    root_ = tiny;
    std::vector<std::string> paths;
    for (const auto& name : kNames) paths.push_back(root_ + "/" + name);
    api_ = std::make_unique<ExplorerApi>(paths, ServeLimits{});
  }
  json ask(const json& request) const {
    const ApiResponse answer = api_->attention(request.dump());
    EXPECT_EQ(answer.status, 200) << request.dump() << " -> " << answer.body;
    return json::parse(answer.body);
  }
  FolderCache& cache(size_t model) const { return *api_->loaded_pretrained()[model].cache; }
  std::string root_;
  std::unique_ptr<ExplorerApi> api_;
};

TEST_F(ExplorerFolderCache, RolesAreMeasureRolesAndTheRepeatedSequenceRunsOnce) {
  const std::vector<std::string> texts = {"the cat sat on the mat", "a dog ran", "the cat sat on the mat again and again"};
  for (size_t m = 0; m < kNames.size(); ++m) {
    SCOPED_TRACE(kNames[m]);
    const models::Pretrained p = models::load_pretrained(root_ + "/" + kNames[m]);
    for (int round = 0; round < 2; ++round) {
      for (const auto& text : texts) {
        const json a = ask({{"model", kNames[m]}, {"text", text}});
        const std::vector<models::HeadRoleScores> expected = measure_roles(p, a["ids"].get<std::vector<int64_t>>());
        size_t k = 0;
        for (const json& layer : a["layers"]) {
          for (const json& role : layer["roles"]) {
            ASSERT_LT(k, expected.size());
            const models::HeadRoleScores& e = expected[k++];
            EXPECT_EQ(role["role"], std::string(models::to_string(e.role)));
            const json& s = role["scores"];
            EXPECT_EQ(s["previous-token"].get<double>(), e.previous_token);
            EXPECT_EQ(s["first-token"].get<double>(), e.first_token);
            EXPECT_EQ(s["self"].get<double>(), e.self);
            EXPECT_EQ(s["induction"].get<double>(), e.induction);
            EXPECT_EQ(s["broad"].get<double>(), e.broad);
          }
        }
        EXPECT_EQ(k, expected.size());
      }
    }
    // Every text of a model starts alike (a BOS, [CLS], or an ordinary token): one run in all.
    EXPECT_EQ(cache(m).counts().repeated_runs, 1);
  }
}

TEST_F(ExplorerFolderCache, NeuronRowsShareTheLayersQueriesAndKeys) {
  const models::Pretrained p = models::load_pretrained(root_ + "/llama");
  const size_t llama = 1;
  const json a = ask({{"model", "llama"}, {"text", "the cat sat on the mat"}});
  const std::vector<int64_t> ids = a["ids"];
  const auto n = static_cast<int64_t>(ids.size());
  const models::QueryKeys direct = p.model.query_keys(ids, 1);
  const int64_t d = p.config.head_dim, group = p.config.num_heads / p.config.num_kv_heads;
  for (int64_t head = 0; head < p.config.num_heads; ++head) {
    for (int64_t query : {int64_t{0}, n - 1}) {
      const json nr = ask({{"model", "llama"}, {"ids", ids}, {"neuron", {{"layer", 1}, {"head", head}, {"query", query}}}})["neuron"];
      const Tensor q = direct.queries.contiguous(), k = direct.keys.contiguous();
      for (int64_t e = 0; e < d; ++e) {
        EXPECT_EQ(nr["q"][e].get<float>(), q.data()[(head * n + query) * d + e]);
        EXPECT_EQ(nr["k"][n - 1][e].get<float>(), k.data()[((head / group) * n + n - 1) * d + e]);
      }
    }
  }
  const FolderCache::Counts c = cache(llama).counts();
  EXPECT_EQ(c.query_keys_runs, 1);
  EXPECT_EQ(c.query_keys_hits, 2 * p.config.num_heads - 1);
}

TEST_F(ExplorerFolderCache, TheLeastRecentlyUsedQueryKeysAreDropped) {
  const size_t gpt2 = 0;
  const json a = ask({{"model", "gpt2"}, {"text", "the cat sat on the mat"}});
  const std::vector<int64_t> ids = a["ids"];
  const auto neuron = [&](const std::vector<int64_t>& which, int64_t layer) {
    ask({{"model", "gpt2"}, {"ids", which}, {"neuron", {{"layer", layer}, {"head", 0}, {"query", 0}}}});
  };
  // kQueryKeysEntries + 1 different texts: the first is dropped, the last kept.
  for (size_t t = 0; t <= FolderCache::kQueryKeysEntries; ++t) {
    std::vector<int64_t> other = ids;
    other.resize(2 + t, ids.back());
    neuron(other, 0);
  }
  EXPECT_EQ(cache(gpt2).counts().query_keys_runs, static_cast<int64_t>(FolderCache::kQueryKeysEntries) + 1);
  std::vector<int64_t> last = ids;
  last.resize(2 + FolderCache::kQueryKeysEntries, ids.back());
  neuron(last, 0);
  EXPECT_EQ(cache(gpt2).counts().query_keys_hits, 1);
  std::vector<int64_t> first = ids;
  first.resize(2);
  neuron(first, 0);
  EXPECT_EQ(cache(gpt2).counts().query_keys_runs, static_cast<int64_t>(FolderCache::kQueryKeysEntries) + 2);
  neuron(first, 1);  // another layer of the same text is another entry
  EXPECT_EQ(cache(gpt2).counts().query_keys_runs, static_cast<int64_t>(FolderCache::kQueryKeysEntries) + 3);
}

TEST_F(ExplorerFolderCache, ConcurrentRequestsGetTheAnswersOneThreadGets) {
  // The answers one thread gets, from a server of its own (a cold cache).
  const ExplorerApi alone({root_ + "/gpt2", root_ + "/llama", root_ + "/bert"}, ServeLimits{});
  std::vector<json> requests;
  for (const auto& name : kNames) {
    for (const char* text : {"the cat sat on the mat", "a dog ran to it"}) {
      requests.push_back({{"model", name}, {"text", text}});
      requests.push_back({{"model", name}, {"text", text}, {"neuron", {{"layer", 1}, {"head", 1}, {"query", 2}}}});
    }
  }
  std::vector<std::string> expected;
  for (const json& r : requests) expected.push_back(alone.attention(r.dump()).body);
  constexpr int kThreads = 6;
  std::vector<std::vector<std::string>> got(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = 0; i < requests.size(); ++i) {
        const size_t r = (i + static_cast<size_t>(t) * 3) % requests.size();  // each thread in its own order
        got[static_cast<size_t>(t)].push_back(std::to_string(r) + " " + api_->attention(requests[r].dump()).body);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (const auto& answers : got) {
    for (const std::string& answer : answers) {
      const size_t space = answer.find(' ');
      EXPECT_EQ(answer.substr(space + 1), expected[std::stoul(answer.substr(0, space))]);
    }
  }
  for (size_t m = 0; m < kNames.size(); ++m) {
    const FolderCache::Counts c = cache(m).counts();
    EXPECT_GE(c.repeated_runs, 1);
    EXPECT_LE(c.repeated_runs, kThreads);  // at most one per thread that missed at once
    EXPECT_EQ(c.query_keys_runs + c.query_keys_hits, 2 * kThreads);
  }
}

}  // namespace
}  // namespace qkv::cli
