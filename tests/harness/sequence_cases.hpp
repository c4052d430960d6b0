// What the tests of calls made of per-sequence calls share (attention/test_varlen.cpp, packed
// batches; attention/test_paged.cpp, paged K/V): the mask cases such a call takes, each with what
// it means for one sequence's own call, and the check of a refusal's message.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "qkv/qkv.hpp"

namespace qkv_test {

// A mask as the whole call takes it, and as sequence b's own call means it given shift = Nk_b -
// Nq_b: the band aligned to the end of the sequence's keys, the rules in its own positions.
struct SequenceMask {
  std::string name;
  qkv::Mask whole;
  std::function<qkv::Mask(int64_t shift)> alone;
};

inline std::vector<SequenceMask> sequence_masks() {
  using qkv::Mask;
  return {
      {"none", Mask(), [](int64_t) { return Mask(); }},
      {"causal", Mask::causal(), [](int64_t s) { return Mask::causal(s); }},
      {"causal(offset=3)", Mask::causal(3), [](int64_t s) { return Mask::causal(3 + s); }},
      {"causal(offset=-2)", Mask::causal(-2), [](int64_t s) { return Mask::causal(s - 2); }},
      {"window(4)", Mask::window(4), [](int64_t s) { return Mask::window(4, 0, s); }},
      {"window(3, 2)", Mask::window(3, 2), [](int64_t s) { return Mask::window(3, 2, s); }},
      {"strided(3)", Mask::strided(3), [](int64_t) { return Mask::strided(3); }},
      {"causal & strided(5, 1)", Mask::causal() & Mask::strided(5, 1),
       [](int64_t s) { return Mask::causal(s) & Mask::strided(5, 1); }},
      // In a union the band is a rule: the sequence's own positions, not aligned to the end.
      {"causal | global(2)", Mask::causal() | Mask::global_tokens(2),
       [](int64_t) { return Mask::causal() | Mask::global_tokens(2); }},
  };
}

// The error of `call`, which must throw qkv::Error containing every one of `parts`.
template <class Call>
void expect_error(const Call& call, std::initializer_list<const char*> parts) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one containing " << *parts.begin();
  } catch (const qkv::Error& e) {
    for (const char* part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

}  // namespace qkv_test
