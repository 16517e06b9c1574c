// The Kiln side of the PyTorch logits round trip (tests/python/test_gpt_logits.py): a small nn::GPT made from
// a seed, its checkpoint, a batch of tokens and targets, the gradients of the mean cross-entropy (f32), and
// the logits Kiln computes in f32 and, on a GPU, under bf16 autocast, written as raw little-endian arrays
// beside the checkpoint. The Python test loads the
// checkpoint into PyTorch (or numpy where PyTorch is absent), computes the same logits and compares.
// Usage: kiln_gpt_logits OUT_DIR [cpu|cuda]   (OUT_DIR/gpt.h5, tokens.i64, logits_f32.f32, logits_bf16.f32)
// Exit status 77 (a skip) for cuda on a machine without a GPU.
#include <cstdio>
#include <exception>
#include <fstream>
#include <string>

#include <kiln/core/autocast.h>
#include <kiln/autograd/grad_mode.h>
#include <kiln/core/ops.h>
#include <kiln/core/random.h>
#include <kiln/cuda/runtime.h>
#include <kiln/nn/gpt.h>
#include <kiln/optim/checkpoint.h>

using namespace kiln;

namespace {

void write_raw(const std::string& path, const Tensor& t) {
  const Tensor c = t.cpu().contiguous();
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(c.raw_data()), std::streamsize(c.numel() * int64_t(element_size(c.dtype()))));
  KILN_CHECK(f.good(), "kiln_gpt_logits: cannot write ", path);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    KILN_CHECK(argc >= 2, "usage: kiln_gpt_logits OUT_DIR [cpu|cuda]");
    const std::string dir = argv[1];
    const Device dev = Device::parse(argc > 2 ? argv[2] : "cpu");
    if (dev.is_cuda() && cuda::device_count() == 0) {  // ctest's SKIP_RETURN_CODE: no GPU on this machine
      std::printf("SKIP: no CUDA device\n");
      return 77;
    }
    manual_seed(7);
    // GPT-2's architecture at a small size: 2 blocks, 4 heads of 16, a 96-token vocabulary, 32 positions
    nn::GPT model({.vocab_size = 96, .block_size = 32, .n_layer = 2, .n_head = 4, .n_embd = 64, .dropout = 0.0,
                   .bias = true, .device = dev});
    model.eval();
    optim::save_checkpoint(dir + "/gpt.h5", model, nullptr);
    const Tensor tokens = randint(0, 96, {3, 32}, {.dtype = DType::i64});
    const Tensor targets = randint(0, 96, {3, 32}, {.dtype = DType::i64});
    write_raw(dir + "/tokens.i64", tokens);
    write_raw(dir + "/targets.i64", targets);
    // the gradients of the mean cross-entropy, in f32, one raw file a parameter (grad.<name>.f32)
    model.loss(tokens.to(dev), targets.to(dev)).backward();
    for (const auto& [name, p] : model.named_parameters()) write_raw(dir + "/grad." + name + ".f32", p.grad().to(DType::f32));
    NoGradGuard no_grad;
    write_raw(dir + "/logits_f32.f32", model(tokens.to(dev)).to(DType::f32));
    if (dev.is_cuda()) {
      amp::Autocast autocast(dev, DType::bf16);
      write_raw(dir + "/logits_bf16.f32", model(tokens.to(dev)).to(DType::f32));
    }
    std::printf("wrote %s: GPT 2x4x64, vocabulary 96, tokens (3, 32), logits on %s\n", dir.c_str(), dev.str().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
