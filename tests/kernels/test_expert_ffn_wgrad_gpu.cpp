// The backward's weight-gradient GEMM (launch_expert_wgrad: dw[e] = lhs_eᵀ rhs_e over expert e's
// rows) against a CPU reference in double on the same bf16 inputs: ragged segments (empty experts,
// whose gradient must be exactly zero; 1, 127, 128, 129 and a few hundred rows), m and n tails,
// and the DeepSeek-V3 per-rank shapes of dW_down and dW_gate; bf16 and fp32 outputs, written and
// accumulated, lhs rows wider than m (the backward's [dg | du]). dw is poisoned first: every
// element must be written.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/routing_schedule.h"
#include "expert_test_data.h"
#include "gpu_test_util.h"
#include "kernels/expert_wgrad.cuh"

namespace epflow {
namespace {

using namespace test_data;

struct Case {
  std::string name;
  int64_t m, n;               // dw[e] is [m, n]
  std::vector<int64_t> rows;  // routed rows per local expert (before padding)
  int64_t sample_m;           // 0: check every row of dw[e]; else this many rows of it
  uint64_t seed;
  bool fp32_out = false;
  int calls = 1;              // > 1: the later calls accumulate (dw = calls * lhsᵀ rhs)
  int64_t lhs_skip = 0;       // lhs rows are [lhs_skip junk | m used] columns wide
  int32_t max_ctas = 0;       // > 0: so few CTAs that each runs many tiles
  // Real rows per expert passed (expert_rows): K stops at the 64-row block of the last real row,
  // and the padding past that block is poisoned (must not be read).
  bool real_rows = false;
};

// rows x cols of segment data: routed rows random, padding rows zero (as the layer leaves them),
// rows past the last segment poisoned (never read); with real_rows, also each segment's padding
// past the 64-row block its real rows end in.
std::vector<uint16_t> segment_rows(const std::vector<int64_t>& seg, const std::vector<int64_t>& rows,
                                   int64_t max_rows, int64_t cols, uint64_t seed, uint64_t stream,
                                   bool real_rows) {
  std::vector<uint16_t> v(max_rows * cols, kPoison);
  for (size_t e = 0; e + 1 < seg.size(); ++e) {
    parallel_for(rows[e], [&](int64_t i) {
      const int64_t r = seg[e] + i;
      for (int64_t k = 0; k < cols; ++k)
        v[r * cols + k] =
            float_to_bf16(signed_unit(seed, stream, static_cast<uint64_t>(r * cols + k)));
    });
    const int64_t zero_end = real_rows ? seg[e] + sched::round_up(rows[e], 64) : seg[e + 1];
    std::fill(v.begin() + (seg[e] + rows[e]) * cols, v.begin() + zero_end * cols, uint16_t{0});
  }
  return v;
}

void run_case(const Case& c) {
  SCOPED_TRACE(::testing::Message() << c.name << ": m " << c.m << ", n " << c.n << ", experts "
                                    << c.rows.size());
  const int32_t E = static_cast<int32_t>(c.rows.size());
  const int64_t M = c.m, N = c.n;
  std::vector<int64_t> seg(E + 1, 0);
  for (int32_t e = 0; e < E; ++e) seg[e + 1] = seg[e] + sched::round_up(c.rows[e], kTileRows);
  const int64_t max_rows = seg[E] + kTileRows;  // one spare tile, poisoned
  const int64_t lhs_ld = c.lhs_skip + M;
  const std::vector<uint16_t> lhs =
      segment_rows(seg, c.rows, max_rows, lhs_ld, c.seed, 1, c.real_rows);
  const std::vector<uint16_t> rhs = segment_rows(seg, c.rows, max_rows, N, c.seed, 2, c.real_rows);
  std::vector<int32_t> real(c.rows.begin(), c.rows.end());

  const size_t b = sizeof(uint16_t);
  int64_t* d_seg = nullptr;
  int32_t* d_real = nullptr;
  void *d_lhs = nullptr, *d_rhs = nullptr, *d_dw = nullptr;
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_seg, sizeof(int64_t) * (E + 1)));
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_real, sizeof(int32_t) * (E + 1)));
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_lhs, b * lhs.size()));
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_rhs, b * rhs.size()));
  const size_t out_bytes = c.fp32_out ? 4 : 2;
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_dw, out_bytes * E * M * N));
  EPFLOW_CUDA_CHECK(
      cudaMemcpy(d_seg, seg.data(), sizeof(int64_t) * (E + 1), cudaMemcpyHostToDevice));
  if (E > 0)
    EPFLOW_CUDA_CHECK(
        cudaMemcpy(d_real, real.data(), sizeof(int32_t) * E, cudaMemcpyHostToDevice));
  EPFLOW_CUDA_CHECK(cudaMemcpy(d_lhs, lhs.data(), b * lhs.size(), cudaMemcpyHostToDevice));
  EPFLOW_CUDA_CHECK(cudaMemcpy(d_rhs, rhs.data(), b * rhs.size(), cudaMemcpyHostToDevice));
  EPFLOW_CUDA_CHECK(cudaMemset(d_dw, 0xFF, out_bytes * E * M * N));  // poison: NaN

  kernels::ExpertWgradArgs args;
  args.segments.experts = E;
  args.segments.max_rows = max_rows;
  args.segments.seg_offset = d_seg;
  if (c.real_rows) args.segments.expert_rows = d_real;
  args.m = M;
  args.n = N;
  args.lhs = static_cast<const __nv_bfloat16*>(d_lhs) + c.lhs_skip;
  args.lhs_ld = lhs_ld;
  args.rhs = static_cast<const __nv_bfloat16*>(d_rhs);
  args.dw = d_dw;
  args.fp32_out = c.fp32_out;
  args.max_ctas = c.max_ctas;
  for (int call = 0; call < c.calls; ++call) {
    args.accumulate = call > 0;
    EPFLOW_CUDA_CHECK(kernels::launch_expert_wgrad(args, nullptr));
  }
  EPFLOW_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<float> dw = fetch_dw(d_dw, c.rows, M, N, c.fp32_out);
  for (void* p : {static_cast<void*>(d_seg), static_cast<void*>(d_real), d_lhs, d_rhs, d_dw}) EPFLOW_CUDA_CHECK(cudaFree(p));

  // Checked rows of dw[e] against sum_r lhs[r, i] rhs[r, :] in double, per row and per expert.
  for (int32_t e = 0; e < E; ++e) {
    if (c.rows[e] == 0) continue;
    const std::vector<int64_t> checked = sampled_rows(M, c.sample_m);
    std::vector<double> err(checked.size(), 0.0), ref(checked.size(), 0.0);
    parallel_for(static_cast<int64_t>(checked.size()), [&](int64_t s) {
      const int64_t i = checked[s];
      std::vector<double> acc(N, 0.0);
      for (int64_t r = seg[e]; r < seg[e] + c.rows[e]; ++r) {
        const double l = c.calls * double(bf16_to_float(lhs[r * lhs_ld + c.lhs_skip + i]));
        for (int64_t j = 0; j < N; ++j) acc[j] += l * bf16_to_float(rhs[r * N + j]);
      }
      for (int64_t j = 0; j < N; ++j) {
        const double d = dw[(e * M + i) * N + j] - acc[j];
        err[s] += d * d;
        ref[s] += acc[j] * acc[j];
      }
    });
    double err_e = 0, ref_e = 0;
    for (size_t s = 0; s < checked.size(); ++s) {
      EXPECT_LE(std::sqrt(err[s] / ref[s]), kMaxRelError)
          << "expert " << e << ", row " << checked[s] << " of dw";
      err_e += err[s];
      ref_e += ref[s];
    }
    EXPECT_LE(std::sqrt(err_e / ref_e), kMaxRelError) << "expert " << e;
  }
}

TEST(ExpertWgradGpu, RaggedSegmentsSmallShapes) {
  EPFLOW_SKIP_WITHOUT_GPU();
  // Smallest shape (half an m tile, a quarter n tile); empty experts at the start, in the
  // middle and at the end; K of 1, 127, 128 and 129 rows. Then m and n tails (1.5 m tiles, 1.25
  // n tiles) with a few hundred rows; then nothing routed at all (every dw[e] zero).
  run_case({"minimum", 64, 64, {0, 1, 127, 0, 128, 129, 0}, 0, 41});
  run_case({"tails", 192, 320, {300, 0, 5, 257, 64}, 0, 42});
  run_case({"nothing routed", 128, 256, {0, 0}, 0, 43});
}

// The layer passes the real rows per expert: K ends at the 64-row block of the last real row (1,
// 63, 64, 65, 127, 129, 191 and 300 rows: padding of 0 to 63 rows read, the rest poisoned).
TEST(ExpertWgradGpu, RealRowsEndTheReduction) {
  EPFLOW_SKIP_WITHOUT_GPU();
  const std::vector<int64_t> rows = {1, 0, 63, 64, 65, 127, 129, 191, 300, 0};
  Case c{"real rows, bf16", 192, 320, rows, 0, 44};
  c.real_rows = true;
  run_case(c);
  c = {"real rows, fp32 accumulated, 2 CTAs", 192, 320, rows, 0, 45, true, 2, 0, 2};
  c.real_rows = true;
  run_case(c);
}

// One to three CTAs for every tile (the backward leaves SMs to its side stream; here the extreme):
// each CTA runs tiles of experts with 0 to 600 rows (1 to 10 k-blocks) in turn through one stage
// ring, and an m of 9.5 row tiles.
TEST(ExpertWgradGpu, FewCtasManyTilesEach) {
  EPFLOW_SKIP_WITHOUT_GPU();
  const std::vector<int64_t> rows = {257, 5, 0, 600, 256, 1, 300, 128, 64};
  run_case({"bf16, 2 CTAs", 1216, 320, rows, 0, 71, false, 1, 0, 2});
  run_case({"bf16 accumulated, 3 CTAs", 1216, 320, rows, 0, 72, false, 2, 0, 3});
  run_case({"fp32, 1 CTA", 1216, 320, rows, 0, 73, true, 1, 0, 1});
}

TEST(ExpertWgradGpu, Fp32AccumulatedAndWideLhsRows) {
  EPFLOW_SKIP_WITHOUT_GPU();
  // The layer's uses: fp32 gradients, accumulated over calls, lhs the second half of [dg | du].
  const std::vector<int64_t> rows = {0, 1, 127, 129, 300, 0};
  run_case({"fp32", 192, 320, rows, 0, 61, true, 1, 0});
  run_case({"fp32 accumulated", 192, 320, rows, 0, 62, true, 3, 0});
  run_case({"bf16 accumulated", 128, 256, rows, 0, 63, false, 2, 0});
  run_case({"wide lhs rows", 128, 256, rows, 0, 64, false, 1, 128});
  run_case({"wide lhs rows, fp32", 128, 256, rows, 0, 65, true, 2, 128});
}

TEST(ExpertWgradGpu, DeepSeekV3PerRankShapes) {
  EPFLOW_SKIP_WITHOUT_GPU();
  // dW_down = dzᵀ h ([H, I] = [7168, 2048]) and dW_gate = dgᵀ x ([I, H]), 8 experts of 0..321
  // rows; 6 rows of each dw[e] checked to keep the CPU reference short.
  const std::vector<int64_t> rows = {190, 0, 321, 1, 256, 129, 300, 77};
  run_case({"dW_down", 7168, 2048, rows, 6, 51});
  run_case({"dW_gate", 2048, 7168, rows, 6, 52});
}

TEST(ExpertWgradGpu, RejectsBadShapesBeforeLaunching) {
  // Argument checks only: no device needed.
  kernels::ExpertWgradArgs args;
  args.segments.experts = 1;
  args.segments.max_rows = 128;
  args.m = 100;  // not a multiple of 64
  args.n = 64;
  EXPECT_EQ(kernels::launch_expert_wgrad(args, nullptr), cudaErrorInvalidValue);
  args.m = 64;
  args.segments.max_rows = 100;  // not a multiple of the M tile
  EXPECT_EQ(kernels::launch_expert_wgrad(args, nullptr), cudaErrorInvalidValue);
  args.segments.max_rows = 128;  // shapes fine, pointers missing
  EXPECT_EQ(kernels::launch_expert_wgrad(args, nullptr), cudaErrorInvalidValue);
  args.segments.experts = 0;  // nothing to do
  EXPECT_EQ(kernels::launch_expert_wgrad(args, nullptr), cudaSuccess);
}

}  // namespace
}  // namespace epflow
