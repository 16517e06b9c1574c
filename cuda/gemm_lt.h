#pragma once
// What the GEMM (cuda/gemm.cpp) offers the other cuBLASLt users (cuda/linear.cpp): operands in
// column-major terms, epilogues, and a product through the plan cache. Host code, CUDA library types.
#include <cstdint>

#include <cublasLt.h>

#include <kiln/core/tensor.h>

namespace kiln::cuda {

// A matrix operand (R x C slice of a (B, R, C) tensor) in column-major terms: a row-major matrix with
// row stride ld is the column-major (C x R) matrix with leading dimension ld.
struct Operand {
  bool row_major = true;
  int64_t ld = 1;
  int64_t batch_stride = 0;  // 0: broadcast (or a single batch)
};
// Whether t (B, R, C) is a matrix layout cuBLASLt takes (unit stride along one matrix dim); fills *op.
bool operand_of(const Tensor& t, Operand* op);
// A (B, R, C) operand in a layout cuBLASLt takes: t itself, or a contiguous copy.
Tensor as_operand(const Tensor& t, Operand* op);

struct TypeInfo {
  cudaDataType_t data, scale;
  cublasComputeType_t compute;
};
// The cuBLASLt types of a Kiln dtype (throws kiln::Error for a non-floating dtype).
TypeInfo type_info(DType t, bool tf32);

// A cuBLASLt epilogue and its pointers. bias: BIAS* input of length rows(D) = n, or the BGRADB output of
// length columns(D) = m; aux: the GELU input matrix (column-major n x m, leading dim aux_ld).
struct EpilogueSpec {
  cublasLtEpilogue_t kind = CUBLASLT_EPILOGUE_DEFAULT;
  void* bias = nullptr;
  void* aux = nullptr;
  int64_t aux_ld = 0;
};

// out (B, M, N) = a · b (+ out when accumulate) with the epilogue ep, launched on the current stream.
// Returns false, launching nothing, when cuBLASLt has no algorithm for it. a and b share a dtype: the
// output's, or bf16/f16 with an f32 output (f32 accumulation written without rounding to 16 bits).
// alpha scales the product (before the bias epilogue adds its bias); beta scales out's old values when
// accumulate.
bool try_gemm(const Tensor& a, const Operand& oa, const Tensor& b, const Operand& ob, const Tensor& out,
              const EpilogueSpec& ep, bool accumulate = false, double alpha = 1.0, double beta = 1.0);

}  // namespace kiln::cuda
