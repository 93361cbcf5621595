// Host "runtime": resolves a LayerConfig's automatic knobs (0 = auto) into the concrete plan the
// kernels run with, from the shapes, the tile sizes and the device's SM count. Pure host code,
// testable without a GPU.
#pragma once

#include <cstdint>

#include "common/tile.h"
#include "epflow/config.h"
#include "epflow/status.h"

namespace epflow::runtime {

// GEMM tile of the expert FFN (common/tile.h).
struct TileShape {
  int32_t m = kTileRows;
  int32_t n = kTileCols;
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
  int32_t backward_comm_sms = 0;  // backward megakernel: communication partition
  // Pull-table rows whose g | u a SavedContext keeps (multiple of tile.m, <= the capacity
  // rounded to the tile); the backward recomputes the rows past it.
  int64_t saved_gate_up_rows = 0;
};

// Default rows of kept g | u: what balanced routing brings a rank (T_max·K: every rank sends
// T_max·K rows spread over the ranks) plus kSavedRowsMargin of it and one tile of padding per
// local expert; never more than the pull table. At EP = 1 that is the whole table (every
// routed row is this rank's); at EP = w it is about 1.25 / w of it.
inline constexpr double kSavedRowsMargin = 0.25;
int64_t default_saved_gate_up_rows(const LayerConfig& config, int64_t table_rows);

// Default communication SMs: enough pull bandwidth to feed the compute partition. A routed row
// brings 2·H bytes and costs 6·H·I FLOPs of GEMM, so C compute SMs at R_gemm each consume
// C·R_gemm / (3·I) bytes/s of rows, whatever H; one communication SM pulls R_pull. With a 2x
// margin (dispatch must run ahead, and the first minibatch waits on pulls only),
// comm = S·r / (1 + r) with r = 2·R_gemm / (3·I·R_pull), rounded, at least kMinCommSms and at
// most a quarter of the SMs: 6 for I = 2048, 8 for I = 1536, 15 for I = 768 on 132 SMs. The two
// rates are the megakernel's own per-SM rates on H200 (bulk-copy pulls over NVLink, wgmma tiles);
// docs/benchmarks.md has the trace they come from and the SM sweep that checked these defaults.
inline constexpr double kGemmFlopsPerComputeSm = 4.6e12;
inline constexpr double kPullBytesPerCommSm = 31e9;
inline constexpr int32_t kMinCommSms = 4;
int32_t default_comm_sms(const LayerConfig& config, int32_t sm_count);
// The backward megakernel's communication SMs: the forward's rule with twice the bytes per
// row (it pulls dy for its GEMMs and x for the weight gradients: 4·H bytes against the same
// 6·H·I FLOPs of its two GEMMs), at most a quarter of the SMs: 12 for I = 2048, 15 for I = 1536,
// 27 for I = 768 on 132 SMs.
int32_t default_backward_comm_sms(const LayerConfig& config, int32_t sm_count);

// An FP8 training layer's weight gradients: in FP8 (operands quantized along the tokens) when a
// call brings each local expert at least kFp8WgradMinRowsPerExpert routed rows on average
// (T·K / experts per rank, T this rank's tokens), else in bf16 on the dequantized rows: with one
// 128-row K block per expert the operands' transposed quantization costs more than the FP8 GEMMs
// save, from four it pays (docs/benchmarks.md, the FP8 weight gradients).
inline constexpr int64_t kFp8WgradMinRowsPerExpert = 256;
bool fp8_weight_gradients_pay(const LayerConfig& config, int64_t tokens);

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
