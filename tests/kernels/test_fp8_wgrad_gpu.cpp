// The FP8 weight-gradient GEMM (launch_fp8_expert_wgrad: dw[e] = A_eᵀ B_e over expert e's rows,
// both operands given transposed and K-major with their scales, as launch_quantize_transposed
// writes them) against a CPU sum in double of the same e4m3 values times their scales: ragged
// segments (an empty expert, whose gradient must be exactly zero; 1, 127, 128, 129 and a few
// hundred rows), an n whose last tile is half past it, an expert of more than 248 K blocks (its
// K in two chunks), few CTAs with many tiles each, bf16 and fp32 outputs, written and
// accumulated. dw is poisoned first: every element must be written.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common/fp8_blocks.h"
#include "common/routing_schedule.h"
#include "expert_test_data.h"
#include "gpu_test_util.h"
#include "kernels/expert_wgrad.cuh"

namespace epflow {
namespace {

using namespace test_data;

struct Case {
  std::string name;
  int64_t m, n;               // dw[e] is [m, n]: multiples of 128
  std::vector<int64_t> rows;  // routed rows per local expert (before padding)
  uint64_t seed;
  bool fp32_out = false;
  int calls = 1;         // > 1: the later calls accumulate (dw = calls * A_eᵀ B_e)
  int32_t max_ctas = 0;  // > 0: so few CTAs that each runs many tiles
};

// A finite e4m3 byte (no NaN codes) from a hash, zero for the padding.
uint8_t e4m3_of(uint64_t seed, uint64_t stream, uint64_t index) {
  const float v = signed_unit(seed, stream, index) * 400.0f;
  return static_cast<uint8_t>(fp8::quantize(v, 1.0f));
}

void run_case(const Case& c) {
  SCOPED_TRACE(::testing::Message() << c.name << ": m " << c.m << ", n " << c.n << ", experts "
                                    << c.rows.size());
  constexpr int64_t kB = fp8::kBlock;
  const int32_t E = static_cast<int32_t>(c.rows.size());
  const int64_t M = c.m, N = c.n;
  std::vector<int64_t> seg(E + 1, 0);
  for (int32_t e = 0; e < E; ++e) seg[e + 1] = seg[e] + sched::round_up(c.rows[e], kTileRows);
  const int64_t max_rows = seg[E] + kTileRows;  // one spare tile, never read
  const int64_t kb_cap = max_rows / kB, a_row_bytes = fp8::packed_row_bytes(max_rows);
  // Which table rows are routed (the rest of a segment is zero padding).
  std::vector<bool> routed(max_rows, false);
  for (int32_t e = 0; e < E; ++e)
    for (int64_t r = seg[e]; r < seg[e] + c.rows[e]; ++r) routed[r] = true;
  // A_t packed rows [M, a_row_bytes]: e4m3, then a scale per 128 rows; B_t [N, max_rows] and its
  // block scales [N / 128, kb_cap]. Scales 2^-8 .. 2^-3 with a mantissa.
  std::vector<uint8_t> a(M * a_row_bytes, 0), b(N * max_rows, 0);
  std::vector<float> b_scales(N / kB * kb_cap);
  auto scale_of = [&](uint64_t stream, uint64_t i) {
    const float u = signed_unit(c.seed, stream, i);
    return std::ldexp(1.0f + 0.5f * std::fabs(u), -3 - static_cast<int>(i % 6));
  };
  parallel_for(M, [&](int64_t m) {
    for (int64_t r = 0; r < max_rows; ++r)
      if (routed[r]) a[m * a_row_bytes + r] = e4m3_of(c.seed, 1, uint64_t(m * max_rows + r));
    for (int64_t k = 0; k < kb_cap; ++k) {
      const float s = scale_of(3, uint64_t(m * kb_cap + k));
      std::memcpy(&a[m * a_row_bytes + max_rows + 4 * k], &s, 4);
    }
  });
  parallel_for(N, [&](int64_t n) {
    for (int64_t r = 0; r < max_rows; ++r)
      if (routed[r]) b[n * max_rows + r] = e4m3_of(c.seed, 2, uint64_t(n * max_rows + r));
  });
  for (size_t i = 0; i < b_scales.size(); ++i) b_scales[i] = scale_of(4, i);
  std::vector<int32_t> real(c.rows.begin(), c.rows.end());

  int64_t* d_seg = nullptr;
  int32_t* d_real = nullptr;
  uint8_t *d_a = nullptr, *d_b = nullptr;
  float* d_bs = nullptr;
  void* d_dw = nullptr;
  const size_t out_bytes = c.fp32_out ? 4 : 2;
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_seg, sizeof(int64_t) * (E + 1)));
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_real, sizeof(int32_t) * (E + 1)));
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_a, a.size()));
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_b, b.size()));
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_bs, 4 * b_scales.size()));
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_dw, out_bytes * E * M * N));
  EPFLOW_CUDA_CHECK(cudaMemcpy(d_seg, seg.data(), sizeof(int64_t) * (E + 1), cudaMemcpyHostToDevice));
  EPFLOW_CUDA_CHECK(cudaMemcpy(d_real, real.data(), sizeof(int32_t) * E, cudaMemcpyHostToDevice));
  EPFLOW_CUDA_CHECK(cudaMemcpy(d_a, a.data(), a.size(), cudaMemcpyHostToDevice));
  EPFLOW_CUDA_CHECK(cudaMemcpy(d_b, b.data(), b.size(), cudaMemcpyHostToDevice));
  EPFLOW_CUDA_CHECK(
      cudaMemcpy(d_bs, b_scales.data(), 4 * b_scales.size(), cudaMemcpyHostToDevice));
  EPFLOW_CUDA_CHECK(cudaMemset(d_dw, 0xFF, out_bytes * E * M * N));  // poison: NaN

  kernels::Fp8ExpertWgradArgs args;
  args.segments.experts = E;
  args.segments.max_rows = max_rows;
  args.segments.seg_offset = d_seg;
  args.segments.expert_rows = d_real;
  args.m = M;
  args.n = N;
  args.a_t = d_a;
  args.b_t = d_b;
  args.b_scales = d_bs;
  args.dw = d_dw;
  args.fp32_out = c.fp32_out;
  args.max_ctas = c.max_ctas;
  for (int call = 0; call < c.calls; ++call) {
    args.accumulate = call > 0;
    EPFLOW_CUDA_CHECK(kernels::launch_fp8_expert_wgrad(args, nullptr));
  }
  EPFLOW_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> dw = fetch_dw(d_dw, c.rows, M, N, c.fp32_out);
  for (void* p : {static_cast<void*>(d_seg), static_cast<void*>(d_real), static_cast<void*>(d_a),
                  static_cast<void*>(d_b), static_cast<void*>(d_bs), d_dw})
    EPFLOW_CUDA_CHECK(cudaFree(p));

  // dw[e][m][n] = calls * sum over the expert's K blocks of a's and b's block scales times the
  // block's exact sum of e4m3 products, in double; per expert, relative L2 error. fp32 outputs
  // hold the GPU's fp32 accumulation; bf16 outputs round it.
  const double tol = c.fp32_out ? 1e-3 : kMaxRelError;
  for (int32_t e = 0; e < E; ++e) {
    if (c.rows[e] == 0) continue;
    std::vector<double> err(M, 0.0), ref(M, 0.0);
    parallel_for(M, [&](int64_t m) {
      for (int64_t n = 0; n < N; ++n) {
        double acc = 0.0;
        for (int64_t k0 = seg[e]; k0 < seg[e] + c.rows[e]; k0 += kB) {
          double block = 0.0;
          for (int64_t r = k0; r < k0 + kB && r < seg[e + 1]; ++r)
            block += double(fp8::to_float(a[m * a_row_bytes + r])) *
                     fp8::to_float(b[n * max_rows + r]);
          float sa;
          std::memcpy(&sa, &a[m * a_row_bytes + max_rows + 4 * (k0 / kB)], 4);
          acc += block * sa * b_scales[(n / kB) * kb_cap + k0 / kB];
        }
        acc *= c.calls;
        const double d = dw[(e * M + m) * N + n] - acc;
        err[m] += d * d;
        ref[m] += acc * acc;
      }
    });
    double err_e = 0, ref_e = 0;
    for (int64_t m = 0; m < M; ++m) {
      err_e += err[m];
      ref_e += ref[m];
    }
    EXPECT_LE(std::sqrt(err_e / ref_e), tol) << "expert " << e;
  }
}

TEST(Fp8WgradGpu, RaggedSegmentsAndAnNTail) {
  EPFLOW_SKIP_WITHOUT_GPU();
  run_case({"ragged", 256, 384, {0, 1, 127, 128, 129, 300}, 11});
  run_case({"ragged, fp32, accumulated", 128, 256, {200, 0, 129}, 12, true, 2});
}

TEST(Fp8WgradGpu, AnExpertPastOneScaleChunk) {
  EPFLOW_SKIP_WITHOUT_GPU();
  // 248 * 128 + 300 rows: 251 K blocks, two chunks of the B scales.
  run_case({"two chunks", 128, 256, {3, 248 * 128 + 300, 50}, 13, true});
}

TEST(Fp8WgradGpu, FewCtasManyTilesEach) {
  EPFLOW_SKIP_WITHOUT_GPU();
  Case c{"few CTAs", 384, 512, {130, 257, 0, 640}, 14};
  c.max_ctas = 3;
  run_case(c);
}

TEST(Fp8WgradGpu, RejectsBadShapesBeforeLaunching) {
  EPFLOW_SKIP_WITHOUT_GPU();
  kernels::Fp8ExpertWgradArgs a;
  a.segments.experts = 1;
  a.segments.max_rows = 128;
  a.m = 100;  // not a multiple of 128
  a.n = 128;
  EXPECT_EQ(kernels::launch_fp8_expert_wgrad(a, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace epflow
