// GPT-2 124M training throughput: 12 layers, 12 heads, width 768, context 1024, vocabulary 50304 (50257
// padded to a multiple of 64), biases, no dropout; batch 16 x 1024 random tokens; bf16 autocast with f32
// master weights; fused AdamW (lr 6e-4, betas (0.9, 0.95), weight decay 0.1 on the 2-D weights).
//
//   gpt2_bench                       # B=16, T=1024 on cuda:0
//   gpt2_bench --grad-checkpoint     # the same with gradient checkpointing of every block
//   gpt2_bench --batch-size 8 --seq-len 512 --warmup 2 --steps 5
//
// Runs --warmup untimed steps (allocator, cuBLASLt heuristics), then --steps timed steps between two
// device synchronizations. stdout ends with
//   RESULT tokens_per_second=... mfu=... peak_gib=... step_ms=... world=... [...] sm_mhz=... power_w=...
// the last two being the GPU's mean SM clock and power over the timed steps (NVML; absent without it).
// Data parallel: started with several ranks (scripts/kilnrun --nproc-per-node 2 gpt2_bench, or mpirun -n 2
// gpt2_bench), each rank drives the GPU of
// its local rank, trains on its own batches of B x T tokens, and DistributedDataParallel averages the
// gradients over NCCL during backward; tokens/s counts every rank's tokens, and rank 0 alone prints.
// --zero trains the ranks with distributed::ZeroAdamW (ZeRO-1: AdamW's moments sharded across the ranks)
// instead of DDP + AdamW; peak_gib then shows the state it saves.
//
// CUDA graph (default on GPUs with AdamW, DDP's and ZeRO-1's collectives captured with the step;
// --no-cuda-graph turns it off, --cuda-graph insists): after the warm-up the step (forward, zero_grad,
// backward, AdamW) is captured once as a CUDA graph (cuda/graph.h) and every timed step copies its batch
// into the graph's inputs and replays it. --amp f16 adds a GradScaler to the step, captured with it.
//
// MFU is nanoGPT's estimate_mfu: FLOPs per token = 6N + 12 L H Q T (N = parameters without the position
// embeddings, the tied token embedding counted once; L layers, H heads, Q head dim, T context: the
// attention score and value products, forward and backward), times tokens/s, over the H100/H200's dense
// bf16 peak of 989 TFLOP/s. peak_gib is the caching allocator's high-water mark of allocated bytes over
// the whole run (model, optimizer state, activations), like torch.cuda.max_memory_allocated.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/autocast.h>
#include <kiln/core/phase_timer.h>
#include <kiln/core/profiler.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/cuda/graph.h>
#include <kiln/cuda/runtime.h>
#include <kiln/cuda/stream.h>
#include <kiln/distributed/data_parallel.h>
#include <kiln/distributed/zero_adamw.h>
#include <kiln/nn/fp8_autocast.h>
#include <kiln/nn/gpt.h>
#include <kiln/observe/gpu_monitor.h>
#include <kiln/observe/progress.h>
#include <kiln/observe/step_profile.h>
#include <kiln/observe/trace.h>
#include <kiln/optim/adamw.h>
#include <kiln/optim/grad_scaler.h>
#include <kiln/optim/step_in_backward.h>
#include <kiln/optim/shampoo.h>

#include "../common/cli.h"
#include "../common/shampoo_flags.h"

using namespace kiln;

namespace {

struct Args {
  int64_t batch_size = 16, seq_len = 1024;
  int64_t n_layer = 12, n_head = 12, n_embd = 768, vocab_size = 50304;
  int64_t warmup = 3, steps = 10;
  int64_t profile = 0;
  bool grad_checkpoint = false;
  bool zero = false;
  int64_t shampoo = 0;  // > 0: Shampoo with this precondition_frequency instead of AdamW
  examples::ShampooFlags shampoo_flags;  // the other --shampoo-* flags
  double shampoo_beta2 = 0.95;  // Shampoo's factor average (AdamW's β2 by default)
  bool timeline = false;
  bool comm_bf16 = false;  // DDP all-reduces bf16 copies of the gradient buckets
  int cuda_graph = -1;     // the step captured once as a CUDA graph and replayed: 1 on, 0 off, -1 where it can
  bool fp8 = false;        // the blocks' Linear layers in FP8 (nn::Fp8Autocast, delayed scaling)
  int sm_carveout = 0;     // DDP leaves this many SMs to NCCL during backward
  bool overlap_step = false;  // DDP: AdamW of the other buckets under the last bucket's all-reduce
  bool step_in_backward = false;  // AdamW inside backward as gradients complete (one GPU or DDP)
  bool autocast_cache = true;  // parameters' bf16 casts kept (amp::cast_parameter; AdamW writes them)
  double bucket_mb = 25.0, first_bucket_mb = 1.0;  // DDP's bucket caps (PyTorch's defaults)
  std::string trace;       // --trace FILE: a Chrome trace of 3 more steps
  bool step_ms = false;    // --step-ms: each timed step's device time (events at the steps' starts)
  std::string device = "cuda";
  std::string amp = "bf16";
  uint64_t seed = 0;
  bool help = false;
};

void usage(std::ostream& os) {
  os << "usage: gpt2_bench [--batch-size B] [--seq-len T] [--n-layer L] [--n-head H] [--n-embd E] [--vocab-size V]\n"
        "                  [--warmup N] [--steps N] [--grad-checkpoint] [--device cuda[:i]|cpu] [--amp bf16|f16|none]\n"
        "                  [--seed S] [--profile N] [--zero] [--timeline] [--comm-bf16] [--fp8]\n"
        "                  [--shampoo F [--shampoo-beta2 B] "
     << examples::ShampooFlags::synopsis(std::string(18, ' ')) << "]\n"
     << "                  [--sm-carveout N] [--bucket-mb MB] [--first-bucket-mb MB] [--overlap-step]\n"
        "                  [--step-in-backward] [--trace FILE] [--[no-]cuda-graph]\n"
        "                  [--no-autocast-cache] [--step-ms]\n"
        "  defaults: GPT-2 124M (12 x 12 x 768, vocabulary 50304), B 16, T 1024, 3 warm-up and 10 timed steps\n"
        "  --profile N: N more steps timed phase by phase (forward, backward, optimizer; stderr)\n"
        "  --zero: with several ranks, ZeRO-1 (distributed::ZeroAdamW) instead of DDP + AdamW\n"
        "  --trace FILE: 3 more steps under the profiler, written as a Chrome trace (Perfetto), a table to stderr\n"
        "  --step-ms: each timed step's milliseconds on the GPU's clock (events recorded between the steps, no\n"
        "             synchronisation: a step's figure holds the GPU's idle time waiting for the host)\n"
        "  --comm-bf16: DDP all-reduces the gradients as bf16 (half the bytes; PyTorch's bf16_compress_hook)\n"
        "  --bucket-mb MB, --first-bucket-mb MB: DDP's gradient bucket caps (default 25 and 1, as PyTorch's)\n"
        "  --sm-carveout N: DDP plans backward's matmuls for N fewer SMs while all-reduces run beside them\n"
        "  --overlap-step: DDP leaves the last bucket's all-reduce running at the end of backward and AdamW\n"
        "                  updates the other parameters beside it (DistributedDataParallelOptions::\n"
        "                  overlap_optimizer_step)\n"
        "  --step-in-backward: AdamW updates each batch of parameters inside backward as soon as their\n"
        "                  gradients are final (with DDP: averaged), on a side stream beside the matmuls\n"
        "                  (optim::StepInBackward; DistributedDataParallel::set_step_in_backward)\n"
        "  --no-autocast-cache: cast the weights to bf16 at every use (default: the casts are kept and AdamW\n"
        "                writes them with each update: amp::cast_parameter)\n"
        "  --shampoo F: optim::Shampoo (roots every F steps, Adam grafting) instead of AdamW\n"
        "  --amp f16: f16 autocast with dynamic loss scaling (optim::GradScaler; captured with the step)\n"
        "  --fp8: the blocks' Linear layers in FP8 (nn::Fp8Autocast: e4m3/e5m2, delayed scaling, history 16)\n"
        "  --cuda-graph, --no-cuda-graph: the step captured once as a CUDA graph, replayed after the warm-up\n"
        "                (default: on GPUs; Shampoo's steps that compute roots run without it)\n"
     << examples::ShampooFlags::kHelp <<
        "  --shampoo-beta2 B: its factors' average (default 0.95, AdamW's β2 here)\n"
        "  --timeline: with several ranks on GPUs, one more DDP step whose all-reduces are placed on the device's\n"
        "              timeline against backward (rank 0 prints it)\n";
}

Args parse_args(int argc, char** argv) {
  Args a;
  examples::ArgReader r("gpt2_bench", argc, argv);
  while (r.next()) {
    const std::string& flag = r.flag();
    if (flag == "--batch-size") a.batch_size = r.i64();
    else if (flag == "--seq-len") a.seq_len = r.i64();
    else if (flag == "--n-layer") a.n_layer = r.i64();
    else if (flag == "--n-head") a.n_head = r.i64();
    else if (flag == "--n-embd") a.n_embd = r.i64();
    else if (flag == "--vocab-size") a.vocab_size = r.i64();
    else if (flag == "--warmup") a.warmup = r.i64();
    else if (flag == "--steps") a.steps = r.i64();
    else if (flag == "--step-ms") a.step_ms = true;
    else if (flag == "--profile") a.profile = r.i64();
    else if (flag == "--grad-checkpoint") a.grad_checkpoint = true;
    else if (flag == "--zero") a.zero = true;
    else if (flag == "--shampoo") a.shampoo = r.i64();
    else if (a.shampoo_flags.read(r)) continue;
    else if (flag == "--shampoo-beta2") a.shampoo_beta2 = r.f64(), a.shampoo_flags.last = flag;
    else if (flag == "--timeline") a.timeline = true;
    else if (flag == "--comm-bf16") a.comm_bf16 = true;
    else if (flag == "--cuda-graph") a.cuda_graph = 1;
    else if (flag == "--no-cuda-graph") a.cuda_graph = 0;
    else if (flag == "--fp8") a.fp8 = true;
    else if (flag == "--sm-carveout") a.sm_carveout = int(r.i64());
    else if (flag == "--overlap-step") a.overlap_step = true;
    else if (flag == "--step-in-backward") a.step_in_backward = true;
    else if (flag == "--no-autocast-cache") a.autocast_cache = false;
    else if (flag == "--bucket-mb") a.bucket_mb = r.f64();
    else if (flag == "--first-bucket-mb") a.first_bucket_mb = r.f64();
    else if (flag == "--trace") a.trace = r.value();
    else if (flag == "--device") a.device = r.value();
    else if (flag == "--amp") a.amp = r.value();
    else if (flag == "--seed") a.seed = uint64_t(r.i64());
    else if (flag == "--help" || flag == "-h") a.help = true;
    else r.unknown();
  }
  KILN_CHECK(a.amp == "bf16" || a.amp == "f16" || a.amp == "none", "gpt2_bench: --amp must be bf16, f16 or none, got '",
             a.amp, "'");
  KILN_CHECK(a.amp != "f16" || (!a.step_in_backward && !a.overlap_step && a.shampoo == 0),
             "gpt2_bench: --amp f16 (a GradScaler, which steps after checking every gradient) needs AdamW or --zero "
             "stepping after backward (not --step-in-backward, --overlap-step or --shampoo)");
  a.shampoo_flags.check("gpt2_bench");
  KILN_CHECK(a.shampoo_flags.last.empty() || a.shampoo > 0, "gpt2_bench: ", a.shampoo_flags.last,
             " sets Shampoo, which runs only with --shampoo F");
  KILN_CHECK(!a.overlap_step || !a.zero, "gpt2_bench: --overlap-step is DDP's (ZeRO-1 reduce-scatters instead)");
  KILN_CHECK(!a.step_in_backward || (!a.zero && a.shampoo == 0 && !a.overlap_step),
             "gpt2_bench: --step-in-backward needs AdamW (not --zero, --shampoo or --overlap-step)");
  KILN_CHECK(a.batch_size >= 1 && a.seq_len >= 1 && a.warmup >= 0 && a.steps >= 1,
             "gpt2_bench: --batch-size, --seq-len and --steps must be at least 1, --warmup at least 0");
  return a;
}

int run(const Args& args) {
  Device dev = Device::parse(args.device);
  // several ranks (kilnrun, torchrun or mpirun): data parallelism, NCCL on GPUs (one a rank), MPI on the CPU
  const std::shared_ptr<distributed::ProcessGroup> group = distributed::init_process_group_if_launched(dev);
  if (group) dev = group->device();
  const int world = group ? group->size() : 1, rank = group ? group->rank() : 0;
  KILN_CHECK(args.cuda_graph != 1 || dev.is_cuda(), "gpt2_bench: --cuda-graph needs GPUs");
  const bool use_graph = args.cuda_graph != 0 && dev.is_cuda();
  if (dev.is_cuda()) {
    KILN_CHECK(cuda::is_available(), "gpt2_bench: no CUDA device is available (or this build has no CUDA backend); "
               "--device cpu runs a (slow) CPU smoke test");
    cuda::set_device(dev.index);
    // time cuBLASLt's candidate algorithms once for each new large matmul (KILN_MATMUL_BENCHMARK=0: the
    // heuristic's first choice; docs/cuda.md)
    if (std::getenv("KILN_MATMUL_BENCHMARK") == nullptr) cuda::set_matmul_benchmark(true);
  }
  auto sync = [&] {
    if (dev.is_cuda()) cuda::synchronize();
  };
  const bool amp_on = args.amp != "none";
  const DType amp_dtype = args.amp == "f16" ? DType::f16 : DType::bf16;
  optim::GradScaler scaler({.enabled = args.amp == "f16"});  // f16: dynamic loss scaling, in the graph too
  const int64_t B = args.batch_size, T = args.seq_len;

  manual_seed(args.seed);
  nn::GPT model({.vocab_size = args.vocab_size, .block_size = T, .n_layer = args.n_layer, .n_head = args.n_head,
                 .n_embd = args.n_embd, .dropout = 0.0, .bias = true, .checkpoint = args.grad_checkpoint, .device = dev});
  auto groups = model.parameter_groups();
  const optim::AdamWOptions decay{.lr = 6e-4, .betas = {0.9, 0.95}, .weight_decay = 0.1};
  const optim::AdamWOptions no_decay{.lr = 6e-4, .betas = {0.9, 0.95}, .weight_decay = 0.0};
  // DDP + AdamW (rank 0's weights everywhere, gradients averaged during backward), or ZeRO-1 alone
  std::unique_ptr<distributed::DistributedDataParallel> ddp;
  std::unique_ptr<optim::Optimizer> opt;
  const optim::Shampoo* shampoo_stats = nullptr;  // for the root counts printed at the end
  distributed::ZeroAdamW* zero = nullptr;
  if (group && args.zero) {
    auto z = std::make_unique<distributed::ZeroAdamW>(
        std::vector<distributed::ZeroParamGroup>{{groups.decay, decay}, {groups.no_decay, no_decay}}, group);
    zero = z.get();
    opt = std::move(z);
  } else {
    if (group) {
      distributed::DistributedDataParallelOptions o;
      if (args.comm_bf16) o.comm_dtype = DType::bf16;
      o.sm_carveout = args.sm_carveout;
      o.overlap_optimizer_step = args.overlap_step;
      o.bucket_cap_mb = args.bucket_mb;
      o.first_bucket_cap_mb = args.first_bucket_mb;
      ddp = std::make_unique<distributed::DistributedDataParallel>(model, group, o);
    }
    if (args.shampoo > 0) {  // the same betas, decay and lr, with roots every --shampoo steps
      optim::ShampooOptions s{.lr = 6e-4, .betas = {0.9, args.shampoo_beta2}, .weight_decay = 0.1,
                              .precondition_frequency = args.shampoo};
      args.shampoo_flags.apply(s);
      optim::ShampooOptions without_decay = s;
      without_decay.weight_decay = 0.0;
      auto shampoo = std::make_unique<optim::Shampoo>(groups.decay, s);
      shampoo->add_param_group(groups.no_decay, without_decay);
      args.shampoo_flags.apply(*shampoo);
      shampoo_stats = shampoo.get();
      opt = std::move(shampoo);
    } else {
      auto adamw = std::make_unique<optim::AdamW>(groups.decay, decay);
      adamw->add_param_group(groups.no_decay, no_decay);
      opt = std::move(adamw);
    }
  }
  auto zero_grad = [&] {
    if (zero) zero->zero_grad();
    else opt->zero_grad();
  };
  // --step-in-backward: AdamW runs inside backward, bucket by bucket after each all-reduce under DDP
  // (DistributedDataParallel::set_step_in_backward), batch by batch on one GPU (optim::StepInBackward)
  KILN_CHECK(!args.overlap_step || group, "gpt2_bench: --overlap-step is DDP's, which needs several ranks (one GPU: "
             "--step-in-backward)");
  std::unique_ptr<optim::StepInBackward> in_backward;
  if (args.step_in_backward && ddp) ddp->set_step_in_backward(opt.get());
  else if (args.step_in_backward) in_backward = std::make_unique<optim::StepInBackward>(*opt);
  auto optimizer_step = [&] {  // through DDP, which may update some parameters while an all-reduce runs
    if (args.step_in_backward) return;  // done inside backward
    if (scaler.is_enabled()) {  // f16: every averaged gradient checked, then the step where all were finite
      if (ddp) ddp->wait_for_gradients();
      scaler.step(*opt);
      scaler.update();
      return;
    }
    if (ddp) ddp->step(*opt);
    else opt->step();
  };

  // A few batches of random tokens made up front and cycled (the input pipeline is not what is measured).
  Generator gen(args.seed + 1 + uint64_t(rank));  // each rank its own data
  std::vector<std::pair<Tensor, Tensor>> batches;
  for (int k = 0; k < 2; ++k)
    batches.emplace_back(randint(0, args.vocab_size, {B, T}, {.dtype = DType::i64}, &gen).to(dev),
                         randint(0, args.vocab_size, {B, T}, {.dtype = DType::i64}, &gen).to(dev));

  // One training step, written once: `timer` times its phases under --profile (synchronizing between
  // them); the untimed one runs them back to back.
  Tensor loss;
  auto timed_step = [&](int64_t i, PhaseTimer& timer) {
    const auto& [x, y] = batches[size_t(i) % batches.size()];
    timer.time("forward", [&] {
      nn::Fp8Autocast fp8({.history_len = 16}, args.fp8);
      amp::Autocast autocast(dev, amp_dtype, amp_on, args.autocast_cache);
      loss = model.loss(x, y);
    });
    timer.time("backward", [&] {
      zero_grad();
      scaler.scale(loss).backward();  // (bf16: loss.backward())
    });
    timer.time("optimizer", [&] {
      optimizer_step();
      if (args.fp8) nn::fp8_step(model);
    });
  };
  PhaseTimer untimed(dev, /*enabled=*/false);
  auto eager_step = [&](int64_t i) { timed_step(i, untimed); };
  std::function<void(int64_t)> step = eager_step;

  for (int64_t i = 0; i < args.warmup; ++i) step(i);
  std::optional<cuda::Graph> graph;  // --cuda-graph: the step on the batch in (gx, gy), replayed
  Tensor gx, gy;
  const optim::Shampoo* shampoo = shampoo_stats;
  // Shampoo: a step without roots is captured (past its first roots, its state made): at the latest a
  // frequency's steps after its first root step; roots at every step (--shampoo 1) leave none to capture
  bool capture = use_graph;
  if (use_graph) {
    if (args.warmup == 0) eager_step(0);  // AdamW's state (and NCCL's connections) must exist before the capture
    const int64_t first_roots = args.shampoo_flags.start >= 0 ? args.shampoo_flags.start : args.shampoo;
    const int64_t most = std::max<int64_t>(first_roots - args.warmup, 0) + args.shampoo + 1;
    for (int64_t i = 1; shampoo && !shampoo->capturable_next_step() && i <= most; ++i) eager_step(args.warmup + i);
    capture = !shampoo || shampoo->capturable_next_step();
    KILN_CHECK(capture || args.cuda_graph != 1, "gpt2_bench: --cuda-graph: Shampoo computes roots at every step "
               "(--shampoo ", args.shampoo, "), which leaves no step to capture");
  }
  if (capture) {
    gx = batches[0].first.clone();
    gy = batches[0].second.clone();
    graph.emplace(cuda::capture(
        [&] {
          {
            nn::Fp8Autocast fp8({.history_len = 16}, args.fp8);
            amp::Autocast autocast(dev, amp_dtype, amp_on, args.autocast_cache);
            loss = model.loss(gx, gy);
          }
          zero_grad();
          scaler.scale(loss).backward();
          optimizer_step();
          if (args.fp8) nn::fp8_step(model);  // the histories' positions live on the device: a replay moves them
        },
        /*warmup=*/0));
    step = [&](int64_t i) {
      if (shampoo && shampoo->roots_due_next_step()) return eager_step(i);  // roots are computed on the host
      const auto& [x, y] = batches[size_t(i) % batches.size()];
      gx.copy_(x);
      gy.copy_(y);
      graph->replay();
    };
  }
  sync();
  const int64_t roots_before = shampoo_stats ? shampoo_stats->root_updates() : 0;
  const int64_t refreshes_before = shampoo_stats ? shampoo_stats->eigen_refreshes() : 0;
  // the GPU's clock and power over the timed steps (NVML every 50 ms): the clock falls ~9% once an H200
  // draws its power cap, ~10 s into a run, so two timings compare only at one clock (docs/performance.md)
  std::unique_ptr<observe::GpuMonitor> monitor;
  if (dev.is_cuda() && rank == 0) monitor = std::make_unique<observe::GpuMonitor>(observe::GpuMonitor::Options{
                         .devices = {dev.index}, .interval = std::chrono::milliseconds(50)});
  const auto start = std::chrono::steady_clock::now();
  std::unique_ptr<observe::ProgressBar> progress;  // rank 0, on stderr
  if (rank == 0) progress = std::make_unique<observe::ProgressBar>("step", args.steps);
  std::vector<cuda::Event> marks;  // --step-ms: one before each step and one after the last
  const bool mark = args.step_ms && dev.is_cuda();
  for (int64_t i = 0; i < args.steps; ++i) {
    if (mark) marks.emplace_back(true).record();
    step(args.warmup + i);
    if (progress) progress->update(i + 1);
  }
  if (mark) marks.emplace_back(true).record();
  sync();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const observe::GpuSummary gpu = monitor ? observe::summarize(monitor->samples(), dev.index) : observe::GpuSummary{};
  monitor.reset();

  if (args.profile > 0) {
    // Host and wall time of each phase, synchronizing between phases (core/phase_timer.h).
    const Tensor final_loss = loss;
    PhaseTimer timer(dev);
    for (int64_t i = 0; i < args.profile; ++i) timed_step(i, timer);
    loss = final_loss;  // the loss reported below is the measured run's
    std::fputs(timer.report(args.profile).c_str(), stderr);
  }

  if (!args.trace.empty()) {  // 3 more steps unprofiled, 3 profiled (rank 0; every rank runs them for DDP)
    const Tensor final_loss = loss;
    const observe::StepProfile p = observe::profile_steps(3, step, sync, rank == 0);
    loss = final_loss;
    if (rank == 0) {
      observe::save_chrome_trace(p.trace, args.trace);
      std::fprintf(stderr, "profile of 3 steps (%s):\n%s", args.trace.c_str(), observe::profile_table(p.trace).c_str());
      std::printf("%s\n", p.summary().c_str());
    }
  }

  std::string timeline;
  if (args.timeline && ddp) {  // one more step, its all-reduces timed against backward on the device
    const Tensor final_loss = loss;
    ddp->record_timeline(true);
    eager_step(0);  // the timeline's events are recorded by the host as the step is queued: not in a replay
    timeline = ddp->last_timeline().to_string();
    ddp->record_timeline(false);
    loss = final_loss;
  }

  const double N = double(model.num_params(/*non_embedding=*/true));
  const double L = double(args.n_layer), H = double(args.n_head), Q = double(args.n_embd / args.n_head);
  const double flops_per_token = 6.0 * N + 12.0 * L * H * Q * double(T);
  const double tps = double(args.steps * B * T * world) / seconds;  // every rank's tokens
  const double mfu = flops_per_token * tps / (989e12 * world);
  const double peak_gib = dev.is_cuda() ? double(cuda::memory_stats(dev.index).peak_allocated) / double(1 << 30) : 0.0;
  if (rank != 0) return 0;
  std::fprintf(stderr,
               "GPT %lldx%lldx%lld, vocab %lld: N = %.2fM parameters (without wpe), %.3g FLOPs/token; B=%lld T=%lld, "
               "%s%s; final loss %.4f\n",
               (long long)args.n_layer, (long long)args.n_head, (long long)args.n_embd, (long long)args.vocab_size,
               N / 1e6, flops_per_token, (long long)B, (long long)T, !amp_on ? "f32" : args.amp == "f16" ? "f16 autocast + GradScaler" : "bf16 autocast",
               args.grad_checkpoint ? ", gradient checkpointing" : "", loss.item<double>());
  if (scaler.is_enabled())  // steps skipped while the scale backs off from 2^16 leave the loss behind bf16's
    std::fprintf(stderr, "loss scale %g%s\n", scaler.get_scale(),
                 zero ? "" : (", AdamW steps taken " + std::to_string(opt->state(0).step)).c_str());
  if (shampoo_stats)
    std::printf("Shampoo: %lld root updates, %lld eigendecomposed afresh (warm starts), %lld f64 retries, %lld kept; "
                "in the timed steps %lld root updates, %lld eigendecomposed afresh; Newton iterations %lld, "
                "fallbacks %lld\n",
                (long long)shampoo_stats->root_updates(), (long long)shampoo_stats->eigen_refreshes(),
                (long long)shampoo_stats->f64_retries(), (long long)shampoo_stats->kept_roots(),
                (long long)(shampoo_stats->root_updates() - roots_before),
                (long long)(shampoo_stats->eigen_refreshes() - refreshes_before),
                (long long)shampoo_stats->newton_iterations(), (long long)shampoo_stats->newton_fallbacks());
  if (marks.size() > 1) {
    std::string line = "STEP_MS";
    for (size_t i = 0; i + 1 < marks.size(); ++i) {
      char buf[32];
      std::snprintf(buf, sizeof buf, " %.2f", marks[i].elapsed_ms(marks[i + 1]));
      line += buf;
    }
    std::printf("%s\n", line.c_str());
  }
  if (!timeline.empty()) std::printf("DDP timeline of one step (ms from the first gradient ready):\n%s", timeline.c_str());
  std::string clocks;  // rank 0's GPU over the timed steps
  if (gpu.samples > 0) {
    std::fprintf(stderr,
                 "GPU %d over the timed steps (%lld samples): SM clock %.0f MHz, %.0f W, up to %.0f C; clocks held "
                 "back by: %s\n",
                 dev.index, (long long)gpu.samples, gpu.sm_clock_mhz, gpu.power_w, gpu.max_temperature_c,
                 observe::clock_event_reasons(gpu.clock_event_reasons).c_str());
    char buf[64];
    std::snprintf(buf, sizeof buf, " sm_mhz=%.0f power_w=%.0f", gpu.sm_clock_mhz, gpu.power_w);
    clocks = buf;
  }
  std::printf("RESULT tokens_per_second=%.0f mfu=%.4f peak_gib=%.2f step_ms=%.1f world=%d%s%s%s%s%s%s%s\n", tps, mfu,
              peak_gib, 1e3 * seconds / double(args.steps), world, zero ? " zero=1" : "",
              args.shampoo > 0 ? (" shampoo=" + std::to_string(args.shampoo)).c_str() : args.comm_bf16 ? " comm=bf16" : "",
              graph ? " cuda_graph=1" : "", args.fp8 ? " fp8=1" : "", args.overlap_step ? " overlap_step=1" : "",
              args.step_in_backward ? " step_in_backward=1" : "", clocks.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return kiln::examples::example_main(argc, argv, parse_args, usage, run); }
