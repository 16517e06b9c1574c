// kiln_info: what a bug report needs. Kiln's version and build, the backends it was compiled with, the CUDA
// libraries it runs on, and each GPU with the fast paths it takes there.
//
//   $ kiln_info
//   Kiln 0.1.0 (Release, GCC 12.2.0)
//   CUDA backend: on (architectures 90); flash attention sm90 (wgmma/TMA): compiled
//   CUDA runtime 13.0, driver 13.0, cuDNN 91900, cuBLASLt 130000
//   distributed: MPI backend yes, NCCL 2.28.3
//   1 CUDA device
//     cuda:0  NVIDIA H100 80GB HBM3  compute capability 9.0, 79.2 GiB, 132 multiprocessors
//             bf16/f16 tensor cores: yes; flash attention: sm90 (wgmma/TMA); fp8: not built
#include <cstdio>
#include <string>

#include <kiln/core/build_info.h>
#include <kiln/cuda/runtime.h>
#include <kiln/distributed/process_group.h>

using namespace kiln;

namespace {
std::string dotted(int v) {  // 13000 -> "13.0"
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}
}  // namespace

int main() {
  const BuildInfo b = build_info();
  std::printf("Kiln %s (%s, %s)\n", b.version.c_str(), b.build_type.empty() ? "no build type" : b.build_type.c_str(),
              b.compiler.c_str());
  if (b.cuda)
    std::printf("CUDA backend: on (architectures %s); flash attention sm90 (wgmma/TMA): %s\n",
                b.cuda_architectures.c_str(), b.flash_attention_sm90 ? "compiled" : "not compiled");
  else
    std::printf("CUDA backend: off (a CPU-only build)\n");
  const cuda::LibraryVersions v = cuda::library_versions();
  if (b.cuda)
    std::printf("CUDA runtime %s, driver %s, cuDNN %zu, cuBLASLt %zu\n", dotted(v.runtime).c_str(),
                v.driver ? dotted(v.driver).c_str() : "none (no driver)", v.cudnn, v.cublaslt);
  const int nccl = distributed::nccl_version();
  std::printf("distributed: MPI backend %s, NCCL %s\n", distributed::has_mpi_backend() ? "yes" : "no",
              nccl ? (std::to_string(nccl / 10000) + "." + std::to_string((nccl / 100) % 100) + "." +
                      std::to_string(nccl % 100))
                         .c_str()
                   : "no");
  const int n = cuda::is_available() ? cuda::device_count() : 0;
  std::printf("%d CUDA device%s\n", n, n == 1 ? "" : "s");
  for (int i = 0; i < n; ++i) {
    const cuda::DeviceProperties p = cuda::properties(i);
    const bool hopper = p.major == 9 && p.minor == 0;
    std::printf("  cuda:%d  %s  compute capability %d.%d, %.1f GiB, %d multiprocessors\n", i, p.name.c_str(), p.major,
                p.minor, double(p.total_memory) / double(1 << 30), p.multiprocessors);
    std::printf("          bf16/f16 tensor cores: %s; flash attention: %s; fp8: not built\n",
                cuda::has_tensor_core_support(i) ? "yes" : "no",
                hopper && b.flash_attention_sm90 ? "sm90 (wgmma/TMA)" : "mma.sync");
  }
  return 0;
}
