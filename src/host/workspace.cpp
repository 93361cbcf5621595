#include "host/workspace.h"

#include <cuda_runtime.h>

#include <string>
#include <utility>
#include <vector>

#include "common/routing_schedule.h"
#include "common/status_util.h"
#include "common/tile.h"

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

// Host-mapped memory the device writes and the host reads: *host zeroed, *device its address.
template <typename T>
Status alloc_mapped(T** host, T** device) {
  EPFLOW_CUDA_RETURN(cudaHostAlloc(reinterpret_cast<void**>(host), sizeof(T), cudaHostAllocMapped));
  **host = T{};
  EPFLOW_CUDA_RETURN(cudaHostGetDevicePointer(reinterpret_cast<void**>(device), *host, 0));
  return Status::ok_status();
}

}  // namespace

Status Workspace::create(const LayerConfig& config, ncclComm_t comm,
                         std::unique_ptr<Workspace>* out) {
  std::unique_ptr<Workspace> ws(new Workspace());
  ws->config = config;
  ws->comm = comm;
  int device = 0;
  EPFLOW_CUDA_RETURN(cudaGetDevice(&device));
  EPFLOW_CUDA_RETURN(cudaDeviceGetAttribute(&ws->sm_count, cudaDevAttrMultiProcessorCount, device));
  EPFLOW_RETURN_IF_ERROR(runtime::make_plan(config, ws->sm_count, &ws->plan));
  EPFLOW_RETURN_IF_ERROR(ws->allocate());
  if (config.with_backward) EPFLOW_RETURN_IF_ERROR(ws->allocate_backward());
  *out = std::move(ws);
  return Status::ok_status();
}

Workspace::~Workspace() {
  // After a timed-out wait trapped a kernel the CUDA context is dead: nothing can be freed any
  // more (the process must exit), and NCCL's window teardown would use the context.
  if (reports.megakernel && reports.barrier && !device_failure().ok()) return;
  if (reports.megakernel) cudaFreeHost(reports.megakernel);
  if (reports.barrier) cudaFreeHost(reports.barrier);
  if (reports.routing) cudaFreeHost(reports.routing);
  if (reports.routing_tally) cudaFree(reports.routing_tally);
  if (local_) cudaFree(local_);
  if (backward_buffers_) cudaFree(backward_buffers_);
  window.destroy();
}

Status Workspace::allocate() {
  const LayerConfig& c = config;
  EPFLOW_RETURN_IF_ERROR(agree_on_config(c, comm));
  layout = kernels::WindowLayout::make(c.max_tokens_per_rank, c.hidden, c.top_k);
  EPFLOW_RETURN_IF_ERROR(comm::LsaWindow::create(comm, layout.bytes, &window));
  for (int32_t r = 0; r < c.ep_size; ++r) peers.base[r] = window.peer_bases()[r];

  schedule.shape = sched::ScheduleShape{c.ep_size, c.ep_rank, c.experts_per_rank(), c.top_k,
                                        kTileRows};
  schedule.max_tokens_per_rank = c.max_tokens_per_rank;
  max_rows = sched::round_up(sched::pull_table_capacity(schedule.shape, c.max_tokens_per_rank),
                             kTileRows);
  const size_t small_bytes = aligned(sizeof(void*) * c.ep_size) +
                             aligned(sizeof(int64_t) * c.ep_size) + aligned(sizeof(uint64_t));
  ring.rows = plan.ring_rows;
  const size_t x_bytes = aligned(sizeof(__nv_bfloat16) * ring.rows * c.hidden);
  const size_t h_bytes = aligned(sizeof(__nv_bfloat16) * ring.rows * c.intermediate);
  ring.counter_bytes = kernels::megakernel_counter_bytes(
      static_cast<int32_t>(ring.rows / kTileRows), sm_count);
  const size_t counter_bytes = aligned(ring.counter_bytes);
  EPFLOW_CUDA_RETURN(cudaMalloc(&local_, small_bytes + counter_bytes + x_bytes + h_bytes));
  char* p = static_cast<char*>(local_);
  peer_topk_idx = reinterpret_cast<const int32_t**>(p);
  p += aligned(sizeof(void*) * c.ep_size);
  tokens = reinterpret_cast<int64_t*>(p);
  p += aligned(sizeof(int64_t) * c.ep_size);
  epoch = reinterpret_cast<uint64_t*>(p);
  p += aligned(sizeof(uint64_t));
  ring.counters = reinterpret_cast<uint32_t*>(p);
  p += counter_bytes;
  ring.x = reinterpret_cast<__nv_bfloat16*>(p);
  p += x_bytes;
  ring.h = reinterpret_cast<__nv_bfloat16*>(p);

  std::vector<const int32_t*> idx(c.ep_size);
  for (int32_t r = 0; r < c.ep_size; ++r)
    idx[r] = reinterpret_cast<const int32_t*>(peers.base[r] + layout.topk_idx);
  EPFLOW_CUDA_RETURN(
      cudaMemcpy(peer_topk_idx, idx.data(), sizeof(void*) * c.ep_size, cudaMemcpyHostToDevice));
  EPFLOW_CUDA_RETURN(cudaMemset(epoch, 0, sizeof(uint64_t)));
  EPFLOW_RETURN_IF_ERROR(alloc_mapped(&reports.megakernel, &reports.megakernel_device));
  EPFLOW_RETURN_IF_ERROR(alloc_mapped(&reports.barrier, &reports.barrier_device));
  EPFLOW_RETURN_IF_ERROR(alloc_mapped(&reports.routing, &reports.routing_device));
  EPFLOW_CUDA_RETURN(cudaMalloc(&reports.routing_tally, sizeof(kernels::RoutingTally)));
  EPFLOW_CUDA_RETURN(cudaMemset(reports.routing_tally, 0, sizeof(kernels::RoutingTally)));
  EPFLOW_CUDA_RETURN(
      cudaMemset(local_window() + layout.flags, 0, sizeof(uint64_t) * kernels::kMaxPeers));
  EPFLOW_CUDA_RETURN(cudaDeviceSynchronize());
  // No rank may signal a barrier before every rank has zeroed its flags: one collective at
  // creation (a host sync is allowed here, never in a call) orders the two.
  int32_t* one = reinterpret_cast<int32_t*>(tokens);
  const ncclResult_t r = ncclAllReduce(one, one, 1, ncclInt32, ncclSum, comm, nullptr);
  if (r != ncclSuccess)
    return error_status(StatusCode::kNcclError, "creation handshake: ", ncclGetErrorString(r));
  EPFLOW_CUDA_RETURN(cudaDeviceSynchronize());

  memory.symmetric_bytes = static_cast<int64_t>(window.bytes());
  memory.schedule_bytes = static_cast<int64_t>(small_bytes + counter_bytes);
  memory.ring_bytes = static_cast<int64_t>(x_bytes + h_bytes);
  return Status::ok_status();
}

// The backward's rows: max_rows rounded up to the minibatch (its megakernel's ring holds every
// routed row): dy and x ([H] each), w·h ([I]), [dg | du] ([2I]), the partial <dhp, h> and the
// megakernel's counters.
Status Workspace::allocate_backward() {
  const int64_t H = config.hidden, I = config.intermediate;
  BackwardRows& b = backward;
  b.ring.rows = sched::round_up(max_rows, plan.minibatch_rows);
  const int64_t rows = b.ring.rows;
  const size_t rows_bytes = sizeof(__nv_bfloat16) * rows * (2 * H + 3 * I);
  const size_t partial_bytes = aligned(sizeof(float) * rows * kernels::backward_dh_tiles(I));
  b.ring.counter_bytes =
      kernels::megakernel_counter_bytes(static_cast<int32_t>(rows / kTileRows), sm_count);
  const size_t bytes = rows_bytes + partial_bytes + aligned(b.ring.counter_bytes);
  EPFLOW_CUDA_RETURN(cudaMalloc(&backward_buffers_, bytes));
  __nv_bfloat16* p = static_cast<__nv_bfloat16*>(backward_buffers_);
  for (auto [buf, cols] : {std::pair{&b.x, H}, {&b.ring.x, H}, {&b.wh, I}, {&b.ring.h, 2 * I}}) {
    *buf = p;
    p += rows * cols;
  }
  char* base = static_cast<char*>(backward_buffers_);
  b.dw_partial = reinterpret_cast<float*>(base + rows_bytes);
  b.ring.counters = reinterpret_cast<uint32_t*>(base + rows_bytes + partial_bytes);
  memory.backward_bytes = static_cast<int64_t>(bytes);
  return Status::ok_status();
}

kernels::BarrierArgs Workspace::barrier_args(int64_t T, kernels::BarrierPhase phase) const {
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

Status Workspace::publish_barrier(int64_t T, cudaStream_t stream) {
  kernels::BarrierArgs barrier = barrier_args(T, kernels::BarrierPhase::kDispatch);
  barrier.tokens_out = tokens;
  EPFLOW_CUDA_RETURN(kernels::launch_rank_barrier(barrier, stream));
  return Status::ok_status();
}

Status Workspace::barrier_and_sum(int64_t T, const int32_t* topk_idx, const float* topk_weights,
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

Status Workspace::device_failure() const {
  if (reports.megakernel->set)
    return error_status(StatusCode::kTimeout, kernels::describe(*reports.megakernel));
  const volatile kernels::BarrierTimeout* b = reports.barrier;
  if (!b->set) return Status::ok_status();
  return error_status(StatusCode::kTimeout, "rank ", b->rank, " timed out after ", b->seconds,
                      " s in the ",
                      b->phase == static_cast<int32_t>(kernels::BarrierPhase::kDispatch)
                          ? "dispatch barrier (before pulling tokens)"
                          : "combine barrier (after pushing results)",
                      ", epoch ", b->epoch, ": rank ", b->peer,
                      " never arrived (its last epoch here: ", b->seen, ")");
}

// The device may be adding to the record while the host reads it (a later call's kernels): a
// report can miss a slot of a call still running, which the next report then has.
Status Workspace::routing_report() {
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
