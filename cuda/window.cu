// 2-D window kernels on the GPU, matching core/cpu/window.cpp: im2col / col2im (convolution as a
// GEMM), max / average pooling with their backward, and the per-channel bias add of conv2d.
//
// Geometry: output (oy, ox) with kernel tap (ky, kx) reads input row iy = oy*sh - ph + ky*dh and column
// ix = ox*sw - pw + kx*dw (zero outside the input). L = oh*ow, K = kh*kw.
//   im2col:  cols (N, C*K, L) [ (n*C + c)*K + k, l ] = x[n, c, iy, ix]          one thread per cols element
//   col2im:  x[n, c, iy, ix] += sum over (k, l) that read it of cols[...]      one thread per input pixel
//            (a gather, so no atomics: every pixel sums its taps in ascending k and rounds to the storage
//            dtype after each add, as the CPU does)
//   pool:    max: first maximum of the window in (ky, kx) order, NaN wins; index iy*W + ix into the plane
//            avg: window sum / (kh*kw), padding counted (count_include_pad)      one thread per output
//   pool backward: one thread per input pixel gathers the outputs whose window covers it (max: those whose
//            index is this pixel), in ascending output order: deterministic, no atomics.
//   bias:    out[n, o, l] += bias[o]                                             16-byte vectors when L allows
// Bytes: each kernel reads its input once (windows overlap in cache) and writes its output once: im2col
// writes K times the input; pool forward reads the input and writes out (+ i64 indices).
// Arithmetic in f32 for f32/f16/bf16 and in f64 for f64.
#include <algorithm>
#include <cmath>

#include <kiln/core/kernels/window.h>
#include <kiln/cuda/check.h>
#include <kiln/cuda/context.h>
#include <kiln/cuda/dtype.cuh>
#include <kiln/cuda/nvtx.h>
#include <kiln/cuda/window.h>

namespace kiln::cuda {

namespace {

constexpr int kThreads = 256;

template <class T>
__device__ __forceinline__ compute_t<T> load(const T* p, int64_t i) {
  return convert<compute_t<T>>(p[i]);
}

#define KILN_GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < (n); i += int64_t(gridDim.x) * blockDim.x)

template <class T>
__global__ void im2col_kernel(const T* __restrict__ x, T* __restrict__ cols, Window2d g, int64_t total) {
  int64_t L = g.oh * g.ow, K = g.kh * g.kw;
  KILN_GRID_STRIDE(i, total) {
    int64_t l = i % L, r = i / L;
    int64_t k = r % K, nc = r / K;
    int64_t oy = l / g.ow, ox = l % g.ow, ky = k / g.kw, kx = k % g.kw;
    int64_t iy = oy * g.sh - g.ph + ky * g.dh, ix = ox * g.sw - g.pw + kx * g.dw;
    bool inside = iy >= 0 && iy < g.h && ix >= 0 && ix < g.w;
    cols[i] = inside ? x[(nc * g.h + iy) * g.w + ix] : convert<T>(0.0f);
  }
}

// The output index o with o*s - p + t*d == i for some tap t in [0, taps): none when out of range.
__device__ __forceinline__ bool tap_to_out(int64_t i, int64_t t, int64_t s, int64_t p, int64_t d, int64_t n_out,
                                           int64_t* o) {
  int64_t q = i + p - t * d;
  if (q < 0 || q % s != 0) return false;
  *o = q / s;
  return *o < n_out;
}

template <class T>
__global__ void col2im_kernel(const T* __restrict__ cols, T* __restrict__ x, Window2d g, int64_t total) {
  using C = compute_t<T>;
  int64_t L = g.oh * g.ow, K = g.kh * g.kw;
  KILN_GRID_STRIDE(p, total) {
    int64_t ix = p % g.w, iy = (p / g.w) % g.h, nc = p / (g.w * g.h);
    T acc = x[p];
    for (int64_t ky = 0; ky < g.kh; ++ky) {
      int64_t oy;
      if (!tap_to_out(iy, ky, g.sh, g.ph, g.dh, g.oh, &oy)) continue;
      for (int64_t kx = 0; kx < g.kw; ++kx) {
        int64_t ox;
        if (!tap_to_out(ix, kx, g.sw, g.pw, g.dw, g.ow, &ox)) continue;
        C v = load(cols, (nc * K + ky * g.kw + kx) * L + oy * g.ow + ox);
        acc = convert<T>(convert<C>(acc) + v);  // round per add, like the CPU reference
      }
    }
    x[p] = acc;
  }
}

template <class T>
__global__ void pool_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t* __restrict__ idx, Window2d g,
                            int64_t total, bool is_max) {
  using C = compute_t<T>;
  C inv = C(1) / C(g.kh * g.kw);
  KILN_GRID_STRIDE(o, total) {
    int64_t ox = o % g.ow, oy = (o / g.ow) % g.oh, nc = o / (g.ow * g.oh);
    const T* plane = x + nc * g.h * g.w;
    if (is_max) {
      C best = C(-INFINITY);
      int64_t best_i = -1;
      for (int64_t ky = 0; ky < g.kh; ++ky) {
        int64_t iy = oy * g.sh - g.ph + ky * g.dh;
        if (iy < 0 || iy >= g.h) continue;
        for (int64_t kx = 0; kx < g.kw; ++kx) {
          int64_t ix = ox * g.sw - g.pw + kx * g.dw;
          if (ix < 0 || ix >= g.w) continue;
          C v = load(plane, iy * g.w + ix);
          bool nan = isnan(v);
          if (best_i < 0 || v > best || nan) {
            best = v;
            best_i = iy * g.w + ix;
            if (nan) break;  // ends this window row, as the CPU loop does
          }
        }
      }
      out[o] = convert<T>(best);
      idx[o] = best_i;
    } else {
      C s = 0;
      for (int64_t ky = 0; ky < g.kh; ++ky) {
        int64_t iy = oy * g.sh - g.ph + ky * g.dh;
        if (iy < 0 || iy >= g.h) continue;
        for (int64_t kx = 0; kx < g.kw; ++kx) {
          int64_t ix = ox * g.sw - g.pw + kx * g.dw;
          if (ix >= 0 && ix < g.w) s += load(plane, iy * g.w + ix);
        }
      }
      out[o] = convert<T>(s * inv);
    }
  }
}

// grad_in[p] = sum of grad_out over the outputs whose window covers p (max: whose index is p).
template <class T>
__global__ void pool_backward_kernel(const T* __restrict__ go, const int64_t* __restrict__ idx, T* __restrict__ gi,
                                     Window2d g, int64_t total, bool is_max) {
  using C = compute_t<T>;
  C inv = C(1) / C(g.kh * g.kw);
  int64_t L = g.oh * g.ow;
  KILN_GRID_STRIDE(p, total) {
    int64_t ix = p % g.w, iy = (p / g.w) % g.h, nc = p / (g.w * g.h);
    // outputs whose window rows span iy: oy*sh - ph <= iy <= oy*sh - ph + (kh-1)*dh
    int64_t qy = iy + g.ph - (g.kh - 1) * g.dh, qx = ix + g.pw - (g.kw - 1) * g.dw;
    int64_t oy0 = qy > 0 ? (qy + g.sh - 1) / g.sh : 0, ox0 = qx > 0 ? (qx + g.sw - 1) / g.sw : 0;
    int64_t oy1 = (iy + g.ph) / g.sh, ox1 = (ix + g.pw) / g.sw;
    oy1 = oy1 < g.oh - 1 ? oy1 : g.oh - 1;
    ox1 = ox1 < g.ow - 1 ? ox1 : g.ow - 1;
    int64_t self = iy * g.w + ix;
    C acc = 0;
    for (int64_t oy = oy0; oy <= oy1; ++oy) {
      int64_t ty = iy + g.ph - oy * g.sh;  // ky * dh for the tap that lands on iy
      if (!is_max && ty % g.dh != 0) continue;
      for (int64_t ox = ox0; ox <= ox1; ++ox) {
        int64_t o = nc * L + oy * g.ow + ox;
        if (is_max) {
          if (idx[o] == self) acc += load(go, o);
        } else if ((ix + g.pw - ox * g.sw) % g.dw == 0) {
          acc += load(go, o) * inv;
        }
      }
    }
    gi[p] = convert<T>(acc);
  }
}

// out[i] += bias[(i / L) % O]; VEC elements per thread (VEC divides L, so a vector stays in one plane).
template <class T, int VEC>
__global__ void channel_bias_kernel(T* __restrict__ out, const T* __restrict__ bias, int64_t L, int64_t O,
                                    int64_t n_vec) {
  using C = compute_t<T>;
  struct alignas(sizeof(T) * VEC) Pack {
    T v[VEC];
  };
  KILN_GRID_STRIDE(i, n_vec) {
    Pack pk = reinterpret_cast<Pack*>(out)[i];
    C b = load(bias, (i * VEC / L) % O);
#pragma unroll
    for (int j = 0; j < VEC; ++j) pk.v[j] = convert<T>(convert<C>(pk.v[j]) + b);
    reinterpret_cast<Pack*>(out)[i] = pk;
  }
}

void check_window(const char* op, const Tensor& a, const Tensor& b) {
  KILN_CHECK(a.device() == b.device() && a.dtype() == b.dtype() && a.is_contiguous() && b.is_contiguous(), op,
             ": expected contiguous tensors of one dtype on one device, got ", a.str(), " and ", b.str());
}

}  // namespace

void kernels::im2col(const Tensor& x, const Window2d& g, const Tensor& cols) {
  NvtxRange range("im2col");
  check_window("im2col", x, cols);
  DeviceGuard guard(x.device().index);
  int64_t total = cols.numel();
  if (total == 0) return;
  KILN_CUDA_DISPATCH_FLOATING(x.dtype(), "im2col", {
    using D = device_t<scalar_t>;
    im2col_kernel<D><<<blocks_for(total, kThreads), kThreads, 0, current_stream()>>>(
        static_cast<const D*>(x.raw_data()), static_cast<D*>(cols.raw_data()), g, total);
    KILN_LAUNCH_CHECK("im2col_kernel", "im2col");
  });
}

void kernels::col2im(const Tensor& cols, const Window2d& g, const Tensor& x) {
  NvtxRange range("col2im");
  check_window("col2im", cols, x);
  DeviceGuard guard(x.device().index);
  int64_t total = x.numel();
  if (total == 0 || cols.numel() == 0) return;
  KILN_CUDA_DISPATCH_FLOATING(x.dtype(), "col2im", {
    using D = device_t<scalar_t>;
    col2im_kernel<D><<<blocks_for(total, kThreads), kThreads, 0, current_stream()>>>(
        static_cast<const D*>(cols.raw_data()), static_cast<D*>(x.raw_data()), g, total);
    KILN_LAUNCH_CHECK("col2im_kernel", "col2im");
  });
}

namespace {

void pool_forward(const char* op, const Tensor& x, const Window2d& g, const Tensor& out, const Tensor* indices) {
  NvtxRange range(op);
  check_window(op, x, out);
  bool is_max = indices != nullptr;
  if (is_max)
    KILN_CHECK(indices->dtype() == DType::i64 && indices->is_contiguous() && indices->device() == out.device() &&
                   indices->numel() == out.numel(),
               op, ": indices must be contiguous i64 shaped like the output, got ", indices->str());
  DeviceGuard guard(x.device().index);
  int64_t total = out.numel();
  if (total == 0) return;
  int64_t* idx = is_max ? static_cast<int64_t*>(indices->raw_data()) : nullptr;
  KILN_CUDA_DISPATCH_FLOATING(x.dtype(), op, {
    using D = device_t<scalar_t>;
    pool_kernel<D><<<blocks_for(total, kThreads), kThreads, 0, current_stream()>>>(
        static_cast<const D*>(x.raw_data()), static_cast<D*>(out.raw_data()), idx, g, total, is_max);
    KILN_LAUNCH_CHECK("pool_kernel", op);
  });
}

void pool_backward(const char* op, const Tensor& grad_out, const Tensor* indices, const Window2d& g,
                   const Tensor& grad_in) {
  NvtxRange range(op);
  check_window(op, grad_out, grad_in);
  bool is_max = indices != nullptr;
  if (is_max)
    KILN_CHECK(indices->dtype() == DType::i64 && indices->is_contiguous() && indices->device() == grad_in.device() &&
                   indices->numel() == grad_out.numel(),
               op, ": indices must be contiguous i64 shaped like grad_out, got ", indices->str());
  DeviceGuard guard(grad_in.device().index);
  int64_t total = grad_in.numel();
  if (total == 0) return;
  const int64_t* idx = is_max ? static_cast<const int64_t*>(indices->raw_data()) : nullptr;
  KILN_CUDA_DISPATCH_FLOATING(grad_in.dtype(), op, {
    using D = device_t<scalar_t>;
    pool_backward_kernel<D><<<blocks_for(total, kThreads), kThreads, 0, current_stream()>>>(
        static_cast<const D*>(grad_out.raw_data()), idx, static_cast<D*>(grad_in.raw_data()), g, total, is_max);
    KILN_LAUNCH_CHECK("pool_backward_kernel", op);
  });
}

template <class D>
void launch_channel_bias(const Tensor& out, const Tensor& bias, int64_t L, int64_t O) {
  constexpr int kVec = 16 / sizeof(D);
  D* po = static_cast<D*>(out.raw_data());
  int64_t n = out.numel();
  bool vec = L % kVec == 0 && reinterpret_cast<uintptr_t>(po) % 16 == 0;
  if (vec) {
    channel_bias_kernel<D, kVec><<<blocks_for(n / kVec, kThreads), kThreads, 0, current_stream()>>>(
        po, static_cast<const D*>(bias.raw_data()), L, O, n / kVec);
  } else {
    channel_bias_kernel<D, 1><<<blocks_for(n, kThreads), kThreads, 0, current_stream()>>>(
        po, static_cast<const D*>(bias.raw_data()), L, O, n);
  }
  KILN_LAUNCH_CHECK("channel_bias_kernel", "conv2d");
}

}  // namespace

void kernels::max_pool2d(const Tensor& x, const Window2d& g, const Tensor& out, const Tensor& indices) {
  pool_forward("max_pool2d", x, g, out, &indices);
}
void kernels::max_pool2d_backward(const Tensor& grad_out, const Tensor& indices, const Window2d& g,
                                      const Tensor& grad_in) {
  pool_backward("max_pool2d_backward", grad_out, &indices, g, grad_in);
}
void kernels::avg_pool2d(const Tensor& x, const Window2d& g, const Tensor& out) {
  pool_forward("avg_pool2d", x, g, out, nullptr);
}
void kernels::avg_pool2d_backward(const Tensor& grad_out, const Window2d& g, const Tensor& grad_in) {
  pool_backward("avg_pool2d_backward", grad_out, nullptr, g, grad_in);
}

void add_channel_bias(const Tensor& out, const Tensor& bias) {
  check_window("conv2d bias", out, bias);
  DeviceGuard guard(out.device().index);
  int64_t O = out.size(1), L = out.numel() / std::max<int64_t>(out.size(0) * O, 1);
  KILN_CHECK(bias.numel() == O, "conv2d: bias ", bias.str(), " does not have ", O, " channels");
  if (out.numel() == 0) return;
  KILN_CUDA_DISPATCH_FLOATING(out.dtype(), "conv2d", launch_channel_bias<device_t<scalar_t>>(out, bias, L, O));
}

}  // namespace kiln::cuda
