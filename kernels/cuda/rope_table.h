// rope_table.h: the forward angles of rotary embeddings as a device table (rope.cu), for
// kernels that look them up instead of forming them in double per element (gemm_sm90.cu's
// q|k|v epilogue: 32 angles per row of a tile, which in double would take longer than the
// tile's product; the attention backward's joined q|k|v gradient, attention_sm90_bwd.cu's ROPE
// store and attention_bwd_single.cu's attn_bwd_finish_qkv). rope.cuh's rope_lookup reads it.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace loom::cuda {

// Row p, entry i (i < hd / 2) holds (cos, sin) of pair i at position p: the very floats
// rope.cuh's rope_cos_sin<false> forms (a kernel calling it builds the table). *table_rows is
// set to the table's row count: at least `rows`, rounded up to 2048, at most 65536 (positions
// past it are the caller's to form). Built on first use on stream s (the host waits for that
// build, once, so that any stream may read the table after) and kept for the process;
// grown when more rows are asked for (the old copy stays allocated: a graph may hold its
// address). While s is being captured into a CUDA graph nothing is built (a build is no part of
// a graph): the table there is comes back, even if shorter than asked (then *table_rows says
// so), or null with *table_rows 0 before any; the caller forms the angles it lacks itself.
const float2* rope_table(int hd, double theta, int64_t rows, int* table_rows, cudaStream_t s);

}  // namespace loom::cuda
