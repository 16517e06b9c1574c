// 2-D convolution through cuDNN's convolution API (cudnnConvolutionForward / BackwardData /
// BackwardFilter) on NCHW tensors.
//
// Work: 2·N·O·C·kh·kw·oh·ow FLOPs per direction; bytes at least input + weight + output once each.
// Precision: f16/bf16 run on tensor cores (CUDNN_TENSOR_OP_MATH) with f32 accumulation; f32 uses
// CUDNN_FMA_MATH (true f32: CUDNN_DEFAULT_MATH would let cuDNN pick TF32 kernels on Ampere and later)
// unless cuda::set_allow_tf32(true); f64 computes in f64. The bias is added by a small kernel after the
// convolution (the output rounds once, then once more with the bias, as on the CPU).
//
// Algorithm choice costs milliseconds (benchmark mode runs every algorithm), so the choice is cached per
// (device, direction, dtype, math, mode, shapes, geometry): one Find or Get per shape per process, as in
// PyTorch with torch.backends.cudnn.benchmark. Workspaces come from the caching allocator.
#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include <kiln/core/kernels/conv.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/nvtx.h>
#include <kiln/cuda/runtime.h>
#include <kiln/cuda/window.h>

namespace kiln::cuda {

namespace {

std::atomic<bool>& benchmark_flag() {
  static std::atomic<bool> flag{false};
  return flag;
}

// Algorithms whose workspace exceeds this are skipped (and Find gets at most this much scratch).
constexpr size_t kMaxWorkspace = size_t(1) << 30;

cudnnDataType_t cudnn_type(DType t) {
  switch (t) {
    case DType::f32: return CUDNN_DATA_FLOAT;
    case DType::f64: return CUDNN_DATA_DOUBLE;
    case DType::f16: return CUDNN_DATA_HALF;
    case DType::bf16: return CUDNN_DATA_BFLOAT16;
    default: KILN_FAIL("conv2d: unsupported dtype ", dtype_name(t), " on CUDA (f32, f64, f16, bf16)");
  }
}

cudnnMathType_t requested_math(DType t) {
  switch (t) {
    case DType::f16:
    case DType::bf16: return CUDNN_TENSOR_OP_MATH;
    case DType::f32: return allow_tf32() ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH;
    default: return CUDNN_DEFAULT_MATH;
  }
}

int to_int(int64_t v, const char* what) {
  KILN_CHECK(v >= 0 && v <= INT_MAX, "conv2d: ", what, " = ", v, " does not fit cuDNN's 32-bit sizes");
  return int(v);
}

// The four descriptors of one convolution; created per call (host-only, microseconds).
struct ConvDescs {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t conv = nullptr;

  ConvDescs(const Window2d& g, int64_t O, DType dt) {
    cudnnDataType_t t = cudnn_type(dt);
    KILN_CUDNN_CHECK(cudnnCreateTensorDescriptor(&x));
    KILN_CUDNN_CHECK(cudnnCreateTensorDescriptor(&y));
    KILN_CUDNN_CHECK(cudnnCreateFilterDescriptor(&w));
    KILN_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(&conv));
    KILN_CUDNN_CHECK(cudnnSetTensor4dDescriptor(x, CUDNN_TENSOR_NCHW, t, to_int(g.n, "N"), to_int(g.c, "C"),
                                                to_int(g.h, "H"), to_int(g.w, "W")));
    KILN_CUDNN_CHECK(cudnnSetTensor4dDescriptor(y, CUDNN_TENSOR_NCHW, t, to_int(g.n, "N"), to_int(O, "C_out"),
                                                to_int(g.oh, "oh"), to_int(g.ow, "ow")));
    KILN_CUDNN_CHECK(cudnnSetFilter4dDescriptor(w, t, CUDNN_TENSOR_NCHW, to_int(O, "C_out"), to_int(g.c, "C"),
                                                to_int(g.kh, "kh"), to_int(g.kw, "kw")));
    KILN_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(
        conv, to_int(g.ph, "padding"), to_int(g.pw, "padding"), to_int(g.sh, "stride"), to_int(g.sw, "stride"),
        to_int(g.dh, "dilation"), to_int(g.dw, "dilation"), CUDNN_CROSS_CORRELATION,
        dt == DType::f64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT));
    KILN_CUDNN_CHECK(cudnnSetConvolutionMathType(conv, requested_math(dt)));
    int n = 0, c = 0, h = 0, ww = 0;
    KILN_CUDNN_CHECK(cudnnGetConvolution2dForwardOutputDim(conv, x, w, &n, &c, &h, &ww));
    KILN_CHECK(h == g.oh && ww == g.ow, "conv2d: cuDNN computes output ", h, "x", ww, ", expected ", g.oh, "x", g.ow);
  }
  ~ConvDescs() {
    cudnnDestroyConvolutionDescriptor(conv);
    cudnnDestroyFilterDescriptor(w);
    cudnnDestroyTensorDescriptor(y);
    cudnnDestroyTensorDescriptor(x);
  }
  ConvDescs(const ConvDescs&) = delete;
  ConvDescs& operator=(const ConvDescs&) = delete;
};

// Device scratch from the caching allocator, freed (to the stream's cache) at scope exit.
class Workspace {
 public:
  Workspace(size_t bytes, int device) : device_(device), bytes_(bytes) {
    if (bytes_) ptr_ = allocator(device_).allocate(bytes_, uintptr_t(current_stream()));
  }
  ~Workspace() {
    if (ptr_) allocator(device_).free(ptr_);
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  void* get() const { return ptr_; }
  size_t size() const { return bytes_; }

 private:
  int device_;
  size_t bytes_;
  void* ptr_ = nullptr;
};

enum class Direction : uint8_t { forward, backward_data, backward_filter };

struct AlgoKey {
  int device;
  Direction dir;
  DType dtype;
  cudnnMathType_t math;
  bool benchmark;
  int64_t n, c, h, w, o, kh, kw, sh, sw, ph, pw, dh, dw;
  auto operator<=>(const AlgoKey&) const = default;
};

struct AlgoChoice {
  int algo;
  cudnnMathType_t math;
  size_t workspace;
};

std::mutex& algo_mutex() {
  static std::mutex m;
  return m;
}
std::map<AlgoKey, AlgoChoice>& algo_cache() {
  static auto* cache = new std::map<AlgoKey, AlgoChoice>();  // never destroyed (static teardown)
  return *cache;
}

AlgoKey make_key(Direction dir, const Window2d& g, int64_t O, DType dt, int device) {
  return {device, dir, dt, requested_math(dt), benchmark_flag().load(), g.n, g.c, g.h, g.w, O,
          g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw};
}

// The first usable entry of cuDNN's ranking (fastest measured, or best predicted). With FMA math
// requested (exact f32), entries that would use tensor cores are skipped.
template <class Perf>
bool pick(const std::vector<Perf>& perf, int returned, cudnnMathType_t requested, bool strict, AlgoChoice* out) {
  for (int i = 0; i < returned; ++i) {
    const Perf& p = perf[size_t(i)];
    if (p.status != CUDNN_STATUS_SUCCESS || p.memory > kMaxWorkspace) continue;
    if (strict && requested == CUDNN_FMA_MATH && p.mathType != CUDNN_FMA_MATH) continue;
    *out = {int(p.algo), requested == CUDNN_FMA_MATH ? CUDNN_FMA_MATH : p.mathType, p.memory};
    return true;
  }
  return false;
}

// Looks up or chooses the algorithm for one direction. find(ws, ws_bytes, perf, count, &returned) runs
// cudnnFind*Ex; get(perf, count, &returned) runs cudnnGet*_v7; ws_size(algo, &bytes) asks the workspace
// size of an algorithm under the descriptor's current math type.
template <class Perf, class Find, class Get, class WsSize>
AlgoChoice choose(const AlgoKey& key, const ConvDescs& d, int max_count, Find find, Get get, WsSize ws_size,
                  const char* what) {
  {
    std::lock_guard<std::mutex> lock(algo_mutex());
    auto it = algo_cache().find(key);
    if (it != algo_cache().end()) return it->second;
  }
  max_count = std::max(max_count, 1);
  std::vector<Perf> perf(static_cast<size_t>(max_count));
  int returned = 0;
  if (key.benchmark) {
    // Scratch for the timing runs: the largest workspace any algorithm asks for, within the cap.
    size_t budget = 0;
    for (int a = 0; a < max_count; ++a) {
      size_t bytes = 0;
      if (ws_size(a, &bytes) == CUDNN_STATUS_SUCCESS && bytes <= kMaxWorkspace) budget = std::max(budget, bytes);
    }
    Workspace ws(budget, key.device);
    KILN_CUDNN_CHECK(find(ws.get(), ws.size(), perf.data(), max_count, &returned));
  } else {
    KILN_CUDNN_CHECK(get(perf.data(), max_count, &returned));
  }
  AlgoChoice choice{};
  bool ok = pick(perf, returned, key.math, true, &choice) || pick(perf, returned, key.math, false, &choice);
  KILN_CHECK(ok, "conv2d: cuDNN offers no ", what, " algorithm for input (", key.n, ", ", key.c, ", ", key.h, ", ",
             key.w, "), weight (", key.o, ", ", key.c, ", ", key.kh, ", ", key.kw, ") in ", dtype_name(key.dtype));
  // The workspace depends on the math type: ask again under the one that will run.
  KILN_CUDNN_CHECK(cudnnSetConvolutionMathType(d.conv, choice.math));
  size_t bytes = 0;
  KILN_CUDNN_CHECK(ws_size(choice.algo, &bytes));
  choice.workspace = std::max(choice.workspace, bytes);
  std::lock_guard<std::mutex> lock(algo_mutex());
  algo_cache().emplace(key, choice);
  return choice;
}

// alpha = 1, beta = 0 in the scaling type cuDNN expects: double for f64 data, float otherwise.
struct Scale {
  float f1 = 1.0f, f0 = 0.0f;
  double d1 = 1.0, d0 = 0.0;
  bool dbl;
  explicit Scale(DType t) : dbl(t == DType::f64) {}
  const void* one() const { return dbl ? static_cast<const void*>(&d1) : &f1; }
  const void* zero() const { return dbl ? static_cast<const void*>(&d0) : &f0; }
};

void zero(const Tensor& t) {
  KILN_CUDA_CHECK(cudaMemsetAsync(t.raw_data(), 0, size_t(t.numel()) * t.element_size(), current_stream()));
}

void check_conv_args(const char* op, std::initializer_list<const Tensor*> ts, DType dt, Device dev) {
  for (const Tensor* t : ts) {
    if (!t->defined()) continue;
    KILN_CHECK(t->dtype() == dt && t->device() == dev && t->is_contiguous(), op, ": expected contiguous ",
               dtype_name(dt), " tensors on ", dev.str(), ", got ", t->str());
  }
  (void)cudnn_type(dt);  // rejects dtypes cuDNN does not take
}

}  // namespace

void set_cudnn_benchmark(bool on) { benchmark_flag().store(on); }
bool cudnn_benchmark() { return benchmark_flag().load(); }
size_t conv_algorithm_cache_size() {
  std::lock_guard<std::mutex> lock(algo_mutex());
  return algo_cache().size();
}

void kernels::conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& bias, const Window2d& g,
                                 const Tensor& out) {
  NvtxRange range("conv2d_forward");
  check_conv_args("conv2d_forward", {&x, &w, &bias, &out}, out.dtype(), out.device());
  DeviceGuard guard(out.device().index);
  int64_t O = w.size(0);
  if (out.numel() == 0) return;
  if (x.numel() == 0 || w.numel() == 0) {  // C == 0: an empty sum
    zero(out);
  } else {
    ConvDescs d(g, O, out.dtype());
    cudnnHandle_t h = cudnn_handle();
    AlgoKey key = make_key(Direction::forward, g, O, out.dtype(), out.device().index);
    int max_count = 0;
    KILN_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithmMaxCount(h, &max_count));
    AlgoChoice c = choose<cudnnConvolutionFwdAlgoPerf_t>(
        key, d, max_count,
        [&](void* ws, size_t bytes, cudnnConvolutionFwdAlgoPerf_t* perf, int n, int* ret) {
          return cudnnFindConvolutionForwardAlgorithmEx(h, d.x, x.raw_data(), d.w, w.raw_data(), d.conv, d.y,
                                                        out.raw_data(), n, ret, perf, ws, bytes);
        },
        [&](cudnnConvolutionFwdAlgoPerf_t* perf, int n, int* ret) {
          return cudnnGetConvolutionForwardAlgorithm_v7(h, d.x, d.w, d.conv, d.y, n, ret, perf);
        },
        [&](int algo, size_t* bytes) {
          return cudnnGetConvolutionForwardWorkspaceSize(h, d.x, d.w, d.conv, d.y, cudnnConvolutionFwdAlgo_t(algo),
                                                         bytes);
        },
        "forward");
    KILN_CUDNN_CHECK(cudnnSetConvolutionMathType(d.conv, c.math));
    Workspace ws(c.workspace, out.device().index);
    Scale s(out.dtype());
    KILN_CUDNN_CHECK(cudnnConvolutionForward(h, s.one(), d.x, x.raw_data(), d.w, w.raw_data(), d.conv,
                                             cudnnConvolutionFwdAlgo_t(c.algo), ws.get(), ws.size(), s.zero(), d.y,
                                             out.raw_data()));
  }
  if (bias.defined()) add_channel_bias(out, bias);
}

void kernels::conv2d_backward_input(const Tensor& grad_out, const Tensor& w, const Window2d& g,
                                        const Tensor& grad_x) {
  NvtxRange range("conv2d_backward_input");
  check_conv_args("conv2d_backward_input", {&grad_out, &w, &grad_x}, grad_x.dtype(), grad_x.device());
  DeviceGuard guard(grad_x.device().index);
  int64_t O = w.size(0);
  if (grad_x.numel() == 0) return;
  if (grad_out.numel() == 0 || w.numel() == 0) return zero(grad_x);  // O == 0
  ConvDescs d(g, O, grad_x.dtype());
  cudnnHandle_t h = cudnn_handle();
  AlgoKey key = make_key(Direction::backward_data, g, O, grad_x.dtype(), grad_x.device().index);
  int max_count = 0;
  KILN_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithmMaxCount(h, &max_count));
  AlgoChoice c = choose<cudnnConvolutionBwdDataAlgoPerf_t>(
      key, d, max_count,
      [&](void* ws, size_t bytes, cudnnConvolutionBwdDataAlgoPerf_t* perf, int n, int* ret) {
        return cudnnFindConvolutionBackwardDataAlgorithmEx(h, d.w, w.raw_data(), d.y, grad_out.raw_data(), d.conv,
                                                           d.x, grad_x.raw_data(), n, ret, perf, ws, bytes);
      },
      [&](cudnnConvolutionBwdDataAlgoPerf_t* perf, int n, int* ret) {
        return cudnnGetConvolutionBackwardDataAlgorithm_v7(h, d.w, d.y, d.conv, d.x, n, ret, perf);
      },
      [&](int algo, size_t* bytes) {
        return cudnnGetConvolutionBackwardDataWorkspaceSize(h, d.w, d.y, d.conv, d.x,
                                                            cudnnConvolutionBwdDataAlgo_t(algo), bytes);
      },
      "backward-data");
  KILN_CUDNN_CHECK(cudnnSetConvolutionMathType(d.conv, c.math));
  Workspace ws(c.workspace, grad_x.device().index);
  Scale s(grad_x.dtype());
  KILN_CUDNN_CHECK(cudnnConvolutionBackwardData(h, s.one(), d.w, w.raw_data(), d.y, grad_out.raw_data(), d.conv,
                                                cudnnConvolutionBwdDataAlgo_t(c.algo), ws.get(), ws.size(), s.zero(),
                                                d.x, grad_x.raw_data()));
}

void kernels::conv2d_backward_weight(const Tensor& grad_out, const Tensor& x, const Window2d& g,
                                         const Tensor& grad_w) {
  NvtxRange range("conv2d_backward_weight");
  check_conv_args("conv2d_backward_weight", {&grad_out, &x, &grad_w}, grad_w.dtype(), grad_w.device());
  DeviceGuard guard(grad_w.device().index);
  int64_t O = grad_w.size(0);
  if (grad_w.numel() == 0) return;
  if (grad_out.numel() == 0 || x.numel() == 0) return zero(grad_w);  // N == 0
  ConvDescs d(g, O, grad_w.dtype());
  cudnnHandle_t h = cudnn_handle();
  AlgoKey key = make_key(Direction::backward_filter, g, O, grad_w.dtype(), grad_w.device().index);
  int max_count = 0;
  KILN_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(h, &max_count));
  AlgoChoice c = choose<cudnnConvolutionBwdFilterAlgoPerf_t>(
      key, d, max_count,
      [&](void* ws, size_t bytes, cudnnConvolutionBwdFilterAlgoPerf_t* perf, int n, int* ret) {
        return cudnnFindConvolutionBackwardFilterAlgorithmEx(h, d.x, x.raw_data(), d.y, grad_out.raw_data(), d.conv,
                                                             d.w, grad_w.raw_data(), n, ret, perf, ws, bytes);
      },
      [&](cudnnConvolutionBwdFilterAlgoPerf_t* perf, int n, int* ret) {
        return cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, d.x, d.y, d.conv, d.w, n, ret, perf);
      },
      [&](int algo, size_t* bytes) {
        return cudnnGetConvolutionBackwardFilterWorkspaceSize(h, d.x, d.y, d.conv, d.w,
                                                              cudnnConvolutionBwdFilterAlgo_t(algo), bytes);
      },
      "backward-filter");
  KILN_CUDNN_CHECK(cudnnSetConvolutionMathType(d.conv, c.math));
  Workspace ws(c.workspace, grad_w.device().index);
  Scale s(grad_w.dtype());
  KILN_CUDNN_CHECK(cudnnConvolutionBackwardFilter(h, s.one(), d.x, x.raw_data(), d.y, grad_out.raw_data(), d.conv,
                                                  cudnnConvolutionBwdFilterAlgo_t(c.algo), ws.get(), ws.size(),
                                                  s.zero(), d.w, grad_w.raw_data()));
}

}  // namespace kiln::cuda
