// Character-level GPT on tinyshakespeare, nanoGPT's "shakespeare-char" configuration by default: 6 layers,
// 6 heads, width 384, context 256, batch 64, dropout 0.2 (embeddings, residual branches and attention
// weights), no biases; AdamW (lr 1e-3, betas (0.9, 0.99),
// weight decay 0.1 on the 2-D weights only), 100 warmup iterations then cosine decay to 1e-4 at 5000,
// gradient clipping at 1.0, 5000 iterations, bf16 autocast on a GPU (--amp f16: f16 with a GradScaler).
//
//   char_gpt --device cuda                                  # the full run (bf16 autocast on the GPU)
//   char_gpt --device cuda --checkpoint ckpt.h5             # + checkpoints (ckpt.h5 latest, ckpt.best.h5 best)
//   char_gpt --device cuda --checkpoint ckpt.h5 --resume    # continues where ckpt.h5 stopped
//   char_gpt --iters 30 --eval-interval 10 --eval-iters 2 --n-layer 2 --n-embd 64 --n-head 4  # a CPU smoke test
//   char_gpt --device cuda --sketch 1,64                    # the MLP layers sketched (nn::sketch, docs/sketched.md)
//
// Data: the text file from --data, else $KILN_SHAKESPEARE, else ../shared/data/tinyshakespeare.txt (or
// .data/tinyshakespeare.txt when that is missing). The vocabulary is the sorted set of its characters;
// the first 90% of the characters train, the last 10% validate. A batch is B random windows of T + 1
// characters (offsets from a generator seeded by --seed), inputs the first T, targets the last T.
//
// Every --eval-interval iterations (and after the last) the mean loss over --eval-iters random batches of
// each split is measured without gradients in eval mode (no dropout), as nanoGPT's estimate_loss. stdout:
//   iter N train X val Y (lr ..., ms/iter ...)          per evaluation
//   <--sample N characters sampled from the model>      at the end (temperature 0.8, top-k 200)
//   RESULT best_val_loss=... seconds=... tokens_per_second=...
// seconds is the wall time of the whole run up to the end of training (data loading, training,
// evaluations and checkpoints; not the final sample); tokens_per_second counts training tokens (B*T per
// iteration) over the time spent in training iterations only.
//
// Data parallel: started with several ranks (scripts/kilnrun --nproc-per-node 2 char_gpt --device cuda, or
// mpirun; on the CPU mpirun alone), each iteration draws one global batch of world·B windows (--batch-size B
// a rank) and each rank trains on its B (data::WindowSampler's shards); DistributedDataParallel averages the
// gradients in the flat buffer; every rank evaluates the same batches (the same figures), rank 0 alone prints
// and writes; tokens/s counts every rank's tokens. A checkpoint resumes at any world size: with world·B kept
// (and --dropout 0, whose masks differ by rank) the losses go on as the saving run's would have, which
// --print-loss shows (tests/distributed/resume/run.sh).
//
// The training step makes no host synchronization: the loss is read only at evaluation points, the
// parameters and gradients live in flat buffers (optim::FlatParameters: one fill to zero the gradients, one
// reduction for the clipping norm, which stays on the device), and each batch is one asynchronous copy from
// page-locked memory (data::WindowSampler).
//
// CUDA graph (default on GPUs, data-parallel ranks included; --no-cuda-graph turns it off, and
// --cuda-graph insists on it): after 3 ordinary iterations the training step (zero_grad, forward,
// backward, clipping, the optimizer's step) is captured as one CUDA graph (cuda/graph.h) and each later iteration copies
// its batch into the graph's input tensors and replays it: one launch instead of hundreds. Dropout masks,
// AdamW's step count and the scheduled lr advance per replay as they would without the graph; under
// --amp f16 the GradScaler's scale too, and a replay whose gradients were not finite skips its update.
// Shampoo: the step is captured past its first roots, and the iterations that compute roots (every
// --shampoo-frequency) run without the graph (optim::Shampoo::roots_due_next_step).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/autocast.h>
#include <kiln/core/data/window_sampler.h>
#include <kiln/core/phase_timer.h>
#include <kiln/core/profiler.h>
#include <kiln/cuda/graph.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/cuda/runtime.h>
#include <kiln/distributed/checkpoint.h>
#include <kiln/distributed/data_parallel.h>
#include <kiln/nn/fp8_autocast.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/gpt.h>
#include <kiln/nn/sketch.h>
#include <kiln/observe/gpu_monitor.h>
#include <kiln/observe/metrics_logger.h>
#include <kiln/observe/plot.h>
#include <kiln/observe/progress.h>
#include <kiln/observe/step_profile.h>
#include <kiln/observe/trace.h>
#include <kiln/optim/adamw.h>
#include <kiln/optim/checkpoint.h>
#include <kiln/optim/flat_parameters.h>
#include <kiln/optim/grad_scaler.h>
#include <kiln/optim/lr_scheduler.h>
#include <kiln/optim/shampoo.h>

#include "../common/cli.h"
#include "../common/shampoo_flags.h"

using namespace kiln;

namespace {

struct Args {
  std::string data;
  std::string device = "cpu";
  std::string amp = "auto";  // bf16 on a GPU, none on the CPU
  int64_t iters = 5000;
  std::string optimizer = "adamw";  // or shampoo
  std::string trace;  // --trace FILE: a Chrome trace of 3 more iterations
  double gpu_monitor = 5;  // seconds between NVML samples into the metrics log (0: off)
  std::string run_dir = "runs/char_gpt";  // metrics.jsonl, metrics.csv and loss.png; "none": no logging
  int64_t shampoo_frequency = 10;
  examples::ShampooFlags shampoo;  // the other --shampoo-* flags
  int64_t eval_interval = 250;
  int64_t eval_iters = 200;
  int64_t batch_size = 64;
  int64_t block_size = 256;
  int64_t n_layer = 6, n_head = 6, n_embd = 384;
  double dropout = 0.2;
  double attn_dropout = -1;  // < 0: --dropout (nanoGPT drops attention weights at the same rate)
  bool bias = false;
  double lr = 1e-3, min_lr = 1e-4;
  int64_t warmup_iters = 100;
  int64_t lr_decay_iters = 0;  // 0: --iters
  double beta1 = 0.9, beta2 = 0.99, weight_decay = 0.1;
  double grad_clip = 1.0;
  std::string checkpoint;
  bool resume = false;
  bool grad_checkpoint = false;
  uint64_t seed = 1337;
  int64_t sample = 500;
  int64_t profile = 0;
  bool print_loss = false;  // every iteration's training loss over the global batch (a host sync each)
  int cuda_graph = -1;  // the step as one CUDA graph after 3 ordinary iterations: 1 on, 0 off, -1 on a GPU
  bool cuda_graph_asked = false;  // --cuda-graph given: an error where it cannot be
  bool fp8 = false;  // the blocks' Linear layers in FP8 (nn::Fp8Autocast); evaluation stays in --amp's dtype
  std::pair<int64_t, int64_t> sketch{0, 0};  // (L, k): the MLP layers as SKLinear; k = 0: dense
  bool help = false;
};

void usage(std::ostream& os) {
  os << "usage: char_gpt [--data FILE] [--device cpu|cuda[:i]] [--amp auto|none|bf16|f16] [--iters N]\n"
        "                [--eval-interval N] [--eval-iters N] [--batch-size B] [--block-size T]\n"
        "                [--n-layer L] [--n-head H] [--n-embd E] [--dropout P] [--attn-dropout P] [--bias]\n"
        "                [--lr LR] [--min-lr LR] [--warmup-iters N] [--lr-decay-iters N] [--beta1 B] [--beta2 B]\n"
        "                [--weight-decay WD] [--grad-clip C] [--checkpoint FILE [--resume]] [--grad-checkpoint]\n"
        "                [--seed S] [--sample N] [--profile N] [--sketch L,k] [--optimizer adamw|shampoo]\n"
        "                [--shampoo-frequency F] "
     << examples::ShampooFlags::synopsis(std::string(16, ' ')) << "\n"
     << "                [--run-dir DIR|none] [--trace FILE] [--gpu-monitor S] [--print-loss]\n"
        "                [--cuda-graph|--no-cuda-graph]\n"
        "  defaults: nanoGPT's shakespeare-char (6x6x384, T 256, B 64, dropout 0.2, lr 1e-3 -> 1e-4, 5000 iters)\n"
        "  --profile N: after training, N more iterations timed phase by phase (stderr)\n"
        "  --sketch L,k: each block's MLP layers as nn::SKLinear (L terms of rank k), from the dense init\n"
        "  --optimizer shampoo: optim::Shampoo (betas, lr, decay as given; Adam grafting; roots every F steps)\n"
     << examples::ShampooFlags::kHelp <<
        "  --trace FILE: after training, 3 iterations under the profiler as a Chrome trace (Perfetto), a table\n"
        "  --run-dir: where the evaluations' metrics (JSONL, CSV) and the loss-curve PNG go (default runs/char_gpt)\n"
        "  --gpu-monitor S: on a GPU, its utilization, memory, power, temperature and clocks (NVML) every S seconds\n"
        "                   into the run's metrics (default 5; 0: off)\n"
        "  --print-loss: each iteration's training loss, the mean over all ranks' batches (\"iter N loss X\"; reads\n"
        "                the loss every iteration: for checks such as a resume at another world size, not speed)\n"
        "  --cuda-graph, --no-cuda-graph: the training step captured once as a CUDA graph and replayed (default:\n"
        "                on GPUs, except Shampoo under --amp f16; Shampoo's iterations that compute roots run\n"
        "                without it)\n"
        "  --fp8: the blocks' Linear layers train in FP8 (nn::Fp8Autocast: e4m3/e5m2, delayed scaling, history 16;\n"
        "         their scaling states go into the checkpoint; evaluation and sampling in --amp's dtype)\n"
        "  --amp f16: f16 autocast with dynamic loss scaling (optim::GradScaler: steps whose gradients are not\n"
        "             finite are skipped, inside the CUDA graph too with AdamW; Shampoo runs f16 without the graph;\n"
        "             the scaler's state goes into the checkpoint)\n";
}

Args parse_args(int argc, char** argv) {
  Args a;
  examples::ArgReader r("char_gpt", argc, argv);
  std::string shampoo_flag;  // the last --shampoo-* flag given
  while (r.next()) {
    const std::string& flag = r.flag();
    if (flag == "--data") a.data = r.value();
    else if (flag == "--device") a.device = r.value();
    else if (flag == "--amp") a.amp = r.value();
    else if (flag == "--iters") a.iters = r.i64();
    else if (flag == "--eval-interval") a.eval_interval = r.i64();
    else if (flag == "--eval-iters") a.eval_iters = r.i64();
    else if (flag == "--batch-size") a.batch_size = r.i64();
    else if (flag == "--block-size") a.block_size = r.i64();
    else if (flag == "--n-layer") a.n_layer = r.i64();
    else if (flag == "--n-head") a.n_head = r.i64();
    else if (flag == "--n-embd") a.n_embd = r.i64();
    else if (flag == "--dropout") a.dropout = r.f64();
    else if (flag == "--attn-dropout") a.attn_dropout = r.f64();
    else if (flag == "--bias") a.bias = true;
    else if (flag == "--lr") a.lr = r.f64();
    else if (flag == "--min-lr") a.min_lr = r.f64();
    else if (flag == "--warmup-iters") a.warmup_iters = r.i64();
    else if (flag == "--lr-decay-iters") a.lr_decay_iters = r.i64();
    else if (flag == "--beta1") a.beta1 = r.f64();
    else if (flag == "--beta2") a.beta2 = r.f64();
    else if (flag == "--weight-decay") a.weight_decay = r.f64();
    else if (flag == "--grad-clip") a.grad_clip = r.f64();
    else if (flag == "--sketch") a.sketch = r.i64_pair();
    else if (flag == "--optimizer") a.optimizer = r.value();
    else if (flag == "--shampoo-frequency") a.shampoo_frequency = r.i64(), shampoo_flag = flag;
    else if (a.shampoo.read(r)) shampoo_flag = flag;
    else if (flag == "--run-dir") a.run_dir = r.value();
    else if (flag == "--gpu-monitor") a.gpu_monitor = r.f64();
    else if (flag == "--trace") a.trace = r.value();
    else if (flag == "--checkpoint") a.checkpoint = r.value();
    else if (flag == "--resume") a.resume = true;
    else if (flag == "--print-loss") a.print_loss = true;
    else if (flag == "--grad-checkpoint") a.grad_checkpoint = true;
    else if (flag == "--cuda-graph") a.cuda_graph = 1, a.cuda_graph_asked = true;
    else if (flag == "--no-cuda-graph") a.cuda_graph = 0;
    else if (flag == "--fp8") a.fp8 = true;
    else if (flag == "--seed") a.seed = uint64_t(r.i64());
    else if (flag == "--sample") a.sample = r.i64();
    else if (flag == "--profile") a.profile = r.i64();
    else if (flag == "--help" || flag == "-h") a.help = true;
    else r.unknown();
  }
  KILN_CHECK(a.amp == "auto" || a.amp == "none" || a.amp == "bf16" || a.amp == "f16",
             "char_gpt: --amp must be auto, none, bf16 or f16, got '", a.amp, "'");
  KILN_CHECK(a.iters >= 1 && a.eval_interval >= 1 && a.eval_iters >= 1, "char_gpt: --iters, --eval-interval and "
             "--eval-iters must be at least 1");
  KILN_CHECK(a.batch_size >= 1 && a.block_size >= 1, "char_gpt: --batch-size and --block-size must be at least 1");
  KILN_CHECK(a.lr > 0 && a.min_lr >= 0 && a.warmup_iters >= 0, "char_gpt: bad learning-rate schedule");
  if (a.attn_dropout < 0) a.attn_dropout = a.dropout;
  if (a.lr_decay_iters == 0) a.lr_decay_iters = std::max(a.iters, a.warmup_iters + 1);
  KILN_CHECK(a.lr_decay_iters > a.warmup_iters, "char_gpt: --lr-decay-iters must exceed --warmup-iters");
  KILN_CHECK(a.gpu_monitor >= 0, "char_gpt: --gpu-monitor must be >= 0 seconds, got ", a.gpu_monitor);
  KILN_CHECK(a.grad_clip >= 0, "char_gpt: --grad-clip must be non-negative (0: no clipping)");
  KILN_CHECK(a.sample >= 0, "char_gpt: --sample must be non-negative");
  KILN_CHECK(!a.resume || !a.checkpoint.empty(), "char_gpt: --resume needs --checkpoint FILE");
  a.shampoo.check("char_gpt");
  KILN_CHECK(shampoo_flag.empty() || a.optimizer == "shampoo", "char_gpt: ", shampoo_flag,
             " sets Shampoo, which runs only with --optimizer shampoo (this run's optimizer: ", a.optimizer, ")");
  // Shampoo under f16: its step decides on the host, which a GradScaler's captured step cannot follow
  KILN_CHECK(a.cuda_graph != 1 || a.optimizer != "shampoo" || a.amp != "f16", "char_gpt: --cuda-graph with "
             "--optimizer shampoo needs --amp bf16 or none (a GradScaler's captured step needs an optimizer that "
             "skips on the device: AdamW)");
  if (a.cuda_graph == -1) a.cuda_graph = !(a.optimizer == "shampoo" && a.amp == "f16");  // on a GPU: in run()
  return a;
}

std::string data_path(const Args& a) {
  if (!a.data.empty()) return a.data;
  if (const char* env = std::getenv("KILN_SHAKESPEARE"); env && *env) return env;
  const std::string shared = "../shared/data/tinyshakespeare.txt", local = ".data/tinyshakespeare.txt";
  return !std::filesystem::exists(shared) && std::filesystem::exists(local) ? local : shared;
}

// The text as token ids (indices into the sorted set of its characters).
struct Corpus {
  std::string vocab;
  std::vector<int32_t> train, val;
};

Corpus load_corpus(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  KILN_CHECK(in, "char_gpt: cannot read ", path, " (pass --data FILE or set KILN_SHAKESPEARE)");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  KILN_CHECK(text.size() >= 1000, "char_gpt: ", path, " is too short (", text.size(), " bytes)");
  std::set<unsigned char> chars(text.begin(), text.end());
  Corpus c;
  c.vocab.assign(chars.begin(), chars.end());
  std::vector<uint8_t> lut(256, 0);
  for (size_t i = 0; i < c.vocab.size(); ++i) lut[(unsigned char)c.vocab[i]] = uint8_t(i);
  const size_t n_train = size_t(0.9 * double(text.size()));
  c.train.reserve(n_train);
  c.val.reserve(text.size() - n_train);
  for (size_t i = 0; i < text.size(); ++i) (i < n_train ? c.train : c.val).push_back(lut[(unsigned char)text[i]]);
  return c;
}

std::string best_path(const std::string& path) {
  std::filesystem::path p(path);
  return (p.parent_path() / (p.stem().string() + ".best" + p.extension().string())).string();
}

int run(const Args& args) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  Device dev = Device::parse(args.device);
  // several ranks (kilnrun, torchrun or mpirun): data parallelism, NCCL on GPUs (one a rank), MPI on the CPU
  const std::shared_ptr<distributed::ProcessGroup> group = distributed::init_process_group_if_launched(dev);
  if (group) dev = group->device();
  const int rank = group ? group->rank() : 0, world = group ? group->size() : 1;
  KILN_CHECK(!args.cuda_graph_asked || dev.is_cuda(), "char_gpt: --cuda-graph needs --device cuda");
  const bool use_graph = args.cuda_graph == 1 && dev.is_cuda();  // data-parallel too: collectives are captured
  if (dev.is_cuda()) {
    KILN_CHECK(cuda::is_available(), "char_gpt: --device ", args.device,
               ": no CUDA device is available (or this build has no CUDA backend); use --device cpu");
    KILN_CHECK(dev.index < cuda::device_count(), "char_gpt: --device ", args.device, ": only ", cuda::device_count(),
               " CUDA device(s)");
    cuda::set_device(dev.index);
  }
  const bool amp_on = args.amp == "bf16" || args.amp == "f16" || (args.amp == "auto" && dev.is_cuda());
  // f16 autocast needs loss scaling (a GradScaler, whose state goes into checkpoints); bf16 does not
  const DType amp_dtype = args.amp == "f16" ? DType::f16 : DType::bf16;
  optim::GradScaler scaler({.enabled = args.amp == "f16"});
  auto sync = [&] {
    if (dev.is_cuda()) cuda::synchronize();
  };

  const std::string path = data_path(args);
  Corpus corpus = load_corpus(path);
  const int64_t V = int64_t(corpus.vocab.size());
  std::fprintf(stderr, "data %s: %zu train + %zu val characters, vocabulary %lld\n", path.c_str(), corpus.train.size(),
               corpus.val.size(), (long long)V);

  manual_seed(args.seed);  // parameter initialization, then dropout masks
  nn::GPT model({.vocab_size = V, .block_size = args.block_size, .n_layer = args.n_layer, .n_head = args.n_head,
                 .n_embd = args.n_embd, .dropout = args.dropout, .attn_dropout = args.attn_dropout, .bias = args.bias,
                 .checkpoint = args.grad_checkpoint, .device = dev});
  std::fprintf(stderr, "%s: %.2fM parameters (%s, amp %s%s)\n", model.repr().c_str(), double(model.num_params()) / 1e6,
               dev.str().c_str(), amp_on ? dtype_name(amp_dtype) : "none", args.grad_checkpoint ? ", gradient checkpointing" : "");

  if (args.sketch.second > 0) {  // each block's MLP (fc, proj) as SKLinear initialised from its dense weights
    const nn::SketchReport report = nn::sketch(
        model, {.num_terms = args.sketch.first, .low_rank = args.sketch.second, .conv2d = false,
                .filter = [](const std::string& name, const nn::Module&) { return name.find(".mlp.") != std::string::npos; },
                .seed = args.seed});
    std::ostringstream os;
    os << report;
    std::fprintf(stderr, "--sketch %lld,%lld: %s\n", (long long)args.sketch.first, (long long)args.sketch.second,
                 os.str().c_str());
    KILN_CHECK(report.num_sketched() > 0, "char_gpt: --sketch ", args.sketch.first, ",", args.sketch.second,
               " sketched no layer (each would hold more numbers than its dense weight)");
  }
  auto groups = model.parameter_groups();
  const std::pair<double, double> betas{args.beta1, args.beta2};
  KILN_CHECK(args.optimizer == "adamw" || args.optimizer == "shampoo",
             "char_gpt: --optimizer must be adamw or shampoo, got '", args.optimizer, "'");
  std::unique_ptr<optim::Optimizer> optimizer;
  if (args.optimizer == "adamw") {
    auto adamw = std::make_unique<optim::AdamW>(groups.decay, optim::AdamWOptions{.lr = args.lr, .betas = betas,
                                                                                  .weight_decay = args.weight_decay});
    adamw->add_param_group(groups.no_decay, {.lr = args.lr, .betas = betas, .weight_decay = 0.0});
    optimizer = std::move(adamw);
  } else {
    optim::ShampooOptions o{.lr = args.lr, .betas = betas, .weight_decay = args.weight_decay,
                            .precondition_frequency = args.shampoo_frequency, .grafting_beta2 = args.beta2};
    args.shampoo.apply(o);
    auto shampoo = std::make_unique<optim::Shampoo>(groups.decay, o);
    o.weight_decay = 0.0;
    shampoo->add_param_group(groups.no_decay, o);
    args.shampoo.apply(*shampoo);
    optimizer = std::move(shampoo);
  }
  optim::Optimizer& opt = *optimizer;
  const optim::Shampoo* shampoo = dynamic_cast<const optim::Shampoo*>(optimizer.get());
  optim::CosineWithWarmup schedule(opt, args.warmup_iters, args.lr_decay_iters, args.min_lr);
  optim::FlatParameters flat(model.parameters());
  std::unique_ptr<distributed::DistributedDataParallel> ddp;  // buckets are ranges of flat's gradient
  if (group)
    ddp = std::make_unique<distributed::DistributedDataParallel>(
        model, group, distributed::DistributedDataParallelOptions{.flat = &flat});

  const data::WindowSampler train_batches(corpus.train, args.batch_size, args.block_size, dev);
  const data::WindowSampler val_batches(corpus.val, args.batch_size, args.block_size, dev);
  // training batches: one stream of global batches of world·B windows, each rank its shard; the position
  // (the same on every rank and at every world size) goes into checkpoints, so a run saved at one world size
  // resumes at another with the same global batches (--batch-size scaled to keep world·B)
  const uint64_t batch_seed = args.seed;
  Generator batch_gen(batch_seed);
  nn::Fp8ModelState fp8_state(model);  // --fp8: the layers' scaling states, a checkpoint component
  int64_t start_iter = 0;
  double best_val = std::numeric_limits<double>::infinity();
  if (args.resume) {
    if (!std::filesystem::exists(args.checkpoint)) {
      std::fprintf(stderr, "no checkpoint at %s yet: starting from scratch\n", args.checkpoint.c_str());
    } else {
      optim::LoadedComponents components{{"optimizer", &opt}, {"scheduler", &schedule}};
      if (args.fp8) components["fp8"] = &fp8_state;
      if (scaler.is_enabled()) components["scaler"] = &scaler;
      optim::CheckpointInfo info = optim::load_checkpoint(args.checkpoint, model, components);
      auto meta = [&](const char* key) -> const optim::MetadataValue& {
        auto found = info.metadata.find(key);
        KILN_CHECK(found != info.metadata.end(), "char_gpt: ", args.checkpoint, " has no '", key,
                   "' metadata: not written by char_gpt?");
        return found->second;
      };
      const auto* vocab = std::get_if<std::string>(&meta("vocab"));
      const auto* best = std::get_if<double>(&meta("best_val_loss"));
      const auto* offset = std::get_if<int64_t>(&meta("batch_rng_offset"));
      KILN_CHECK(vocab && best && offset, "char_gpt: ", args.checkpoint, ": metadata of the wrong type");
      KILN_CHECK(*vocab == corpus.vocab, "char_gpt: ", args.checkpoint, " was trained on another vocabulary");
      start_iter = info.step;
      best_val = *best;
      batch_gen.set_state({batch_seed, uint64_t(*offset)});
      std::fprintf(stderr, "resumed from %s at iteration %lld (best val loss %.4f)\n", args.checkpoint.c_str(),
                   (long long)start_iter, best_val);
    }
  }

  // Mean loss over eval_iters batches of a split, in eval mode without gradients. The batches depend on
  // (seed, iteration) only, so a resumed run measures what the uninterrupted one would have. Several
  // batches go through the model at once (fewer, larger launches; the mean is the same).
  auto estimate_loss = [&](const data::WindowSampler& split, uint64_t stream, int64_t iter) {
    NoGradGuard no_grad;
    amp::Autocast autocast(dev, amp_dtype, amp_on);
    model.eval();
    Generator gen(args.seed * 1000003u + stream * 7919u + uint64_t(iter));
    constexpr int64_t kGroup = 4;
    Tensor total = zeros({}, {.dtype = DType::f32, .device = dev});
    for (int64_t done = 0; done < args.eval_iters;) {
      const int64_t n = std::min(kGroup, args.eval_iters - done);
      std::vector<Tensor> xs, ys;
      for (int64_t k = 0; k < n; ++k) {
        auto [x, y] = split.sample(gen);
        xs.push_back(x);
        ys.push_back(y);
      }
      Tensor x = n == 1 ? xs[0] : cat(xs, 0), y = n == 1 ? ys[0] : cat(ys, 0);
      total = add(total, mul(model.loss(x, y), double(n)));
      done += n;
    }
    model.train();
    return total.item<double>() / double(args.eval_iters);
  };

  // One training iteration, written once: `timer` times its phases under --profile; the untimed one runs
  // them back to back.
  // The step on a batch (x, y), the scheduler aside: what a CUDA graph captures under --cuda-graph.
  auto compute_step = [&](const Tensor& x, const Tensor& y, PhaseTimer& timer) {
    Tensor loss;
    timer.time("forward", [&] {
      nn::Fp8Autocast fp8({.history_len = 16}, args.fp8);
      amp::Autocast autocast(dev, amp_dtype, amp_on);
      loss = model.loss(x, y);
    });
    timer.time("backward", [&] {
      flat.zero_grad();
      scaler.scale(loss).backward();  // (the scaler disabled: loss.backward())
    });
    timer.time("clip", [&] {
      scaler.unscale_(opt);
      if (args.grad_clip > 0) flat.clip_grad_norm(args.grad_clip);
    });
    timer.time("step", [&] {
      scaler.step(opt);  // f16: skipped where the gradients were not finite (on the device in a CUDA graph)
      scaler.update();
      if (args.fp8) nn::fp8_step(model);
    });
    return loss;
  };
  std::optional<cuda::Graph> graph;  // --cuda-graph: the captured step, its input batch and its loss
  Tensor graph_x, graph_y, graph_loss;
  // One training iteration, written once: `timer` times its phases under --profile; the untimed one runs
  // them back to back.
  auto train_step = [&](PhaseTimer& timer) {
    Tensor x, y, loss;
    timer.time("batch", [&] { std::tie(x, y) = train_batches.sample(batch_gen, rank, world); });
    // Shampoo: the steps that compute roots (every --shampoo-frequency) run without the graph
    if (graph && !(shampoo && shampoo->roots_due_next_step())) {
      timer.time("graph", [&] {
        graph_x.copy_(x);
        graph_y.copy_(y);
        graph->replay();
      });
      loss = graph_loss;
    } else {
      loss = compute_step(x, y, timer);
    }
    schedule.step();
    return loss;
  };
  PhaseTimer untimed(dev, /*enabled=*/false);

  // rank 0 logs every evaluation (appending on --resume) and draws the loss curves at the end
  std::unique_ptr<observe::MetricsLogger> metrics;
  if (rank == 0 && args.run_dir != "none")
    metrics = std::make_unique<observe::MetricsLogger>(args.run_dir, observe::MetricsLoggerOptions{.append = args.resume});
  // the GPU's utilization, memory, power, temperature and clocks into the same log, on a thread (NVML)
  std::atomic<int64_t> current_iter{start_iter};
  const std::unique_ptr<observe::GpuMonitor> monitor =
      observe::monitor_training(metrics.get(), dev, args.gpu_monitor, [&current_iter] { return current_iter.load(); });
  const int64_t tokens_per_iter = args.batch_size * args.block_size;
  std::unique_ptr<observe::ProgressBar> progress;  // rank 0, on stderr, with the time left
  if (rank == 0 && args.iters > start_iter)
    progress = std::make_unique<observe::ProgressBar>("iter", args.iters - start_iter);
  double train_seconds = 0;
  int64_t trained_iters = 0;
  sync();
  auto segment_start = Clock::now();
  int64_t segment_iters = 0;
  for (int64_t iter = start_iter;; ++iter) {
    current_iter.store(iter, std::memory_order_relaxed);
    const bool last = iter == args.iters;
    if ((iter % args.eval_interval == 0 || last) && !(args.resume && iter == start_iter && start_iter > 0)) {
      sync();
      const double seg = std::chrono::duration<double>(Clock::now() - segment_start).count();
      train_seconds += seg;
      const double train_loss = estimate_loss(train_batches, 1, iter);
      const double val_loss = estimate_loss(val_batches, 2, iter);
      const bool improved = val_loss < best_val;
      if (improved) best_val = val_loss;
      if (rank == 0) {
        const double ms_per_iter = segment_iters > 0 ? 1e3 * seg / double(segment_iters) : 0.0;
        std::printf("iter %lld train %.4f val %.4f (lr %.3g, %.1f ms/iter", (long long)iter, train_loss, val_loss,
                    schedule.get_last_lr()[0], ms_per_iter);
        if (shampoo)  // roots so far
          std::printf("; Shampoo roots %lld, %lld eigendecomposed afresh, Newton %lld iterations %lld fallbacks",
                      (long long)shampoo->root_updates(), (long long)shampoo->eigen_refreshes(),
                      (long long)shampoo->newton_iterations(), (long long)shampoo->newton_fallbacks());
        std::printf(")\n");
        std::fflush(stdout);
        if (metrics) {
          std::vector<std::pair<std::string, double>> values{
              {"train_loss", train_loss}, {"val_loss", val_loss}, {"lr", schedule.get_last_lr()[0]}};
          // the training's own time so far, evaluations left out (AlgoPerf's time to target counts it so)
          values.emplace_back("train_seconds", train_seconds);
          if (segment_iters > 0) {
            values.emplace_back("ms_per_iter", ms_per_iter);
            values.emplace_back("tokens_per_second", double(tokens_per_iter * world) * 1e3 / ms_per_iter);
          }
          if (dev.is_cuda())
            values.emplace_back("peak_memory_gib", double(cuda::memory_stats(dev.index).peak_allocated) / double(1 << 30));
          metrics->log(iter, values);
        }
      }
      if (!args.checkpoint.empty() && iter > start_iter) {
        optim::Metadata meta{{"vocab", corpus.vocab},
                             {"best_val_loss", best_val},
                             {"val_loss", val_loss},
                             {"batch_rng_offset", int64_t(batch_gen.state().offset)},
                             {"seed", int64_t(args.seed)},
                             {"n_layer", args.n_layer},
                             {"n_head", args.n_head},
                             {"n_embd", args.n_embd},
                             {"block_size", args.block_size}};
        optim::SavedComponents components{{"optimizer", &opt}, {"scheduler", &schedule}};
        if (args.fp8) components["fp8"] = &fp8_state;
        if (scaler.is_enabled()) components["scaler"] = &scaler;
        auto save = [&](const std::string& to) {
          if (group)  // rank 0 writes, the others wait
            distributed::save_checkpoint(*group, to, model, components, meta, iter);
          else
            optim::save_checkpoint(to, model, components, meta, iter);
        };
        save(args.checkpoint);
        if (improved) save(best_path(args.checkpoint));
      }
      sync();
      segment_start = Clock::now();
      segment_iters = 0;
    }
    if (last) break;

    // warm: optimizer state, workspaces, heuristics (Shampoo: past its first roots, at a step without them)
    if (use_graph && !graph && trained_iters >= 3 && (!shampoo || shampoo->capturable_next_step())) {
      graph_x = empty({args.batch_size, args.block_size}, {.dtype = DType::i64, .device = dev});
      graph_y = empty_like(graph_x);
      graph.emplace(cuda::capture([&] { graph_loss = compute_step(graph_x, graph_y, untimed); }, /*warmup=*/0));
      if (rank == 0) std::fprintf(stderr, "captured the training step as a CUDA graph of %zu nodes\n", graph->num_nodes());
    }
    const Tensor loss = train_step(untimed);
    if (args.print_loss) {  // the mean over the global batch (every rank's B windows)
      Tensor mean = loss.detach().to(DType::f32).clone();
      if (group) group->all_reduce(mean, distributed::ReduceOp::avg);
      const double value = mean.item<double>();
      if (rank == 0) std::printf("iter %lld loss %.6f\n", (long long)iter, value);
    }
    ++segment_iters;
    ++trained_iters;
    if (progress) progress->update(iter + 1 - start_iter);
  }
  sync();
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();

  if (!args.trace.empty()) {  // 3 iterations unprofiled, 3 profiled (rank 0; every rank runs them for DDP)
    const observe::StepProfile p =
        observe::profile_steps(3, [&](int64_t) { train_step(untimed); }, sync, rank == 0);
    if (rank == 0) {
      observe::save_chrome_trace(p.trace, args.trace);
      std::fprintf(stderr, "profile of 3 iterations (%s):\n%s", args.trace.c_str(),
                   observe::profile_table(p.trace).c_str());
      std::printf("%s\n", p.summary().c_str());
    }
  }
  if (args.profile > 0) {
    // Where an iteration's time goes (host and wall time of each phase; core/phase_timer.h).
    PhaseTimer timer(dev);
    for (int64_t i = 0; i < args.profile; ++i) train_step(timer);
    // The same iterations back to back, without the synchronizations.
    sync();
    auto a = Clock::now();
    for (int64_t i = 0; i < args.profile; ++i) train_step(untimed);
    auto b = Clock::now();
    sync();
    auto c = Clock::now();
    std::fputs(timer.report(args.profile).c_str(), stderr);
    std::fprintf(stderr, "profile pipelined: host %.3f ms/iter enqueueing, %.3f ms/iter wall\n",
                 1e3 * std::chrono::duration<double>(b - a).count() / double(args.profile),
                 1e3 * std::chrono::duration<double>(c - a).count() / double(args.profile));
  }
  if (rank != 0) return 0;
  if (args.sample > 0) {
    Generator gen(args.seed + 1);
    const size_t newline = corpus.vocab.find('\n');
    Tensor start = full({1, 1}, double(newline == std::string::npos ? 0 : newline), {.dtype = DType::i64, .device = dev});
    Tensor out;
    {
      amp::Autocast autocast(dev, amp_dtype, amp_on);
      out = model.generate(start, args.sample, 0.8, 200, &gen);
    }
    std::string text;
    for (int64_t t : out.to_vector<int64_t>()) text.push_back(corpus.vocab[size_t(t)]);
    std::printf("---- sample ----\n%s\n----------------\n", text.c_str());
  }
  if (dev.is_cuda())
    std::fprintf(stderr, "peak GPU memory %.2f GiB\n", double(cuda::memory_stats(dev.index).peak_allocated) / (1 << 30));
  const double tps = train_seconds > 0 ? double(trained_iters * tokens_per_iter * world) / train_seconds : 0.0;
  if (metrics && !metrics->series("val_loss").empty()) {
    const std::string png = (std::filesystem::path(args.run_dir) / "loss.png").string();
    observe::save_metrics_plot(*metrics, {"train_loss", "val_loss"}, png,
                               {.title = "char_gpt (" + args.optimizer + ")", .x_label = "iteration",
                                .y_label = "cross-entropy loss"});
    std::fprintf(stderr, "metrics and loss curves: %s\n", args.run_dir.c_str());
  }
  std::printf("RESULT best_val_loss=%.4f seconds=%.1f tokens_per_second=%.0f\n", best_val, seconds, tps);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return kiln::examples::example_main(argc, argv, parse_args, usage, run); }
