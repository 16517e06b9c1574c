// The runtime hooks data parallelism and second-order optimizers build on: removable tensor hooks, the
// post-accumulate-grad hook (a parameter's gradient is final) and the end-of-backward callback.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <kiln/autograd/checkpoint.h>
#include <kiln/autograd/node.h>
#include <kiln/core/ops.h>

#include "../core/core_test_util.h"

namespace kiln {
namespace {

TEST(TensorHooks, RemovedHooksNoLongerRun) {
  Tensor x = ones({3}, {.requires_grad = true});
  Tensor y = mul(x, 2.0);
  int first = 0, second = 0;
  const size_t h1 = y.register_hook([&](const Tensor&) {
    ++first;
    return Tensor();
  });
  const size_t h2 = y.register_hook([&](const Tensor& g) {
    ++second;
    return mul(g, 10.0);
  });
  EXPECT_NE(h1, h2);
  y.remove_hook(h1);
  sum(y).backward({}, /*retain_graph=*/true);
  EXPECT_EQ(first, 0);
  EXPECT_EQ(second, 1);
  EXPECT_EQ(x.grad().to_vector<float>(), std::vector<float>(3, 20.0f));
  y.remove_hook(h2);
  x.set_grad(Tensor());
  sum(y).backward();
  EXPECT_EQ(second, 1);
  EXPECT_EQ(x.grad().to_vector<float>(), std::vector<float>(3, 2.0f));
  EXPECT_KILN_ERROR(y.remove_hook(h2), "remove_hook", "handle");
}

TEST(TensorHooks, AHookMayRemoveItselfWhileRunning) {
  Tensor x = ones({2}, {.requires_grad = true});
  Tensor y = mul(x, 3.0);
  int calls = 0;
  size_t handle = 0;
  handle = y.register_hook([&](const Tensor&) {
    ++calls;
    y.remove_hook(handle);
    return Tensor();
  });
  sum(y).backward({}, true);
  sum(y).backward();
  EXPECT_EQ(calls, 1);
}

// A leaf's gradient is accumulated as soon as it is complete, before the rest of backward goes on, also
// when its accumulator is older than every node of the pass (a parameter used in earlier steps): what lets
// DistributedDataParallel all-reduce the late layers' gradients while the early layers' backward runs.
TEST(PostAccumulateGradHook, FiresAsSoonAsTheGradientIsComplete) {
  Tensor x = tensor({1, 2}, {2}, {.requires_grad = true});
  Tensor w1 = tensor({3, 4}, {2}, {.requires_grad = true}), w2 = tensor({5, 6}, {2}, {.requires_grad = true});
  sum(mul(mul(x, w1), w2)).backward();  // an earlier step: the accumulators now exist
  std::vector<std::string> order;
  w2.register_post_accumulate_grad_hook([&](const Tensor&) { order.push_back("w2 accumulated"); });
  Tensor h1 = mul(x, w1);  // newer nodes than w2's accumulator
  h1.register_hook([&](const Tensor&) {
    order.push_back("backward of x * w1");
    return Tensor();
  });
  sum(mul(h1, w2)).backward();
  EXPECT_EQ(order, (std::vector<std::string>{"w2 accumulated", "backward of x * w1"}));
}

TEST(PostAccumulateGradHook, FiresOnceWithTheWholeGradient) {
  // x reaches the loss along three paths; the hook must see their sum, once.
  Tensor x = tensor({1, 2}, {2}, {.requires_grad = true});
  std::vector<std::vector<float>> seen;
  x.register_post_accumulate_grad_hook([&](const Tensor& leaf) {
    EXPECT_TRUE(leaf.is_same(x));
    seen.push_back(leaf.grad().to_vector<float>());
  });
  sum(add(add(mul(x, 2.0), mul(x, 3.0)), mul(x, x))).backward();  // d/dx = 5 + 2x
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0], (std::vector<float>{7, 9}));
  sum(mul(x, 4.0)).backward();  // accumulates: the hook sees .grad after the add
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[1], (std::vector<float>{11, 13}));
}

TEST(PostAccumulateGradHook, OnlyLeavesAndRemovable) {
  Tensor x = ones({2}, {.requires_grad = true});
  EXPECT_KILN_ERROR(mul(x, 2.0).register_post_accumulate_grad_hook([](const Tensor&) {}),
                    "register_post_accumulate_grad_hook", "leaf");
  EXPECT_KILN_ERROR(ones({2}).register_post_accumulate_grad_hook([](const Tensor&) {}),
                    "register_post_accumulate_grad_hook");
  int calls = 0;
  const size_t h = x.register_post_accumulate_grad_hook([&](const Tensor&) { ++calls; });
  sum(x).backward();
  x.remove_hook(h);
  sum(x).backward();
  EXPECT_EQ(calls, 1);
}

TEST(QueueCallback, RunsOnceAfterEveryGradientIsAccumulated) {
  Tensor a = ones({2}, {.requires_grad = true}), b = ones({2}, {.requires_grad = true});
  std::vector<std::string> events;
  bool queued = false;
  auto note_ready = [&](const char* name) {
    return [&, name](const Tensor&) {
      events.push_back(name);
      if (!queued) {
        queued = true;
        autograd::queue_callback([&] {
          events.push_back("end");
          EXPECT_TRUE(a.grad().defined() && b.grad().defined());
          autograd::queue_callback([&] { events.push_back("queued by a callback"); });
        });
      }
    };
  };
  a.register_post_accumulate_grad_hook(note_ready("a"));
  b.register_post_accumulate_grad_hook(note_ready("b"));
  sum(add(mul(a, 2.0), mul(b, 3.0))).backward();
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[2], "end");
  EXPECT_EQ(events[3], "queued by a callback");
  EXPECT_KILN_ERROR(autograd::queue_callback([] {}), "queue_callback", "no backward pass");
}

TEST(QueueCallback, ANestedBackwardDefersToTheOutermostPass) {
  // checkpoint recomputes its function and runs a nested backward inside the outer one; a callback queued
  // from inside must wait until the outer pass has reached every leaf.
  Tensor w = ones({2}, {.requires_grad = true}), v = ones({2}, {.requires_grad = true});
  bool v_ready_at_end = false;
  w.register_post_accumulate_grad_hook([&](const Tensor&) {
    autograd::queue_callback([&] { v_ready_at_end = v.grad().defined(); });
  });
  Tensor inner = autograd::checkpoint([&](const std::vector<Tensor>& in) { return mul(in[0], w); }, {mul(v, 1.0)});
  sum(mul(inner, v)).backward();
  EXPECT_TRUE(v_ready_at_end);
}

}  // namespace
}  // namespace kiln
