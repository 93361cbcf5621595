#include "host/layer_workspace.h"

#include <cuda_runtime.h>

#include <string>
#include <utility>
#include <vector>

#include "common/fp8_blocks.h"
#include "common/routing_schedule.h"
#include "common/status_util.h"
#include "common/tile.h"
#include "host/saved_activations.h"

namespace epflow {

static_assert(Limits::kMaxEpSize == kernels::kMaxPeers, "the window's peer table covers the EP limit");

namespace {

size_t aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Every rank of the communicator must create the layer with the same shape: one all-reduce of
// the fields (max of each value and of its negation) before the first collective that depends
// on them (the symmetric window's registration), so a mismatch is an error on every rank
// instead of a hang. The knobs (comm_sms, minibatch_rows, ring_rows, timeout) may differ.
Status agree_on_config(const LayerConfig& c, ncclComm_t comm) {
  const std::pair<const char*, int64_t> fields[] = {
      {"hidden", c.hidden},
      {"intermediate", c.intermediate},
      {"num_experts", c.num_experts},
      {"top_k", c.top_k},
      {"max_tokens_per_rank", c.max_tokens_per_rank},
      {"dtype", static_cast<int64_t>(c.dtype)},
      {"with_backward", c.with_backward ? 1 : 0}};
  constexpr int kFields = sizeof(fields) / sizeof(fields[0]);
  int64_t host[2 * kFields];
  for (int i = 0; i < kFields; ++i) {
    host[i] = fields[i].second;
    host[kFields + i] = -fields[i].second;
  }
  int64_t* dev = nullptr;
  EPFLOW_CUDA_RETURN(cudaMalloc(&dev, sizeof(host)));
  cudaError_t e = cudaMemcpy(dev, host, sizeof(host), cudaMemcpyHostToDevice);
  ncclResult_t r = ncclSuccess;
  if (e == cudaSuccess) r = ncclAllReduce(dev, dev, 2 * kFields, ncclInt64, ncclMax, comm, nullptr);
  if (e == cudaSuccess && r == ncclSuccess)
    e = cudaMemcpy(host, dev, sizeof(host), cudaMemcpyDeviceToHost);
  cudaFree(dev);
  if (r != ncclSuccess)
    return error_status(StatusCode::kNcclError, "config agreement: ", ncclGetErrorString(r));
  EPFLOW_CUDA_RETURN(e);
  std::string differ;
  for (int i = 0; i < kFields; ++i)
    if (host[i] != -host[kFields + i])
      differ += (differ.empty() ? "" : ", ") + std::string(fields[i].first) + " from " +
                std::to_string(-host[kFields + i]) + " to " + std::to_string(host[i]);
  if (!differ.empty())
    return error_status(StatusCode::kInvalidArgument, "LayerConfig differs across the ",
                        c.ep_size, " ranks of the communicator (", differ,
                        "): every rank must create the layer with the same shape");
  return Status::ok_status();
}

}  // namespace

Status LayerWorkspace::create(const LayerConfig& config, std::shared_ptr<SharedWorkspace> shared,
                              std::unique_ptr<LayerWorkspace>* out) {
  std::unique_ptr<LayerWorkspace> ws(new LayerWorkspace());
  const LayerConfig& c = config;
  ws->config = config;
  ws->shared = std::move(shared);
  ws->comm = ws->shared->comm();
  ws->sm_count = ws->shared->sm_count();
  EPFLOW_RETURN_IF_ERROR(agree_on_config(c, ws->comm));
  EPFLOW_RETURN_IF_ERROR(runtime::make_plan(config, ws->sm_count, &ws->plan));
  ws->layout = kernels::WindowLayout::make(c.max_tokens_per_rank, c.hidden, c.top_k);
  ws->schedule.shape = sched::ScheduleShape{c.ep_size, c.ep_rank, c.experts_per_rank(), c.top_k,
                                            kTileRows};
  ws->schedule.max_tokens_per_rank = c.max_tokens_per_rank;
  ws->max_rows = sched::round_up(
      sched::pull_table_capacity(ws->schedule.shape, c.max_tokens_per_rank), kTileRows);
  ws->ring.rows = ws->plan.ring_rows;
  ws->ring_x_bytes_ = aligned(sizeof(__nv_bfloat16) * ws->ring.rows * c.hidden);
  ws->ring_h_bytes_ = aligned(sizeof(__nv_bfloat16) * ws->ring.rows * c.intermediate);
  ws->ring.counter_bytes = kernels::megakernel_counter_bytes(
      static_cast<int32_t>(ws->ring.rows / kTileRows), ws->sm_count);
  ws->ring_counter_bytes_ = aligned(ws->ring.counter_bytes);
  if (c.with_backward) {
    // The backward's rows: max_rows rounded up to the minibatch (its megakernel's ring holds
    // every routed row): dy and x ([H] each), w·h ([I]), [dg | du] ([2I]), the partial
    // <dhp, h> and the megakernel's counters.
    BackwardRows& b = ws->backward;
    b.ring.rows = sched::round_up(ws->max_rows, ws->plan.minibatch_rows);
    const int64_t H = c.hidden, I = c.intermediate, rows = b.ring.rows;
    ws->backward_x_bytes_ = aligned(sizeof(__nv_bfloat16) * rows * H);
    ws->backward_rows_bytes_ = sizeof(__nv_bfloat16) * rows * (H + 3 * I);
    if (c.dtype == DType::kFP8Blockwise) {
      // The packed x and [dg | du] rows; the FP8 weight gradients' operands in x's bytes.
      size_t operands = 0;
      for (size_t bytes : ws->fp8_wgrad_operand_bytes()) operands += aligned(bytes);
      ws->backward_x_bytes_ = std::max(ws->backward_x_bytes_, operands);
      ws->backward_rows_bytes_ += rows * (fp8::packed_row_bytes(H) + fp8::packed_row_bytes(2 * I));
    }
    ws->backward_rows_bytes_ = ws->backward_x_bytes_ + aligned(ws->backward_rows_bytes_);
    ws->backward_partial_bytes_ = aligned(sizeof(float) * rows * kernels::backward_dh_tiles(I));
    b.ring.counter_bytes =
        kernels::megakernel_counter_bytes(static_cast<int32_t>(rows / kTileRows), ws->sm_count);
    ws->overflow_bytes_ =
        aligned(sizeof(__nv_bfloat16) * (ws->max_rows - ws->plan.saved_gate_up_rows) * 2 * I);
  }
  EPFLOW_RETURN_IF_ERROR(ws->shared->reserve(ws->needs()));
  ws->carve();
  *out = std::move(ws);
  return Status::ok_status();
}

std::array<size_t, 3> LayerWorkspace::fp8_wgrad_operand_bytes() const {
  const int64_t H = config.hidden, I = config.intermediate, rows = backward.ring.rows;
  const int64_t packed = fp8::packed_row_bytes(rows), scales = rows / fp8::kBlock * 4;
  return {size_t(H * packed), size_t(std::max(2 * I * packed, I * rows)),
          size_t(std::max(H, I) / fp8::kBlock * scales)};
}

SharedWorkspace::Needs LayerWorkspace::needs() const {
  SharedWorkspace::Needs n;
  n.window = layout.bytes;
  n.ring = ring_counter_bytes_ + ring_x_bytes_ + ring_h_bytes_;
  if (config.with_backward)
    n.backward = backward_rows_bytes_ + backward_partial_bytes_ +
                 aligned(backward.ring.counter_bytes) + overflow_bytes_;
  n.schedule = static_cast<size_t>(SavedActivations::bytes(*this, /*with_gate_up=*/false));
  return n;
}

void LayerWorkspace::carve() {
  const SharedWorkspace& s = *shared;
  for (int32_t r = 0; r < config.ep_size; ++r) peers.base[r] = s.window().peer_bases()[r];
  peer_topk_idx = s.peer_topk_idx();
  tokens = s.tokens();
  epoch = s.epoch();
  reports = s.reports();
  char* p = s.ring();
  ring.counters = reinterpret_cast<uint32_t*>(p);
  p += ring_counter_bytes_;
  ring.x = reinterpret_cast<__nv_bfloat16*>(p);
  p += ring_x_bytes_;
  ring.h = reinterpret_cast<__nv_bfloat16*>(p);
  if (config.with_backward) {
    BackwardRows& b = backward;
    const int64_t H = config.hidden, I = config.intermediate, rows = b.ring.rows;
    b.x = reinterpret_cast<__nv_bfloat16*>(s.backward());
    __nv_bfloat16* q = reinterpret_cast<__nv_bfloat16*>(s.backward() + backward_x_bytes_);
    for (auto [buf, cols] : {std::pair{&b.ring.x, H}, {&b.wh, I}, {&b.ring.h, 2 * I}}) {
      *buf = q;
      q += rows * cols;
    }
    if (config.dtype == DType::kFP8Blockwise) {
      b.x_fp8 = reinterpret_cast<uint8_t*>(q);
      b.dgu_fp8 = b.x_fp8 + rows * fp8::packed_row_bytes(H);
      // d W_down's operands, then d W_gate's and d W_up's in the same three slots.
      const auto sizes = fp8_wgrad_operand_bytes();
      char* slot[3] = {s.backward()};
      for (int i = 1; i < 3; ++i) slot[i] = slot[i - 1] + aligned(sizes[i - 1]);
      b.dy_t = b.x_t = reinterpret_cast<uint8_t*>(slot[0]);
      b.wh_t = b.dgu_t = reinterpret_cast<uint8_t*>(slot[1]);
      b.wh_t_scales = b.x_t_scales = reinterpret_cast<float*>(slot[2]);
    }
    char* base = s.backward();
    b.dw_partial = reinterpret_cast<float*>(base + backward_rows_bytes_);
    b.ring.counters =
        reinterpret_cast<uint32_t*>(base + backward_rows_bytes_ + backward_partial_bytes_);
    b.gate_up_overflow =
        overflow_bytes_ == 0
            ? nullptr
            : reinterpret_cast<__nv_bfloat16*>(base + backward_rows_bytes_ +
                                               backward_partial_bytes_ +
                                               aligned(b.ring.counter_bytes));
  }
  inference_schedule = s.schedule();
  generation_ = s.generation();
}

kernels::BarrierArgs LayerWorkspace::barrier_args(int64_t T, kernels::BarrierPhase phase) const {
  kernels::BarrierArgs b;
  b.peers = peers;
  b.layout = layout;
  b.rank = config.ep_rank;
  b.world = config.ep_size;
  b.epoch = epoch;
  b.timeout_ns = static_cast<int64_t>(config.timeout_seconds * 1e9);
  b.phase = phase;
  b.my_tokens = T;
  b.timeout_report = reports.barrier_device;
  return b;
}

Status LayerWorkspace::publish_barrier(int64_t T, cudaStream_t stream) {
  kernels::BarrierArgs barrier = barrier_args(T, kernels::BarrierPhase::kDispatch);
  barrier.tokens_out = tokens;
  EPFLOW_CUDA_RETURN(kernels::launch_rank_barrier(barrier, stream));
  return Status::ok_status();
}

Status LayerWorkspace::barrier_and_sum(int64_t T, const int32_t* topk_idx, const float* topk_weights,
                                  bool check_routing, __nv_bfloat16* out, cudaStream_t stream) {
  EPFLOW_CUDA_RETURN(
      kernels::launch_rank_barrier(barrier_args(T, kernels::BarrierPhase::kCombine), stream));
  kernels::WeightedSumArgs ws;
  ws.combine = reinterpret_cast<const __nv_bfloat16*>(local_window() + layout.combine);
  ws.topk_idx = topk_idx;
  ws.topk_weights = topk_weights;
  ws.num_tokens = T;
  ws.hidden = config.hidden;
  ws.top_k = config.top_k;
  ws.num_experts = config.num_experts;
  ws.y = out;
  ws.check = check_routing ? reports.routing_device : nullptr;
  ws.tally = reports.routing_tally;
  EPFLOW_CUDA_RETURN(kernels::launch_weighted_sum(ws, stream));
  return Status::ok_status();
}

// The device may be adding to the record while the host reads it (a later call's kernels): a
// report can miss a slot of a call still running, which the next report then has.
Status LayerWorkspace::routing_report() {
  volatile kernels::RoutingCheck* r = reports.routing;
  const uint32_t bad = r->bad_slots;
  if (bad == 0) return Status::ok_status();
  const uint32_t duplicated = r->duplicated_slots;
  std::string first = "(details still being written)";
  if (r->published) {
    first = "first seen: token " + std::to_string(r->token) + ", slot " + std::to_string(r->k) +
            ", expert id " + std::to_string(r->id) +
            (r->duplicate ? " (repeats an earlier slot of the token)"
                          : " (outside [-1, " + std::to_string(config.num_experts) + "))");
  }
  *reports.routing = kernels::RoutingCheck{};
  return error_status(StatusCode::kInvalidArgument, "topk_idx of rank ", config.ep_rank,
                      " had ", bad, " bad slots in calls since the last report (",
                      duplicated, " repeating an expert of the same token, ", bad - duplicated,
                      " out of range: skipped); ", first);
}

}  // namespace epflow
