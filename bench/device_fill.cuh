// Fills device buffers with reproducible pseudo-random bf16 values in (-scale, scale), never zero
// (the benchmark's expert weights: generating gigabytes on the host would dominate the run).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace epflow::bench {

cudaError_t fill_uniform_bf16(__nv_bfloat16* dst, int64_t count, float scale, uint64_t seed,
                              cudaStream_t stream);

}  // namespace epflow::bench
