#include "rooflines.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <vector>

#include "bench_inputs.h"
#include "cublas_rows.h"
#include "host/status_util.h"

namespace epflow::bench {

namespace {

Status cuda(cudaError_t e, const char* what) {
  return e == cudaSuccess ? Status::ok_status()
                          : error_status(StatusCode::kCudaError, what, ": ", cudaGetErrorString(e));
}

// Median milliseconds of `iters` runs of fn on `stream`, after 3 untimed ones.
template <typename Fn>
Status median_ms(cudaStream_t stream, int warmup, int iters, Fn fn, double* out) {
  std::vector<cudaEvent_t> ev(2 * iters);
  for (auto& e : ev) EPFLOW_RETURN_IF_ERROR(cuda(cudaEventCreate(&e), "cudaEventCreate"));
  Status s = Status::ok_status();
  for (int i = 0; i < warmup && s.ok(); ++i) s = fn();
  for (int i = 0; i < iters && s.ok(); ++i) {
    s = cuda(cudaEventRecord(ev[2 * i], stream), "cudaEventRecord");
    if (s.ok()) s = fn();
    if (s.ok()) s = cuda(cudaEventRecord(ev[2 * i + 1], stream), "cudaEventRecord");
  }
  if (s.ok()) s = cuda(cudaStreamSynchronize(stream), "rooflines");
  std::vector<double> ms;
  for (int i = 0; i < iters && s.ok(); ++i) {
    float v = 0;
    s = cuda(cudaEventElapsedTime(&v, ev[2 * i], ev[2 * i + 1]), "cudaEventElapsedTime");
    ms.push_back(v);
  }
  for (auto& e : ev) cudaEventDestroy(e);
  if (!s.ok()) return s;
  std::sort(ms.begin(), ms.end());
  *out = ms[ms.size() / 2];
  return Status::ok_status();
}

}  // namespace

Status measure_rooflines(int64_t rows, int64_t H, int64_t I, int warmup, int iters,
                         Rooflines* out) {
  constexpr size_t kCopyBytes = size_t{2} << 30;
  cudaStream_t stream = nullptr;
  EPFLOW_RETURN_IF_ERROR(cuda(cudaStreamCreate(&stream), "cudaStreamCreate"));
  cublasHandle_t h = nullptr;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) {
    cudaStreamDestroy(stream);
    return error_status(StatusCode::kCudaError, "cublasCreate failed");
  }
  cublasSetStream(h, stream);
  // x [rows, H], w_gu [2I, H], h [rows, 2I] (SwiGLU reads half of it), w_down [H, I], y [rows, H].
  const size_t elems = rows * H + 2 * I * H + rows * 2 * I + H * I + rows * H;
  void* buf = nullptr;
  void *src = nullptr, *dst = nullptr;
  Status s = cuda(cudaMalloc(&buf, elems * 2), "cudaMalloc (dense GEMM operands)");
  if (s.ok()) s = cuda(cudaMalloc(&src, kCopyBytes), "cudaMalloc (copy source)");
  if (s.ok()) s = cuda(cudaMalloc(&dst, kCopyBytes), "cudaMalloc (copy destination)");
  if (s.ok()) s = cuda(cudaMemsetAsync(src, 1, kCopyBytes, stream), "cudaMemsetAsync");
  auto* x = static_cast<__nv_bfloat16*>(buf);
  auto* w_gu = x + rows * H;
  auto* hid = w_gu + 2 * I * H;
  auto* w_down = hid + rows * 2 * I;
  auto* y = w_down + H * I;
  // NOTES: random operands at the layer's scales, like the layer's inputs: on constant data the
  // tensor cores toggle fewer bits, draw less power and can hold higher clocks than any real
  // layer call, which would make the yardstick unreachable for the wrong reason.
  struct Fill {
    __nv_bfloat16* dst;
    int64_t count;
    float scale;
  };
  uint64_t key = 0x9e3779b97f4a7c15ull;
  for (const Fill& f : {Fill{x, rows * H, 1.0f}, Fill{w_gu, 2 * I * H, fan_in_scale(H)},
                        Fill{hid, rows * 2 * I, 1.0f}, Fill{w_down, H * I, fan_in_scale(I)}}) {
    if (s.ok())
      s = cuda(fill_uniform_bf16(f.dst, f.count, f.scale, mix64(++key), stream),
               "fill_uniform_bf16");
  }
  auto gemm = [&](const void* in, const void* w, void* o, int64_t N, int64_t K) {
    return gemm_rows_wt(h, rows, N, K, in, K, w, o, N);
  };
  double ffn_ms = 0, copy_ms = 0;
  if (s.ok())
    s = median_ms(stream, warmup, iters, [&] {
      if (gemm(x, w_gu, hid, 2 * I, H) != CUBLAS_STATUS_SUCCESS ||
          gemm(hid, w_down, y, H, I) != CUBLAS_STATUS_SUCCESS)
        return error_status(StatusCode::kCudaError, "cublasGemmEx failed");
      return Status::ok_status();
    }, &ffn_ms);
  if (s.ok())
    s = median_ms(stream, warmup, iters, [&] {
      return cuda(cudaMemcpyAsync(dst, src, kCopyBytes, cudaMemcpyDeviceToDevice, stream),
                  "cudaMemcpyAsync (HBM copy)");
    }, &copy_ms);
  if (s.ok()) {
    out->dense_tflops = 6.0 * rows * H * I / (ffn_ms * 1e-3) * 1e-12;
    out->hbm_copy_gbs = 2.0 * kCopyBytes / (copy_ms * 1e-3) * 1e-9;
  }
  cudaFree(buf);
  cudaFree(src);
  cudaFree(dst);
  cublasDestroy(h);
  cudaStreamDestroy(stream);
  return s;
}

}  // namespace epflow::bench
