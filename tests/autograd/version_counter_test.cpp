// Saved tensors remember the storage version: modifying one in place before backward is an error.
#include <gtest/gtest.h>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/ops.h>

#include "../core/core_test_util.h"

using namespace kiln;

TEST(VersionCounter, ModifyingASavedOutputInPlaceThrows) {
  Tensor x = tensor({0.5, 1.0}, {2}, {.requires_grad = true});
  Tensor y = x.exp();  // exp saves its output
  {
    NoGradGuard ng;
    y.mul_(2.0);
  }
  EXPECT_KILN_ERROR(y.sum().backward(), "exp", "modified in place");
}

TEST(VersionCounter, ModifyingASavedInputInPlaceThrows) {
  Tensor x = tensor({0.5, 1.0}, {2}, {.requires_grad = true});
  Tensor w = tensor({2.0, 3.0}, {2});
  Tensor y = x * w;  // mul saves w for x's gradient
  w.add_(1.0);
  EXPECT_KILN_ERROR(y.sum().backward(), "mul", "modified in place");
}

TEST(VersionCounter, WriteThroughAViewBumpsTheSharedCounter) {
  Tensor x = tensor({0.5, 1.0, 2.0}, {3}, {.requires_grad = true});
  Tensor y = x.log();  // log saves its input x; modify x through a detached view under no_grad
  uint64_t v0 = x.version();
  {
    NoGradGuard ng;
    x.narrow(0, 1, 1).fill_(5.0);
  }
  EXPECT_GT(x.version(), v0);
  EXPECT_KILN_ERROR(y.sum().backward(), "log", "modified in place");
  // a detached alias shares the counter too
  Tensor z = tensor({1.0, 2.0}, {2}, {.requires_grad = true});
  Tensor s = z.sqrt();
  Tensor alias = s.detach();
  alias.zero_();
  EXPECT_KILN_ERROR(s.sum().backward(), "sqrt", "modified in place");
}

TEST(VersionCounter, UnrelatedOrUnsavedModificationsAreFine) {
  Tensor x = tensor({0.5, 1.0}, {2}, {.requires_grad = true});
  Tensor y = x * 3.0;  // mul by a scalar saves nothing
  Tensor z = y + 1.0;
  {
    NoGradGuard ng;
    y.mul_(10.0);
  }
  z.sum().backward();
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{3, 3}));
  // in-place on a copy does not affect the original's saved tensors
  Tensor a = tensor({1.0, 2.0}, {2}, {.requires_grad = true});
  Tensor e = a.exp();
  Tensor c;
  {
    NoGradGuard ng;
    c = e.clone();
  }
  c.mul_(2.0);
  EXPECT_NO_THROW(e.sum().backward());
}

TEST(VersionCounter, InPlaceOpsBumpVersion) {
  Tensor t = zeros({3});
  uint64_t v = t.version();
  t.add_(1.0);
  t.mul_(2.0);
  t.fill_(3.0);
  t.copy_(ones({3}));
  t.zero_();
  EXPECT_EQ(t.version(), v + 5);
  Tensor u = t.clone();
  EXPECT_EQ(u.version(), 0u);
}
