// The NCCL + cuBLAS baseline of epflow-bench: the MoE layer forward as a competent C++ user
// writes it without EPFlow, one stream per rank, on the same inputs and layouts as EPFlow's
// public API (ForwardArgs):
//   1. route: counting sort of the (token, k) slots by global expert id (= by destination rank,
//      then local expert), stable in slot order; rows and local expert ids scattered into a
//      send buffer in that order;
//   2. counts: ncclAllGather of every rank's per-destination row counts, one copy to the host,
//      one host sync;
//   3. dispatch: ncclSend/ncclRecv of the bf16 rows and int32 local expert ids, every peer in one
//      group; the receiver groups the rows by local expert (the same counting sort), one copy of
//      the per-expert offsets to the host, a host sync;
//   4. expert FFN: cublasGemmGroupedBatchedEx for gate and up (2 problems per expert, writing the
//      two halves of one [rows, 2I] buffer), the SwiGLU kernel of bench/swiglu_baseline.cuh,
//      cublasGemmGroupedBatchedEx for down; one dense cublasGemmEx per expert and projection
//      instead when every expert has at least 256 rows (where cuBLAS's grouped GEMM is slow);
//   5. combine: rows put back in received order and sent home with ncclSend/ncclRecv;
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
  // The stages forward() marks with events, named as epflow-bench names EPFlow's:
  //   0 "metadata+schedule": route + count exchange (ends after its host sync),
  //   1 "dispatch": row all-to-all + grouping by expert (ends after its host sync and the upload
  //     of the grouped GEMM's pointer arrays),
  //   2 "expert FFN": both grouped GEMMs and SwiGLU,
  //   3 "combine+sum": ungroup, row all-to-all back, weighted sum.
  static constexpr int kStages = 4;

  // `comm` spans config.ep_size ranks with this one as config.ep_rank, on the current device;
  // all work goes to `stream`. T per call may be anything up to config.max_tokens_per_rank.
  static Status create(const LayerConfig& config, ncclComm_t comm, cudaStream_t stream,
                       std::unique_ptr<NcclCublasMoe>* out);
  ~NcclCublasMoe();
  NcclCublasMoe(const NcclCublasMoe&) = delete;
  NcclCublasMoe& operator=(const NcclCublasMoe&) = delete;

  // One layer forward. Collective: every rank of the communicator calls it the same number of
  // times. Blocks the host at the two syncs of steps 2 and 3; returns with the rest enqueued.
  // `marks`: null, or kStages + 1 events recorded at the start, each stage end (see above).
  // Grow-only buffers sized by the rows this rank receives are (re)allocated inside the call
  // whose count exceeds every earlier one: time calls after a first untimed one.
  Status forward(const ForwardArgs& args, const cudaEvent_t* marks);

 private:
  struct Impl;
  explicit NcclCublasMoe(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace epflow::bench
