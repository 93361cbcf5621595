// Device helpers of epflow-gemm-bench that cuBLAS does not provide: the elementwise SwiGLU between
// the baselines' two GEMMs, and a stream hold that lets the host queue a whole timing batch before
// the GPU starts on it (so event timings are device time, not host launch latency).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace epflow::bench {

// h[r, j] = silu(gu[r, j]) * gu[r, I + j] for r < rows, j < I, silu and product in fp32 as in
// EPFlow's fused epilogue. gu is [rows, 2I] (gate columns, then up columns: how the baselines'
// first GEMM writes it), h is [rows, I]. One 16-byte vector (8 bf16) per thread and operand, so
// I must be a multiple of 8 and gu, h 16-byte aligned (cudaErrorInvalidValue otherwise).
cudaError_t swiglu_bf16(const __nv_bfloat16* gu, __nv_bfloat16* h, int64_t rows,
                        int64_t intermediate, cudaStream_t stream);

// One thread that spins (sleeping) on the global timer for `ns` nanoseconds: work queued after it
// on `stream` starts only then. Bounded, so a host call that happens to synchronise behind it
// costs at most `ns` and never deadlocks.
cudaError_t hold_stream(uint64_t ns, cudaStream_t stream);

}  // namespace epflow::bench
