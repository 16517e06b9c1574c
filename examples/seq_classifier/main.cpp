// Fashion-MNIST read as sequences of rows: a small transformer over each image's rows, with the blank
// rows above and below the item trimmed away, so the sequences have different lengths (4 to 28 rows:
// sandals and sneakers are short, trousers and dresses fill the frame). Each batch is padded to its longest
// sequence (data::pad_sequence) and attention takes a key padding mask (data::padding_mask), so a padded
// row never reaches a real one; an image's class comes from the mean of its real rows' features.
//
//   seq_classifier                              # CPU, 5 epochs
//   seq_classifier --device cuda --amp bf16     # GPU, bf16 autocast (flash attention with the mask)
//
// The model: each row (28 pixels) projected to the model width -> blocks of [RMSNorm -> self-attention with
// rotary position embeddings (nn::RotaryEmbedding on q and k) and the padding mask -> residual; RMSNorm ->
// SwiGLU MLP -> residual] -> RMSNorm -> mean over the real rows -> linear. AdamW, a cosine schedule with
// warmup, gradient clipping. The baseline, trained alike on the same images (all 784 pixels, untrimmed):
// softmax regression, one linear layer.
//
// stdout: one line per epoch, then
//   RESULT test_accuracy=0.xxxx baseline_accuracy=0.xxxx epochs=N seconds=S
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include <kiln/kiln.h>

#include "../common/cli.h"

using namespace kiln;
namespace F = kiln::nn::functional;

namespace {

// ------------------------------------------------------------------------------------------------ data

// The rows of every image that hold the item: [first, first + length), found on the raw pixels (a row is
// blank when all its pixels are 0).
struct RowRange {
  int64_t first, length;
};
std::vector<RowRange> item_rows(const data::FashionMNIST& raw) {
  std::vector<RowRange> ranges;
  const int64_t R = raw.rows(), C = raw.cols(), chunk = 10000;
  for (int64_t start = 0; start < raw.size(); start += chunk) {
    std::vector<int64_t> idx(size_t(std::min(chunk, raw.size() - start)));
    for (size_t i = 0; i < idx.size(); ++i) idx[i] = start + int64_t(i);
    const std::vector<float> px = raw.get_batch(idx).x.contiguous().to_vector<float>();
    for (size_t i = 0; i < idx.size(); ++i) {
      int64_t first = R, last = -1;
      for (int64_t r = 0; r < R; ++r) {
        const float* row = px.data() + i * size_t(R * C) + size_t(r * C);
        if (*std::max_element(row, row + C) > 0.f) first = std::min(first, r), last = r;
      }
      if (last < 0) first = 0, last = 0;  // a blank image: one row
      ranges.push_back({first, last - first + 1});
    }
  }
  return ranges;
}

// A batch of images as padded row sequences: x (B, T, 28) normalized pixels, T the longest item in the
// batch; padding (B, T) bool, true at the rows past each item; y (B) the classes.
struct RowBatch {
  Tensor x, padding, y, images;  // images: (B, 784), untrimmed, for the baseline
};
RowBatch make_batch(const data::FashionMNIST& set, const std::vector<RowRange>& ranges,
                    const std::vector<int64_t>& indices) {
  const data::Batch b = set.get_batch(indices);  // (B, 1, 28, 28) normalized
  std::vector<Tensor> rows;
  std::vector<int64_t> lengths;
  for (size_t i = 0; i < indices.size(); ++i) {
    const RowRange& r = ranges[size_t(indices[i])];
    rows.push_back(b.x.select(0, int64_t(i)).select(0, 0).narrow(0, r.first, r.length));
    lengths.push_back(r.length);
  }
  Tensor x = data::pad_sequence(rows);
  return {x, data::padding_mask(lengths, x.size(1)), b.y, b.x.flatten(1)};
}

// ---------------------------------------------------------------------------------------------- model

// Self-attention with rotary position embeddings on q and k; keep (B, 1, 1, T) bool is true at the real
// rows (scaled_dot_product_attention's convention), so padded keys get no weight.
struct SelfAttention : nn::Module {
  int64_t dim, heads;
  double dropout;
  nn::Linear qkv, proj;
  nn::RotaryEmbedding rope;
  SelfAttention(int64_t dim_, int64_t heads_, double dropout_)
      : dim(dim_), heads(heads_), dropout(dropout_), qkv(dim_, 3 * dim_, {.bias = false}),
        proj(dim_, dim_, {.bias = false}), rope(dim_ / heads_, {.max_seq_len = 128}) {
    register_module("qkv", qkv);
    register_module("proj", proj);
    register_module("rope", rope);
  }
  Tensor forward_args(const std::vector<Tensor>& in) override {
    const Tensor &x = in.at(0), &keep = in.at(1);
    const int64_t B = x.size(0), T = x.size(1), D = dim / heads;
    Tensor h = qkv(x).view({B, T, 3, heads, D});
    Tensor q = rope(h.select(2, 0).transpose(1, 2)), k = rope(h.select(2, 1).transpose(1, 2));
    Tensor v = h.select(2, 2).transpose(1, 2);
    Tensor a = F::scaled_dot_product_attention(q, k, v, keep, false, std::nullopt, dropout, is_training());
    return proj(a.transpose(1, 2).reshape({B, T, dim}));
  }
};

// LLaMA's MLP: down(silu(x W_gate) ⊙ x W_up), the two up-projections as one layer.
struct SwiGLU : nn::Module {
  nn::Linear up, down;
  SwiGLU(int64_t dim, int64_t hidden) : up(dim, 2 * hidden, {.bias = false}), down(hidden, dim, {.bias = false}) {
    register_module("up", up);
    register_module("down", down);
  }
  Tensor forward(const Tensor& x) override { return down(F::swiglu(up(x))); }
};

struct Block : nn::Module {
  nn::RMSNorm norm1, norm2;
  SelfAttention attn;
  SwiGLU mlp;
  nn::Dropout drop;
  Block(int64_t dim, int64_t heads, int64_t hidden, double dropout)
      : norm1(dim), norm2(dim), attn(dim, heads, dropout), mlp(dim, hidden), drop(dropout) {
    register_module("norm1", norm1);
    register_module("attn", attn);
    register_module("norm2", norm2);
    register_module("mlp", mlp);
    register_module("drop", drop);
  }
  // block(x, keep): two inputs, through Module::operator() and its hooks
  Tensor forward_args(const std::vector<Tensor>& in) override {
    Tensor x = in.at(0);
    x = add(x, drop(attn(norm1(x), in.at(1))));
    return add(x, drop(mlp(norm2(x))));
  }
};

struct RowClassifier : nn::Module {
  nn::Linear in_proj;
  nn::ModuleList blocks;
  nn::RMSNorm norm;
  nn::Linear head;
  RowClassifier(int64_t row_width, int64_t dim, int64_t heads, int64_t layers, int64_t hidden, double dropout,
                int64_t classes)
      : in_proj(row_width, dim), norm(dim), head(dim, classes) {
    register_module("in_proj", in_proj);
    register_module("blocks", blocks);
    for (int64_t i = 0; i < layers; ++i) blocks.emplace_back<Block>(dim, heads, hidden, dropout);
    register_module("norm", norm);
    register_module("head", head);
  }
  // rows (B, T, 28), padding (B, T) bool (true: not a row of the image) -> logits (B, classes)
  Tensor forward_args(const std::vector<Tensor>& in) override {
    const Tensor &rows = in.at(0), &padding = in.at(1);
    const int64_t B = rows.size(0), T = rows.size(1);
    const Tensor real = eq(padding, full({}, 0.0, {.dtype = DType::boolean, .device = padding.device()}));
    const Tensor keep = real.view({B, 1, 1, T});
    Tensor x = in_proj(rows);
    for (size_t i = 0; i < blocks.size(); ++i) x = blocks[i](x, keep);
    x = norm(x);
    // the mean over the image's real rows
    const Tensor w = cast(real, x.dtype()).unsqueeze(2);
    return head(div(sum(mul(x, w), {1}), sum(w, {1})));
  }
};

// ------------------------------------------------------------------------------------------- training

struct Args {
  std::string data = "/usr/share/datasets/fashion-mnist";
  int64_t epochs = 5, batch_size = 128, dim = 64, heads = 1, layers = 2, hidden = 128;
  double lr = 2e-3, weight_decay = 0.05, dropout = 0.1, clip = 1.0;
  std::string device = "cpu", amp = "none";
  uint64_t seed = 0;
  bool help = false;
};

void usage(std::ostream& os) {
  os << "usage: seq_classifier [--data DIR] [--epochs N] [--batch-size B] [--lr LR] [--weight-decay WD]\n"
        "                      [--dim E] [--heads H] [--layers L] [--hidden N] [--dropout P] [--clip MAX_NORM]\n"
        "                      [--device cpu|cuda[:i]] [--amp none|bf16] [--seed S]\n"
        "  --data is the folder of Fashion-MNIST's idx files (default /usr/share/datasets/fashion-mnist)\n";
}

Args parse_args(int argc, char** argv) {
  Args a;
  examples::ArgReader r("seq_classifier", argc, argv);
  while (r.next()) {
    const std::string& f = r.flag();
    if (f == "--data") a.data = r.value();
    else if (f == "--epochs") a.epochs = r.i64();
    else if (f == "--batch-size") a.batch_size = r.i64();
    else if (f == "--lr") a.lr = r.f64();
    else if (f == "--weight-decay") a.weight_decay = r.f64();
    else if (f == "--dim") a.dim = r.i64();
    else if (f == "--heads") a.heads = r.i64();
    else if (f == "--layers") a.layers = r.i64();
    else if (f == "--hidden") a.hidden = r.i64();
    else if (f == "--dropout") a.dropout = r.f64();
    else if (f == "--clip") a.clip = r.f64();
    else if (f == "--device") a.device = r.value();
    else if (f == "--amp") a.amp = r.value();
    else if (f == "--seed") a.seed = uint64_t(r.i64());
    else if (f == "--help" || f == "-h") a.help = true;
    else r.unknown();
  }
  KILN_CHECK(a.epochs >= 1 && a.batch_size >= 1 && a.layers >= 1,
             "seq_classifier: --epochs, --batch-size and --layers must be at least 1");
  KILN_CHECK(a.dim > 0 && a.heads > 0 && a.dim % a.heads == 0 && (a.dim / a.heads) % 2 == 0,
             "seq_classifier: --dim must split into --heads heads of an even width, got ", a.dim, " and ", a.heads);
  KILN_CHECK(a.lr > 0, "seq_classifier: --lr must be positive");
  KILN_CHECK(a.amp == "none" || a.amp == "bf16", "seq_classifier: --amp must be none or bf16, got '", a.amp, "'");
  return a;
}

// The batches of one epoch: a permutation of the examples (seeded by epoch), or the examples in order.
std::vector<std::vector<int64_t>> batches(int64_t n, int64_t batch_size, std::optional<uint64_t> seed) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  if (seed) {
    Generator gen(*seed);
    order = randperm(n, &gen).to_vector<int64_t>();
  } else {
    for (int64_t i = 0; i < n; ++i) order[size_t(i)] = i;
  }
  std::vector<std::vector<int64_t>> out;
  for (int64_t s = 0; s < n; s += batch_size)
    out.emplace_back(order.begin() + s, order.begin() + std::min(n, s + batch_size));
  return out;
}

// Test accuracy of the model and of the baseline.
std::pair<double, double> evaluate(RowClassifier& net, nn::Linear& baseline, const data::FashionMNIST& test,
                                   const std::vector<RowRange>& ranges, Device dev, bool amp) {
  NoGradGuard no_grad;
  amp::Autocast autocast(dev, DType::bf16, amp);
  net.eval();
  int64_t hit = 0, hit_baseline = 0;
  for (const auto& idx : batches(test.size(), 1000, std::nullopt)) {
    const RowBatch b = make_batch(test, ranges, idx);
    const auto y = b.y.to_vector<int64_t>();
    const auto p = net(b.x.to(dev), b.padding.to(dev)).argmax(1).cpu().to_vector<int64_t>();
    const auto q = baseline(b.images.to(dev)).argmax(1).cpu().to_vector<int64_t>();
    for (size_t i = 0; i < y.size(); ++i) hit += p[i] == y[i], hit_baseline += q[i] == y[i];
  }
  net.train();
  return {double(hit) / double(test.size()), double(hit_baseline) / double(test.size())};
}

int run(const Args& args) {
  const auto t0 = std::chrono::steady_clock::now();
  const Device dev = Device::parse(args.device);
  KILN_CHECK(!dev.is_cuda() || cuda::is_available(), "seq_classifier: --device ", args.device,
             ": no CUDA device is available (or this build has no CUDA backend); use --device cpu");
  const bool amp = args.amp == "bf16";
  const data::FashionMNIST train(args.data, data::Split::Train, {.normalize = true});
  const data::FashionMNIST test(args.data, data::Split::Test, {.normalize = true});
  const std::vector<RowRange> train_rows = item_rows(data::FashionMNIST(args.data, data::Split::Train));
  const std::vector<RowRange> test_rows = item_rows(data::FashionMNIST(args.data, data::Split::Test));
  int64_t total_rows = 0;
  for (const RowRange& r : train_rows) total_rows += r.length;
  std::printf("%lld training images, %lld test images; %.1f rows an image on average after trimming\n",
              (long long)train.size(), (long long)test.size(), double(total_rows) / double(train.size()));

  manual_seed(args.seed);
  RowClassifier net(train.cols(), args.dim, args.heads, args.layers, args.hidden, args.dropout,
                    data::FashionMNIST::kClasses);
  nn::Linear baseline(train.rows() * train.cols(), data::FashionMNIST::kClasses);
  net.to(dev);
  baseline.to(dev);
  std::vector<Tensor> params = net.parameters();
  optim::AdamW opt(params, {.lr = args.lr, .weight_decay = args.weight_decay});
  optim::AdamW baseline_opt(baseline.parameters(), {.lr = 1e-3, .weight_decay = 0.0});
  const int64_t steps_per_epoch = (train.size() + args.batch_size - 1) / args.batch_size;
  const int64_t total_steps = args.epochs * steps_per_epoch;
  optim::CosineWithWarmup schedule(opt, /*warmup_steps=*/total_steps / 20, total_steps);
  optim::CosineWithWarmup baseline_schedule(baseline_opt, 0, total_steps);

  double accuracy = 0, baseline_accuracy = 0;
  for (int64_t epoch = 0; epoch < args.epochs; ++epoch) {
    Tensor loss_sum = zeros({}, {.dtype = DType::f32, .device = dev});
    for (const auto& idx : batches(train.size(), args.batch_size, args.seed * 1000 + uint64_t(epoch))) {
      const RowBatch b = make_batch(train, train_rows, idx);
      const Tensor y = b.y.to(dev);
      Tensor loss, baseline_loss;
      {
        amp::Autocast autocast(dev, DType::bf16, amp);
        loss = F::cross_entropy(net(b.x.to(dev), b.padding.to(dev)), y);
        baseline_loss = F::cross_entropy(baseline(b.images.to(dev)), y);
      }
      opt.zero_grad();
      loss.backward();
      if (args.clip > 0) optim::clip_grad_norm_async(params, args.clip);
      opt.step();
      schedule.step();
      baseline_opt.zero_grad();
      baseline_loss.backward();
      baseline_opt.step();
      baseline_schedule.step();
      NoGradGuard no_grad;
      loss_sum = add(loss_sum, cast(loss.detach(), DType::f32));
    }
    const double train_loss = loss_sum.item<double>() / double(steps_per_epoch);
    KILN_CHECK(std::isfinite(train_loss), "seq_classifier: epoch ", epoch + 1, " ended with a non-finite loss (",
               train_loss, "): lower --lr");
    std::tie(accuracy, baseline_accuracy) = evaluate(net, baseline, test, test_rows, dev, amp);
    std::printf("epoch %lld: train loss %.4f, test accuracy %.4f (baseline %.4f)\n", (long long)epoch + 1,
                train_loss, accuracy, baseline_accuracy);
    std::fflush(stdout);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("RESULT test_accuracy=%.4f baseline_accuracy=%.4f epochs=%lld seconds=%.1f\n", accuracy,
              baseline_accuracy, (long long)args.epochs, seconds);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return examples::example_main(argc, argv, parse_args, usage, run); }
