// The op harness's CUDA column: every row of the op table (tests/ops/op_cases.h) runs on the GPU and on
// the CPU from the same fresh random inputs, in f64, f32, bf16 and f16, and the outputs and the
// gradients of every input must agree within the dtype's tolerance. Inputs go in contiguous and as
// non-contiguous views (a transpose of their storage).
#include <iostream>
#include <set>

#include "../ops/op_cases.h"
#include "cuda_compare.h"
#include "cuda_test_util.h"

using namespace kiln;
using namespace kiln::test_ops;
using kiln::testing::expect_close;

namespace {

// Composite rows in 16-bit types round at every intermediate op on both devices, in different orders.
double tolerance(DType t) {
  switch (t) {
    case DType::f64: return 1e-10;
    case DType::f32: return 2e-4;
    case DType::f16: return 2e-2;
    default: return 8e-2;
  }
}

struct DeviceInputs {
  Inputs cpu, gpu;
};

DeviceInputs make_inputs(const OpCase& c, DType t, bool strided, Generator& gen) {
  DeviceInputs in;
  for (const Shape& s : c.shapes) {
    Shape storage = s;
    bool transpose = strided && s.size() >= 2;
    if (transpose) std::swap(storage[storage.size() - 1], storage[storage.size() - 2]);
    Tensor base = rand(storage, {.dtype = DType::f64}, &gen);
    base = c.domain == Domain::positive ? base + 0.5 : base * 2.0 - 1.0;
    base = cast(base, t);
    Tensor cpu_leaf = base.clone().detach().requires_grad_(true);
    Tensor gpu_leaf = base.to(Device::cuda(0)).detach().requires_grad_(true);
    in.cpu.push_back(cpu_leaf);
    in.gpu.push_back(gpu_leaf);
  }
  return in;
}

Inputs view(const Inputs& leaves, bool strided) {
  Inputs out;
  for (const Tensor& t : leaves) out.push_back(strided && t.dim() >= 2 ? t.transpose(-1, -2) : t);
  return out;
}

}  // namespace

TEST(OpHarnessCuda, EveryRowMatchesTheCpuInEveryFloatDtype) {
  KILN_REQUIRE_GPU();
  std::set<std::string> covered;
  Generator gen(77);
  for (const OpCase& c : cases()) {
    for (DType t : {DType::f64, DType::f32, DType::bf16, DType::f16}) {
      for (bool strided : {false, true}) {
        std::string what = c.op + " " + dtype_name(t) + (strided ? " strided" : "");
        SCOPED_TRACE(what);
        DeviceInputs in = make_inputs(c, t, strided, gen);
        case_device() = Device::cpu();
        Tensor y_cpu = c.fn(view(in.cpu, strided));
        case_device() = Device::cuda(0);
        Tensor y_gpu;
        try {
          y_gpu = c.fn(view(in.gpu, strided));
        } catch (const Error& e) {
          case_device() = Device::cpu();
          ADD_FAILURE() << what << ": " << e.what();
          continue;
        }
        case_device() = Device::cpu();
        ASSERT_TRUE(y_gpu.device().is_cuda()) << what;
        expect_close(y_cpu.detach(), y_gpu.detach(), what + " output", tolerance(y_cpu.dtype()));
        // Gradients of sum(y * w) for one random w, the same on both devices.
        Tensor w = cast(rand(y_cpu.sizes(), {.dtype = DType::f64}, &gen), y_cpu.dtype());
        sum(mul(y_cpu, w)).backward();
        sum(mul(y_gpu, w.to(Device::cuda(0)))).backward();
        for (size_t i = 0; i < in.cpu.size(); ++i) {
          Tensor gc = in.cpu[i].grad(), gg = in.gpu[i].grad();
          ASSERT_EQ(gc.defined(), gg.defined()) << what << " input " << i;
          if (gc.defined()) expect_close(gc, gg, what + " gradient of input " + std::to_string(i), tolerance(t));
        }
      }
    }
    covered.insert(c.op);
  }
  std::cout << "CUDA column covered " << covered.size() << " ops x {f64, f32, bf16, f16} x {contiguous, strided}"
            << std::endl;
}
