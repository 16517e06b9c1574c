// The NCCL group on 2 GPUs (ctest label gpu; started with mpiexec -n 2, one GPU a rank): every collective in
// every dtype against an expectation each rank computes itself, collectives ordered against the compute
// stream, DistributedDataParallel on the GPU against one process on the whole batch, ZeroAdamW against DDP,
// both captured in a CUDA graph against their eager steps, and DDP's timeline. Skips (exit 0 on
// every rank) where there are fewer GPUs than ranks; `mpiexec -n 1` runs it on one GPU, and so does
// `scripts/kilnrun --nproc-per-node 1` (the environment-variable rendezvous).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/cuda/graph.h>
#include <kiln/cuda/runtime.h>
#include <kiln/distributed/data_parallel.h>
#include <kiln/distributed/nccl_process_group.h>
#include <kiln/distributed/zero_adamw.h>
#include <kiln/nn/activation.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/linear.h>
#include <kiln/optim/adamw.h>
#include <kiln/optim/grad_scaler.h>

#include "../collective_values.h"
#include "../test_mlp.h"

namespace kiln::distributed {
namespace {

std::shared_ptr<ProcessGroup>& group() {
  static std::shared_ptr<ProcessGroup> pg;
  return pg;
}
Device gpu() { return group()->device(); }

const std::vector<DType> kDtypes = {DType::f32, DType::bf16, DType::f16, DType::i64};
double value(int r, int64_t i) { return double((i * 3 + r * 5) % 17) - 8.0; }
Tensor values_of(int r, int64_t n, DType t) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = value(r, i);
  return cast(from_vector(v, {n}), t).to(gpu());
}
std::vector<double> host(const Tensor& t) { return cast(t.cpu(), DType::f64).to_vector<double>(); }

TEST(Nccl, AllReduceBroadcastAllGatherReduceScatter) {
  auto& pg = *group();
  const int n = pg.size(), me = pg.rank();
  for (DType t : kDtypes) {
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
      if (op == ReduceOp::avg && t == DType::i64) continue;
      Tensor x = values_of(me, 1 << 16, t);
      pg.all_reduce(x, op);
      const auto got = host(x);
      for (int64_t i = 0; i < int64_t(got.size()); ++i) {
        double sum = 0, mx = -1e9;
        for (int r = 0; r < n; ++r) sum += value(r, i), mx = std::max(mx, value(r, i));
        const double want = op == ReduceOp::sum ? sum : op == ReduceOp::max ? mx : sum / n;
        ASSERT_NEAR(got[size_t(i)], want, op == ReduceOp::avg && t != DType::f32 ? std::abs(want) * 1e-2 : 0.0)
            << dtype_name(t) << " " << reduce_op_name(op) << " element " << i;
      }
    }
    Tensor b = values_of(me, 99, t);
    pg.broadcast(b, n - 1);
    EXPECT_EQ(host(b), host(values_of(n - 1, 99, t))) << dtype_name(t);
    Tensor gathered = empty({n * 50}, {.dtype = t, .device = gpu()});
    pg.all_gather(gathered, values_of(me, 50, t));
    std::vector<double> want;
    for (int r = 0; r < n; ++r)
      for (double v : host(values_of(r, 50, t))) want.push_back(v);
    EXPECT_EQ(host(gathered), want) << dtype_name(t);
    Tensor part = empty({40}, {.dtype = t, .device = gpu()});
    pg.reduce_scatter(part, values_of(me, n * 40, t), ReduceOp::sum);
    const auto rs = host(part);
    for (int64_t i = 0; i < 40; ++i) {
      double sum = 0;
      for (int r = 0; r < n; ++r) sum += value(r, me * 40 + i);
      ASSERT_EQ(rs[size_t(i)], sum) << dtype_name(t) << " element " << i;
    }
  }
  pg.barrier();
}

// A tensor written by compute, reduced, and read by compute again, all without host synchronization in
// between: the communication stream waits for compute, and compute (after wait()) for the collective.
TEST(Nccl, CollectivesAreOrderedAgainstTheComputeStream) {
  auto& pg = *group();
  Tensor big = ones({1 << 22}, {.device = gpu()});
  for (int i = 0; i < 3; ++i) {
    big = mul(big, 2.0);  // compute writes
    auto work = pg.all_reduce_async(big, ReduceOp::sum);
    work->wait();        // compute waits for the collective
  }
  // ((1·2·n)·2·n)·2·n = 8 n³
  const double n = pg.size();
  EXPECT_EQ(sum(big).item<double>(), double(1 << 22) * 8 * n * n * n);
}

struct Net : testing::Mlp {
  Net() : testing::Mlp(5, 16, 3) {}
};

TEST(Nccl, DistributedDataParallelMatchesOneProcessOnTheWholeBatch) {
  auto pg = group();
  manual_seed(100 + uint64_t(pg->rank()));
  Net model;
  model.to(gpu());
  DistributedDataParallel ddp(model, pg, {.bucket_cap_mb = 1e-4, .first_bucket_cap_mb = 1e-4});
  Net reference;
  reference.to(gpu());
  reference.load_state_dict(model.state_dict());
  optim::AdamW opt(model.parameters(), {.lr = 0.05}), ref_opt(reference.parameters(), {.lr = 0.05});
  Generator gen(77);
  const int64_t rows = 8 * pg->size();
  Tensor x = randn({rows, 5}, {}, &gen).to(gpu()), y = randn({rows, 3}, {}, &gen).to(gpu());
  Tensor mx = x.narrow(0, pg->rank() * 8, 8), my = y.narrow(0, pg->rank() * 8, 8);
  for (int step = 0; step < 5; ++step) {
    opt.zero_grad();
    nn::functional::mse_loss(ddp(mx), my).backward();
    opt.step();
    ref_opt.zero_grad();
    nn::functional::mse_loss(reference(x), y).backward();
    ref_opt.step();
  }
  auto pa = model.named_parameters(), pb = reference.named_parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    auto a = pa[i].second.cpu().contiguous().to_vector<float>(), b = pb[i].second.cpu().contiguous().to_vector<float>();
    for (size_t k = 0; k < a.size(); ++k) ASSERT_NEAR(a[k], b[k], 2e-5) << pa[i].first << " element " << k;
  }
}

// In place on NCCL: the output is this rank's slice of the input (recvbuff = sendbuff + rank·count).
TEST(Nccl, ReduceScatterInPlace) {
  for (DType t : kDtypes) testing::expect_reduce_scatter_in_place(*group(), 1000, t);
}

// ZeRO-1 on NCCL: the same parameters as DDP + AdamW after a few steps (reduce-scatter, shard step, all-gather).
TEST(Nccl, ZeroAdamWMatchesDistributedDataParallelWithAdamW) {
  auto pg = group();
  manual_seed(21 + uint64_t(pg->rank()));
  testing::Mlp a(7, 9, 4, gpu()), b(7, 9, 4, gpu());
  DistributedDataParallel ddp(a, pg);
  b.load_state_dict(a.state_dict());
  optim::AdamW adamw({a.fc1.weight, a.fc2.weight}, {.lr = 0.02, .weight_decay = 0.1});
  adamw.add_param_group({a.fc1.bias, a.fc2.bias}, optim::AdamWOptions{.lr = 0.02, .weight_decay = 0.0});
  ZeroAdamW zero({{{b.fc1.weight, b.fc2.weight}, {.lr = 0.02, .weight_decay = 0.1}},
                  {{b.fc1.bias, b.fc2.bias}, {.lr = 0.02, .weight_decay = 0.0}}},
                 pg);
  Generator gen(5 + uint64_t(pg->rank()));
  for (int step = 0; step < 6; ++step) {
    Tensor x = randn({5, 7}, {}, &gen).to(gpu()), y = randn({5, 4}, {}, &gen).to(gpu());
    adamw.zero_grad();
    nn::functional::mse_loss(ddp(x), y).backward();
    adamw.step();
    zero.zero_grad();
    nn::functional::mse_loss(b(x), y).backward();
    zero.step();
  }
  auto pa = a.named_parameters(), pb = b.named_parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    auto u = pa[i].second.cpu().contiguous().to_vector<float>(), v = pb[i].second.cpu().contiguous().to_vector<float>();
    for (size_t k = 0; k < u.size(); ++k) ASSERT_NEAR(u[k], v[k], 1e-5) << pa[i].first << " element " << k;
  }
}

// DDP's all-reduces, and ZeroAdamW's reduce-scatter, clipping and all-gather, captured with the whole step as
// one CUDA graph: each replay leaves the parameters the eager step leaves (and a learning rate changed between
// replays reaches both; ZeroAdamW counts the replays as steps, except those a GradScaler skipped).
TEST(Nccl, DataParallelStepsCapturedInACudaGraphReplayToTheEagerSteps) {
  auto pg = group();
  // the third run: ZeroAdamW under a GradScaler, with an inf in rank 1's batch 2 (every rank skips that step:
  // the flags agree through an all-reduce captured with the step)
  for (auto [zero, scaled] : {std::pair{false, false}, std::pair{true, false}, std::pair{true, true}}) {
    SCOPED_TRACE(!zero ? "DistributedDataParallel + AdamW" : scaled ? "ZeroAdamW + GradScaler" : "ZeroAdamW");
    optim::GradScaler scaler_a({.init_scale = 1024.0}), scaler_b({.init_scale = 1024.0});
    manual_seed(41 + uint64_t(pg->rank()));  // rank 0's weights reach every rank through the broadcast
    testing::Mlp a(7, 9, 4, gpu()), b(7, 9, 4, gpu());
    b.load_state_dict(a.state_dict());
    const DistributedDataParallelOptions small{.bucket_cap_mb = 1e-4, .first_bucket_cap_mb = 1e-4};
    std::unique_ptr<DistributedDataParallel> ddp_a, ddp_b;
    std::unique_ptr<optim::Optimizer> opt_a, opt_b;
    auto make = [&](testing::Mlp& m, std::unique_ptr<DistributedDataParallel>& ddp, std::unique_ptr<optim::Optimizer>& opt) {
      if (zero) {
        opt = std::make_unique<ZeroAdamW>(
            std::vector<ZeroParamGroup>{{{m.fc1.weight, m.fc2.weight}, {.lr = 0.02, .weight_decay = 0.1}},
                                        {{m.fc1.bias, m.fc2.bias}, {.lr = 0.02, .weight_decay = 0.0}}},
            pg);
        static_cast<ZeroAdamW&>(*opt).set_max_grad_norm(0.05);  // (these batches' norms are larger: it clips)
      } else {
        ddp = std::make_unique<DistributedDataParallel>(m, pg, small);
        opt = std::make_unique<optim::AdamW>(m.parameters(), optim::AdamWOptions{.lr = 0.02, .weight_decay = 0.1});
      }
    };
    make(a, ddp_a, opt_a);
    make(b, ddp_b, opt_b);
    auto step = [&](testing::Mlp& m, DistributedDataParallel* ddp, optim::Optimizer& opt, const Tensor& x, const Tensor& y) {
      if (zero) static_cast<ZeroAdamW&>(opt).zero_grad();
      else opt.zero_grad();
      const Tensor loss = nn::functional::mse_loss(ddp ? (*ddp)(x) : m(x), y);
      if (!scaled) {
        loss.backward();
        opt.step();
        return;
      }
      optim::GradScaler& scaler = &opt == opt_a.get() ? scaler_a : scaler_b;
      scaler.scale(loss).backward();
      scaler.step(opt);
      scaler.update();
    };
    Generator gen(9 + uint64_t(pg->rank()));  // each rank its own batches
    std::vector<std::pair<Tensor, Tensor>> batches;
    for (int k = 0; k < 6; ++k) batches.emplace_back(randn({5, 7}, {}, &gen).to(gpu()), randn({5, 4}, {}, &gen).to(gpu()));
    if (scaled && pg->rank() == 1) batches[2].first.narrow(0, 1, 1).fill_(INFINITY);
    Tensor gx = empty({5, 7}, {.device = gpu()}), gy = empty({5, 4}, {.device = gpu()});
    // step 0 eager on both (the optimizer state, NCCL's connections), then b's step captured
    step(a, ddp_a.get(), *opt_a, batches[0].first, batches[0].second);
    step(b, ddp_b.get(), *opt_b, batches[0].first, batches[0].second);
    cuda::Graph graph = cuda::capture([&] { step(b, ddp_b.get(), *opt_b, gx, gy); }, /*warmup=*/0);
    for (int k = 1; k < 6; ++k) {
      if (k == 3)
        for (optim::Optimizer* o : {opt_a.get(), opt_b.get()}) o->param_groups()[0].set_lr(0.005);
      step(a, ddp_a.get(), *opt_a, batches[size_t(k)].first, batches[size_t(k)].second);
      gx.copy_(batches[size_t(k)].first);
      gy.copy_(batches[size_t(k)].second);
      graph.replay();
    }
    auto pa = a.named_parameters(), pb = b.named_parameters();
    for (size_t i = 0; i < pa.size(); ++i) {
      auto u = pa[i].second.cpu().contiguous().to_vector<float>(), v = pb[i].second.cpu().contiguous().to_vector<float>();
      for (size_t k = 0; k < u.size(); ++k) ASSERT_NEAR(u[k], v[k], 1e-6) << pa[i].first << " element " << k;
    }
    if (zero) {
      const double norm_a = static_cast<ZeroAdamW&>(*opt_a).last_grad_norm().item<double>(),
                   norm_b = static_cast<ZeroAdamW&>(*opt_b).last_grad_norm().item<double>();
      EXPECT_GT(norm_a, 0.05);
      EXPECT_NEAR(norm_b, norm_a, 1e-6 * norm_a) << "the last replay's norm";
      for (optim::Optimizer* o : {opt_a.get(), opt_b.get()}) static_cast<ZeroAdamW*>(o)->consolidate_state();
      EXPECT_EQ(opt_b->state(0).step, scaled ? 5 : 6);
      EXPECT_EQ(opt_a->state(0).step, scaled ? 5 : 6);
    }
    if (scaled) {
      EXPECT_EQ(scaler_a.get_scale(), 512.0);  // backed off once
      EXPECT_EQ(scaler_b.get_scale(), 512.0);
    }
  }
}

// The timeline of one backward pass: every bucket's all-reduce is placed after its gradients were ready and
// the pass's end is after the first gradient; with tiny buckets some all-reduces end before backward does.
TEST(Nccl, DistributedDataParallelTimelinePlacesEachAllReduceAfterItsBucketIsReady) {
  auto pg = group();
  manual_seed(31);
  Net model;
  model.to(gpu());
  DistributedDataParallel ddp(model, pg, {.bucket_cap_mb = 1e-4, .first_bucket_cap_mb = 1e-4});
  EXPECT_THROW(ddp.last_timeline(), Error);  // nothing recorded yet
  Tensor x = randn({8, 5}).to(gpu()), y = randn({8, 3}).to(gpu());
  ddp.record_timeline(true);
  nn::functional::mse_loss(ddp(x), y).backward();
  const DataParallelTimeline t = ddp.last_timeline();
  ASSERT_EQ(t.buckets.size(), ddp.bucket_parameter_names().size());
  EXPECT_GT(t.backward_end_ms, 0.0);
  int64_t bytes = 0;
  for (const auto& b : t.buckets) {
    EXPECT_GE(b.ready_ms, 0.0);
    EXPECT_GE(b.done_ms, b.ready_ms);
    bytes += b.bytes;
  }
  int64_t expected = 0;
  for (const Tensor& p : model.parameters()) expected += p.numel() * 4;
  EXPECT_EQ(bytes, expected);
  if (pg->rank() == 0) std::printf("%s", t.to_string().c_str());
}

}  // namespace

// Prints a failed assertion of a rank other than 0 (whose full output would repeat rank 0's).
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    const ::testing::TestInfo* t = ::testing::UnitTest::GetInstance()->current_test_info();
    std::printf("[rank %d] FAILED %s.%s at %s:%d\n%s\n", rank_, t ? t->test_suite_name() : "?", t ? t->name() : "?",
                r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
    std::fflush(stdout);
  }

 private:
  int rank_;
};

}  // namespace kiln::distributed

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  // one GPU a rank: mpiexec's rank count (1 without it) must not exceed the GPUs
  const char* ranks_env = std::getenv("WORLD_SIZE") ? std::getenv("WORLD_SIZE") : std::getenv("OMPI_COMM_WORLD_SIZE");
  const int ranks = ranks_env ? std::atoi(ranks_env) : 1;
  if (!kiln::cuda::is_available() || kiln::cuda::device_count() < ranks) {
    std::printf("nccl tests: %d ranks but %d CUDA devices, skipped\n", ranks,
                kiln::cuda::is_available() ? kiln::cuda::device_count() : 0);
    return 0;
  }
  kiln::distributed::group() = kiln::distributed::init_process_group({.backend = "nccl"});
  auto& pg = *kiln::distributed::group();
  kiln::cuda::set_device(pg.device().index);  // as a trainer does (torch.cuda.set_device(local_rank))
  if (pg.rank() != 0) {  // rank 0 prints the run; the others print only their failures
    auto& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new kiln::distributed::FailurePrinter(pg.rank()));
  }
  const int rc = RUN_ALL_TESTS();
  pg.barrier();
  return rc;
}
