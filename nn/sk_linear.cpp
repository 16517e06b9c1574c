#include <kiln/nn/sk_linear.h>

#include <cmath>

#include <kiln/autograd/grad_mode.h>
#include <kiln/core/error.h>
#include <kiln/core/ops.h>
#include <kiln/nn/functional.h>
#include <kiln/nn/init.h>
#include <kiln/nn/sketch_parts.h>
#include <kiln/nn/linear.h>

namespace kiln::nn {

SKLinear::SKLinear(int64_t in_features, int64_t out_features, const SKLinearOptions& options)
    : in_features_(in_features), out_features_(out_features), num_terms_(options.num_terms), low_rank_(options.low_rank) {
  KILN_CHECK(is_floating(options.dtype), "SKLinear: parameters need a floating dtype, got ", dtype_name(options.dtype));
  init(options, Tensor(), Tensor(), options.dtype, options.device);
}

SKLinear::SKLinear(const Linear& dense, const SKLinearOptions& options)
    : in_features_(dense.in_features()), out_features_(dense.out_features()), num_terms_(options.num_terms),
      low_rank_(options.low_rank) {
  KILN_CHECK(dense.weight.defined(), "SKLinear: the dense layer ", dense.repr(), " has no weight (already sketched?)");
  init(options, dense.weight, dense.bias, dense.weight.dtype(), dense.weight.device());
}

void SKLinear::init(const SKLinearOptions& options, const Tensor& dense_w, const Tensor& dense_b, DType dtype,
                    Device device) {
  const int64_t in = in_features_, out = out_features_, L = num_terms_, k = low_rank_;
  KILN_CHECK(in > 0 && out > 0 && L > 0 && k > 0, "SKLinear: in_features, out_features, num_terms and low_rank must be "
             "positive, got ", in, ", ", out, ", ", L, ", ", k);
  // Parameters and sketches: L·k·(in + out) each.
  const int64_t sketched = 2 * L * k * (in + out), dense = in * out;
  KILN_CHECK(options.allow_no_savings || sketched < dense, "SKLinear(", in, ", ", out, ", num_terms=", L,
             ", low_rank=", k, ") saves nothing: its parameters S1, S2 and sketches U1, U2 hold 2·L·k·(in + out) = ",
             sketched, " numbers, the dense weight in·out = ", dense, "; lower num_terms·low_rank below ",
             dense / (2 * (in + out)) + (dense % (2 * (in + out)) ? 1 : 0),
             " or set allow_no_savings");
  seed_ = sketch_parts::choose_seed(options.seed);
  NoGradGuard ng;
  const TensorOptions f32{.dtype = dtype == DType::f64 ? DType::f64 : DType::f32, .device = device};
  u1 = empty({L, k, out}, {.dtype = dtype, .device = device});
  u2 = empty({L, in, k}, {.dtype = dtype, .device = device});
  draw_sketches();
  // W (in, out): the dense layer's weight transposed, or drawn as Linear draws its own.
  Tensor w;
  if (dense_w.defined()) {
    w = cast(dense_w, f32.dtype).t();
  } else {
    w = empty({out, in}, f32);
    init::kaiming_uniform_(w, std::sqrt(5.0));
    w = w.t();
  }
  // S1_i = W · U1_iᵀ (in, k), S2_i = U2_iᵀ · W (k, out), from the sketches as stored (rounded to dtype).
  const Tensor a1 = cast(u1, f32.dtype), a2 = cast(u2, f32.dtype);
  s1 = register_parameter("s1", cast(matmul(w.unsqueeze(0).expand({L, in, out}), a1.transpose(1, 2)), dtype).contiguous());
  s2 = register_parameter("s2", cast(matmul(a2.transpose(1, 2), w.unsqueeze(0).expand({L, in, out})), dtype).contiguous());
  if (options.bias) bias = register_parameter("bias", sketch_parts::bias(dense_w, dense_b, out, in, dtype, device));
  register_buffer("u1", u1, options.store_sketches);
  register_buffer("u2", u2, options.store_sketches);
  if (!options.store_sketches)
    sketch_seed_ = register_buffer("sketch_seed", sketch_parts::seed_buffer(seed_, device));
}

void SKLinear::draw_sketches() {
  Generator gen(seed_);
  const double scale = 1.0 / std::sqrt(double(low_rank_));
  init::sign_sketch_(u1, scale, &gen);
  init::sign_sketch_(u2, scale, &gen);
}

void SKLinear::on_state_loaded() {
  if (!sketch_seed_.defined()) return;  // stored sketches were loaded with the rest
  const uint64_t loaded = sketch_parts::seed_of(sketch_seed_);
  if (loaded == seed_) return;
  seed_ = loaded;
  draw_sketches();
}

int64_t SKLinear::num_trained_parameters() const {
  return num_terms_ * low_rank_ * (in_features_ + out_features_) + (bias.defined() ? out_features_ : 0);
}

Tensor SKLinear::forward(const Tensor& x) {
  KILN_CHECK(x.defined(), repr(), ": the input is undefined");
  KILN_CHECK(x.dim() >= 1 && x.size(-1) == in_features_, repr(), ": expected an input of shape [..., ", in_features_,
             "], got ", x.str());
  return functional::sketched_linear(x, s1, s2, u1, u2, bias);
}

void SKLinear::pretty_print(std::ostream& os) const {
  os << "SKLinear(in_features=" << in_features_ << ", out_features=" << out_features_ << ", num_terms=" << num_terms_
     << ", low_rank=" << low_rank_ << ", bias=" << (bias.defined() ? "true" : "false") << ")";
}

}  // namespace kiln::nn
