// The yardsticks issue [E] holds the layer to, measured in the same run as the layer: the cuBLAS
// dense bf16 GEMM rate on the layer's own FLOPs, and the HBM copy bandwidth that bounds streaming
// the local experts' weights at decode sizes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "epflow/status.h"

namespace epflow::bench {

struct Rooflines {
  double dense_tflops = 0;  // cuBLAS bf16 (fp32 accumulate): rows x 2I x H, then rows x H x I
  double hbm_copy_gbs = 0;  // 2 GiB device-to-device copy, read + write bytes
};

// Median over `iters` timed runs after `warmup` runs (the layer's own counts, so both see the
// same clocks) on the current device: the two dense GEMMs of an expert FFN over `rows` rows
// (M = rows, one weight set, random operands at the layer's scales), and the copy.
Status measure_rooflines(int64_t rows, int64_t hidden, int64_t intermediate, int warmup,
                         int iters, Rooflines* out);

}  // namespace epflow::bench
