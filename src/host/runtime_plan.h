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
// (docs/benchmarks.md, knob sweep, DeepSeek-V3 shape, EP 2, 2xH200): 16 is within 3% of the
// best of 8..32 at 512 and 2048 tokens/rank; at 8192, 8..12 were a few % faster.
inline constexpr int32_t kDefaultCommSms = 16;
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
