// 2-D window kernels on the CPU: im2col / col2im for convolution as a GEMM, and max / average pooling.
// Output position (oy, ox) with kernel tap (ky, kx) reads input row oy*sh - ph + ky*dh, col ox*sw - pw + kx*dw.
#include <cmath>
#include <vector>

#include <kiln/core/cpu/strided.h>
#include <kiln/core/kernels/window.h>

namespace kiln::cpu {

namespace {

template <class T>
void im2col_typed(const Tensor& x_t, const Window2d& g, const Tensor& cols_t) {
  const T* x = static_cast<const T*>(x_t.raw_data());
  T* cols = static_cast<T*>(cols_t.raw_data());
  int64_t L = g.oh * g.ow, K = g.kh * g.kw;
  parallel_for(g.n * g.c, K * L, [&](int64_t nc) {
    const T* plane = x + nc * g.h * g.w;
    T* out = cols + nc * K * L;  // rows (c, ky, kx) of sample n are contiguous: (n*C + c)*K + k
    for (int64_t ky = 0; ky < g.kh; ++ky)
      for (int64_t kx = 0; kx < g.kw; ++kx) {
        T* row = out + (ky * g.kw + kx) * L;
        for (int64_t oy = 0; oy < g.oh; ++oy) {
          int64_t iy = oy * g.sh - g.ph + ky * g.dh;
          for (int64_t ox = 0; ox < g.ow; ++ox) {
            int64_t ix = ox * g.sw - g.pw + kx * g.dw;
            bool inside = iy >= 0 && iy < g.h && ix >= 0 && ix < g.w;
            row[oy * g.ow + ox] = inside ? plane[iy * g.w + ix] : T(0.0f);
          }
        }
      }
  });
}

template <class T>
void col2im_typed(const Tensor& cols_t, const Window2d& g, const Tensor& x_t) {
  T* x = static_cast<T*>(x_t.raw_data());
  const T* cols = static_cast<const T*>(cols_t.raw_data());
  int64_t L = g.oh * g.ow, K = g.kh * g.kw;
  parallel_for(g.n * g.c, K * L, [&](int64_t nc) {
    T* plane = x + nc * g.h * g.w;
    const T* in = cols + nc * K * L;
    for (int64_t ky = 0; ky < g.kh; ++ky)
      for (int64_t kx = 0; kx < g.kw; ++kx) {
        const T* row = in + (ky * g.kw + kx) * L;
        for (int64_t oy = 0; oy < g.oh; ++oy) {
          int64_t iy = oy * g.sh - g.ph + ky * g.dh;
          if (iy < 0 || iy >= g.h) continue;
          for (int64_t ox = 0; ox < g.ow; ++ox) {
            int64_t ix = ox * g.sw - g.pw + kx * g.dw;
            if (ix < 0 || ix >= g.w) continue;
            T& v = plane[iy * g.w + ix];
            v = T(double(v) + double(row[oy * g.ow + ox]));
          }
        }
      }
  });
}

template <class T>
void max_pool_typed(const Tensor& x_t, const Window2d& g, const Tensor& out_t, const Tensor& idx_t) {
  const T* x = static_cast<const T*>(x_t.raw_data());
  T* out = static_cast<T*>(out_t.raw_data());
  int64_t* idx = static_cast<int64_t*>(idx_t.raw_data());
  parallel_for(g.n * g.c, g.oh * g.ow * g.kh * g.kw, [&](int64_t nc) {
    const T* plane = x + nc * g.h * g.w;
    for (int64_t oy = 0; oy < g.oh; ++oy)
      for (int64_t ox = 0; ox < g.ow; ++ox) {
        double best = -INFINITY;
        int64_t best_i = -1;
        for (int64_t ky = 0; ky < g.kh; ++ky) {
          int64_t iy = oy * g.sh - g.ph + ky * g.dh;
          if (iy < 0 || iy >= g.h) continue;
          for (int64_t kx = 0; kx < g.kw; ++kx) {
            int64_t ix = ox * g.sw - g.pw + kx * g.dw;
            if (ix < 0 || ix >= g.w) continue;
            double v = double(plane[iy * g.w + ix]);
            if (best_i < 0 || v > best || std::isnan(v)) {
              best = v;
              best_i = iy * g.w + ix;
              if (std::isnan(v)) break;
            }
          }
        }
        int64_t o = nc * g.oh * g.ow + oy * g.ow + ox;
        out[o] = T(best);
        idx[o] = best_i;
      }
  });
}

template <class T>
void max_pool_backward_typed(const Tensor& go_t, const Tensor& idx_t, const Window2d& g, const Tensor& gi_t) {
  const T* go = static_cast<const T*>(go_t.raw_data());
  const int64_t* idx = static_cast<const int64_t*>(idx_t.raw_data());
  T* gi = static_cast<T*>(gi_t.raw_data());
  parallel_for(g.n * g.c, g.oh * g.ow, [&](int64_t nc) {
    T* plane = gi + nc * g.h * g.w;
    for (int64_t i = 0; i < g.h * g.w; ++i) plane[i] = T(0.0f);
    std::vector<double> acc(size_t(g.h * g.w), 0.0);
    for (int64_t o = 0; o < g.oh * g.ow; ++o) {
      int64_t k = nc * g.oh * g.ow + o;
      if (idx[k] >= 0) acc[size_t(idx[k])] += double(go[k]);
    }
    for (int64_t i = 0; i < g.h * g.w; ++i) plane[i] = T(acc[size_t(i)]);
  });
}

// Average pooling divides by the full window size, padding included (PyTorch's count_include_pad).
template <class T>
void avg_pool_typed(const Tensor& x_t, const Window2d& g, const Tensor& out_t) {
  const T* x = static_cast<const T*>(x_t.raw_data());
  T* out = static_cast<T*>(out_t.raw_data());
  double inv = 1.0 / double(g.kh * g.kw);
  parallel_for(g.n * g.c, g.oh * g.ow * g.kh * g.kw, [&](int64_t nc) {
    const T* plane = x + nc * g.h * g.w;
    for (int64_t oy = 0; oy < g.oh; ++oy)
      for (int64_t ox = 0; ox < g.ow; ++ox) {
        double s = 0;
        for (int64_t ky = 0; ky < g.kh; ++ky) {
          int64_t iy = oy * g.sh - g.ph + ky * g.dh;
          if (iy < 0 || iy >= g.h) continue;
          for (int64_t kx = 0; kx < g.kw; ++kx) {
            int64_t ix = ox * g.sw - g.pw + kx * g.dw;
            if (ix >= 0 && ix < g.w) s += double(plane[iy * g.w + ix]);
          }
        }
        out[nc * g.oh * g.ow + oy * g.ow + ox] = T(s * inv);
      }
  });
}

template <class T>
void avg_pool_backward_typed(const Tensor& go_t, const Window2d& g, const Tensor& gi_t) {
  const T* go = static_cast<const T*>(go_t.raw_data());
  T* gi = static_cast<T*>(gi_t.raw_data());
  double inv = 1.0 / double(g.kh * g.kw);
  parallel_for(g.n * g.c, g.oh * g.ow * g.kh * g.kw, [&](int64_t nc) {
    std::vector<double> acc(size_t(g.h * g.w), 0.0);
    for (int64_t oy = 0; oy < g.oh; ++oy)
      for (int64_t ox = 0; ox < g.ow; ++ox) {
        double v = double(go[nc * g.oh * g.ow + oy * g.ow + ox]) * inv;
        for (int64_t ky = 0; ky < g.kh; ++ky) {
          int64_t iy = oy * g.sh - g.ph + ky * g.dh;
          if (iy < 0 || iy >= g.h) continue;
          for (int64_t kx = 0; kx < g.kw; ++kx) {
            int64_t ix = ox * g.sw - g.pw + kx * g.dw;
            if (ix >= 0 && ix < g.w) acc[size_t(iy * g.w + ix)] += v;
          }
        }
      }
    T* plane = gi + nc * g.h * g.w;
    for (int64_t i = 0; i < g.h * g.w; ++i) plane[i] = T(acc[size_t(i)]);
  });
}

}  // namespace

void kernels::im2col(const Tensor& x, const Window2d& g, const Tensor& cols) {
  KILN_DISPATCH_FLOATING(x.dtype(), "im2col", im2col_typed<scalar_t>(x, g, cols));
}
void kernels::col2im(const Tensor& cols, const Window2d& g, const Tensor& x) {
  KILN_DISPATCH_FLOATING(x.dtype(), "col2im", col2im_typed<scalar_t>(cols, g, x));
}
void kernels::max_pool2d(const Tensor& x, const Window2d& g, const Tensor& out, const Tensor& indices) {
  KILN_DISPATCH_FLOATING(x.dtype(), "max_pool2d", max_pool_typed<scalar_t>(x, g, out, indices));
}
void kernels::max_pool2d_backward(const Tensor& grad_out, const Tensor& indices, const Window2d& g,
                                     const Tensor& grad_in) {
  KILN_DISPATCH_FLOATING(grad_in.dtype(), "max_pool2d_backward",
                         max_pool_backward_typed<scalar_t>(grad_out, indices, g, grad_in));
}
void kernels::avg_pool2d(const Tensor& x, const Window2d& g, const Tensor& out) {
  KILN_DISPATCH_FLOATING(x.dtype(), "avg_pool2d", avg_pool_typed<scalar_t>(x, g, out));
}
void kernels::avg_pool2d_backward(const Tensor& grad_out, const Window2d& g, const Tensor& grad_in) {
  KILN_DISPATCH_FLOATING(grad_in.dtype(), "avg_pool2d_backward", avg_pool_backward_typed<scalar_t>(grad_out, g, grad_in));
}

}  // namespace kiln::cpu
