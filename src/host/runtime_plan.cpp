#include "host/runtime_plan.h"

#include <algorithm>
#include <cmath>

#include "common/routing_schedule.h"
#include "common/status_util.h"

namespace epflow::runtime {

int64_t two_wave_minibatch_rows(const LayerConfig& c, const TileShape& tile, int32_t compute_sms) {
  const int64_t narrow_n = std::min(2 * c.intermediate, c.hidden);
  const int64_t rows = sched::ceil_div(int64_t{2} * compute_sms * tile.m * tile.n, narrow_n);
  return sched::round_up(rows, tile.m);
}

namespace {

// comm = S·r / (1 + r), r = margin · bytes_per_row_over_2H · R_gemm / (3·I·R_pull).
int32_t comm_sms_for(const LayerConfig& c, int32_t sm_count, double rows_per_row) {
  const double r = 2.0 * rows_per_row * kGemmFlopsPerComputeSm /
                   (3.0 * static_cast<double>(c.intermediate) * kPullBytesPerCommSm);
  const auto comm = static_cast<int32_t>(std::lround(sm_count * r / (1.0 + r)));
  return std::max(1, std::min(std::max(comm, kMinCommSms), sm_count / 4));
}

}  // namespace

int32_t default_comm_sms(const LayerConfig& c, int32_t sm_count) {
  return comm_sms_for(c, sm_count, 1.0);
}

int32_t default_backward_comm_sms(const LayerConfig& c, int32_t sm_count) {
  return comm_sms_for(c, sm_count, 2.0);
}

bool fp8_weight_gradients_pay(const LayerConfig& c, int64_t tokens) {
  return tokens * c.top_k >= kFp8WgradMinRowsPerExpert * c.experts_per_rank();
}

int64_t default_saved_gate_up_rows(const LayerConfig& c, int64_t table_rows) {
  const double balanced = static_cast<double>(c.max_tokens_per_rank) * c.top_k;
  const int64_t rows = static_cast<int64_t>(balanced * (1.0 + kSavedRowsMargin)) +
                       int64_t{c.experts_per_rank()} * kTileRows;
  return std::min(sched::round_up(rows, kTileRows), table_rows);
}

Status make_plan(const LayerConfig& c, int32_t sm_count, LayerPlan* plan) {
  if (Status s = validate(c); !s.ok()) return s;
  LayerPlan p;
  p.sm_count = sm_count;
  p.comm_sms = c.comm_sms > 0 ? c.comm_sms : default_comm_sms(c, sm_count);
  if (p.comm_sms < 1 || p.comm_sms >= sm_count)
    return invalid_argument("comm_sms (", p.comm_sms, ") must leave at least one of the device's ",
                            sm_count, " SMs for compute");
  p.compute_sms = sm_count - p.comm_sms;

  if (c.minibatch_rows > 0 && c.minibatch_rows % p.tile.m != 0)
    return invalid_argument("minibatch_rows (", c.minibatch_rows,
                            ") must be a multiple of the GEMM tile "
                            "height (",
                            p.tile.m, ")");
  p.minibatch_rows =
      c.minibatch_rows > 0 ? c.minibatch_rows : two_wave_minibatch_rows(c, p.tile, p.compute_sms);

  sched::ScheduleShape shape{c.ep_size, c.ep_rank, c.experts_per_rank(), c.top_k, p.tile.m};
  p.max_routed_rows = sched::pull_table_capacity(shape, c.max_tokens_per_rank);

  if (c.ring_rows > 0) {
    if (c.ring_rows < p.minibatch_rows)
      return invalid_argument("ring_rows (", c.ring_rows, ") must hold at least one minibatch (",
                              p.minibatch_rows, " rows)");
    p.ring_rows = c.ring_rows / p.minibatch_rows * p.minibatch_rows;
  } else {
    // Modest by default; never larger than the most rows a call can route here.
    const int64_t cap = sched::round_up(p.max_routed_rows, p.minibatch_rows);
    p.ring_rows = std::min<int64_t>(kDefaultRingMinibatches * p.minibatch_rows, cap);
  }
  // Per ring row: the routed x row (H) and its SwiGLU output (I), bf16 (the expert output goes
  // straight from the down GEMM's registers to the owner's combine slot).
  p.ring_bytes = p.ring_rows * (c.hidden + c.intermediate) * 2;
  p.backward_comm_sms = std::min(default_backward_comm_sms(c, sm_count), sm_count - 1);
  const int64_t table_rows = sched::round_up(p.max_routed_rows, p.tile.m);
  // NOTES: an FP8 layer's contexts keep every row's g | u: the backward's recompute of the rows
  // past the bound is a bf16 GEMM, whose g | u would not be the FP8 forward's.
  p.saved_gate_up_rows =
      c.dtype == DType::kFP8Blockwise ? table_rows
      : c.saved_gate_up_rows > 0
          ? std::min(sched::round_up(c.saved_gate_up_rows, p.tile.m), table_rows)
          : default_saved_gate_up_rows(c, table_rows);
  *plan = p;
  return Status::ok_status();
}

}  // namespace epflow::runtime
