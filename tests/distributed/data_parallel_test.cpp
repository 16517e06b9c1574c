// DistributedDataParallel over the MPI group (2 ranks under ctest): training on each rank's half of the batch
// gives what one process gets on the whole batch; no_sync accumulates; unused parameters and models that
// differ between ranks are errors naming the parameter; buckets come in reverse registration order.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/distributed/data_parallel.h>
#include <kiln/nn/activation.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/linear.h>
#include <kiln/optim/adamw.h>
#include <kiln/optim/flat_parameters.h>
#include <kiln/optim/grad_scaler.h>
#include <kiln/autograd/checkpoint.h>
#include <kiln/optim/sgd.h>

#include "distributed_test_util.h"

namespace kiln::distributed {
namespace {

using testing::world;
namespace F = kiln::nn::functional;

struct Net : nn::Module {
  nn::Linear fc1, fc2, spare;
  bool use_spare = true;
  explicit Net(int64_t hidden = 6) : fc1(5, hidden), fc2(hidden, 3), spare(3, 3) {
    register_module("fc1", fc1);
    register_module("fc2", fc2);
    register_module("spare", spare);
  }
  Tensor forward(const Tensor& x) override {
    Tensor y = fc2(tanh(fc1(x)));
    return use_spare ? spare(y) : y;
  }
};

// The whole batch (the same on every rank) and this rank's contiguous share of it.
struct Data {
  Tensor x, y;
};
Data whole_batch(int64_t rows) {
  Generator gen(77);
  return {randn({rows, 5}, {}, &gen), randn({rows, 3}, {}, &gen)};
}
Data share(const Data& d, int rank, int size) {
  const int64_t n = d.x.size(0) / size;
  return {d.x.narrow(0, rank * n, n), d.y.narrow(0, rank * n, n)};
}

void expect_same_parameters(nn::Module& a, nn::Module& b, double tol) {
  auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    auto x = pa[i].second.contiguous().to_vector<float>(), y = pb[i].second.contiguous().to_vector<float>();
    for (size_t k = 0; k < x.size(); ++k) ASSERT_NEAR(x[k], y[k], tol) << pa[i].first << " element " << k;
  }
}

TEST(DistributedDataParallel, MatchesOneProcessOnTheWholeBatch) {
  const auto& pg = world();
  manual_seed(100 + uint64_t(pg->rank()));  // different initial weights on every rank: DDP sends rank 0's
  Net model;
  DistributedDataParallel ddp(model, pg, {.bucket_cap_mb = 1e-4, .first_bucket_cap_mb = 1e-4});
  Net reference;  // rank 0's initial weights, trained alone on the whole batch
  reference.load_state_dict(model.state_dict());
  optim::AdamW opt(model.parameters(), {.lr = 0.05});
  optim::AdamW ref_opt(reference.parameters(), {.lr = 0.05});
  const Data all = whole_batch(8 * pg->size());
  const Data mine = share(all, pg->rank(), pg->size());
  for (int step = 0; step < 5; ++step) {
    opt.zero_grad();
    F::mse_loss(ddp(mine.x), mine.y).backward();
    opt.step();
    ref_opt.zero_grad();
    F::mse_loss(reference(all.x), all.y).backward();
    ref_opt.step();
  }
  expect_same_parameters(model, reference, 1e-5);
  // and every rank holds the same weights: rank 0's, broadcast, compared on every rank
  for (const auto& [name, p] : model.named_parameters()) {
    Tensor mine_p = p.contiguous().clone(), rank0 = p.contiguous().clone();
    pg->broadcast(rank0, 0);
    EXPECT_EQ(mine_p.to_vector<float>(), rank0.to_vector<float>()) << name;
  }
}

// Over optim::FlatParameters (char_gpt's flat gradients): the buckets are ranges of the flat gradient, and
// training gives what DDP with its own buckets gives.
TEST(DistributedDataParallel, OverFlatParametersTheBucketsAreRangesOfTheFlatGradient) {
  const auto& pg = world();
  manual_seed(21 + uint64_t(pg->rank()));
  Net a, b;
  DistributedDataParallel plain(a, pg);
  b.load_state_dict(a.state_dict());
  optim::FlatParameters flat(b.parameters());
  DistributedDataParallel over(b, pg, {.bucket_cap_mb = 1e-4, .first_bucket_cap_mb = 1e-4, .flat = &flat});
  EXPECT_GT(over.bucket_parameter_names().size(), 1u);
  EXPECT_EQ(over.bucket_parameter_names().front().front(), "spare.bias");  // the last of the layout first
  optim::AdamW oa(a.parameters(), {.lr = 0.03}), ob(b.parameters(), {.lr = 0.03});
  const Data d = share(whole_batch(6 * pg->size()), pg->rank(), pg->size());
  for (int step = 0; step < 4; ++step) {
    oa.zero_grad();
    F::mse_loss(plain(d.x), d.y).backward();
    oa.step();
    flat.zero_grad();
    F::mse_loss(over(d.x), d.y).backward();
    ob.step();
  }
  expect_same_parameters(a, b, 1e-6);
}

TEST(DistributedDataParallel, BucketsInReverseRegistrationOrderAndGradientsAreViews) {
  const auto& pg = world();
  Net model;
  DistributedDataParallel ddp(model, pg, {.bucket_cap_mb = 1e-5, .first_bucket_cap_mb = 1e-5});
  const auto buckets = ddp.bucket_parameter_names();
  ASSERT_EQ(buckets.size(), 6u);  // 1e-5 MiB (10 bytes) holds one parameter at a time
  EXPECT_EQ(buckets.front(), std::vector<std::string>{"spare.bias"});
  EXPECT_EQ(buckets.back(), std::vector<std::string>{"fc1.weight"});
  Net other;
  DistributedDataParallel one_bucket(other, pg);  // default caps: one bucket
  EXPECT_EQ(one_bucket.bucket_parameter_names().size(), 1u);
  EXPECT_TRUE(model.fc1.weight.grad_is_pinned());
}

// Inside no_sync backward only accumulates; the next backward averages the sum: with the loss a mean over
// each micro-batch of each rank, two micro-batches give twice the gradient of the whole batch's mean loss.
TEST(DistributedDataParallel, NoSyncAccumulatesUntilTheNextSynchronizedBackward) {
  const auto& pg = world();
  manual_seed(5);
  Net model, reference;
  reference.load_state_dict(model.state_dict());
  DistributedDataParallel ddp(model, pg);
  const Data all = whole_batch(4 * pg->size());
  const Data mine = share(all, pg->rank(), pg->size());
  const Data first{mine.x.narrow(0, 0, 2), mine.y.narrow(0, 0, 2)}, second{mine.x.narrow(0, 2, 2), mine.y.narrow(0, 2, 2)};
  {
    auto guard = ddp.no_sync();
    F::mse_loss(ddp(first.x), first.y).backward();
  }
  // in between, the gradient is this rank's own, not averaged: that of its first micro-batch alone
  Net local;
  local.load_state_dict(model.state_dict());
  F::mse_loss(local(first.x), first.y).backward();
  auto own = model.fc1.weight.grad().contiguous().to_vector<float>();
  auto alone = local.fc1.weight.grad().contiguous().to_vector<float>();
  for (size_t k = 0; k < own.size(); ++k) ASSERT_NEAR(own[k], alone[k], 1e-6) << "fc1.weight element " << k;
  F::mse_loss(ddp(second.x), second.y).backward();
  F::mse_loss(reference(all.x), all.y).backward();
  const auto params = model.named_parameters(), ref_params = reference.named_parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    auto g = params[i].second.grad().contiguous().to_vector<float>();
    auto w = mul(ref_params[i].second.grad(), 2.0).contiguous().to_vector<float>();
    for (size_t k = 0; k < g.size(); ++k) ASSERT_NEAR(g[k], w[k], 1e-5) << params[i].first << " element " << k;
  }
}

TEST(DistributedDataParallel, UnusedParameterIsAnErrorNamingItUnlessDetected) {
  const auto& pg = world();
  Net model;
  model.use_spare = false;
  DistributedDataParallel ddp(model, pg);
  const Data d = share(whole_batch(2 * pg->size()), pg->rank(), pg->size());
  try {
    F::mse_loss(ddp(d.x), d.y).backward();  // `spare` is not used
    FAIL() << "expected a kiln::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("spare.weight"), std::string::npos) << e.what();
  }
  Net other;
  other.use_spare = false;
  DistributedDataParallel tolerant(other, pg, {.find_unused_parameters = true});
  other.zero_grad();
  F::mse_loss(tolerant(d.x), d.y).backward();
  other.use_spare = true;
  other.zero_grad();
  F::mse_loss(tolerant(d.x), d.y).backward();  // now every parameter is used
  Tensor g = other.spare.weight.grad().contiguous().clone(), g0 = g.clone();
  pg->broadcast(g0, 0);
  EXPECT_EQ(g.to_vector<float>(), g0.to_vector<float>());
}

// overlap_optimizer_step: backward leaves the last bucket's all-reduce (fc1.weight here, one parameter a
// bucket) running, and ddp.step(opt) updates the other parameters, waits, then updates fc1.weight. The
// weights equal the plain step's exactly, with AdamW over small buckets (gradients all-reduced as they are,
// and as bf16 copies cast back) and with SGD over one bucket.
TEST(DistributedDataParallel, OverlappedOptimizerStepEqualsThePlainStep) {
  const auto& pg = world();
  manual_seed(31 + uint64_t(pg->rank()));
  const Data d = share(whole_batch(6 * pg->size()), pg->rank(), pg->size());
  for (int variant = 0; variant < 3; ++variant) {
    const bool small_buckets = variant != 1;  // variant 2: small buckets with bf16 on the wire
    SCOPED_TRACE(variant == 0 ? "one parameter a bucket, AdamW" : variant == 1 ? "one bucket, SGD"
                                                                             : "one parameter a bucket, bf16 wire");
    Net a, b;
    b.load_state_dict(a.state_dict());
    DistributedDataParallelOptions plain_options, overlap_options;
    if (small_buckets) plain_options.bucket_cap_mb = plain_options.first_bucket_cap_mb = 1e-5;
    if (variant == 2) plain_options.comm_dtype = DType::bf16;  // the last bucket's copy cast back in ddp.step
    overlap_options = plain_options;
    overlap_options.overlap_optimizer_step = true;
    DistributedDataParallel plain(a, pg, plain_options), overlapped(b, pg, overlap_options);
    std::unique_ptr<optim::Optimizer> oa, ob;
    if (small_buckets) {
      oa = std::make_unique<optim::AdamW>(a.parameters(), optim::AdamWOptions{.lr = 0.03, .weight_decay = 0.1});
      ob = std::make_unique<optim::AdamW>(b.parameters(), optim::AdamWOptions{.lr = 0.03, .weight_decay = 0.1});
    } else {
      oa = std::make_unique<optim::SGD>(a.parameters(), optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
      ob = std::make_unique<optim::SGD>(b.parameters(), optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
    }
    for (int step = 0; step < 4; ++step) {
      oa->zero_grad();
      F::mse_loss(plain(d.x), d.y).backward();
      oa->step();
      ob->zero_grad();
      F::mse_loss(overlapped(d.x), d.y).backward();
      overlapped.step(*ob);
    }
    expect_same_parameters(a, b, 0.0);
    if (small_buckets) {  // AdamW's per-parameter step counts: each parameter stepped once a step
      for (int64_t i = 0; i < ob->num_params(); ++i) EXPECT_EQ(ob->state(i).step, 4) << "parameter " << i;
    }
  }
}

// set_step_in_backward: each bucket's parameters are stepped inside backward once its all-reduce is done
// (on the host, at once). The weights equal backward + step() exactly: AdamW over small buckets (as they
// are, and with bf16 on the wire), SGD over one bucket; a second step through ddp.step is refused, and an
// optimizer that is not the model's is refused at once.
TEST(DistributedDataParallel, StepInBackwardEqualsThePlainStep) {
  const auto& pg = world();
  manual_seed(51 + uint64_t(pg->rank()));
  const Data d = share(whole_batch(6 * pg->size()), pg->rank(), pg->size());
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE("variant " + std::to_string(variant));
    Net a, b;
    b.load_state_dict(a.state_dict());
    DistributedDataParallelOptions o;
    if (variant != 1) o.bucket_cap_mb = o.first_bucket_cap_mb = 1e-5;
    if (variant == 2) o.comm_dtype = DType::bf16;
    DistributedDataParallel plain(a, pg, o), in_backward(b, pg, o);
    std::unique_ptr<optim::Optimizer> oa, ob;
    if (variant != 1) {
      oa = std::make_unique<optim::AdamW>(a.parameters(), optim::AdamWOptions{.lr = 0.03, .weight_decay = 0.1});
      ob = std::make_unique<optim::AdamW>(b.parameters(), optim::AdamWOptions{.lr = 0.03, .weight_decay = 0.1});
    } else {
      oa = std::make_unique<optim::SGD>(a.parameters(), optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
      ob = std::make_unique<optim::SGD>(b.parameters(), optim::SGDOptions{.lr = 0.05, .momentum = 0.9});
    }
    in_backward.set_step_in_backward(ob.get());
    for (int step = 0; step < 4; ++step) {
      oa->zero_grad();
      F::mse_loss(plain(d.x), d.y).backward();
      oa->step();
      ob->zero_grad();
      F::mse_loss(in_backward(d.x), d.y).backward();  // the step happens here
    }
    expect_same_parameters(a, b, 0.0);
    EXPECT_THROW(in_backward.step(*ob), Error);
  }
  Net c;
  DistributedDataParallel ddp(c, pg);
  optim::AdamW partial({c.fc1.weight}, {.lr = 0.01});
  EXPECT_THROW(ddp.set_step_in_backward(&partial), Error);
}

// With overlap_optimizer_step, a step that bypasses ddp.step (here opt.step() straight after backward) is
// found at the next backward: an error that says how to step, after which training can go on.
TEST(DistributedDataParallel, OverlappedStepBypassedIsAnErrorAtTheNextBackward) {
  const auto& pg = world();
  Net model;
  DistributedDataParallel ddp(model, pg, {.overlap_optimizer_step = true});
  optim::SGD opt(model.parameters(), {.lr = 0.01});
  const Data d = share(whole_batch(2 * pg->size()), pg->rank(), pg->size());
  opt.zero_grad();
  F::mse_loss(ddp(d.x), d.y).backward();
  opt.step();  // wrong: the last bucket's all-reduce has not been waited for
  opt.zero_grad();
  try {
    F::mse_loss(ddp(d.x), d.y).backward();
    FAIL() << "expected a kiln::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ddp.step(optimizer)"), std::string::npos) << e.what();
  }
  // the error waited for the collective: the next pass is a normal one
  opt.zero_grad();
  F::mse_loss(ddp(d.x), d.y).backward();
  ddp.wait_for_gradients();  // what a clip between backward and the step needs
  Tensor g = model.fc1.weight.grad().contiguous().clone(), g0 = g.clone();
  pg->broadcast(g0, 0);
  EXPECT_EQ(g.to_vector<float>(), g0.to_vector<float>());  // averaged: the same on every rank
  ddp.step(opt);
  // gradients dropped without a step (nothing read them): the next backward just waits, no error
  opt.zero_grad();
  F::mse_loss(ddp(d.x), d.y).backward();
  opt.zero_grad();
  F::mse_loss(ddp(d.x), d.y).backward();
  ddp.step(opt);
}

// A backward that fails part way (here a hook on an activation throws after some buckets were launched)
// leaves DDP ready for the next one: its collectives waited for, its buckets reset, the next gradients
// averaged as usual.
TEST(DistributedDataParallel, AFailedBackwardLeavesTheNextOneWorking) {
  const auto& pg = world();
  manual_seed(41 + uint64_t(pg->rank()));
  Net model;
  DistributedDataParallel ddp(model, pg, {.bucket_cap_mb = 1e-5, .first_bucket_cap_mb = 1e-5});
  const Data d = share(whole_batch(4 * pg->size()), pg->rank(), pg->size());
  model.zero_grad();
  Tensor h = model.fc1(d.x);
  h.register_hook([](const Tensor&) -> Tensor { throw Error("a hook fails"); });
  Tensor y = model.spare(model.fc2(tanh(h)));
  EXPECT_THROW(F::mse_loss(y, d.y).backward(), Error);  // spare's and fc2's buckets were launched
  model.zero_grad();
  F::mse_loss(ddp(d.x), d.y).backward();
  for (const auto& [name, p] : model.named_parameters()) {
    Tensor g = p.grad().contiguous().clone(), g0 = g.clone();
    pg->broadcast(g0, 0);
    EXPECT_EQ(g.to_vector<float>(), g0.to_vector<float>()) << name;
  }
}

// comm_dtype bf16: the buckets travel as bf16 copies; every rank ends with the same gradients, within
// bf16's rounding of the f32 average.
TEST(DistributedDataParallel, Bf16CommunicationAgreesWithF32ToItsRounding) {
  const auto& pg = world();
  manual_seed(41);
  Net a, b;
  b.load_state_dict(a.state_dict());
  DistributedDataParallel f32(a, pg), bf16(b, pg, {.comm_dtype = DType::bf16});
  const Data d = share(whole_batch(2 * pg->size()), pg->rank(), pg->size());
  F::mse_loss(f32(d.x), d.y).backward();
  F::mse_loss(bf16(d.x), d.y).backward();
  auto pa = a.named_parameters(), pb = b.named_parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    if (!pa[i].second.grad().defined()) continue;
    const Tensor ga = pa[i].second.grad(), gb = pb[i].second.grad();
    EXPECT_EQ(gb.dtype(), DType::f32);
    const double scale = amax(abs(ga)).item<double>();
    EXPECT_LE(amax(abs(sub(ga, gb))).item<double>(), 8e-3 * scale + 1e-12) << pa[i].first;
    Tensor from0 = gb.contiguous().clone();
    pg->broadcast(from0, 0);
    EXPECT_EQ(gb.contiguous().to_vector<float>(), from0.to_vector<float>()) << pa[i].first;
  }
  Net c;
  EXPECT_THROW(DistributedDataParallel(c, pg, {.comm_dtype = DType::i64}), Error);
}

TEST(DistributedDataParallel, TimelineNeedsACudaGroup) {
  const auto& pg = world();
  Net model;
  DistributedDataParallel ddp(model, pg);
  try {
    ddp.record_timeline(true);
    FAIL() << "expected a kiln::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("CUDA events"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ddp.last_timeline(), Error);
}

// Gradient checkpointing: the hooks of parameters inside a recomputed block fire in the nested backward,
// and the end-of-backward wait is deferred to the outermost pass; the result equals DDP without it.
TEST(DistributedDataParallel, WorksWithGradientCheckpointing) {
  const auto& pg = world();
  manual_seed(31 + uint64_t(pg->rank()));
  Net a, b;
  DistributedDataParallel plain(a, pg);
  b.load_state_dict(a.state_dict());
  DistributedDataParallel ckpt(b, pg);
  const Data d = share(whole_batch(4 * pg->size()), pg->rank(), pg->size());
  F::mse_loss(a(d.x), d.y).backward();
  Tensor h = autograd::checkpoint([&](const std::vector<Tensor>& in) { return tanh(b.fc1(in[0])); }, {d.x});
  F::mse_loss(b.spare(b.fc2(h)), d.y).backward();
  auto pa = a.named_parameters(), pb = b.named_parameters();
  for (size_t i = 0; i < pa.size(); ++i)
    EXPECT_EQ(pa[i].second.grad().contiguous().to_vector<float>(), pb[i].second.grad().contiguous().to_vector<float>())
        << pa[i].first;
}

// GradScaler: a non-finite gradient on one rank reaches every rank through the all-reduce, so every rank
// skips the same step (and backs off the same scale) without more communication.
TEST(DistributedDataParallel, EveryRankSkipsAStepWhenOneRankOverflows) {
  const auto& pg = world();
  Net model;
  DistributedDataParallel ddp(model, pg);
  optim::AdamW opt(model.parameters(), {.lr = 0.1});
  optim::GradScaler scaler({.init_scale = 1024.0});
  Data d = share(whole_batch(2 * pg->size()), pg->rank(), pg->size());
  Tensor x = d.x.clone();
  if (pg->rank() == pg->size() - 1) x.narrow(0, 0, 1).fill_(INFINITY);  // the last rank overflows
  const std::vector<float> before = model.fc1.weight.contiguous().to_vector<float>();
  opt.zero_grad();
  scaler.scale(F::mse_loss(ddp(x), d.y)).backward();
  EXPECT_FALSE(scaler.step(opt)) << "rank " << pg->rank() << " stepped";
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 512.0);
  EXPECT_EQ(model.fc1.weight.contiguous().to_vector<float>(), before);
}

TEST(DistributedDataParallel, ModelsThatDifferBetweenRanksFailAtConstruction) {
  const auto& pg = world();
  if (pg->size() < 2) GTEST_SKIP() << "needs 2 ranks";
  Net model(pg->rank() == 0 ? 6 : 7);  // fc1.weight [6, 5] on rank 0, [7, 5] elsewhere
  try {
    DistributedDataParallel ddp(model, pg);
    FAIL() << "expected a kiln::Error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    if (pg->rank() != 0) {
      EXPECT_NE(msg.find("fc1.weight [7, 5] f32' here, 'fc1.weight [6, 5] f32' on rank 0"), std::string::npos) << msg;
    } else {
      EXPECT_NE(msg.find("another rank differs"), std::string::npos) << msg;
    }
  }
}

}  // namespace
}  // namespace kiln::distributed
