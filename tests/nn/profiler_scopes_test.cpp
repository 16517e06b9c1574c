// Module scopes in the profiler's records: a module called through operator() is a "module" range named as
// its parent registered it, GPT's blocks are h.<i> (its fused path calls them directly), and the kernel
// calls nest inside them; with the profiler off nothing is recorded.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <kiln/core/profiler.h>
#include <kiln/core/random.h>
#include <kiln/nn/gpt.h>

namespace kiln::nn {
namespace {

TEST(ProfilerScopes, GptBlocksAndTheirModulesNestTheirKernelCalls) {
  manual_seed(5);
  GPT gpt({.vocab_size = 11, .block_size = 8, .n_layer = 2, .n_head = 2, .n_embd = 8, .dropout = 0.0});
  const Tensor idx = randint(0, 11, {2, 8});
  gpt(idx);  // not recorded
  profiler::start({.gpu = false});
  gpt(idx);
  const profiler::Trace trace = profiler::stop();
  auto find = [&](const std::string& name) -> const profiler::Event* {
    for (const auto& e : trace.events)
      if (e.category == "module" && e.name == name) return &e;
    return nullptr;
  };
  const profiler::Event* block1 = find("h.1");
  const profiler::Event* attn = nullptr;
  for (const auto& e : trace.events)
    if (e.category == "module" && e.name == "attn" && block1 && e.start_ns >= block1->start_ns) attn = &e;
  ASSERT_NE(find("h.0"), nullptr);
  ASSERT_NE(block1, nullptr);
  ASSERT_NE(attn, nullptr);
  EXPECT_LE(attn->start_ns + attn->duration_ns, block1->start_ns + block1->duration_ns);  // attn inside h.1
  int inside = 0;
  for (const auto& e : trace.events)
    inside += e.category == "op" && e.start_ns >= attn->start_ns &&
              e.start_ns + e.duration_ns <= attn->start_ns + attn->duration_ns;
  EXPECT_GT(inside, 0) << "no kernel call inside the attention's scope";
}

}  // namespace
}  // namespace kiln::nn
