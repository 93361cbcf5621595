// The backward's input-gradient GEMM (launch_expert_dgrad: out = rows W, the weights read
// N-major) against a CPU reference in double on the same bf16 inputs, in both of its uses: the
// down GEMM's dh = dz W_down (one weight, K = H) and the gate/up GEMM's dx = [dg | du]
// [W_gate; W_up] (K split between two weights). Ragged segments (empty experts, 1, 127, 128, 129
// and a few hundred rows), N tails, the DeepSeek-V3 per-rank shape; outputs poisoned first.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/routing_schedule.h"
#include "expert_test_data.h"
#include "gpu_test_util.h"
#include "unfused/expert_ffn.cuh"

namespace epflow {
namespace {

using namespace test_data;

struct Case {
  std::string name;
  int64_t k, k0, n;           // K of the rows; K of the first weight (= k: one weight); N
  std::vector<int64_t> rows;  // routed rows per local expert (before padding)
  int64_t spare_tiles;        // M tiles of max_rows past the last segment
  int64_t sample_per_expert;  // 0: check every routed row; else this many rows per expert
  uint64_t seed;
};

void run_case(const Case& c, bool pass_expert_rows) {
  const int32_t E = static_cast<int32_t>(c.rows.size());
  const int64_t K = c.k, K0 = c.k0, N = c.n;
  std::vector<int64_t> seg(E + 1, 0);
  for (int32_t e = 0; e < E; ++e) seg[e + 1] = seg[e] + sched::round_up(c.rows[e], kTileRows);
  const int64_t total = seg[E];
  const int64_t max_rows = total + c.spare_tiles * kTileRows;

  // Rows: routed ones random, padding zero (as the layer leaves them), past the end poisoned.
  std::vector<uint16_t> a(max_rows * K, kPoison);
  for (int32_t e = 0; e < E; ++e) {
    parallel_for(c.rows[e], [&](int64_t i) {
      const int64_t r = seg[e] + i;
      for (int64_t k = 0; k < K; ++k)
        a[r * K + k] = float_to_bf16(signed_unit(c.seed, 1, static_cast<uint64_t>(r * K + k)));
    });
    std::fill(a.begin() + (seg[e] + c.rows[e]) * K, a.begin() + seg[e + 1] * K, uint16_t{0});
  }
  // w0 [E, K0, N], w1 [E, K - K0, N] ~ U(-1, 1) / sqrt(K).
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(K)));
  std::vector<uint16_t> w0, w1;
  fill_uniform(&w0, E * K0, N, scale, c.seed, 2);
  if (K0 < K) fill_uniform(&w1, E * (K - K0), N, scale, c.seed, 3);

  const size_t b = sizeof(uint16_t);
  int64_t* d_seg = nullptr;
  int32_t* d_rows = nullptr;
  void *d_a = nullptr, *d_w0 = nullptr, *d_w1 = nullptr, *d_out = nullptr;
  std::vector<int32_t> rows32(c.rows.begin(), c.rows.end());
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_seg, sizeof(int64_t) * (E + 1)));
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_rows, sizeof(int32_t) * (E + 1)));
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_a, b * a.size()));
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_w0, b * w0.size()));
  if (!w1.empty()) EPFLOW_CUDA_CHECK(cudaMalloc(&d_w1, b * w1.size()));
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_out, b * max_rows * N));
  EPFLOW_CUDA_CHECK(
      cudaMemcpy(d_seg, seg.data(), sizeof(int64_t) * (E + 1), cudaMemcpyHostToDevice));
  EPFLOW_CUDA_CHECK(
      cudaMemcpy(d_rows, rows32.data(), sizeof(int32_t) * E, cudaMemcpyHostToDevice));
  EPFLOW_CUDA_CHECK(cudaMemcpy(d_a, a.data(), b * a.size(), cudaMemcpyHostToDevice));
  EPFLOW_CUDA_CHECK(cudaMemcpy(d_w0, w0.data(), b * w0.size(), cudaMemcpyHostToDevice));
  if (!w1.empty())
    EPFLOW_CUDA_CHECK(cudaMemcpy(d_w1, w1.data(), b * w1.size(), cudaMemcpyHostToDevice));
  EPFLOW_CUDA_CHECK(cudaMemset(d_out, 0xFF, b * max_rows * N));  // poison: 0xFFFF is a NaN

  kernels::ExpertDgradArgs args;
  args.segments.experts = E;
  args.segments.max_rows = max_rows;
  args.segments.seg_offset = d_seg;
  args.segments.expert_rows = pass_expert_rows ? d_rows : nullptr;
  args.k = K;
  args.n = N;
  args.k0 = K0;
  args.rows = static_cast<const __nv_bfloat16*>(d_a);
  args.w0 = static_cast<const __nv_bfloat16*>(d_w0);
  args.w1 = static_cast<const __nv_bfloat16*>(d_w1);
  args.out = static_cast<__nv_bfloat16*>(d_out);
  EPFLOW_CUDA_CHECK(kernels::launch_expert_dgrad(args, nullptr));
  EPFLOW_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> out(max_rows * N);
  EPFLOW_CUDA_CHECK(cudaMemcpy(out.data(), d_out, b * out.size(), cudaMemcpyDeviceToHost));
  for (void* p : {static_cast<void*>(d_seg), static_cast<void*>(d_rows), d_a, d_w0, d_w1, d_out})
    EPFLOW_CUDA_CHECK(cudaFree(p));

  expect_written(out, N, seg, c.rows, pass_expert_rows, max_rows, "out");

  // Each checked row against sum_k a[r, k] W(k, :) in double, per row and per expert.
  struct Sample {
    int32_t expert;
    int64_t row;
  };
  std::vector<Sample> samples;
  for (int32_t e = 0; e < E; ++e)
    for (int64_t i : sampled_rows(c.rows[e], c.sample_per_expert))
      samples.push_back({e, seg[e] + i});
  std::vector<double> err(samples.size()), ref(samples.size());
  parallel_for(static_cast<int64_t>(samples.size()), [&](int64_t s) {
    const int32_t e = samples[s].expert;
    const int64_t r = samples[s].row;
    std::vector<double> acc(N, 0.0);
    for (int64_t k = 0; k < K; ++k) {
      const double av = bf16_to_float(a[r * K + k]);
      const uint16_t* w = k < K0 ? w0.data() + (e * K0 + k) * N
                                 : w1.data() + (e * (K - K0) + (k - K0)) * N;
      for (int64_t j = 0; j < N; ++j) acc[j] += av * bf16_to_float(w[j]);
    }
    for (int64_t j = 0; j < N; ++j) {
      const double d = bf16_to_float(out[r * N + j]) - acc[j];
      err[s] += d * d;
      ref[s] += acc[j] * acc[j];
    }
  });
  std::vector<double> err_e(E, 0.0), ref_e(E, 0.0);
  for (size_t s = 0; s < samples.size(); ++s) {
    EXPECT_LE(std::sqrt(err[s] / ref[s]), kMaxRelError)
        << "expert " << samples[s].expert << ", row " << samples[s].row;
    err_e[samples[s].expert] += err[s];
    ref_e[samples[s].expert] += ref[s];
  }
  for (int32_t e = 0; e < E; ++e)
    if (c.rows[e] > 0) EXPECT_LE(std::sqrt(err_e[e] / ref_e[e]), kMaxRelError) << "expert " << e;
}

void run_cases(const std::vector<Case>& cases) {
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << c.name << ": K " << c.k << " (first weight " << c.k0
                                      << "), N " << c.n << ", experts " << c.rows.size());
    with_and_without_expert_rows([&](bool pass_expert_rows) { run_case(c, pass_expert_rows); });
  }
}

TEST(ExpertDgradGpu, DownInputGradientRaggedSegments) {
  EPFLOW_SKIP_WITHOUT_GPU();
  run_cases({
      // dh = dz W_down: K = H, N = I. One k tile and half an N tile; then 3 k tiles and N of
      // 1.25 N tiles; empty experts at the start, middle and end; 1, 127, 128, 129 rows.
      {"minimum", 64, 64, 64, {0, 1, 127, 0, 128, 129, 0}, 3, 0, 11},
      {"tails", 192, 192, 320, {300, 0, 5, 257, 64}, 2, 0, 12},
      {"last tiles", 128, 128, 192, {16, 17, 33, 64, 65, 97, 127, 240}, 1, 0, 13},
  });
}

TEST(ExpertDgradGpu, GateUpInputGradientSplitK) {
  EPFLOW_SKIP_WITHOUT_GPU();
  run_cases({
      // dx = [dg | du] [W_gate; W_up]: K = 2I split at I, N = H.
      {"minimum", 128, 64, 64, {0, 1, 127, 0, 128, 129, 0}, 3, 0, 21},
      {"tails", 640, 320, 192, {300, 0, 5, 257, 64}, 2, 0, 22},
  });
}

TEST(ExpertDgradGpu, DeepSeekV3PerRankShape) {
  EPFLOW_SKIP_WITHOUT_GPU();
  // H = 7168, I = 2048, 32 local experts of 190..321 rows (one empty, one with a single row); 4
  // rows per expert checked to keep the CPU reference short.
  std::vector<int64_t> rows(32);
  for (int32_t e = 0; e < 32; ++e) rows[e] = 190 + (e * 37) % 132;
  rows[7] = 0;
  rows[19] = 1;
  run_cases({
      {"down: dh = dz W_down", 7168, 7168, 2048, rows, 2, 4, 31},
      {"gate/up: dx = [dg | du] [W_gate; W_up]", 4096, 2048, 7168, rows, 2, 4, 32},
  });
}

TEST(ExpertDgradGpu, RejectsBadShapesBeforeLaunching) {
  // Argument checks only: no device needed.
  kernels::ExpertDgradArgs args;
  args.segments.experts = 1;
  args.segments.max_rows = 128;
  args.k = 100;  // not a multiple of 64
  args.n = 64;
  EXPECT_EQ(kernels::launch_expert_dgrad(args, nullptr), cudaErrorInvalidValue);
  args.k = 128;
  args.k0 = 96;  // the split is not a multiple of 64
  EXPECT_EQ(kernels::launch_expert_dgrad(args, nullptr), cudaErrorInvalidValue);
  args.k0 = 64;  // shapes fine, pointers missing
  EXPECT_EQ(kernels::launch_expert_dgrad(args, nullptr), cudaErrorInvalidValue);
  args.segments.max_rows = 100;  // not a multiple of the M tile
  EXPECT_EQ(kernels::launch_expert_dgrad(args, nullptr), cudaErrorInvalidValue);
  args.segments.max_rows = 128;
  args.segments.experts = 0;  // nothing to do
  EXPECT_EQ(kernels::launch_expert_dgrad(args, nullptr), cudaSuccess);
}

}  // namespace
}  // namespace epflow
