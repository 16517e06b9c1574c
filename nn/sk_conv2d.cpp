#include <kiln/nn/sk_conv2d.h>

#include <cmath>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/error.h>
#include <kiln/core/ops.h>
#include <kiln/nn/conv2d.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/init.h>
#include <kiln/nn/sketch_parts.h>

namespace kiln::nn {

SKConv2d::SKConv2d(int64_t in_channels, int64_t out_channels, ExpandingArray<2> kernel_size,
                   const SKConv2dOptions& options)
    : in_channels_(in_channels), out_channels_(out_channels), num_terms_(options.num_terms),
      low_rank_(options.low_rank), kernel_size_(kernel_size), stride_(options.stride), padding_(options.padding),
      dilation_(options.dilation) {
  KILN_CHECK(is_floating(options.dtype), "SKConv2d: parameters need a floating dtype, got ", dtype_name(options.dtype));
  init(options, Tensor(), Tensor(), options.dtype, options.device);
}

SKConv2d::SKConv2d(const Conv2d& dense, const SKConv2dOptions& options)
    : in_channels_(dense.in_channels()), out_channels_(dense.out_channels()), num_terms_(options.num_terms),
      low_rank_(options.low_rank), kernel_size_(dense.kernel_size()), stride_(dense.options().stride),
      padding_(dense.options().padding), dilation_(dense.options().dilation) {
  KILN_CHECK(dense.weight.defined(), "SKConv2d: the dense layer ", dense.repr(), " has no weight (already sketched?)");
  init(options, dense.weight, dense.bias, dense.weight.dtype(), dense.weight.device());
}

void SKConv2d::init(const SKConv2dOptions& options, const Tensor& dense_w, const Tensor& dense_b, DType dtype,
                    Device device) {
  const int64_t cin = in_channels_, cout = out_channels_, L = num_terms_, k = low_rank_;
  KILN_CHECK(cin > 0 && cout > 0 && L > 0 && k > 0, "SKConv2d: in_channels, out_channels, num_terms and low_rank must "
             "be positive, got ", cin, ", ", cout, ", ", L, ", ", k);
  for (size_t i = 0; i < 2; ++i)
    KILN_CHECK(kernel_size_[i] > 0 && stride_[i] > 0 && dilation_[i] > 0 && padding_[i] >= 0, "SKConv2d: kernel_size ",
               kernel_size_, ", stride ", stride_, " and dilation ", dilation_, " must be positive and padding ",
               padding_, " non-negative");
  const int64_t taps = cin * kernel_size_[0] * kernel_size_[1];
  const int64_t sketched = 2 * L * k * (taps + cout), dense = cout * taps;
  KILN_CHECK(options.allow_no_savings || sketched < dense, "SKConv2d(", cin, ", ", cout, ", kernel_size=", kernel_size_,
             ", num_terms=", L, ", low_rank=", k, ") saves nothing: its kernel S1 and sketch U1 hold 2·L·k·(C_in·kH·kW + "
             "C_out) = ", sketched, " numbers, the dense kernel C_out·C_in·kH·kW = ", dense,
             "; lower num_terms·low_rank or set allow_no_savings");
  seed_ = sketch_parts::choose_seed(options.seed);
  NoGradGuard ng;
  const DType wide = dtype == DType::f64 ? DType::f64 : DType::f32;
  u1 = empty({2 * L, k, cout}, {.dtype = dtype, .device = device});
  draw_sketch();
  Tensor w;  // (C_out, C_in·kH·kW)
  if (dense_w.defined()) {
    w = cast(dense_w, wide).reshape({cout, taps});
  } else {
    w = empty({cout, cin, kernel_size_[0], kernel_size_[1]}, {.dtype = wide, .device = device});
    init::kaiming_uniform_(w, std::sqrt(5.0));
    w = w.reshape({cout, taps});
  }
  // S1 (2L·k, taps) = U1 (2L·k, C_out) · W
  const Tensor s = matmul(cast(u1, wide).reshape({2 * L * k, cout}), w);
  s1 = register_parameter("s1", cast(s, dtype).reshape({2 * L * k, cin, kernel_size_[0], kernel_size_[1]}).contiguous());
  if (options.bias) bias = register_parameter("bias", sketch_parts::bias(dense_w, dense_b, cout, taps, dtype, device));
  register_buffer("u1", u1, options.store_sketches);
  if (!options.store_sketches)
    sketch_seed_ = register_buffer("sketch_seed", sketch_parts::seed_buffer(seed_, device));
}

void SKConv2d::draw_sketch() {
  Generator gen(seed_);
  init::sign_sketch_(u1, 1.0 / std::sqrt(double(low_rank_)), &gen);
}

void SKConv2d::on_state_loaded() {
  if (!sketch_seed_.defined()) return;
  const uint64_t loaded = sketch_parts::seed_of(sketch_seed_);
  if (loaded == seed_) return;
  seed_ = loaded;
  draw_sketch();
}

int64_t SKConv2d::num_trained_parameters() const {
  return s1.numel() + (bias.defined() ? out_channels_ : 0);
}

Tensor SKConv2d::forward(const Tensor& x) {
  KILN_CHECK(x.defined(), repr(), ": the input is undefined");
  KILN_CHECK(x.dim() == 3 || x.dim() == 4, repr(), ": expected a 4-D input (N, C, H, W) or a 3-D one (C, H, W), got ",
             x.str());
  const bool batched = x.dim() == 4;
  const Tensor in = batched ? x : x.unsqueeze(0);
  KILN_CHECK(in.size(1) == in_channels_, repr(), ": expected ", in_channels_, " input channels, got ", x.str());
  for (size_t i = 0; i < 2; ++i) {
    const int64_t extent = in.size(int64_t(2 + i)) + 2 * padding_[i];
    const int64_t span = dilation_[i] * (kernel_size_[i] - 1) + 1;
    KILN_CHECK(extent >= span, repr(), ": input ", x.str(), " with padding ", padding_,
               " is smaller than the dilated kernel");
  }
  const int64_t L = num_terms_, k = low_rank_, n = in.size(0);
  functional::Conv2dOptions f{.stride = stride_, .padding = padding_, .dilation = dilation_};
  const Tensor z = functional::conv2d(in, s1, Tensor(), f);  // (N, 2Lk, Ho, Wo)
  const int64_t ho = z.size(2), wo = z.size(3);
  // The mix (C_out, 2Lk) = 1/(2L) · U1ᵀ, one GEMM per image: (C_out, 2Lk) · (2Lk, Ho·Wo).
  const Tensor mix = mul(u1.reshape({2 * L * k, out_channels_}).t(), 1.0 / double(2 * L));
  Tensor y = matmul(mix, z.reshape({n, 2 * L * k, ho * wo}));
  if (bias.defined()) y = add(y, cast(bias, y.dtype()).reshape({out_channels_, 1}));
  y = y.reshape({n, out_channels_, ho, wo});
  return batched ? y : y.squeeze(0);
}

void SKConv2d::pretty_print(std::ostream& os) const {
  os << "SKConv2d(" << in_channels_ << ", " << out_channels_ << ", kernel_size=" << kernel_size_
     << ", stride=" << stride_ << ", padding=" << padding_ << ", dilation=" << dilation_ << ", num_terms=" << num_terms_
     << ", low_rank=" << low_rank_ << ", bias=" << (bias.defined() ? "true" : "false") << ")";
}

}  // namespace kiln::nn
