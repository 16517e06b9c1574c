#pragma once
// Kernel family: indexing along one dim.
#include <cstdint>

#include <kiln/core/kernel.h>

// src contiguous viewed as (outer, D, inner); out contiguous (outer, n, inner); index (n) i64.
KILN_KERNEL(index_select, void(const Tensor& src, int64_t dim, const Tensor& index, const Tensor& out));
// dst contiguous (outer, D, inner) += src contiguous (outer, n, inner) at rows index (n) i64.
KILN_KERNEL(index_add, void(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src));
// out[..i_dim..] = src[..index[..]..]; index, out contiguous with equal shapes; src contiguous.
KILN_KERNEL(gather, void(const Tensor& src, int64_t dim, const Tensor& index, const Tensor& out));
// dst[..index[..]..] += src[..]; dst contiguous, index and src contiguous with equal shapes.
KILN_KERNEL(scatter_add, void(const Tensor& dst, int64_t dim, const Tensor& index, const Tensor& src));
