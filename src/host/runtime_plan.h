// Host "runtime": resolves a LayerConfig's automatic knobs (0 = auto) into the concrete plan the
// kernels run with, from the shapes, the tile sizes and the device's SM count. Pure host code,
// testable without a GPU.
#pragma once

#include <cstdint>

#include "epflow/config.h"
#include "epflow/status.h"

namespace epflow::runtime {

// GEMM tile of the expert FFN. NOTES: 128x256 is the Hopper wgmma tile the seeds' minibatch rule
// is stated for; issue [C] picks the shipped tiles by heuristic and will feed them in here.
struct TileShape {
  int32_t m = 128;
  int32_t n = 256;
};

struct LayerPlan {
  TileShape tile;
  int32_t sm_count = 0;
  int32_t comm_sms = 0;  // communication partition of the megakernel
  int32_t compute_sms = 0;
  int64_t minibatch_rows = 0;   // multiple of tile.m
  int64_t ring_rows = 0;        // multiple of minibatch_rows
  int64_t max_routed_rows = 0;  // pull-table capacity: every slot of every rank, plus padding
  int64_t ring_bytes = 0;       // routed x rows + SwiGLU intermediates (bf16)
};

// Default communication SMs. NOTES: MoK tuned 24 of 148 SMs for BF16 forward. Measured here
// (docs/benchmarks.md, knob sweep, DeepSeek-V3 shape, EP 2, 2xH200, cdf9839): 8 was within 1% of
// the best of 8..32 at 512 and 2048 tokens/rank and among the best at 8192 (16: within 3% at
// 512 and 2048, 5-10% behind at 8192); the communication SMs idle 60% of the time at 16. With
// more ranks a larger share of the rows crosses NVLink: 16 there, until EP 4/8 are measured.
inline constexpr int32_t kDefaultCommSms = 8;
inline constexpr int32_t kDefaultCommSmsManyRanks = 16;  // ep_size > 2
// Default ring: this many minibatches, so dispatch runs ahead of compute and the down GEMM of
// minibatch j can run after the gate/up GEMM of j + 1 (which needs at least 2).
inline constexpr int32_t kDefaultRingMinibatches = 4;

// Two full waves rule: the smallest row count whose tile grid covers the compute SMs twice in
// the narrower of the two GEMMs, T >= 2 * C * BM * BN / min(2I, H), rounded up to whole tiles.
int64_t two_wave_minibatch_rows(const LayerConfig& config, const TileShape& tile,
                                int32_t compute_sms);

// Fills plan from config (knobs honoured where set) for a device with sm_count SMs.
Status make_plan(const LayerConfig& config, int32_t sm_count, LayerPlan* plan);

}  // namespace epflow::runtime
