// The yardsticks the layer is held to, measured in the same run as the layer: the cuBLAS
// dense bf16 GEMM rate on the layer's own FLOPs, and the HBM copy bandwidth that bounds streaming
// the local experts' weights at decode sizes.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "epflow/config.h"
#include "epflow/status.h"

namespace epflow::bench {

// FLOPs of the routed experts' forward for `routed_rows` (token, k) rows: 3 GEMMs of 2*H*I each
// (the backward's are twice these).
inline double forward_flops(const LayerConfig& c, int64_t routed_rows) {
  return 6.0 * static_cast<double>(routed_rows) * static_cast<double>(c.hidden) *
         static_cast<double>(c.intermediate);
}

struct Rooflines {
  double dense_tflops = 0;  // cuBLAS bf16 (fp32 accumulate): rows x 2I x H, then rows x H x I
  double hbm_copy_gbs = 0;  // 2 GiB device-to-device copy, read + write bytes
};

// The dense yardstick's work on the current device: the two GEMMs of an expert FFN over `rows`
// rows (M = rows, one weight set, random operands at the layer's scales), enqueued on `stream`
// by run(); for timing inside another loop (epflow-bench --yardstick interleaved) or alone.
class DenseFfn {
 public:
  static Status create(int64_t rows, int64_t hidden, int64_t intermediate, cudaStream_t stream,
                       std::unique_ptr<DenseFfn>* out);
  ~DenseFfn();
  DenseFfn(const DenseFfn&) = delete;
  DenseFfn& operator=(const DenseFfn&) = delete;
  Status run();
  double tflops(double ms) const;  // the FFN's FLOPs over ms milliseconds

 private:
  DenseFfn() = default;
  int64_t rows_ = 0, hidden_ = 0, intermediate_ = 0;
  cublasHandle_t handle_ = nullptr;
  void* buf_ = nullptr;
};

// Median over `iters` timed runs after settle_ms of untimed runs and `warmup` more (the layer's
// own settings: both run in the sustained power state) on the current device: the DenseFfn over
// `rows` rows, and the copy.
Status measure_rooflines(int64_t rows, int64_t hidden, int64_t intermediate, int warmup,
                         int settle_ms, int iters, Rooflines* out);

}  // namespace epflow::bench
