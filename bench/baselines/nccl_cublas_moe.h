// The NCCL + cuBLAS baseline of epflow-bench: the MoE layer forward as a competent C++ user
// writes it without EPFlow, one stream per rank, on the same inputs and layouts as EPFlow's
// public API (ForwardArgs). Exactly ONE device-to-host synchronisation per forward:
//   1. route: counting sort of the (token, k) slots by global expert id (= by destination rank,
//      then local expert), stable in slot order, giving every slot its send row and every global
//      expert its row count; ncclAllGather of those [P * E] counts (and of the rank's count of
//      bad ids), one copy to the host, THE host sync (an event just after that copy). The rows
//      are permuted into the send buffer in (destination, expert) order after the event, so that
//      copy runs while the host waits and plans;
//   2. plan, on the host, from the counts of every (source rank, local expert) pair: the
//      all-to-all split sizes, where each received row lands in expert-grouped order (a table of
//      2 * P * E + 1 block offsets), the per-expert row counts the GEMMs need;
//   3. dispatch: ncclSend/ncclRecv of the bf16 rows, every peer in one group; they arrive grouped
//      by (source rank, local expert), and one kernel moves the (source, expert) blocks into
//      expert order (none when that order already is the received one, e.g. one rank);
//   4. expert FFN: one GEMM per expert against a fused gate|up weight [E, 2I, H] (gate rows, then
//      up rows) writing [rows, 2I], the SwiGLU kernel of bench/swiglu_baseline.cuh over its two
//      halves, the down GEMM: one dense cublasGemmEx per projection for each expert with at
//      least 64 rows (where cuBLAS's grouped GEMM is slow), one cublasGemmGroupedBatchedEx call
//      per projection for the experts with fewer;
//   5. combine: results moved back into received order (the same kernel, the other way) and sent
//      home with ncclSend/ncclRecv;
//   6. y[t] = sum over k (in order, fp32) of topk_weights[t, k] * the row of slot (t, k), bf16.
// Rows come back in the order they were sent, so the receiver needs no slot metadata: the
// sender's sort positions map every returned row to its slot.
// Nothing of EPFlow's implementation is used; only its public config/argument structs.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <memory>

#include "epflow/config.h"
#include "epflow/layer.h"
#include "epflow/status.h"

namespace epflow::bench {

class NcclCublasMoe {
 public:
  // What epflow-bench prints after "baseline nccl-cublas: " (lines after the first indented).
  static constexpr const char* kDescription =
      "counting-sort permute, ncclAllGather of per-(rank, expert) counts + one host sync\n"
      "  (the only one), ncclSend/Recv all-to-all, block permute to expert order, fused gate|up\n"
      "  GEMM + SwiGLU kernel + down GEMM (one cublasGemmEx per expert with 64 rows or more,\n"
      "  cublasGemmGroupedBatchedEx for the rest), permute back, all-to-all back, weighted sum;\n"
      "  one stream per rank, whole call timed with CUDA events (host sync included)";

  // The stages forward() marks with events, named as epflow-bench names EPFlow's:
  //   0 "metadata+schedule": route sort, count exchange, the host sync, the host's plan, and the
  //     rows' permutation into the send buffer (enqueued behind the copy the host waits for, so
  //     it overlaps the host's wake-up and planning);
  //   1 "dispatch": the upload of the plan (block table, grouped GEMM pointer arrays), the row
  //     all-to-all, the permutation into expert order;
  //   2 "expert FFN": fused gate|up GEMM(s), SwiGLU, down GEMM(s);
  //   3 "combine+sum": permutation back to received order, row all-to-all back, weighted sum.
  static constexpr int kStages = 4;

  // `comm` spans config.ep_size ranks with this one as config.ep_rank, on the current device;
  // all work goes to `stream`. T per call may be anything up to config.max_tokens_per_rank.
  // Allocates the fused gate|up weight [E_local, 2I, H] (filled by forward(), see there).
  static Status create(const LayerConfig& config, ncclComm_t comm, cudaStream_t stream,
                       std::unique_ptr<NcclCublasMoe>* out);
  ~NcclCublasMoe();
  NcclCublasMoe(const NcclCublasMoe&) = delete;
  NcclCublasMoe& operator=(const NcclCublasMoe&) = delete;

  // One layer forward. Collective: every rank of the communicator calls it the same number of
  // times. Blocks the host once, at the sync of step 1; returns with the rest enqueued.
  // `marks`: null, or kStages + 1 events recorded at the start, each stage end (see above).
  // The first call with a given (weights.gate, weights.up) pair first copies them into the fused
  // gate|up weight (stream-ordered, before the first mark): weights rewritten in place at the
  // same addresses are not seen again. Grow-only buffers sized by the rows this rank receives are
  // (re)allocated inside the call whose count exceeds every earlier one. Time calls after a
  // first untimed one.
  Status forward(const ForwardArgs& args, const cudaEvent_t* marks);

 private:
  struct Impl;
  explicit NcclCublasMoe(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace epflow::bench
