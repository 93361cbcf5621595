// The host side of the megakernel's counters region: its size (megakernel_counter_bytes) and the
// message of the diagnostic a timed-out wait leaves in it and in host-mapped memory (describe).
// Host-only, so that it builds without the device code and tests run it on any machine.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include "common/megakernel_tasks.h"
#include "kernels/megakernel/counter_layout.h"
#include "kernels/moe_megakernel.cuh"

namespace epflow::kernels {

namespace {

// The backward pass's words for the shared task kinds and counters.
const char* task_name(bool backward, mega::TaskKind k) {
  if (!backward) return mega::task_name(k);
  switch (k) {
    case mega::TaskKind::kDispatch: return "dy pull";
    case mega::TaskKind::kGateUp: return "dhp GEMM + SwiGLU backward";
    default: return "dx GEMM + push";
  }
}
const char* counter_name(bool backward, mega::Counter c) {
  if (!backward) return mega::counter_name(c);
  switch (c) {
    case mega::Counter::kXReady: return "x_ready (pulled dy rows)";
    case mega::Counter::kHDone: return "h_done (dhp warpgroups finished [dg | du])";
    default: return "y_done (dx warpgroups finished)";
  }
}

}  // namespace

std::string describe(const MegakernelDiagnostic& d) {
  if (!d.set) return "";
  const auto kind = static_cast<mega::TaskKind>(d.task_kind);
  const bool bw = d.backward != 0;
  char msg[512];
  std::snprintf(msg, sizeof msg,
                "rank %d %s megakernel, CTA %d (%s partition) timed out after %.3f s: %s of "
                "row tile %d (n tile %d) waited for %s of ring slot %d to reach %u, it was %u "
                "(%d row tiles, ring of %d)",
                d.rank, bw ? "backward" : "forward", d.cta,
                d.compute ? "compute" : "communication", d.seconds, task_name(bw, kind),
                d.m_tile, d.n_tile, counter_name(bw, static_cast<mega::Counter>(d.counter)),
                d.slot, d.want, d.have, d.m_tiles, d.ring_tiles);
  std::string out = msg;
  // Which CTAs were inside a compute task when the wait gave up (the work it waited for; a
  // communication CTA joins the compute tasks once its dispatch is done).
  mega::TaskShape shape;
  shape.m_tiles = d.m_tiles;
  shape.ring_tiles = d.ring_tiles > 0 ? d.ring_tiles : 1;
  shape.minibatch_tiles = d.minibatch_tiles > 0 ? d.minibatch_tiles : 1;
  shape.n_gate_up = d.n_gate_up > 0 ? d.n_gate_up : 1;
  shape.n_down = d.n_down > 0 ? d.n_down : 1;
  shape.down_n_fastest = d.down_n_fastest != 0;
  const int64_t tasks = mega::num_compute_tasks(shape);
  auto task_text = [&](uint64_t word) -> std::string {
    if (word == 0) return "none";
    const int64_t i = static_cast<int64_t>(word) - 1;
    if (i >= tasks) return std::to_string(i) + " (out of range)";
    const mega::Task t = mega::compute_task(shape, i);
    const char* kinds[2][2] = {{"down", "gate/up"}, {"dx", "dhp"}};
    return std::to_string(i) + " (" + kinds[bw][t.kind == mega::TaskKind::kGateUp] + " m " +
           std::to_string(t.m_tile) + " n " + std::to_string(t.n_tile) + ")";
  };
  int listed = 0, inside = 0;
  for (int c = 0; c < d.ctas && c < kMaxDiagnosedCtas; ++c) {
    const uint64_t* p = d.progress[c];
    bool busy = false;
    for (int w = 0; w < 2; ++w) busy |= p[kConsumerTaken + w] != p[kConsumerDone + w];
    if (!busy) continue;
    ++inside;
    if (listed++ >= 8) continue;
    out += "; CTA " + std::to_string(c) + ": loads issued to task " +
           task_text(p[kProducerLoaded]);
    for (int w = 0; w < 2; ++w)
      out += ", warpgroup " + std::to_string(w) + " in " + task_text(p[kConsumerTaken + w]) +
             " after " + task_text(p[kConsumerDone + w]) + ", its stores signalled " +
             task_text(p[kStoreSignalled + w]);
  }
  out += inside ? "; " + std::to_string(inside) + " CTAs were inside a compute task"
                : "; no CTA was inside a compute task";
  return out;
}

size_t megakernel_counter_bytes(int32_t ring_tiles, int32_t sm_count) {
  // The slots' counters and the claim words (counter_layout.h), rounded up to 8 bytes, then the
  // CTAs' progress words.
  const size_t words32 =
      (mega::kCounters * static_cast<size_t>(ring_tiles) + megakernel::kClaimWords + 1) / 2 * 2;
  return sizeof(uint32_t) * words32 + sizeof(uint64_t) * kProgressWords * sm_count;
}

}  // namespace epflow::kernels
