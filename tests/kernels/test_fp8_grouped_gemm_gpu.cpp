// The block-scaled FP8 grouped GEMM (kernels/fp8_grouped_gemm.cuh) against the CPU: the same e4m3
// values and scales (quantized by the CPU reference), each 128-deep block's products summed
// exactly and scaled, in double. Ragged experts (rows not a tile multiple, an empty expert), the
// output poisoned first; a small shape whole and the DeepSeek-V3 gate/up shape on sampled rows.
// Tolerance: the bf16 output's rounding (2^-9) and the FP8 MMA's accumulation, 1% of the row.
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/fp8_blocks.h"
#include "epflow/reference.h"
#include "gpu_test_util.h"
#include "kernels/fp8_grouped_gemm.cuh"

namespace epflow {
namespace {

struct Case {
  int64_t n, k;
  std::vector<int64_t> rows;  // real rows per expert
  int64_t sampled_rows;       // per expert, 0: all
};

void run_case(const Case& c) {
  const int32_t E = static_cast<int32_t>(c.rows.size());
  std::vector<int64_t> seg(E + 1, 0);
  for (int32_t e = 0; e < E; ++e) seg[e + 1] = seg[e] + (c.rows[e] + 127) / 128 * 128;
  const int64_t max_rows = std::max<int64_t>(seg[E], 128), kb = c.k / 128, nb = c.n / 128;
  std::mt19937_64 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> a(max_rows * c.k), w(E * c.n * c.k);
  for (int64_t r = 0; r < max_rows; ++r)  // rows of different magnitudes
    for (int64_t j = 0; j < c.k; ++j) a[r * c.k + j] = nd(rng) * std::ldexp(1.0f, int(r % 7) - 3);
  for (float& v : w) v = nd(rng) * 0.02f;
  std::vector<uint8_t> aq(a.size()), wq(w.size());
  std::vector<float> as(max_rows * kb), ws(E * nb * kb);
  reference::quantize_rows_1x128(a.data(), max_rows, c.k, false, aq.data(), as.data());
  for (int32_t e = 0; e < E; ++e)
    reference::quantize_blocks_128x128(w.data() + e * c.n * c.k, c.n, c.k, false,
                                       wq.data() + e * c.n * c.k, ws.data() + e * nb * kb);
  int64_t* d_seg = nullptr;
  uint8_t *d_a = nullptr, *d_w = nullptr;
  float *d_as = nullptr, *d_ws = nullptr;
  __nv_bfloat16* d_out = nullptr;
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_seg, seg.size() * 8));
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_a, aq.size()));
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_w, wq.size()));
  // The kernel's scale rows are padded to whole float4s: the padding poisoned (NaN), never used.
  const int64_t as_stride = (kb + 3) / 4 * 4;
  std::vector<float> as_padded(max_rows * as_stride, NAN);
  for (int64_t r = 0; r < max_rows; ++r)
    std::copy_n(as.data() + r * kb, kb, as_padded.data() + r * as_stride);
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_as, as_padded.size() * 4));
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_ws, ws.size() * 4));
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_out, max_rows * c.n * 2));
  EPFLOW_CUDA_CHECK(cudaMemcpy(d_seg, seg.data(), seg.size() * 8, cudaMemcpyHostToDevice));
  EPFLOW_CUDA_CHECK(cudaMemcpy(d_a, aq.data(), aq.size(), cudaMemcpyHostToDevice));
  EPFLOW_CUDA_CHECK(cudaMemcpy(d_w, wq.data(), wq.size(), cudaMemcpyHostToDevice));
  EPFLOW_CUDA_CHECK(
      cudaMemcpy(d_as, as_padded.data(), as_padded.size() * 4, cudaMemcpyHostToDevice));
  EPFLOW_CUDA_CHECK(cudaMemcpy(d_ws, ws.data(), ws.size() * 4, cudaMemcpyHostToDevice));
  EPFLOW_CUDA_CHECK(cudaMemset(d_out, 0xFF, max_rows * c.n * 2));  // NaN
  kernels::Fp8GroupedGemmArgs args;
  args.segments = kernels::ExpertSegments{E, max_rows, d_seg, nullptr};
  args.n = c.n;
  args.k = c.k;
  args.a = d_a;
  args.a_scales = d_as;
  args.a_scale_stride = as_stride;
  args.w = d_w;
  args.w_scales = d_ws;
  args.out = d_out;
  EPFLOW_CUDA_CHECK(kernels::launch_fp8_grouped_gemm(args, nullptr));
  EPFLOW_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<__nv_bfloat16> out(max_rows * c.n);
  EPFLOW_CUDA_CHECK(cudaMemcpy(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost));
  for (void* p : {static_cast<void*>(d_seg), static_cast<void*>(d_a), static_cast<void*>(d_w),
                  static_cast<void*>(d_as), static_cast<void*>(d_ws), static_cast<void*>(d_out)})
    EPFLOW_CUDA_CHECK(cudaFree(p));
  std::vector<float> af(aq.size()), wf(wq.size());
  for (size_t i = 0; i < aq.size(); ++i) af[i] = fp8::to_float(aq[i]);
  for (size_t i = 0; i < wq.size(); ++i) wf[i] = fp8::to_float(wq[i]);
  int64_t checked = 0, bad = 0, not_finite = 0;
  std::vector<double> want(c.n);
  for (int32_t e = 0; e < E; ++e) {
    const int64_t step = c.sampled_rows > 0 ? std::max<int64_t>(1, c.rows[e] / c.sampled_rows) : 1;
    for (int64_t i = 0; i < c.rows[e]; i += step) {
      const int64_t r = seg[e] + i;
      double norm = 0;
      for (int64_t col = 0; col < c.n; ++col) {
        double acc = 0;
        for (int64_t b = 0; b < kb; ++b) {
          double block = 0;
          for (int64_t j = b * 128; j < (b + 1) * 128; ++j)
            block += double(af[r * c.k + j]) * wf[(e * c.n + col) * c.k + j];
          acc += block * (double(as[r * kb + b]) * ws[(e * nb + col / 128) * kb + b]);
        }
        want[col] = acc;
        norm += acc * acc;
      }
      const double rms = std::sqrt(norm / c.n);
      for (int64_t col = 0; col < c.n; ++col) {
        const float got = __bfloat162float(out[r * c.n + col]);
        not_finite += !std::isfinite(got);
        bad += std::fabs(got - want[col]) > 1e-2 * (std::fabs(want[col]) + rms);
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 0);
  EXPECT_EQ(not_finite, 0) << "elements not written";
  EXPECT_EQ(bad, 0) << "of " << checked << " elements off by more than 1% of the row";
}

TEST(Fp8GroupedGemmGpu, RaggedExpertsSmallShape) {
  EPFLOW_SKIP_WITHOUT_GPU();
  run_case({256, 384, {200, 0, 77, 128}, 0});
}

// K blocks not a multiple of four (each tile's weight-scale rows start at every offset from a
// 16-byte boundary) and a last 256-column tile past n (its second half's scales clamped).
TEST(Fp8GroupedGemmGpu, OddBlockCountsAndPartialLastTile) {
  EPFLOW_SKIP_WITHOUT_GPU();
  run_case({384, 640, {130, 40, 0, 256, 7}, 0});
}

TEST(Fp8GroupedGemmGpu, DeepSeekV3GateShapeSampled) {
  EPFLOW_SKIP_WITHOUT_GPU();
  run_case({2048, 7168, {300, 128, 5, 0, 1000}, 12});
}

TEST(Fp8GroupedGemmGpu, RejectsBadShapes) {
  EPFLOW_SKIP_WITHOUT_GPU();
  kernels::Fp8GroupedGemmArgs args;
  args.segments = kernels::ExpertSegments{1, 128, nullptr, nullptr};
  args.n = 100;  // not a multiple of 128
  args.k = 128;
  EXPECT_EQ(kernels::launch_fp8_grouped_gemm(args, nullptr), cudaErrorInvalidValue);
  args.n = 128;
  args.k = 128 * (fp8::kMaxKBlocks + 1);  // a tile's weight scales would not fit shared memory
  EXPECT_EQ(kernels::launch_fp8_grouped_gemm(args, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace epflow
