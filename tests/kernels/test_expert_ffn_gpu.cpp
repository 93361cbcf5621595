// The expert FFN kernels (gate/up with SwiGLU, then down) against a CPU reference in double on
// the same bf16-rounded inputs: ragged expert segments (empty experts at the start, middle and
// end; 1, 127, 128, 129 and a few hundred rows; last tiles of 16 .. 127 rows), N tails (N not a
// multiple of the kernels' N tile), the smallest shape and the DeepSeek-V3 per-rank shape.
// Outputs are poisoned before the launch, so unwritten rows show up, and rows past the last
// segment must keep the poison.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
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
  int64_t hidden, intermediate;
  std::vector<int64_t> rows;  // routed rows per local expert (before padding)
  int64_t spare_tiles;        // M tiles of max_rows past the last segment
  int64_t sample_per_expert;  // 0: check every routed row; else this many rows per expert
  uint64_t seed;
};

struct RowError {  // squared norms over one checked row
  double h_err = 0, h_ref = 0, y_err = 0, y_ref = 0;
};

// pass_expert_rows: give the kernels the real rows per expert (as the layer does), which lets
// warpgroups skip all-padding halves of a tile; padding rows then need not be written.
void run_case(const Case& c, bool pass_expert_rows) {
  const int64_t H = c.hidden, I = c.intermediate;
  const int32_t E = static_cast<int32_t>(c.rows.size());

  std::vector<int64_t> seg(E + 1, 0);
  for (int32_t e = 0; e < E; ++e) seg[e + 1] = seg[e] + sched::round_up(c.rows[e], kTileRows);
  const int64_t total = seg[E];
  const int64_t max_rows = total + c.spare_tiles * kTileRows;

  // x: routed rows random; padding rows zero (the layer zero-fills them); rows past the last
  // segment poisoned (no correct kernel reads them).
  std::vector<uint16_t> x(max_rows * H, kPoison);
  for (int32_t e = 0; e < E; ++e)
    parallel_for(c.rows[e], [&](int64_t i) {
      const int64_t r = seg[e] + i;
      for (int64_t k = 0; k < H; ++k)
        x[r * H + k] = float_to_bf16(signed_unit(c.seed, 1, static_cast<uint64_t>(r * H + k)));
    });
  for (int32_t e = 0; e < E; ++e)
    std::fill(x.begin() + (seg[e] + c.rows[e]) * H, x.begin() + seg[e + 1] * H, uint16_t{0});

  // Weights ~ U(-1, 1) / sqrt(fan_in): outputs stay O(1).
  std::vector<uint16_t> w_gate, w_up, w_down;
  fill_uniform(&w_gate, E * I, H, static_cast<float>(1.0 / std::sqrt(double(H))), c.seed, 2);
  fill_uniform(&w_up, E * I, H, static_cast<float>(1.0 / std::sqrt(double(H))), c.seed, 3);
  fill_uniform(&w_down, E * H, I, static_cast<float>(1.0 / std::sqrt(double(I))), c.seed, 4);

  int64_t* d_seg = nullptr;
  int32_t* d_rows = nullptr;
  std::vector<int32_t> rows32(c.rows.begin(), c.rows.end());
  void *d_x = nullptr, *d_gate = nullptr, *d_up = nullptr, *d_down = nullptr, *d_h = nullptr,
       *d_y = nullptr;
  const size_t b = sizeof(uint16_t);
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_seg, sizeof(int64_t) * (E + 1)));
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_rows, sizeof(int32_t) * (E + 1)));
  EPFLOW_CUDA_CHECK(
      cudaMemcpy(d_rows, rows32.data(), sizeof(int32_t) * E, cudaMemcpyHostToDevice));
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_x, b * x.size()));
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_gate, b * w_gate.size()));
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_up, b * w_up.size()));
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_down, b * w_down.size()));
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_h, b * max_rows * I));
  EPFLOW_CUDA_CHECK(cudaMalloc(&d_y, b * max_rows * H));
  EPFLOW_CUDA_CHECK(
      cudaMemcpy(d_seg, seg.data(), sizeof(int64_t) * (E + 1), cudaMemcpyHostToDevice));
  EPFLOW_CUDA_CHECK(cudaMemcpy(d_x, x.data(), b * x.size(), cudaMemcpyHostToDevice));
  EPFLOW_CUDA_CHECK(cudaMemcpy(d_gate, w_gate.data(), b * w_gate.size(), cudaMemcpyHostToDevice));
  EPFLOW_CUDA_CHECK(cudaMemcpy(d_up, w_up.data(), b * w_up.size(), cudaMemcpyHostToDevice));
  EPFLOW_CUDA_CHECK(cudaMemcpy(d_down, w_down.data(), b * w_down.size(), cudaMemcpyHostToDevice));
  EPFLOW_CUDA_CHECK(cudaMemset(d_h, 0xFF, b * max_rows * I));  // poison: 0xFFFF is a NaN
  EPFLOW_CUDA_CHECK(cudaMemset(d_y, 0xFF, b * max_rows * H));

  kernels::ExpertFfnArgs args;
  args.experts = E;
  args.hidden = H;
  args.intermediate = I;
  args.max_rows = max_rows;
  args.seg_offset = d_seg;
  args.expert_rows = pass_expert_rows ? d_rows : nullptr;
  args.x = static_cast<const __nv_bfloat16*>(d_x);
  args.w_gate = static_cast<const __nv_bfloat16*>(d_gate);
  args.w_up = static_cast<const __nv_bfloat16*>(d_up);
  args.w_down = static_cast<const __nv_bfloat16*>(d_down);
  args.h = static_cast<__nv_bfloat16*>(d_h);
  args.y = static_cast<__nv_bfloat16*>(d_y);
  cudaStream_t stream = nullptr;
  EPFLOW_CUDA_CHECK(cudaStreamCreate(&stream));
  EPFLOW_CUDA_CHECK(kernels::launch_expert_ffn(args, stream));
  EPFLOW_CUDA_CHECK(cudaStreamSynchronize(stream));
  EPFLOW_CUDA_CHECK(cudaStreamDestroy(stream));

  std::vector<uint16_t> h(max_rows * I), y(max_rows * H);
  EPFLOW_CUDA_CHECK(cudaMemcpy(h.data(), d_h, b * h.size(), cudaMemcpyDeviceToHost));
  EPFLOW_CUDA_CHECK(cudaMemcpy(y.data(), d_y, b * y.size(), cudaMemcpyDeviceToHost));
  for (void* p : {static_cast<void*>(d_seg), static_cast<void*>(d_rows), d_x, d_gate, d_up, d_down, d_h, d_y})
    EPFLOW_CUDA_CHECK(cudaFree(p));

  // (a) every routed row (and, without expert_rows, every padding row too) was written; (b)
  // rows past the last segment still hold the poison, bit for bit.
  auto check_written = [&](const std::vector<uint16_t>& out, int64_t cols, const char* what) {
    expect_written(out, cols, seg, c.rows, pass_expert_rows, max_rows, what);
  };
  check_written(h, I, "h");
  check_written(y, H, "y");

  // (c) h against silu(x Wg^T) * (x Wu^T), y against h_gpu Wd^T (the GPU's own bf16 h, so the
  // two checks are independent), in double. A product of two bf16 values is exact in float.
  struct Sample {
    int32_t expert;
    int64_t row;
  };
  std::vector<Sample> samples;
  for (int32_t e = 0; e < E; ++e)
    for (int64_t i : sampled_rows(c.rows[e], c.sample_per_expert))
      samples.push_back({e, seg[e] + i});
  std::vector<RowError> errors(samples.size());
  parallel_for(static_cast<int64_t>(samples.size()), [&](int64_t s) {
    const int32_t e = samples[s].expert;
    const int64_t r = samples[s].row;
    std::vector<float> xf(H), hf(I);
    for (int64_t k = 0; k < H; ++k) xf[k] = bf16_to_float(x[r * H + k]);
    for (int64_t n = 0; n < I; ++n) hf[n] = bf16_to_float(h[r * I + n]);
    RowError& err = errors[s];
    for (int64_t n = 0; n < I; ++n) {
      const uint16_t* wg = w_gate.data() + (e * I + n) * H;
      const uint16_t* wu = w_up.data() + (e * I + n) * H;
      double g = 0, u = 0;
      for (int64_t k = 0; k < H; ++k) {
        g += static_cast<double>(xf[k] * bf16_to_float(wg[k]));
        u += static_cast<double>(xf[k] * bf16_to_float(wu[k]));
      }
      const double ref = g / (1.0 + std::exp(-g)) * u;
      err.h_err += (hf[n] - ref) * (hf[n] - ref);
      err.h_ref += ref * ref;
    }
    for (int64_t j = 0; j < H; ++j) {
      const uint16_t* wd = w_down.data() + (e * H + j) * I;
      double ref = 0;
      for (int64_t n = 0; n < I; ++n) ref += static_cast<double>(hf[n] * bf16_to_float(wd[n]));
      const double out = bf16_to_float(y[r * H + j]);
      err.y_err += (out - ref) * (out - ref);
      err.y_ref += ref * ref;
    }
  });

  // Per expert as required; per row too, so an error confined to one row (a wrong A row, a
  // mis-indexed fragment) cannot hide in a segment's norm.
  std::vector<RowError> per_expert(E);
  for (size_t s = 0; s < samples.size(); ++s) {
    const RowError& err = errors[s];
    RowError& sum = per_expert[samples[s].expert];
    sum.h_err += err.h_err;
    sum.h_ref += err.h_ref;
    sum.y_err += err.y_err;
    sum.y_ref += err.y_ref;
    const double rel_h = std::sqrt(err.h_err / err.h_ref), rel_y = std::sqrt(err.y_err / err.y_ref);
    EXPECT_LE(rel_h, kMaxRelError)
        << "h, expert " << samples[s].expert << ", row " << samples[s].row;
    EXPECT_LE(rel_y, kMaxRelError)
        << "y, expert " << samples[s].expert << ", row " << samples[s].row;
  }
  for (int32_t e = 0; e < E; ++e) {
    if (c.rows[e] == 0) continue;
    EXPECT_LE(std::sqrt(per_expert[e].h_err / per_expert[e].h_ref), kMaxRelError)
        << "h, expert " << e;
    EXPECT_LE(std::sqrt(per_expert[e].y_err / per_expert[e].y_ref), kMaxRelError)
        << "y, expert " << e;
  }
}

void run_cases(const std::vector<Case>& cases) {
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << c.name << ": H " << c.hidden << ", I " << c.intermediate
                                      << ", experts " << c.rows.size());
    with_and_without_expert_rows([&](bool pass_expert_rows) { run_case(c, pass_expert_rows); });
  }
}

TEST(ExpertFfnGpu, RaggedSegmentsSmallShapes) {
  EPFLOW_SKIP_WITHOUT_GPU();
  run_cases({
      // Smallest shape (K = one 64-wide k tile, N = half an N tile); empty experts at the
      // start, in the middle and at the end; 1, 127, 128 and 129 rows.
      {"minimum", 64, 64, {0, 1, 127, 0, 128, 129, 0}, 3, 0, 1},
      // N tails in both kernels (I = 2.5, H = 1.5 N tiles), K of 3 and 5 k tiles.
      {"tails", 192, 320, {300, 0, 5, 257, 64}, 2, 0, 2},
      // Last tiles of 16 .. 127 rows (one warpgroup's rows or both warpgroups'), alone and after
      // whole tiles; H = 128 is half a down N tile.
      {"last tiles", 128, 192, {16, 17, 33, 48, 64, 65, 80, 96, 97, 112, 113, 127, 240, 129},
       1, 0, 7},
      // One expert, one row, no spare tiles: the grid is exactly the one M tile.
      {"single row", 128, 256, {1}, 0, 0, 3},
      // Nothing routed: every tile exits, both outputs keep the poison everywhere.
      {"nothing routed", 64, 128, {0, 0, 0}, 2, 0, 4},
  });
}

TEST(ExpertFfnGpu, GptOssShapeWithNTail) {
  EPFLOW_SKIP_WITHOUT_GPU();
  // H = I = 2880 = 45 * 64: a half N tile at the end of both GEMMs.
  run_cases({{"gpt-oss", 2880, 2880, {129, 0, 1, 300}, 1, 0, 5}});
}

TEST(ExpertFfnGpu, DeepSeekV3PerRankShape) {
  EPFLOW_SKIP_WITHOUT_GPU();
  // H = 7168, I = 2048, 32 local experts, 190..321 rows each (one expert empty, one with a
  // single row); a spread of 8 rows per expert is checked to keep the CPU reference short.
  std::vector<int64_t> rows(32);
  for (int32_t e = 0; e < 32; ++e) rows[e] = 190 + (e * 37) % 132;
  rows[7] = 0;
  rows[19] = 1;
  run_cases({{"DeepSeek-V3 per rank", 7168, 2048, rows, 4, 8, 6}});
}

TEST(ExpertFfnGpu, RejectsBadShapesBeforeLaunching) {
  // Argument checks only: no device needed.
  kernels::ExpertFfnArgs args;
  args.experts = 1;
  args.hidden = 100;  // not a multiple of 64
  args.intermediate = 64;
  args.max_rows = 128;
  EXPECT_EQ(kernels::launch_expert_ffn(args, nullptr), cudaErrorInvalidValue);
  args.hidden = 64;
  args.max_rows = 100;  // not a multiple of the M tile
  EXPECT_EQ(kernels::launch_expert_ffn(args, nullptr), cudaErrorInvalidValue);
  args.max_rows = 128;  // shapes fine, pointers missing
  EXPECT_EQ(kernels::launch_expert_ffn(args, nullptr), cudaErrorInvalidValue);
  args.experts = 0;  // nothing to do
  EXPECT_EQ(kernels::launch_expert_ffn(args, nullptr), cudaSuccess);
}

}  // namespace
}  // namespace epflow
