// FlatParameters: parameters and gradients as views of two flat buffers, which survive zero_grad, train
// exactly like unflattened parameters and go through a checkpoint.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <vector>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/nn/activation.h>
#include <kiln/nn/linear.h>
#include <kiln/nn/sequential.h>
#include <kiln/optim/adamw.h>
#include <kiln/optim/checkpoint.h>
#include <kiln/optim/clip_grad.h>
#include <kiln/optim/flat_parameters.h>

namespace kiln::optim {
namespace {

std::unique_ptr<nn::Sequential> make_model(uint64_t seed) {
  manual_seed(seed);
  return std::make_unique<nn::Sequential>(std::make_unique<nn::Linear>(5, 7), std::make_unique<nn::Tanh>(),
                                          std::make_unique<nn::Linear>(7, 3));
}

Tensor loss_of(nn::Sequential& m, uint64_t seed) {
  Generator gen(seed);
  Tensor x = randn({4, 5}, {}, &gen), y = randn({4, 3}, {}, &gen);
  return sum(square(sub(m.forward(x), y)));
}

bool shares_memory(const Tensor& view, const Tensor& flat) {
  const char* a = static_cast<const char*>(view.raw_data());
  const char* b = static_cast<const char*>(flat.raw_data());
  return a >= b && a < b + flat.numel() * int64_t(flat.element_size());
}

TEST(FlatParameters, ParametersBecomeAlignedViewsWithTheirValues) {
  auto m = make_model(1);
  std::vector<Tensor> params = m->parameters();
  std::vector<std::vector<float>> before;
  for (const Tensor& p : params) before.push_back(p.to_vector<float>());
  FlatParameters flat(params);
  ASSERT_EQ(flat.params().size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(shares_memory(params[i], flat.data())) << i;
    EXPECT_EQ(params[i].to_vector<float>(), before[i]) << i;
    EXPECT_EQ(flat.offset(i) % 32, 0) << "f32 views start at 128-byte multiples";
    EXPECT_TRUE(m->parameters()[i].is_same(params[i]));
  }
  // Writing the flat buffer writes the module's parameters.
  Tensor data = flat.data();
  data.fill_(0.5);
  for (const Tensor& p : m->parameters())
    for (float v : p.to_vector<float>()) EXPECT_EQ(v, 0.5f);
}

TEST(FlatParameters, GradientsAccumulateIntoTheBufferAndSurviveZeroGrad) {
  auto plain = make_model(2), flat_model = make_model(2);
  FlatParameters flat(flat_model->parameters());
  AdamW opt(flat_model->parameters(), {.lr = 1e-2});
  loss_of(*plain, 7).backward();
  loss_of(*flat_model, 7).backward();
  for (size_t i = 0; i < flat.params().size(); ++i) {
    const Tensor g = flat_model->parameters()[i].grad();
    EXPECT_TRUE(shares_memory(g, flat.grad())) << i;
    EXPECT_EQ(g.to_vector<float>(), plain->parameters()[i].grad().to_vector<float>()) << i;
  }
  // Both zero_grads (set_to_none by default) keep the views and zero them.
  opt.zero_grad();
  flat_model->zero_grad();
  for (const Tensor& p : flat_model->parameters()) {
    ASSERT_TRUE(p.grad().defined());
    EXPECT_TRUE(shares_memory(p.grad(), flat.grad()));
    for (float v : p.grad().to_vector<float>()) EXPECT_EQ(v, 0.0f);
  }
  // A second backward accumulates into the same views.
  loss_of(*flat_model, 7).backward();
  for (size_t i = 0; i < flat.params().size(); ++i)
    EXPECT_EQ(flat_model->parameters()[i].grad().to_vector<float>(), plain->parameters()[i].grad().to_vector<float>());
  // set_grad releases a pinned gradient: zero_grad then drops it.
  flat_model->parameters()[0].set_grad(Tensor());
  EXPECT_FALSE(flat_model->parameters()[0].grad_is_pinned());
}

// zero_grad leaves a pinned gradient's fill to backward (Tensor::zero_pinned_grad): backward copies its
// gradient over whatever the buffer held, and a gradient backward does not reach reads as zeros, through
// the parameter and through the flat buffer; a second backward adds to the first.
TEST(FlatParameters, ZeroGradLeavesTheFillToBackward) {
  auto plain = make_model(4), flat_model = make_model(4);
  FlatParameters flat(flat_model->parameters());
  AdamW opt(flat_model->parameters(), {.lr = 1e-2});
  Tensor(flat.grad()).fill_(7.0);  // stale elements: none may survive a lazy zero
  opt.zero_grad();
  opt.zero_grad();  // twice: still no fill
  for (const Tensor& p : flat_model->parameters()) EXPECT_TRUE(p.grad_zero_pending());
  // the head alone: the first Linear's parameters get no gradient from this backward
  auto* head = dynamic_cast<nn::Linear*>(&(*flat_model)[2]);
  ASSERT_NE(head, nullptr);
  Generator gen(3);
  Tensor h = randn({4, 7}, {}, &gen), y = randn({4, 3}, {}, &gen);
  sum(square(sub(head->forward(h), y))).backward();
  const std::vector<Tensor> params = flat_model->parameters();  // (w1, b1, w2, b2)
  EXPECT_TRUE(params[0].grad_zero_pending() && params[1].grad_zero_pending());
  EXPECT_FALSE(params[2].grad_zero_pending() || params[3].grad_zero_pending());
  // the head's gradient is the gradient alone: a copy over the 7s, not an add
  nn::Linear reference(7, 3);
  reference.weight.set_data(head->weight.detach().clone());
  reference.bias.set_data(head->bias.detach().clone());
  sum(square(sub(reference.forward(h), y))).backward();
  EXPECT_EQ(params[2].grad().to_vector<float>(), reference.weight.grad().to_vector<float>());
  EXPECT_EQ(params[3].grad().to_vector<float>(), reference.bias.grad().to_vector<float>());
  // the flat buffer fills the untouched views with zeros when read
  const std::vector<float> all = flat.grad().to_vector<float>();
  EXPECT_FALSE(params[0].grad_zero_pending());
  for (int64_t k = 0; k < params[0].numel(); ++k) EXPECT_EQ(all[size_t(flat.offset(0) + k)], 0.0f) << k;
  for (float v : params[1].grad().to_vector<float>()) EXPECT_EQ(v, 0.0f);
  // a whole backward after another zero_grad, then a second one: the sum of two, as unflattened
  opt.zero_grad();
  loss_of(*flat_model, 8).backward();
  loss_of(*flat_model, 9).backward();
  loss_of(*plain, 8).backward();
  loss_of(*plain, 9).backward();
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_EQ(params[i].grad().to_vector<float>(), plain->parameters()[i].grad().to_vector<float>()) << i;
}

TEST(FlatParameters, TrainsLikeTheUnflattenedModel) {
  auto plain = make_model(3), flat_model = make_model(3);
  FlatParameters flat(flat_model->parameters());
  AdamW opt_plain(plain->parameters(), {.lr = 1e-2, .weight_decay = 0.1});
  AdamW opt_flat(flat_model->parameters(), {.lr = 1e-2, .weight_decay = 0.1});
  for (uint64_t step = 0; step < 5; ++step) {
    opt_plain.zero_grad();
    loss_of(*plain, 100 + step).backward();
    const double norm_plain = clip_grad_norm_async(plain->parameters(), 0.5).item<double>();
    opt_plain.step();
    flat.zero_grad();
    loss_of(*flat_model, 100 + step).backward();
    const double norm_flat = flat.clip_grad_norm(0.5).item<double>();
    opt_flat.step();
    EXPECT_NEAR(norm_flat, norm_plain, 1e-5 * norm_plain) << step;
  }
  for (size_t i = 0; i < flat.params().size(); ++i) {
    const auto a = flat_model->parameters()[i].to_vector<float>(), b = plain->parameters()[i].to_vector<float>();
    ASSERT_EQ(a.size(), b.size());
    for (size_t j = 0; j < a.size(); ++j) EXPECT_NEAR(a[j], b[j], 1e-5) << i << " " << j;
  }
}

TEST(FlatParameters, CheckpointRoundTripKeepsTheViews) {
  const std::string path = (std::filesystem::temp_directory_path() / "kiln_flat_parameters_test.h5").string();
  auto saved = make_model(4);
  FlatParameters flat_saved(saved->parameters());
  AdamW opt_saved(saved->parameters(), {.lr = 1e-2});
  loss_of(*saved, 9).backward();
  opt_saved.step();
  save_checkpoint(path, *saved, &opt_saved, {}, 1);

  auto loaded = make_model(5);
  FlatParameters flat_loaded(loaded->parameters());
  AdamW opt_loaded(loaded->parameters(), {.lr = 1e-2});
  load_checkpoint(path, *loaded, &opt_loaded);
  std::filesystem::remove(path);
  for (size_t i = 0; i < flat_loaded.params().size(); ++i) {
    EXPECT_TRUE(shares_memory(loaded->parameters()[i], flat_loaded.data())) << i;
    EXPECT_EQ(loaded->parameters()[i].to_vector<float>(), saved->parameters()[i].to_vector<float>()) << i;
  }
}

TEST(FlatParameters, RefusesMixedDtypesAndRepeats) {
  Tensor a = zeros({3}, {.requires_grad = true}), b = zeros({3}, {.dtype = DType::f64, .requires_grad = true});
  EXPECT_THROW(FlatParameters({a, b}), Error);
  EXPECT_THROW(FlatParameters({a, a}), Error);
  EXPECT_THROW(FlatParameters({}), Error);
  EXPECT_THROW(a.set_data(zeros({4})), Error);
}

}  // namespace
}  // namespace kiln::optim
