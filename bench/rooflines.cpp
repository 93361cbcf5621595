#include "rooflines.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <vector>

#include "bench_inputs.h"
#include "cublas_rows.h"
#include "common/status_util.h"
#include "settle.h"

namespace epflow::bench {

namespace {

Status cuda(cudaError_t e, const char* what) {
  return e == cudaSuccess ? Status::ok_status()
                          : error_status(StatusCode::kCudaError, what, ": ", cudaGetErrorString(e));
}

// Median milliseconds of `iters` runs of fn on `stream`, after settle_ms of untimed runs
// (settle.h) and `warmup` more.
template <typename Fn>
Status median_ms(cudaStream_t stream, int warmup, int settle_ms, int iters, Fn fn, double* out) {
  std::vector<cudaEvent_t> ev(2 * iters);
  for (auto& e : ev) EPFLOW_RETURN_IF_ERROR(cuda(cudaEventCreate(&e), "cudaEventCreate"));
  Status s = Status::ok_status();
  if (!settle_locally([&] { return (s = fn()).ok(); }, stream, settle_ms) && s.ok())
    s = cuda(cudaErrorUnknown, "timing a settling run");
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

Status DenseFfn::create(int64_t rows, int64_t H, int64_t I, cudaStream_t stream,
                        std::unique_ptr<DenseFfn>* out) {
  std::unique_ptr<DenseFfn> f(new DenseFfn());
  f->rows_ = rows;
  f->hidden_ = H;
  f->intermediate_ = I;
  if (cublasCreate(&f->handle_) != CUBLAS_STATUS_SUCCESS) {
    f->handle_ = nullptr;
    return error_status(StatusCode::kCudaError, "cublasCreate failed");
  }
  cublasSetStream(f->handle_, stream);
  // x [rows, H], w_gu [2I, H], h [rows, 2I] (SwiGLU reads half of it), w_down [H, I], y [rows, H].
  const size_t elems = rows * H + 2 * I * H + rows * 2 * I + H * I + rows * H;
  EPFLOW_RETURN_IF_ERROR(cuda(cudaMalloc(&f->buf_, elems * 2), "cudaMalloc (dense GEMM operands)"));
  auto* x = static_cast<__nv_bfloat16*>(f->buf_);
  auto* w_gu = x + rows * H;
  auto* hid = w_gu + 2 * I * H;
  auto* w_down = hid + rows * 2 * I;
  // NOTES: random operands at the layer's scales, like the layer's inputs: on constant data the
  // tensor cores toggle fewer bits, draw less power and can hold higher clocks than any real
  // layer call, which would make the yardstick unreachable for the wrong reason.
  struct Fill {
    __nv_bfloat16* dst;
    int64_t count;
    float scale;
  };
  uint64_t key = 0x9e3779b97f4a7c15ull;
  for (const Fill& fill : {Fill{x, rows * H, 1.0f}, Fill{w_gu, 2 * I * H, fan_in_scale(H)},
                           Fill{hid, rows * 2 * I, 1.0f}, Fill{w_down, H * I, fan_in_scale(I)}})
    EPFLOW_RETURN_IF_ERROR(cuda(
        fill_uniform_bf16(fill.dst, fill.count, fill.scale, mix64(++key), stream),
        "fill_uniform_bf16"));
  *out = std::move(f);
  return Status::ok_status();
}

DenseFfn::~DenseFfn() {
  if (buf_) cudaFree(buf_);
  if (handle_) cublasDestroy(handle_);
}

Status DenseFfn::run() {
  const int64_t H = hidden_, I = intermediate_;
  auto* x = static_cast<__nv_bfloat16*>(buf_);
  auto* w_gu = x + rows_ * H;
  auto* hid = w_gu + 2 * I * H;
  auto* w_down = hid + rows_ * 2 * I;
  auto* y = w_down + H * I;
  if (gemm_rows_wt(handle_, rows_, 2 * I, H, x, H, w_gu, hid, 2 * I) != CUBLAS_STATUS_SUCCESS ||
      gemm_rows_wt(handle_, rows_, H, I, hid, I, w_down, y, H) != CUBLAS_STATUS_SUCCESS)
    return error_status(StatusCode::kCudaError, "cublasGemmEx failed");
  return Status::ok_status();
}

double DenseFfn::tflops(double ms) const {
  return 6.0 * rows_ * hidden_ * intermediate_ / (ms * 1e-3) * 1e-12;
}

Status measure_rooflines(int64_t rows, int64_t H, int64_t I, int warmup, int settle_ms,
                         int iters, Rooflines* out) {
  constexpr size_t kCopyBytes = size_t{2} << 30;
  cudaStream_t stream = nullptr;
  EPFLOW_RETURN_IF_ERROR(cuda(cudaStreamCreate(&stream), "cudaStreamCreate"));
  std::unique_ptr<DenseFfn> ffn;
  void *src = nullptr, *dst = nullptr;
  Status s = DenseFfn::create(rows, H, I, stream, &ffn);
  if (s.ok()) s = cuda(cudaMalloc(&src, kCopyBytes), "cudaMalloc (copy source)");
  if (s.ok()) s = cuda(cudaMalloc(&dst, kCopyBytes), "cudaMalloc (copy destination)");
  if (s.ok()) s = cuda(cudaMemsetAsync(src, 1, kCopyBytes, stream), "cudaMemsetAsync");
  double ffn_ms = 0, copy_ms = 0;
  if (s.ok()) s = median_ms(stream, warmup, settle_ms, iters, [&] { return ffn->run(); }, &ffn_ms);
  if (s.ok())
    s = median_ms(stream, warmup, settle_ms, iters, [&] {
      return cuda(cudaMemcpyAsync(dst, src, kCopyBytes, cudaMemcpyDeviceToDevice, stream),
                  "cudaMemcpyAsync (HBM copy)");
    }, &copy_ms);
  if (s.ok()) {
    out->dense_tflops = ffn->tflops(ffn_ms);
    out->hbm_copy_gbs = 2.0 * kCopyBytes / (copy_ms * 1e-3) * 1e-9;
  }
  ffn.reset();
  cudaFree(src);
  cudaFree(dst);
  cudaStreamDestroy(stream);
  return s;
}

}  // namespace epflow::bench
