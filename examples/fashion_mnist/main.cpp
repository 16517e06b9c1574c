// Fashion-MNIST classifier: an MLP (784-256-10, GELU) or a CNN trained with AdamW and a cosine
// learning-rate decay, on the CPU or a GPU, optionally in mixed precision, with a checkpoint every epoch
// and exact resumption (model, optimizer, schedule, loss scaler, RNG, epoch) with --resume.
//
//   fashion_mnist --model mlp --epochs 10 --checkpoint fmnist.h5
//   fashion_mnist --model mlp --epochs 10 --checkpoint fmnist.h5 --resume   # continues where it stopped
//   fashion_mnist --model cnn --device cuda --amp bf16                      # 15 epochs on a GPU
//   fashion_mnist --model mlp --device cuda --amp f16 --clip 1.0            # f16 with dynamic loss scaling
//   fashion_mnist --model cnn --device cuda --amp bf16 --sketch 1,16         # sketched layers (nn::sketch)
//
// --amp bf16|f16 runs the forward pass and the loss under amp::Autocast: convolutions and matmuls in the
// low-precision dtype, the loss in f32, parameters (master weights) and AdamW's state in f32. f16 also
// scales the loss with optim::GradScaler (its state goes into the checkpoint); --clip clips the global
// gradient norm between unscaling and the optimizer step.
//
// --optimizer adamw (default) | sgd (momentum 0.9, decoupled decay as L2, the same cosine decay) | kfac (SGD
// with momentum behind optim::KFAC, which preconditions the Linear and Conv2d gradients): the comparison
// docs/optim.md reports. --kfac-damping, --kfac-inv-steps, --kfac-factor-steps, --kfac-kl-clip set K-FAC's λ,
// eigendecomposition and factor-update intervals and KL clipping.
//
// Data parallel: started with several ranks (scripts/kilnrun --nproc-per-node 2 fashion_mnist ..., or mpirun),
// each rank trains on its share of every epoch (data::Loader's num_replicas/rank) and DistributedDataParallel
// averages the gradients (NCCL on GPUs, MPI on the CPU); rank 0 alone prints and writes checkpoints.
//
// Progress goes to stderr (a bar updated in place on a terminal); stdout gets one line per epoch and, last,
//   RESULT test_accuracy=0.xxxx epochs=N seconds=S world=W parameters=P
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <string>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/autocast.h>
#include <kiln/core/data/data.h>
#include <kiln/core/profiler.h>
#include <kiln/core/random.h>
#include <kiln/cuda/runtime.h>
#include <kiln/distributed/checkpoint.h>
#include <kiln/distributed/data_parallel.h>
#include <kiln/nn/modules.h>
#include <kiln/observe/gpu_monitor.h>
#include <kiln/observe/metrics_logger.h>
#include <kiln/observe/plot.h>
#include <kiln/observe/progress.h>
#include <kiln/observe/trace.h>
#include <kiln/optim/adamw.h>
#include <kiln/optim/checkpoint.h>
#include <kiln/optim/clip_grad.h>
#include <kiln/optim/grad_scaler.h>
#include <kiln/optim/kfac.h>
#include <kiln/optim/lr_scheduler.h>
#include <kiln/optim/sgd.h>

#include "../common/cli.h"

using namespace kiln;

namespace {

struct Mlp : nn::Module {
  nn::Linear fc1{784, 256}, fc2{256, 10};
  Mlp() {
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }
  Tensor forward(const Tensor& x) override { return fc2(nn::functional::gelu(fc1(x.flatten(1)))); }
};

// Two conv-relu-pool stages (28 -> 14 -> 7, 32 then 64 channels), dropout, a 128-unit hidden layer and
// the classifier: about 4.2 M multiply-adds per image forward (conv2 is 3.6 M of them), 0.42 M parameters.
struct Cnn : nn::Module {
  nn::Conv2d conv1{1, 32, 3, {.padding = 1}}, conv2{32, 64, 3, {.padding = 1}};
  nn::MaxPool2d pool{2};
  nn::Dropout drop1{0.25}, drop2{0.25};
  nn::Linear fc1{64 * 7 * 7, 128}, fc2{128, 10};
  Cnn() {
    register_module("conv1", conv1);
    register_module("conv2", conv2);
    register_module("pool", pool);
    register_module("drop1", drop1);
    register_module("fc1", fc1);
    register_module("drop2", drop2);
    register_module("fc2", fc2);
  }
  Tensor forward(const Tensor& x) override {
    Tensor h = pool(relu(conv1(x)));
    h = drop1(pool(relu(conv2(h))));
    h = drop2(relu(fc1(h.flatten(1))));
    return fc2(h);
  }
};

struct Args {
  std::string model = "mlp";
  int64_t epochs = 0;  // 0: the model's default (mlp 10, cnn 15)
  int64_t batch_size = 128;
  double lr = 1e-3;
  double weight_decay = 1e-2;
  std::string data = "/usr/share/datasets/fashion-mnist";
  std::string checkpoint;
  bool resume = false;
  std::string device = "cpu";
  std::string amp = "none";
  double clip = 0;  // max global gradient norm; 0: no clipping
  uint64_t seed = 0;
  std::pair<int64_t, int64_t> sketch{0, 0};  // (L, k): Linear and Conv2d layers as SKLinear / SKConv2d
  std::string optimizer = "adamw";
  std::string run_dir = "runs/fashion_mnist";  // metrics and curves; "none": no logging
  double gpu_monitor = 5;                      // seconds between NVML samples into the metrics (0: off)
  double kfac_damping = 1e-3;
  int64_t kfac_inv_steps = 10;
  int64_t kfac_factor_steps = 1;
  double kfac_kl_clip = 1e-3;
  double target_accuracy = 0;  // > 0: stop after the first epoch whose test accuracy reaches it
  std::string trace;           // a Chrome trace of 10 training steps from step 101 (with K-FAC every 10 and
                               // 100 steps: one factor update and one eigendecomposition among them)
  bool help = false;
};

void usage(std::ostream& os) {
  os << "usage: fashion_mnist [--model mlp|cnn] [--epochs N] [--batch-size B] [--lr LR] [--weight-decay WD]\n"
        "                     [--data DIR] [--checkpoint FILE [--resume]] [--device cpu|cuda[:i]]\n"
        "                     [--amp none|bf16|f16] [--clip MAX_NORM] [--seed S] [--sketch L,k]\n"
        "                     [--optimizer adamw|sgd|kfac] [--kfac-damping L] [--kfac-inv-steps N]\n"
        "                     [--kfac-factor-steps N] [--kfac-kl-clip C] [--target-accuracy A]\n"
        "                     [--trace FILE]\n"
        "                     [--run-dir DIR|none] [--gpu-monitor S]\n"
        "  --epochs defaults to 10 for the MLP and 15 for the CNN\n"
        "  --target-accuracy A: stop after the first epoch whose test accuracy is at least A (time-to-target runs)\n"
        "  --trace FILE: 10 training steps from step 101 (the first 10 within one epoch) under the profiler,\n"
        "                as a Chrome trace and a table on stderr\n"
        "  --sketch L,k: nn::sketch the model (L terms of rank k) wherever that saves parameters\n"
        "  --gpu-monitor S: on a GPU, NVML's utilization, memory, power, temperature and clocks every S seconds\n"
        "                   into the run's metrics (default 5; 0: off)\n";
}

Args parse_args(int argc, char** argv) {
  Args a;
  examples::ArgReader r("fashion_mnist", argc, argv);
  std::string kfac_flag;  // the last --kfac-* flag given
  while (r.next()) {
    const std::string& flag = r.flag();
    if (flag == "--model") a.model = r.value();
    else if (flag == "--epochs") a.epochs = r.i64();
    else if (flag == "--batch-size") a.batch_size = r.i64();
    else if (flag == "--lr") a.lr = r.f64();
    else if (flag == "--weight-decay") a.weight_decay = r.f64();
    else if (flag == "--data") a.data = r.value();
    else if (flag == "--checkpoint") a.checkpoint = r.value();
    else if (flag == "--resume") a.resume = true;
    else if (flag == "--device") a.device = r.value();
    else if (flag == "--amp") a.amp = r.value();
    else if (flag == "--clip") a.clip = r.f64();
    else if (flag == "--seed") a.seed = uint64_t(r.i64());
    else if (flag == "--sketch") a.sketch = r.i64_pair();
    else if (flag == "--optimizer") a.optimizer = r.value();
    else if (flag == "--kfac-damping") a.kfac_damping = r.f64(), kfac_flag = flag;
    else if (flag == "--kfac-inv-steps") a.kfac_inv_steps = r.i64(), kfac_flag = flag;
    else if (flag == "--kfac-factor-steps") a.kfac_factor_steps = r.i64(), kfac_flag = flag;
    else if (flag == "--kfac-kl-clip") a.kfac_kl_clip = r.f64(), kfac_flag = flag;
    else if (flag == "--target-accuracy") a.target_accuracy = r.f64();
    else if (flag == "--trace") a.trace = r.value();
    else if (flag == "--run-dir") a.run_dir = r.value();
    else if (flag == "--gpu-monitor") a.gpu_monitor = r.f64();
    else if (flag == "--help" || flag == "-h") a.help = true;
    else r.unknown();
  }
  KILN_CHECK(a.model == "mlp" || a.model == "cnn", "fashion_mnist: --model must be mlp or cnn, got '", a.model, "'");
  if (a.epochs == 0) a.epochs = a.model == "cnn" ? 15 : 10;
  KILN_CHECK(a.epochs >= 1, "fashion_mnist: --epochs must be at least 1");
  KILN_CHECK(a.batch_size >= 1, "fashion_mnist: --batch-size must be at least 1");
  KILN_CHECK(a.lr > 0, "fashion_mnist: --lr must be positive");
  KILN_CHECK(a.gpu_monitor >= 0, "fashion_mnist: --gpu-monitor must be >= 0 seconds, got ", a.gpu_monitor);
  KILN_CHECK(a.optimizer == "adamw" || a.optimizer == "sgd" || a.optimizer == "kfac",
             "fashion_mnist: --optimizer must be adamw, sgd or kfac, got '", a.optimizer, "'");
  KILN_CHECK(kfac_flag.empty() || a.optimizer == "kfac", "fashion_mnist: ", kfac_flag,
             " sets K-FAC, which runs only with --optimizer kfac (this run's optimizer: ", a.optimizer, ")");
  KILN_CHECK(a.amp == "none" || a.amp == "bf16" || a.amp == "f16", "fashion_mnist: --amp must be none, bf16 or f16, got '",
             a.amp, "'");
  KILN_CHECK(a.clip >= 0, "fashion_mnist: --clip must be positive (or 0 for no clipping)");
  KILN_CHECK(!a.resume || !a.checkpoint.empty(), "fashion_mnist: --resume needs --checkpoint FILE");
  return a;
}

// A one-line progress bar on stderr, redrawn in place on a terminal (at most ~10 times a second); when
// stderr is a file or pipe it writes a line at every quarter of the epoch instead.
// Test accuracy, without a graph and in the precision training uses (amp: nullopt for f32).
double evaluate(nn::Module& net, const data::Dataset& test, Device dev, std::optional<DType> amp_dtype) {
  NoGradGuard no_grad;
  amp::Autocast autocast(dev, amp_dtype.value_or(DType::bf16), amp_dtype.has_value());
  net.eval();
  data::Loader loader(test, {.batch_size = 1000, .seed = 0, .pin_memory = dev.is_cuda()});
  int64_t correct = 0;
  for (auto [x, y] : loader) {
    Tensor pred = net(x.to(dev)).argmax(1).cpu();
    auto p = pred.to_vector<int64_t>();
    auto t = y.to_vector<int64_t>();
    for (size_t i = 0; i < p.size(); ++i) correct += p[i] == t[i];
  }
  net.train();
  return double(correct) / double(test.size());
}

int run(const Args& args) {
  auto t0 = std::chrono::steady_clock::now();
  Device dev = Device::parse(args.device);
  // several ranks (kilnrun, torchrun or mpirun): data parallelism, NCCL on GPUs (one a rank), MPI on the CPU
  const std::shared_ptr<distributed::ProcessGroup> group = distributed::init_process_group_if_launched(dev);
  if (group) dev = group->device();
  const int rank = group ? group->rank() : 0;
  const bool main_rank = rank == 0;
  if (dev.is_cuda()) {
    KILN_CHECK(cuda::is_available(), "fashion_mnist: --device ", args.device,
               ": no CUDA device is available (or this build has no CUDA backend); use --device cpu");
    KILN_CHECK(dev.index < cuda::device_count(), "fashion_mnist: --device ", args.device, ": only ",
               cuda::device_count(), " CUDA device(s)");
    cuda::set_cudnn_benchmark(true);  // a few fixed shapes: time cuDNN's algorithms once per shape
  }
  std::optional<DType> amp_dtype;
  if (args.amp == "bf16") amp_dtype = DType::bf16;
  else if (args.amp == "f16") amp_dtype = DType::f16;

  manual_seed(args.seed);  // parameter initialization
  std::unique_ptr<nn::Module> net;
  if (args.model == "mlp") net = std::make_unique<Mlp>();
  else net = std::make_unique<Cnn>();
  if (args.sketch.second > 0) {  // the dense layers that it makes smaller, sketched from their initial weights
    const nn::SketchReport report =
        nn::sketch(*net, {.num_terms = args.sketch.first, .low_rank = args.sketch.second,
                          .conv_num_terms = args.sketch.first, .conv_low_rank = args.sketch.second, .seed = args.seed});
    if (main_rank) std::cerr << "--sketch " << args.sketch.first << "," << args.sketch.second << ": " << report << "\n";
  }
  int64_t num_params = 0;
  for (const Tensor& p : net->parameters()) num_params += p.numel();
  net->to(dev);  // the parameters stay f32 under --amp: they are the master weights
  std::unique_ptr<distributed::DistributedDataParallel> ddp;  // rank 0's weights everywhere
  if (group) ddp = std::make_unique<distributed::DistributedDataParallel>(*net, group);

  data::FashionMNIST train(args.data, data::Split::Train, {.normalize = true});
  data::FashionMNIST test(args.data, data::Split::Test, {.normalize = true});
  // An explicit seed: each epoch's order depends on (seed, epoch) only, so a resumed run sees the batches
  // the uninterrupted run would have seen.
  // On a GPU the batches come in page-locked memory, so their copies to the device are asynchronous.
  data::Loader loader(train, {.batch_size = args.batch_size, .shuffle = true, .seed = args.seed,
                              .pin_memory = dev.is_cuda(), .num_replicas = group ? group->size() : 1, .rank = rank});

  std::vector<Tensor> params = net->parameters();
  std::unique_ptr<optim::Optimizer> optimizer;
  if (args.optimizer == "adamw")
    optimizer = std::make_unique<optim::AdamW>(params, optim::AdamWOptions{.lr = args.lr, .weight_decay = args.weight_decay});
  else
    optimizer = std::make_unique<optim::SGD>(
        params, optim::SGDOptions{.lr = args.lr, .momentum = 0.9, .weight_decay = args.weight_decay});
  optim::Optimizer& opt = *optimizer;
  // K-FAC preconditions the gradients between backward and the step (its factors go into the checkpoint)
  std::unique_ptr<optim::KFAC> kfac;
  KILN_CHECK(!(group && args.optimizer == "kfac"), "fashion_mnist: --optimizer kfac runs in one process (each rank's "
             "factors would come from its own batches, and the ranks' steps would differ)");
  if (args.optimizer == "kfac")
    kfac = std::make_unique<optim::KFAC>(*net, optim::KFACOptions{.damping = args.kfac_damping,
                                                                  .factor_update_steps = args.kfac_factor_steps,
                                                                  .inv_update_steps = args.kfac_inv_steps,
                                                                  .kl_clip = args.kfac_kl_clip});
  optim::CosineWithWarmup schedule(opt, /*warmup_steps=*/0, /*total_steps=*/args.epochs * loader.size());
  // Loss scaling only for f16 (its narrow exponent flushes small gradients to zero); disabled, scale()
  // returns the loss and step() just steps. bf16 has f32's exponent range and needs none.
  optim::GradScaler scaler({.enabled = amp_dtype == DType::f16});

  int64_t start_epoch = 0, step = 0;
  bool target_reached = false;  // a resumed run whose checkpoint already reached --target-accuracy trains no more
  if (args.resume) {
    if (!std::filesystem::exists(args.checkpoint)) {
      std::fprintf(stderr, "no checkpoint at %s yet: starting from scratch\n", args.checkpoint.c_str());
    } else {
      // Every checkpoint of this trainer holds the scaler's state; it is restored when it is in use.
      optim::LoadedComponents components{{"optimizer", &opt}, {"scheduler", &schedule}};
      if (scaler.is_enabled()) components["scaler"] = &scaler;
      if (kfac) components["kfac"] = kfac.get();
      optim::CheckpointInfo info = optim::load_checkpoint(args.checkpoint, *net, components);
      auto meta = [&](const char* key) -> const optim::MetadataValue& {
        auto found = info.metadata.find(key);
        KILN_CHECK(found != info.metadata.end(), "fashion_mnist: ", args.checkpoint, " has no '", key,
                   "' metadata: not written by this example?");
        return found->second;
      };
      const auto* model = std::get_if<std::string>(&meta("model"));
      const auto* epoch = std::get_if<int64_t>(&meta("epoch"));
      KILN_CHECK(model && epoch, "fashion_mnist: ", args.checkpoint, ": 'model' or 'epoch' metadata has the wrong type");
      KILN_CHECK(*model == args.model, "fashion_mnist: ", args.checkpoint, " holds a ", *model,
                 " model, but --model is ", args.model);
      start_epoch = *epoch;
      step = info.step;
      std::fprintf(stderr, "resumed from %s at epoch %lld (step %lld)\n", args.checkpoint.c_str(),
                   (long long)start_epoch, (long long)step);
      if (const auto found = info.metadata.find("test_accuracy"); args.target_accuracy > 0 && found != info.metadata.end())
        if (const auto* reached = std::get_if<double>(&found->second); reached && *reached >= args.target_accuracy) {
          target_reached = true;
          std::fprintf(stderr, "its test accuracy %.4f already reaches --target-accuracy %.4f: no more training\n",
                       *reached, args.target_accuracy);
        }
    }
  }
  loader.set_epoch(start_epoch);

  // the main rank logs every epoch (appending on --resume) and draws the curves at the end
  std::unique_ptr<observe::MetricsLogger> metrics;
  if (main_rank && args.run_dir != "none")
    metrics = std::make_unique<observe::MetricsLogger>(args.run_dir, observe::MetricsLoggerOptions{.append = args.resume});
  // the GPU's utilization, memory, power, temperature and clocks into the same log, on a thread (NVML)
  std::atomic<int64_t> current_epoch{start_epoch};
  const std::unique_ptr<observe::GpuMonitor> monitor =
      observe::monitor_training(metrics.get(), dev, args.gpu_monitor, [&current_epoch] { return current_epoch.load(); });
  // --trace: 10 steps from step 101, within one epoch (main rank)
  enum class TraceState { off, waiting, tracing, done };
  TraceState trace_state = !args.trace.empty() && main_rank ? TraceState::waiting : TraceState::off;
  int64_t trace_from = 0;
  auto save_trace = [&] {
    if (dev.is_cuda()) cuda::synchronize();
    const profiler::Trace trace = profiler::stop();
    observe::save_chrome_trace(trace, args.trace);
    std::fprintf(stderr, "profile of training steps %lld-%lld (%s):\n%s", (long long)trace_from + 1, (long long)step,
                 args.trace.c_str(), observe::profile_table(trace).c_str());
  };
  double accuracy = 0;
  int64_t epochs_run = start_epoch;  // less than --epochs when --target-accuracy ended the run early
  if (start_epoch >= args.epochs || target_reached) accuracy = evaluate(*net, test, dev, amp_dtype);
  for (int64_t epoch = start_epoch; epoch < args.epochs && !target_reached; ++epoch) {
    current_epoch.store(epoch + 1, std::memory_order_relaxed);  // logged as the epoch being trained
    observe::ProgressBar progress("epoch " + std::to_string(epoch + 1) + "/" + std::to_string(args.epochs),
                                  loader.size());
    const auto epoch_start = std::chrono::steady_clock::now();
    // The epoch's loss sum stays on the device; it is read only when the progress line is drawn.
    Tensor loss_sum = zeros({}, {.dtype = DType::f32, .device = dev});
    int64_t seen = 0, skipped = 0;
    for (auto it = loader.begin(); it != loader.end(); ++it) {
      if (trace_state == TraceState::waiting && step >= 100 && it.index() + 10 <= loader.size()) {
        if (dev.is_cuda()) cuda::synchronize();
        profiler::start();
        trace_state = TraceState::tracing, trace_from = step;
      }
      auto [x, y] = *it;
      Tensor loss;
      {
        // Forward and loss under autocast (convs and matmuls in bf16/f16; cross_entropy returns f32);
        // backward runs outside it, through the differentiable casts, to the f32 parameters.
        amp::Autocast autocast(dev, amp_dtype.value_or(DType::bf16), amp_dtype.has_value());
        loss = nn::functional::cross_entropy((*net)(x.to(dev)), y.to(dev));
      }
      opt.zero_grad();
      scaler.scale(loss).backward();
      if (args.clip > 0 || (kfac && scaler.is_enabled())) scaler.unscale_(opt);  // the true gradients
      if (args.clip > 0) optim::clip_grad_norm_async(params, args.clip);           // no wait for the GPU
      if (kfac) kfac->step(opt, &scaler);  // unscale → clip → precondition → step
      if (!scaler.step(opt)) ++skipped;  // f16: skipped when a gradient overflowed
      scaler.update();
      schedule.step();
      ++step;
      if (trace_state == TraceState::tracing && step == trace_from + 10) {
        save_trace();
        trace_state = TraceState::done;
      }
      {
        NoGradGuard no_grad;
        loss_sum = add(loss_sum, cast(loss.detach(), DType::f32));
      }
      seen += x.size(0);
      int64_t done = it.index() + 1;
      if (main_rank)
        progress.update(done, [&] {  // reading the loss waits for the device: only when a line is drawn
          const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch_start).count();
          char text[64];
          std::snprintf(text, sizeof(text), "loss %.4f %.0f ex/s", loss_sum.item<double>() / double(done),
                        secs > 0 ? double(seen) / secs : 0.0);
          return std::string(text);
        });
    }
    const double train_loss = loss_sum.item<double>() / double(loader.size());
    // A diverged run stops here rather than training on NaN: without a scaler no step is skipped, so a
    // non-finite loss has already reached the weights (with one, such steps were skipped and counted).
    KILN_CHECK(std::isfinite(train_loss) || scaler.is_enabled(), "fashion_mnist: epoch ", epoch + 1,
               " ended with a non-finite training loss (", train_loss, "): the run diverged (lr ", args.lr,
               "); lower --lr or set --clip");
    accuracy = evaluate(*net, test, dev, amp_dtype);  // every rank holds the same model: the same figure
    epochs_run = epoch + 1;
    if (metrics)
      metrics->log(epoch + 1, {{"train_loss", train_loss}, {"test_accuracy", accuracy}, {"lr", schedule.get_last_lr()[0]},
                               {"seconds", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()}});
    if (main_rank) {
      std::printf("epoch %lld: train loss %.4f, test accuracy %.4f, %.2f s", (long long)epoch + 1, train_loss, accuracy,
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      if (scaler.is_enabled())
        std::printf(", loss scale %g, skipped steps %lld", scaler.get_scale(), (long long)skipped);
      std::printf("\n");
      std::fflush(stdout);
    }
    if (!args.checkpoint.empty()) {
      const optim::Metadata meta{{"epoch", epoch + 1}, {"model", args.model}, {"seed", int64_t(args.seed)},
                                 {"amp", args.amp}, {"test_accuracy", accuracy}};
      optim::SavedComponents components{{"optimizer", &opt}, {"scheduler", &schedule}, {"scaler", &scaler}};
      if (kfac) components["kfac"] = kfac.get();
      if (group)  // rank 0 writes, the others wait; the file is the one a single process writes
        distributed::save_checkpoint(*group, args.checkpoint, *net, components, meta, step);
      else
        optim::save_checkpoint(args.checkpoint, *net, components, meta, step);
    }
    if (args.target_accuracy > 0 && accuracy >= args.target_accuracy) {
      if (main_rank)
        std::printf("target test accuracy %.4f reached after epoch %lld\n", args.target_accuracy, (long long)epoch + 1);
      break;
    }
  }
  if (trace_state == TraceState::waiting)
    std::fprintf(stderr, "--trace: the run ended at step %lld, before 10 steps from step 101 fit in an epoch: no trace\n",
                 (long long)step);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (metrics && !metrics->series("train_loss").empty()) {
    const std::filesystem::path dir(args.run_dir);
    const std::string what = "fashion_mnist " + args.model + " (" + args.optimizer + ")";
    observe::save_metrics_plot(*metrics, {"train_loss"}, (dir / "loss.png").string(),
                               {.title = what, .x_label = "epoch", .y_label = "training loss"});
    observe::save_metrics_plot(*metrics, {"test_accuracy"}, (dir / "accuracy.png").string(),
                               {.title = what, .x_label = "epoch", .y_label = "test accuracy"});
    std::fprintf(stderr, "metrics and curves: %s\n", args.run_dir.c_str());
  }
  if (main_rank)
    std::printf("RESULT test_accuracy=%.4f epochs=%lld seconds=%.1f world=%d parameters=%lld\n", accuracy,
                (long long)epochs_run, seconds, group ? group->size() : 1, (long long)num_params);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return kiln::examples::example_main(argc, argv, parse_args, usage, run); }
