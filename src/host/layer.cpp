#include "epflow/layer.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <iterator>
#include <vector>

#include "common/routing_schedule.h"
#include "epflow/communicator.h"
#include "host/layer_internals.h"
#include "host/runtime_plan.h"
#include "common/status_util.h"
#include "kernels/comm/lsa_shim.cuh"
#include "kernels/expert_ffn.cuh"
#include "kernels/layer_kernels.cuh"
#include "kernels/moe_megakernel.cuh"
#include "kernels/routing_schedule.cuh"

namespace epflow {

namespace {

Status require(bool ok, const char* what) {
  return ok ? Status::ok_status() : Status(StatusCode::kInvalidArgument, what);
}

}  // namespace

Status validate(const LayerConfig& c, const ForwardArgs& a) {
  EPFLOW_RETURN_IF_ERROR(validate(c));
  if (a.num_tokens < 0 || a.num_tokens > c.max_tokens_per_rank)
    return error_status(StatusCode::kInvalidArgument, "num_tokens (", a.num_tokens,
                        ") must be in [0, max_tokens_per_rank=", c.max_tokens_per_rank, "]");
  if (a.num_tokens > 0) {
    EPFLOW_RETURN_IF_ERROR(require(a.x != nullptr, "x is null"));
    EPFLOW_RETURN_IF_ERROR(require(a.topk_idx != nullptr, "topk_idx is null"));
    EPFLOW_RETURN_IF_ERROR(require(a.topk_weights != nullptr, "topk_weights is null"));
    EPFLOW_RETURN_IF_ERROR(require(a.y != nullptr, "y is null"));
  }
  // Weights are needed even at T = 0: peers' tokens may still route to this rank's experts.
  EPFLOW_RETURN_IF_ERROR(require(a.weights.gate && a.weights.up && a.weights.down,
                                 "expert weights (gate, up, down) must all be set"));
  return Status::ok_status();
}

Status validate(const LayerConfig& c, const SavedContext& saved, const BackwardArgs& a) {
  EPFLOW_RETURN_IF_ERROR(validate(c));
  EPFLOW_RETURN_IF_ERROR(require(c.with_backward,
                                 "backward() needs a layer created with LayerConfig::with_backward"));
  EPFLOW_RETURN_IF_ERROR(
      require(saved.generation != 0, "saved context was never filled by forward()"));
  if (saved.num_tokens > 0) {
    EPFLOW_RETURN_IF_ERROR(require(a.dy != nullptr, "dy is null"));
    EPFLOW_RETURN_IF_ERROR(require(a.dx != nullptr, "dx is null"));
    EPFLOW_RETURN_IF_ERROR(require(a.d_topk_weights != nullptr, "d_topk_weights is null"));
  }
  EPFLOW_RETURN_IF_ERROR(require(a.d_gate && a.d_up && a.d_down,
                                 "weight gradients (d_gate, d_up, d_down) must all be set"));
  return Status::ok_status();
}

// The forward: symmetric window, device schedule, the fused megakernel (pull dispatch, expert FFN,
// push combine over a ring of routed rows), barrier, weighted sum; stream-ordered, no host
// synchronisation (docs/ARCHITECTURE.md). The unfused chain of issue [B] (separate dispatch,
// FFN and combine kernels over buffers for every routable row) stays for the benchmark and tests
// to compare against (LayerInternals::use_unfused_forward).
struct Layer::Impl {
  LayerConfig config;
  ncclComm_t comm = nullptr;
  int32_t sm_count = 0;
  runtime::LayerPlan plan;

  comm::LsaWindow window;
  kernels::WindowLayout layout;
  kernels::PeerWindows peers;

  // Local device memory, one allocation carved into the pieces below.
  void* local = nullptr;
  kernels::ScheduleLaunch schedule;
  kernels::ScheduleBuffers schedule_buffers;
  const int32_t** peer_topk_idx = nullptr;  // [world]: each rank's topk_idx in its window
  int64_t* tokens = nullptr;                // [world]: each rank's T of the current call
  uint64_t* epoch = nullptr;                // barrier epoch
  int64_t max_rows = 0;                     // pull-table capacity (multiple of the tile)
  // The ring of the megakernel: plan.ring_rows routed rows of x and h, and its counters.
  __nv_bfloat16* ring_x = nullptr;
  __nv_bfloat16* ring_h = nullptr;
  uint32_t* ring_counters = nullptr;
  size_t ring_counter_bytes = 0;
  // Host-mapped: where a timed-out wait inside the megakernel says who waited for what.
  kernels::MegakernelDiagnostic* diagnostic = nullptr;
  kernels::MegakernelDiagnostic* diagnostic_device = nullptr;
  // Host-mapped: the first barrier wait that timed out (Layer::device_failure).
  kernels::BarrierTimeout* barrier_timeout = nullptr;
  kernels::BarrierTimeout* barrier_timeout_device = nullptr;
  // Host-mapped: bad topk_idx slots the weighted sums found (Layer::check_routing).
  kernels::RoutingCheck* routing_check = nullptr;
  kernels::RoutingCheck* routing_check_device = nullptr;
  kernels::RoutingTally* routing_tally = nullptr;  // device memory: the current call's counts
  // Optional per-task trace of the megakernel (epflow-bench --trace), [sm_count][records].
  kernels::MegakernelTraceRecord* trace = nullptr;

  // The unfused chain's buffers, [max_rows, H | I | H], allocated on request only.
  bool unfused = false;
  void* unfused_buffers = nullptr;
  __nv_bfloat16* routed_x = nullptr;
  __nv_bfloat16* routed_h = nullptr;
  __nv_bfloat16* routed_y = nullptr;

  // What a forward that fills a SavedContext keeps for the backward: every routed row's g | u
  // ([max_rows, 2I], pull-table order), written by the megakernel; allocated by create() with
  // LayerConfig::with_backward. saved_generation: the forward call whose g | u it holds (0: none).
  __nv_bfloat16* saved_gate_up = nullptr;
  uint64_t saved_generation = 0;

  // The backward's row buffers over bw_rows (max_rows rounded up to the minibatch: the backward
  // megakernel's ring holds every routed row), allocated by create() with
  // LayerConfig::with_backward: x and dy rows ([H] each), w·h ([I]; the unfused backward's dhp
  // first), [dg | du] ([2I]), the dhp tiles' partial <dhp, h> ([n tiles] fp32), and the
  // megakernel's counters.
  int64_t bw_rows = 0;
  void* backward_buffers = nullptr;
  __nv_bfloat16 *bw_x = nullptr, *bw_dy = nullptr, *bw_wh = nullptr, *bw_dgu = nullptr;
  float* bw_dw_partial = nullptr;
  uint32_t* bw_counters = nullptr;
  size_t bw_counter_bytes = 0;
  int32_t backward_comm_sms = 0;  // plan.backward_comm_sms unless set (LayerInternals)
  // The unfused backward (LayerInternals::use_unfused_backward: the benchmark's comparison and
  // a test): separate kernels over the rows above plus dx rows ([max_rows, H], allocated on
  // request). It moves x rows in and dx rows out on a second stream, on side_sms SMs that its
  // GEMMs leave free, while the GEMMs run (fork and join through events: graph-capturable);
  // side_sms = 0: everything on the caller's stream, one after the other.
  bool unfused_backward = false;
  __nv_bfloat16* bw_dx = nullptr;
  int32_t side_sms = 0;  // plan.backward_side_sms unless set (LayerInternals)
  cudaStream_t side = nullptr;
  cudaEvent_t dy_pulled = nullptr, x_pulled = nullptr, dx_ready = nullptr, dx_pushed = nullptr;

  uint64_t generation = 0;
  MemoryReport memory;

  ~Impl() {
    // After a timed-out wait trapped a kernel, the CUDA context is dead: nothing below can be
    // freed any more (the process must exit), and NCCL's window teardown would use the context.
    if (diagnostic && barrier_timeout && !device_failure().ok()) return;
    if (diagnostic) cudaFreeHost(diagnostic);
    if (routing_check) cudaFreeHost(routing_check);
    if (routing_tally) cudaFree(routing_tally);
    if (barrier_timeout) cudaFreeHost(barrier_timeout);
    if (trace) cudaFree(trace);
    if (local) cudaFree(local);
    if (unfused_buffers) cudaFree(unfused_buffers);
    if (backward_buffers) cudaFree(backward_buffers);
    if (bw_dx) cudaFree(bw_dx);
    if (saved_gate_up) cudaFree(saved_gate_up);
    for (cudaEvent_t e : {dy_pulled, x_pulled, dx_ready, dx_pushed})
      if (e) cudaEventDestroy(e);
    if (side) cudaStreamDestroy(side);
    window.destroy();
  }

  Status allocate();
  Status enable_unfused();
  size_t trace_bytes() const {
    return sizeof(kernels::MegakernelTraceRecord) * kernels::kTraceRecordsPerCta * sm_count;
  }
  kernels::BarrierArgs barrier_args(int64_t T, kernels::BarrierPhase phase) const;
  Status publish_barrier(int64_t T, cudaStream_t stream);
  Status exchange_and_schedule(int64_t T, const __nv_bfloat16* x, const int32_t* topk_idx,
                               cudaStream_t stream);
  Status barrier_and_sum(int64_t T, const int32_t* topk_idx, const float* topk_weights,
                         bool check_routing, __nv_bfloat16* out, cudaStream_t stream);
  Status earlier_failure() const;
  Status device_failure() const;
  Status routing_report();
  // Grid of the warp-per-row kernels (dispatch, combine, SwiGLU backward): a few waves of CTAs
  // with the GPU to themselves, or one big CTA on each of the side_sms SMs the backward's GEMMs
  // leave free.
  struct RowMovers {
    int32_t blocks, threads;
  };
  RowMovers whole_gpu() const { return {4 * sm_count, kernels::kRowMoverThreads}; }
  RowMovers beside_gemms() const {
    return side_sms > 0 ? RowMovers{side_sms, kernels::kRowMoverMaxThreads} : whole_gpu();
  }
  Status pull_rows(size_t offset, __nv_bfloat16* out, cudaStream_t stream, RowMovers movers,
                   bool zero_padding_rows = false);
  Status push_rows(const __nv_bfloat16* rows, cudaStream_t stream, RowMovers movers);
  kernels::MegakernelArgs megakernel_args(const ExpertWeights& weights) const;
  Status attach_trace(kernels::MegakernelArgs* m, cudaStream_t stream);
  Status run_megakernel(const ForwardArgs& args, bool keep_gate_up, cudaStream_t stream);
  Status run_unfused(const ForwardArgs& args, cudaStream_t stream, const StageEvents* events);
  Status forward(const ForwardArgs& args, cudaStream_t stream, SavedContext* saved,
                 const StageEvents* events);
  Status allocate_backward();
  Status enable_unfused_backward();
  Status backward(const BackwardArgs& args, const SavedContext& saved, cudaStream_t stream,
                  const cudaEvent_t* marks);
  Status run_backward_megakernel(const SavedContext& saved, cudaStream_t stream);
  Status push_router_weight_grads(cudaStream_t stream);
  Status run_unfused_backward(const SavedContext& saved, cudaStream_t stream,
                              const std::function<cudaError_t()>& mark);
  Status weight_gradients(const BackwardArgs& args, int32_t max_ctas, cudaStream_t stream,
                          cudaEvent_t x_rows_in);
};

namespace {

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

Status Layer::Impl::allocate() {
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
  auto aligned = [](size_t v) { return (v + 255) / 256 * 256; };
  const size_t schedule_bytes = aligned(kernels::routing_schedule_workspace_bytes(schedule));
  const size_t small_bytes = aligned(sizeof(void*) * c.ep_size) +
                             aligned(sizeof(int64_t) * c.ep_size) + aligned(sizeof(uint64_t));
  const int64_t ring_rows = plan.ring_rows;
  const size_t x_bytes = aligned(sizeof(__nv_bfloat16) * ring_rows * c.hidden);
  const size_t h_bytes = aligned(sizeof(__nv_bfloat16) * ring_rows * c.intermediate);
  ring_counter_bytes = kernels::megakernel_counter_bytes(
      static_cast<int32_t>(ring_rows / kTileRows), sm_count);
  const size_t counter_bytes = aligned(ring_counter_bytes);
  EPFLOW_CUDA_RETURN(
      cudaMalloc(&local, schedule_bytes + small_bytes + counter_bytes + x_bytes + h_bytes));
  char* p = static_cast<char*>(local);
  schedule_buffers = kernels::carve_schedule_buffers(schedule, p);
  p += schedule_bytes;
  peer_topk_idx = reinterpret_cast<const int32_t**>(p);
  p += aligned(sizeof(void*) * c.ep_size);
  tokens = reinterpret_cast<int64_t*>(p);
  p += aligned(sizeof(int64_t) * c.ep_size);
  epoch = reinterpret_cast<uint64_t*>(p);
  p += aligned(sizeof(uint64_t));
  ring_counters = reinterpret_cast<uint32_t*>(p);
  p += counter_bytes;
  ring_x = reinterpret_cast<__nv_bfloat16*>(p);
  p += x_bytes;
  ring_h = reinterpret_cast<__nv_bfloat16*>(p);

  std::vector<const int32_t*> idx(c.ep_size);
  for (int32_t r = 0; r < c.ep_size; ++r)
    idx[r] = reinterpret_cast<const int32_t*>(peers.base[r] + layout.topk_idx);
  EPFLOW_CUDA_RETURN(
      cudaMemcpy(peer_topk_idx, idx.data(), sizeof(void*) * c.ep_size, cudaMemcpyHostToDevice));
  EPFLOW_CUDA_RETURN(cudaMemset(epoch, 0, sizeof(uint64_t)));
  EPFLOW_CUDA_RETURN(cudaHostAlloc(reinterpret_cast<void**>(&diagnostic),
                                   sizeof(kernels::MegakernelDiagnostic), cudaHostAllocMapped));
  *diagnostic = kernels::MegakernelDiagnostic{};
  EPFLOW_CUDA_RETURN(
      cudaHostGetDevicePointer(reinterpret_cast<void**>(&diagnostic_device), diagnostic, 0));
  EPFLOW_CUDA_RETURN(cudaHostAlloc(reinterpret_cast<void**>(&barrier_timeout),
                                   sizeof(kernels::BarrierTimeout), cudaHostAllocMapped));
  *barrier_timeout = kernels::BarrierTimeout{};
  EPFLOW_CUDA_RETURN(cudaHostGetDevicePointer(reinterpret_cast<void**>(&barrier_timeout_device),
                                              barrier_timeout, 0));
  EPFLOW_CUDA_RETURN(cudaHostAlloc(reinterpret_cast<void**>(&routing_check),
                                   sizeof(kernels::RoutingCheck), cudaHostAllocMapped));
  *routing_check = kernels::RoutingCheck{};
  EPFLOW_CUDA_RETURN(cudaHostGetDevicePointer(reinterpret_cast<void**>(&routing_check_device),
                                              routing_check, 0));
  EPFLOW_CUDA_RETURN(cudaMalloc(&routing_tally, sizeof(kernels::RoutingTally)));
  EPFLOW_CUDA_RETURN(cudaMemset(routing_tally, 0, sizeof(kernels::RoutingTally)));
  EPFLOW_CUDA_RETURN(cudaMemset(static_cast<char*>(window.local()) + layout.flags, 0,
                                sizeof(uint64_t) * kernels::kMaxPeers));
  EPFLOW_CUDA_RETURN(cudaDeviceSynchronize());
  // NOTES: no rank may signal a barrier before every rank has zeroed its flags: one collective
  // at creation (host sync allowed here, never in forward) orders the two.
  int32_t* one = reinterpret_cast<int32_t*>(tokens);
  const ncclResult_t r = ncclAllReduce(one, one, 1, ncclInt32, ncclSum, comm, nullptr);
  if (r != ncclSuccess)
    return error_status(StatusCode::kNcclError, "creation handshake: ", ncclGetErrorString(r));
  EPFLOW_CUDA_RETURN(cudaDeviceSynchronize());

  memory.symmetric_bytes = static_cast<int64_t>(window.bytes());
  memory.schedule_bytes = static_cast<int64_t>(schedule_bytes + small_bytes + counter_bytes);
  memory.ring_bytes = static_cast<int64_t>(x_bytes + h_bytes);
  return Status::ok_status();
}

Status Layer::Impl::enable_unfused() {
  if (unfused_buffers) {
    unfused = true;
    return Status::ok_status();
  }
  const LayerConfig& c = config;
  const size_t x_bytes = sizeof(__nv_bfloat16) * max_rows * c.hidden;
  const size_t h_bytes = sizeof(__nv_bfloat16) * max_rows * c.intermediate;
  EPFLOW_CUDA_RETURN(cudaMalloc(&unfused_buffers, 2 * x_bytes + h_bytes));
  routed_x = static_cast<__nv_bfloat16*>(unfused_buffers);
  routed_h = routed_x + max_rows * c.hidden;
  routed_y = routed_h + max_rows * c.intermediate;
  memory.ring_bytes += static_cast<int64_t>(2 * x_bytes + h_bytes);
  unfused = true;
  return Status::ok_status();
}

// What both passes of the megakernel share: the schedule, the shapes, the weights, the waits'
// budget and diagnostic; the pass sets its rows, ring and partition.
kernels::MegakernelArgs Layer::Impl::megakernel_args(const ExpertWeights& w) const {
  const LayerConfig& c = config;
  kernels::MegakernelArgs m;
  m.peers = peers;
  m.combine_offset = layout.combine;
  m.table = schedule_buffers.table;
  m.seg_offset = schedule_buffers.seg_offset;
  m.expert_rows = schedule_buffers.expert_rows;
  m.experts = c.experts_per_rank();
  m.hidden = static_cast<int32_t>(c.hidden);
  m.intermediate = static_cast<int32_t>(c.intermediate);
  m.top_k = c.top_k;
  m.minibatch_tiles = static_cast<int32_t>(plan.minibatch_rows / kTileRows);
  m.w_gate = w.gate;
  m.w_up = w.up;
  m.w_down = w.down;
  m.rank = c.ep_rank;
  m.timeout_ns = static_cast<int64_t>(c.timeout_seconds * 1e9);
  m.diagnostic = diagnostic_device;
  return m;
}

// With tracing on (LayerInternals::enable_trace), the launch records its tasks there.
Status Layer::Impl::attach_trace(kernels::MegakernelArgs* m, cudaStream_t stream) {
  if (!trace) return Status::ok_status();
  EPFLOW_CUDA_RETURN(cudaMemsetAsync(trace, 0xff, trace_bytes(), stream));  // task -1: unused
  m->trace = trace;
  return Status::ok_status();
}

Status Layer::Impl::run_megakernel(const ForwardArgs& a, bool keep_gate_up, cudaStream_t stream) {
  EPFLOW_CUDA_RETURN(cudaMemsetAsync(ring_counters, 0, ring_counter_bytes, stream));
  kernels::MegakernelArgs m = megakernel_args(a.weights);
  m.x_offset = layout.x;
  m.ring_tiles = static_cast<int32_t>(plan.ring_rows / kTileRows);
  m.ring_x = ring_x;
  m.ring_h = ring_h;
  m.counters = ring_counters;
  m.comm_ctas = plan.comm_sms;
  if (keep_gate_up) m.gate_up_out = saved_gate_up;
  EPFLOW_RETURN_IF_ERROR(attach_trace(&m, stream));
  EPFLOW_CUDA_RETURN(kernels::launch_forward_megakernel(m, sm_count, stream));
  return Status::ok_status();
}

Status Layer::Impl::run_unfused(const ForwardArgs& a, cudaStream_t stream,
                                const StageEvents* events) {
  auto mark = [&](cudaEvent_t StageEvents::*which) {
    return events ? cudaEventRecord(events->*which, stream) : cudaSuccess;
  };
  const LayerConfig& c = config;
  EPFLOW_RETURN_IF_ERROR(pull_rows(layout.x, routed_x, stream, whole_gpu()));
  EPFLOW_CUDA_RETURN(mark(&StageEvents::dispatch_done));

  kernels::ExpertFfnArgs f;
  f.experts = c.experts_per_rank();
  f.hidden = c.hidden;
  f.intermediate = c.intermediate;
  f.max_rows = max_rows;
  f.seg_offset = schedule_buffers.seg_offset;
  f.expert_rows = schedule_buffers.expert_rows;
  f.x = routed_x;
  f.w_gate = a.weights.gate;
  f.w_up = a.weights.up;
  f.w_down = a.weights.down;
  f.h = routed_h;
  f.y = routed_y;
  EPFLOW_CUDA_RETURN(kernels::launch_expert_ffn(f, stream));
  EPFLOW_CUDA_RETURN(mark(&StageEvents::ffn_done));

  return push_rows(routed_y, stream, whole_gpu());
}

// Pull dispatch: every routed row of the pull table from its source rank's window region at
// `offset` ([T_max, H]: x, or the backward's dy) into `out` [max_rows, H].
Status Layer::Impl::pull_rows(size_t offset, __nv_bfloat16* out, cudaStream_t stream,
                              RowMovers movers, bool zero_padding_rows) {
  kernels::DispatchArgs d;
  d.peers = peers;
  d.x_offset = offset;
  d.table = schedule_buffers.table;
  d.seg_offset = schedule_buffers.seg_offset;
  d.experts = config.experts_per_rank();
  d.hidden = config.hidden;
  d.top_k = config.top_k;
  d.routed_x = out;
  d.zero_padding_rows = zero_padding_rows;
  EPFLOW_CUDA_RETURN(kernels::launch_pull_dispatch(d, movers.blocks, stream, movers.threads));
  return Status::ok_status();
}

// Push combine: every routed row of `rows` [max_rows, H] into its owner's (token, k) slot.
Status Layer::Impl::push_rows(const __nv_bfloat16* rows, cudaStream_t stream,
                              RowMovers movers) {
  kernels::CombineArgs cb;
  cb.peers = peers;
  cb.combine_offset = layout.combine;
  cb.table = schedule_buffers.table;
  cb.seg_offset = schedule_buffers.seg_offset;
  cb.experts = config.experts_per_rank();
  cb.hidden = config.hidden;
  cb.routed_y = rows;
  EPFLOW_CUDA_RETURN(kernels::launch_push_combine(cb, movers.blocks, stream, movers.threads));
  return Status::ok_status();
}

kernels::BarrierArgs Layer::Impl::barrier_args(int64_t T, kernels::BarrierPhase phase) const {
  kernels::BarrierArgs b;
  b.peers = peers;
  b.layout = layout;
  b.rank = config.ep_rank;
  b.world = config.ep_size;
  b.epoch = epoch;
  b.timeout_ns = static_cast<int64_t>(config.timeout_seconds * 1e9);
  b.phase = phase;
  b.my_tokens = T;
  b.timeout_report = barrier_timeout_device;
  return b;
}

// The barrier that publishes what this rank put into its window (peers read it after) and
// gathers every rank's T.
Status Layer::Impl::publish_barrier(int64_t T, cudaStream_t stream) {
  kernels::BarrierArgs barrier = barrier_args(T, kernels::BarrierPhase::kDispatch);
  barrier.tokens_out = tokens;
  EPFLOW_CUDA_RETURN(kernels::launch_rank_barrier(barrier, stream));
  return Status::ok_status();
}

// This rank's tokens and expert ids into its window, the barrier that publishes them and gathers
// every rank's T, then the device schedule (pull table, segments) of this rank's experts.
Status Layer::Impl::exchange_and_schedule(int64_t T, const __nv_bfloat16* x,
                                          const int32_t* topk_idx, cudaStream_t stream) {
  const LayerConfig& c = config;
  char* mine = static_cast<char*>(window.local());
  if (T > 0) {
    EPFLOW_CUDA_RETURN(cudaMemcpyAsync(mine + layout.x, x, sizeof(__nv_bfloat16) * T * c.hidden,
                                       cudaMemcpyDeviceToDevice, stream));
    EPFLOW_CUDA_RETURN(cudaMemcpyAsync(mine + layout.topk_idx, topk_idx,
                                       sizeof(int32_t) * T * c.top_k, cudaMemcpyDeviceToDevice,
                                       stream));
  }
  EPFLOW_RETURN_IF_ERROR(publish_barrier(T, stream));
  EPFLOW_CUDA_RETURN(cudaMemsetAsync(schedule_buffers.invalid_slots, 0, sizeof(int32_t), stream));
  EPFLOW_CUDA_RETURN(
      kernels::launch_routing_schedule(schedule, peer_topk_idx, tokens, schedule_buffers, stream));
  return Status::ok_status();
}

// The barrier after every rank pushed its rows into the owners' combine slots (it also proves
// every peer is done reading this call's window), then out[t] = sum_k w[t,k] combine[t, k]
// (w = 1 without topk_weights); check_routing: the sum also checks topk_idx (check_routing()).
Status Layer::Impl::barrier_and_sum(int64_t T, const int32_t* topk_idx, const float* topk_weights,
                                    bool check_routing, __nv_bfloat16* out,
                                    cudaStream_t stream) {
  const LayerConfig& c = config;
  EPFLOW_CUDA_RETURN(
      kernels::launch_rank_barrier(barrier_args(T, kernels::BarrierPhase::kCombine), stream));
  kernels::WeightedSumArgs ws;
  ws.combine =
      reinterpret_cast<const __nv_bfloat16*>(static_cast<char*>(window.local()) + layout.combine);
  ws.topk_idx = topk_idx;
  ws.topk_weights = topk_weights;
  ws.num_tokens = T;
  ws.hidden = c.hidden;
  ws.top_k = c.top_k;
  ws.num_experts = c.num_experts;
  ws.y = out;
  ws.check = check_routing ? routing_check_device : nullptr;
  ws.tally = routing_tally;
  EPFLOW_CUDA_RETURN(kernels::launch_weighted_sum(ws, stream));
  return Status::ok_status();
}

// A wait of an earlier call that timed out trapped its kernel (the CUDA context is gone); say
// where, read from host-mapped memory without touching the device.
Status Layer::Impl::earlier_failure() const {
  const Status why = device_failure();
  if (why.ok()) return why;
  return error_status(StatusCode::kTimeout, "an earlier call failed on the device: ",
                      why.message());
}

// The megakernel's timed-out wait, else the barrier's, else ok. Host memory only.
Status Layer::Impl::device_failure() const {
  if (diagnostic->set) return error_status(StatusCode::kTimeout, kernels::describe(*diagnostic));
  const volatile kernels::BarrierTimeout* b = barrier_timeout;
  if (!b->set) return Status::ok_status();
  return error_status(StatusCode::kTimeout, "rank ", b->rank, " timed out after ", b->seconds,
                      " s in the ",
                      b->phase == static_cast<int32_t>(kernels::BarrierPhase::kDispatch)
                          ? "dispatch barrier (before pulling tokens)"
                          : "combine barrier (after pushing results)",
                      ", epoch ", b->epoch, ": rank ", b->peer,
                      " never arrived (its last epoch here: ", b->seen, ")");
}

Status Layer::Impl::forward(const ForwardArgs& a, cudaStream_t stream, SavedContext* saved,
                            const StageEvents* events) {
  auto mark = [&](cudaEvent_t StageEvents::*which) {
    return events ? cudaEventRecord(events->*which, stream) : cudaSuccess;
  };
  const int64_t T = a.num_tokens;
  EPFLOW_RETURN_IF_ERROR(earlier_failure());
  EPFLOW_CUDA_RETURN(mark(&StageEvents::start));
  EPFLOW_RETURN_IF_ERROR(exchange_and_schedule(T, a.x, a.topk_idx, stream));
  EPFLOW_CUDA_RETURN(mark(&StageEvents::schedule_done));

  if (unfused) {
    EPFLOW_RETURN_IF_ERROR(run_unfused(a, stream, events));
  } else {
    // The megakernel has no stage boundaries inside: dispatch_done marks its start and
    // ffn_done its end, so the benchmark reports it as one stage.
    EPFLOW_CUDA_RETURN(mark(&StageEvents::dispatch_done));
    EPFLOW_RETURN_IF_ERROR(run_megakernel(a, saved != nullptr, stream));
    EPFLOW_CUDA_RETURN(mark(&StageEvents::ffn_done));
  }

  EPFLOW_RETURN_IF_ERROR(barrier_and_sum(T, a.topk_idx, a.topk_weights, true, a.y, stream));
  EPFLOW_CUDA_RETURN(mark(&StageEvents::end));

  // Every forward replaces the schedule and this rank's x in its window, which the backward of
  // a context reuses: a context is valid until the next forward, with or without a context.
  ++generation;
  if (saved) {
    *saved = SavedContext{};
    saved->generation = generation;
    saved_generation = unfused ? 0 : generation;
    saved->num_tokens = T;
    saved->x = a.x;
    saved->topk_idx = a.topk_idx;
    saved->topk_weights = a.topk_weights;
    saved->weights = a.weights;
  }
  return Status::ok_status();
}

// LayerConfig::with_backward: the g | u the forward keeps and the backward's row buffers.
Status Layer::Impl::allocate_backward() {
  const int64_t H = config.hidden, I = config.intermediate;
  const size_t saved_bytes = sizeof(__nv_bfloat16) * max_rows * 2 * I;
  EPFLOW_CUDA_RETURN(cudaMalloc(&saved_gate_up, saved_bytes));
  memory.saved_bytes = static_cast<int64_t>(saved_bytes);
  bw_rows = sched::round_up(max_rows, plan.minibatch_rows);
  const int32_t ring_tiles = static_cast<int32_t>(bw_rows / kTileRows);
  auto aligned = [](size_t v) { return (v + 255) / 256 * 256; };
  const size_t rows_bytes = sizeof(__nv_bfloat16) * bw_rows * (2 * H + 3 * I);
  const size_t partial_bytes =
      aligned(sizeof(float) * bw_rows * kernels::backward_dh_tiles(I));
  bw_counter_bytes = kernels::megakernel_counter_bytes(ring_tiles, sm_count);
  const size_t bytes = rows_bytes + partial_bytes + aligned(bw_counter_bytes);
  EPFLOW_CUDA_RETURN(cudaMalloc(&backward_buffers, bytes));
  __nv_bfloat16* p = static_cast<__nv_bfloat16*>(backward_buffers);
  for (auto [buf, cols] : {std::pair{&bw_x, H}, {&bw_dy, H}, {&bw_wh, I}, {&bw_dgu, 2 * I}}) {
    *buf = p;
    p += bw_rows * cols;
  }
  bw_dw_partial = reinterpret_cast<float*>(static_cast<char*>(backward_buffers) + rows_bytes);
  bw_counters = reinterpret_cast<uint32_t*>(static_cast<char*>(backward_buffers) + rows_bytes +
                                            partial_bytes);
  memory.backward_bytes = static_cast<int64_t>(bytes);
  return Status::ok_status();
}

// The unfused backward's dx rows, and its side stream and events (the backward megakernel needs
// none of them).
Status Layer::Impl::enable_unfused_backward() {
  if (!bw_dx) {
    const size_t bytes = sizeof(__nv_bfloat16) * max_rows * config.hidden;
    EPFLOW_CUDA_RETURN(cudaMalloc(&bw_dx, bytes));
    memory.backward_bytes += static_cast<int64_t>(bytes);
    EPFLOW_CUDA_RETURN(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    for (cudaEvent_t* e : {&dy_pulled, &x_pulled, &dx_ready, &dx_pushed})
      EPFLOW_CUDA_RETURN(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  }
  unfused_backward = true;
  return Status::ok_status();
}

// The backward (docs/ARCHITECTURE.md, "Backward"), on the forward's schedule: the backward
// megakernel (dy and x rows pulled; dhp = dy W_down with the SwiGLU and router-weight backward
// in its epilogue; dx rows = [dg | du] [W_gate; W_up] pushed into the owners' combine slots), d
// topk_weights pushed to the owners, the weight gradients (dW_down = dyᵀ (w h), dW_gate = dgᵀ x,
// dW_up = duᵀ x) over the rows the megakernel left, then the barrier and each owner's sum of its
// dx over k. The unfused backward runs the same steps as separate kernels.
const char* const kBackwardStageNames[] = {
    "inputs+barrier", "megakernel (dy, x pull; dhp + SwiGLU bwd; dx push)", "d topk_weights",
    "weight gradients", "barrier+sum"};
const char* const kUnfusedBackwardStageNames[] = {
    "inputs+barrier",
    "pull dy rows",
    "dhp = dy W_down",
    "SwiGLU backward",
    "dx = [dg|du] [Wg; Wu]",
    "weight gradients (x pull, dx push beside)",
    "join, barrier, sum"};

std::vector<const char*> LayerInternals::backward_stage_names(const Layer& layer) {
  if (layer.impl_->unfused_backward)
    return {std::begin(kUnfusedBackwardStageNames), std::end(kUnfusedBackwardStageNames)};
  return {std::begin(kBackwardStageNames), std::end(kBackwardStageNames)};
}

Status Layer::Impl::run_backward_megakernel(const SavedContext& saved, cudaStream_t stream) {
  EPFLOW_CUDA_RETURN(cudaMemsetAsync(bw_counters, 0, bw_counter_bytes, stream));
  kernels::MegakernelArgs m = megakernel_args(saved.weights);
  m.x_offset = layout.dy;
  m.ring_tiles = static_cast<int32_t>(bw_rows / kTileRows);
  m.ring_x = bw_dy;
  m.ring_h = bw_dgu;
  m.counters = bw_counters;
  m.comm_ctas = backward_comm_sms;
  m.gate_up_in = saved_gate_up;
  m.weights_offset = layout.topk_weights;
  m.wh_out = bw_wh;
  m.dw_partial = bw_dw_partial;
  m.x_pull_offset = layout.x;
  m.x_out = bw_x;
  EPFLOW_RETURN_IF_ERROR(attach_trace(&m, stream));
  EPFLOW_CUDA_RETURN(kernels::launch_backward_megakernel(m, sm_count, stream));
  return Status::ok_status();
}

// d topk_weights of every routed row from the megakernel's partial sums, into the owners' windows.
Status Layer::Impl::push_router_weight_grads(cudaStream_t stream) {
  const LayerConfig& c = config;
  kernels::RouterWeightGradArgs rw;
  rw.peers = peers;
  rw.d_weights_offset = layout.d_weights;
  rw.table = schedule_buffers.table;
  rw.seg_offset = schedule_buffers.seg_offset;
  rw.experts = c.experts_per_rank();
  rw.dw_partial = bw_dw_partial;
  rw.n_tiles = kernels::backward_dh_tiles(c.intermediate);
  rw.max_rows = max_rows;
  EPFLOW_CUDA_RETURN(kernels::launch_router_weight_grad(rw, stream));
  return Status::ok_status();
}

// dW_down = dyᵀ (w h), dW_gate = dgᵀ x, dW_up = duᵀ x on at most max_ctas SMs (0: all); the last
// two wait for x_rows_in first when it is set.
Status Layer::Impl::weight_gradients(const BackwardArgs& a, int32_t max_ctas,
                                     cudaStream_t stream, cudaEvent_t x_rows_in) {
  const int64_t H = config.hidden, I = config.intermediate;
  kernels::ExpertWgradArgs wg;
  wg.segments = kernels::ExpertSegments{config.experts_per_rank(), max_rows,
                                        schedule_buffers.seg_offset, schedule_buffers.expert_rows};
  wg.fp32_out = a.grad_dtype == GradDType::kFP32;
  wg.accumulate = a.accumulate_weight_grads;
  wg.max_ctas = max_ctas;
  auto wgrad = [&](const __nv_bfloat16* lhs, int64_t m, int64_t lhs_ld, const __nv_bfloat16* rhs,
                   int64_t n, void* dw) {
    wg.lhs = lhs;
    wg.m = m;
    wg.lhs_ld = lhs_ld;
    wg.rhs = rhs;
    wg.n = n;
    wg.dw = dw;
    return kernels::launch_expert_wgrad(wg, stream);
  };
  EPFLOW_CUDA_RETURN(wgrad(bw_dy, H, H, bw_wh, I, a.d_down));
  if (x_rows_in) EPFLOW_CUDA_RETURN(cudaStreamWaitEvent(stream, x_rows_in, 0));
  EPFLOW_CUDA_RETURN(wgrad(bw_dgu, I, 2 * I, bw_x, H, a.d_gate));
  EPFLOW_CUDA_RETURN(wgrad(bw_dgu + I, I, 2 * I, bw_x, H, a.d_up));
  return Status::ok_status();
}

// The unfused backward's kernels between the first barrier and the weight gradients: dy rows
// pulled; dhp = dy W_down; the SwiGLU and router-weight backward (d topk_weights pushed to the
// owners); dx rows = [dg | du] [W_gate; W_up], pushed into the owners' combine slots on the side
// stream beside the weight gradients; x rows pulled on the side stream meanwhile (x_pulled).
Status Layer::Impl::run_unfused_backward(const SavedContext& saved, cudaStream_t stream,
                                         const std::function<cudaError_t()>& mark) {
  const LayerConfig& c = config;
  const int64_t H = c.hidden, I = c.intermediate;
  const int32_t E = c.experts_per_rank();
  // dy rows first (the first GEMM reads them); x rows, needed only by the last two weight
  // gradients, on the side stream beside the GEMMs. NOTES: the GEMMs run on sm_count - side_sms
  // CTAs and the side kernels on side_sms CTAs of a whole SM's threads, so both are resident at
  // once whichever starts first (a GEMM CTA fills an SM's register file).
  EPFLOW_RETURN_IF_ERROR(pull_rows(layout.dy, bw_dy, stream, whole_gpu(), true));
  EPFLOW_CUDA_RETURN(cudaEventRecord(dy_pulled, stream));
  cudaStream_t aside = side_sms > 0 ? side : stream;
  EPFLOW_CUDA_RETURN(cudaStreamWaitEvent(aside, dy_pulled, 0));
  EPFLOW_RETURN_IF_ERROR(pull_rows(layout.x, bw_x, aside, beside_gemms(), true));
  EPFLOW_CUDA_RETURN(cudaEventRecord(x_pulled, aside));
  EPFLOW_CUDA_RETURN(mark());
  const int32_t gemm_ctas = sm_count - side_sms;

  kernels::ExpertDgradArgs dg;
  dg.segments = kernels::ExpertSegments{E, max_rows, schedule_buffers.seg_offset,
                                        schedule_buffers.expert_rows};
  dg.k = H;
  dg.n = I;
  dg.rows = bw_dy;
  dg.w0 = saved.weights.down;
  dg.out = bw_wh;
  dg.max_ctas = gemm_ctas;
  EPFLOW_CUDA_RETURN(kernels::launch_expert_dgrad(dg, stream));
  EPFLOW_CUDA_RETURN(mark());

  kernels::SwigluBackwardArgs sb;
  sb.peers = peers;
  sb.weights_offset = layout.topk_weights;
  sb.d_weights_offset = layout.d_weights;
  sb.table = schedule_buffers.table;
  sb.seg_offset = schedule_buffers.seg_offset;
  sb.experts = E;
  sb.intermediate = I;
  sb.gate_up = saved_gate_up;
  sb.dhp_wh = bw_wh;
  sb.dgu = bw_dgu;
  EPFLOW_CUDA_RETURN(kernels::launch_swiglu_backward(sb, 4 * gemm_ctas, stream));
  EPFLOW_CUDA_RETURN(mark());

  dg.k = 2 * I;
  dg.k0 = I;
  dg.n = H;
  dg.rows = bw_dgu;
  dg.w0 = saved.weights.gate;
  dg.w1 = saved.weights.up;
  dg.out = bw_dx;
  EPFLOW_CUDA_RETURN(kernels::launch_expert_dgrad(dg, stream));
  EPFLOW_CUDA_RETURN(mark());

  // dx rows into the owners' combine slots on the side stream, beside the weight gradients.
  EPFLOW_CUDA_RETURN(cudaEventRecord(dx_ready, stream));
  EPFLOW_CUDA_RETURN(cudaStreamWaitEvent(aside, dx_ready, 0));
  EPFLOW_RETURN_IF_ERROR(push_rows(bw_dx, aside, beside_gemms()));
  EPFLOW_CUDA_RETURN(cudaEventRecord(dx_pushed, aside));
  return Status::ok_status();
}

Status Layer::Impl::backward(const BackwardArgs& a, const SavedContext& saved,
                             cudaStream_t stream, const cudaEvent_t* marks) {
  int stage = 0;
  auto mark = [&]() { return marks ? cudaEventRecord(marks[stage++], stream) : cudaSuccess; };
  if (saved.generation != generation)
    return error_status(StatusCode::kInvalidArgument, "saved context of forward call ",
                        saved.generation, " is stale: forward has run since (call ", generation,
                        ")");
  if (saved_generation != saved.generation)
    return error_status(StatusCode::kNotImplemented,
                        "backward after the unfused forward (a benchmark path): it does not keep "
                        "the gate/up pre-activations the backward reads");
  const LayerConfig& c = config;
  const int64_t T = saved.num_tokens, H = c.hidden;
  EPFLOW_RETURN_IF_ERROR(earlier_failure());
  EPFLOW_CUDA_RETURN(mark());
  char* mine = static_cast<char*>(window.local());
  // Before the first barrier (after it, peers read and write this window): the router weights
  // and dy the experts' GPUs read, and the d topk_weights slots they write (empty slots stay 0).
  if (T > 0) {
    EPFLOW_CUDA_RETURN(cudaMemcpyAsync(mine + layout.topk_weights, saved.topk_weights,
                                       sizeof(float) * T * c.top_k, cudaMemcpyDeviceToDevice,
                                       stream));
    EPFLOW_CUDA_RETURN(cudaMemcpyAsync(mine + layout.dy, a.dy, sizeof(__nv_bfloat16) * T * H,
                                       cudaMemcpyDeviceToDevice, stream));
    EPFLOW_CUDA_RETURN(
        cudaMemsetAsync(mine + layout.d_weights, 0, sizeof(float) * T * c.top_k, stream));
  }
  // The forward's schedule (pull table, segments) is still this layer's: no forward ran since
  // (the generation check above), and peers' windows still hold that forward's x (a peer's next
  // forward overwrites it only after this backward's last barrier, which follows every pull).
  EPFLOW_RETURN_IF_ERROR(publish_barrier(T, stream));
  EPFLOW_CUDA_RETURN(mark());

  // Unweighted sums, and no routing check: the forward of this context checked the same ids.
  auto barrier_and_sum_dx = [&]() -> Status {
    EPFLOW_RETURN_IF_ERROR(barrier_and_sum(T, saved.topk_idx, nullptr, false, a.dx, stream));
    if (T > 0)
      EPFLOW_CUDA_RETURN(cudaMemcpyAsync(a.d_topk_weights, mine + layout.d_weights,
                                         sizeof(float) * T * c.top_k, cudaMemcpyDeviceToDevice,
                                         stream));
    return Status::ok_status();
  };
  if (unfused_backward) {
    EPFLOW_RETURN_IF_ERROR(run_unfused_backward(saved, stream, mark));
    EPFLOW_RETURN_IF_ERROR(weight_gradients(a, sm_count - side_sms, stream, x_pulled));
    EPFLOW_CUDA_RETURN(mark());
    // Join: every dx row is pushed (and the x rows pulled) before the barrier says so to peers.
    EPFLOW_CUDA_RETURN(cudaStreamWaitEvent(stream, dx_pushed, 0));
    EPFLOW_RETURN_IF_ERROR(barrier_and_sum_dx());
    EPFLOW_CUDA_RETURN(mark());
  } else {
    EPFLOW_RETURN_IF_ERROR(run_backward_megakernel(saved, stream));
    EPFLOW_CUDA_RETURN(mark());
    EPFLOW_RETURN_IF_ERROR(push_router_weight_grads(stream));
    EPFLOW_CUDA_RETURN(mark());
    // Weight gradients before the barrier (which waits for the slowest rank's pushes): a rank
    // whose megakernel ended first computes them meanwhile.
    EPFLOW_RETURN_IF_ERROR(weight_gradients(a, 0, stream, nullptr));
    EPFLOW_CUDA_RETURN(mark());
    EPFLOW_RETURN_IF_ERROR(barrier_and_sum_dx());
    EPFLOW_CUDA_RETURN(mark());
  }
  const size_t stages = unfused_backward ? std::size(kUnfusedBackwardStageNames)
                                         : std::size(kBackwardStageNames);
  if (marks && stage != static_cast<int>(stages) + 1)
    return error_status(StatusCode::kInternal, "backward recorded ", stage, " stage events, not ",
                        stages + 1);
  return Status::ok_status();
}

Layer::Layer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Layer::~Layer() = default;

Status Layer::create(const LayerConfig& config, ncclComm_t comm, std::unique_ptr<Layer>* out) {
  EPFLOW_RETURN_IF_ERROR(require(out != nullptr, "output pointer is null"));
  EPFLOW_RETURN_IF_ERROR(validate(config));
  if (config.dtype != DType::kBF16)
    return error_status(StatusCode::kNotImplemented, "dtype ", to_string(config.dtype),
                        " is not implemented yet: only bf16");
  EPFLOW_RETURN_IF_ERROR(check_nccl_version());
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0)
    return error_status(StatusCode::kNoDevice, "no CUDA device found (",
                        err == cudaSuccess ? "0 devices" : cudaGetErrorString(err), ")");
  EPFLOW_RETURN_IF_ERROR(require(comm != nullptr, "communicator is null"));
  int comm_size = 0, comm_rank = 0;
  if (ncclCommCount(comm, &comm_size) != ncclSuccess ||
      ncclCommUserRank(comm, &comm_rank) != ncclSuccess)
    return error_status(StatusCode::kNcclError, "could not query the communicator's size and rank");
  if (comm_size != config.ep_size || comm_rank != config.ep_rank)
    return error_status(StatusCode::kInvalidArgument, "communicator is rank ", comm_rank, " of ",
                        comm_size, " but config says ep_rank ", config.ep_rank, " of ep_size ",
                        config.ep_size);
  auto impl = std::make_unique<Impl>();
  impl->config = config;
  impl->comm = comm;
  int device = 0;
  EPFLOW_CUDA_RETURN(cudaGetDevice(&device));
  EPFLOW_CUDA_RETURN(
      cudaDeviceGetAttribute(&impl->sm_count, cudaDevAttrMultiProcessorCount, device));
  EPFLOW_RETURN_IF_ERROR(runtime::make_plan(config, impl->sm_count, &impl->plan));
  impl->side_sms = impl->plan.backward_side_sms;
  impl->backward_comm_sms = impl->plan.backward_comm_sms;
  EPFLOW_RETURN_IF_ERROR(impl->allocate());
  if (config.with_backward) EPFLOW_RETURN_IF_ERROR(impl->allocate_backward());
  out->reset(new Layer(std::move(impl)));
  return Status::ok_status();
}

Status Layer::device_failure() const { return impl_->device_failure(); }

// A launch fails with cudaErrorLaunchFailure once an earlier kernel of the layer trapped on a
// timed-out wait: add which wait it was.
Status with_device_failure(const Layer& layer, Status s) {
  if (s.ok()) return s;
  const Status why = layer.device_failure();
  return why.ok() ? s : error_status(why.code(), s.message(), ": ", why.message());
}

// What the weighted sums found wrong in topk_idx since the last report, then cleared. NOTES: the
// device may be adding to it while the host reads (a later call's kernels): a report can miss a
// slot of a call still running, which the next report then has.
Status Layer::Impl::routing_report() {
  volatile kernels::RoutingCheck* r = routing_check;
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
  *routing_check = kernels::RoutingCheck{};
  return error_status(StatusCode::kInvalidArgument, "topk_idx of rank ", config.ep_rank,
                      " had ", bad, " bad slots in calls since the last report (",
                      duplicated, " repeating an expert of the same token, ", bad - duplicated,
                      " out of range: skipped); ", first);
}

Status Layer::check_routing() { return impl_->routing_report(); }

Status Layer::forward(const ForwardArgs& args, cudaStream_t stream, SavedContext* saved) {
  EPFLOW_RETURN_IF_ERROR(validate(impl_->config, args));
  if (saved && !impl_->config.with_backward)
    return error_status(StatusCode::kInvalidArgument,
                        "forward() with a SavedContext needs a layer created with "
                        "LayerConfig::with_backward (it keeps g | u for the backward)");
  EPFLOW_RETURN_IF_ERROR(with_device_failure(*this, impl_->forward(args, stream, saved, nullptr)));
  return impl_->routing_report();
}

Status LayerInternals::use_unfused_forward(Layer& layer, bool unfused) {
  if (!unfused) {
    layer.impl_->unfused = false;
    return Status::ok_status();
  }
  return layer.impl_->enable_unfused();
}

runtime::LayerPlan LayerInternals::plan(const Layer& layer) { return layer.impl_->plan; }

Status LayerInternals::enable_trace(Layer& layer) {
  Layer::Impl& impl = *layer.impl_;
  if (!impl.trace) EPFLOW_CUDA_RETURN(cudaMalloc(&impl.trace, impl.trace_bytes()));
  return Status::ok_status();
}

Status LayerInternals::fetch_trace(const Layer& layer,
                                   std::vector<kernels::MegakernelTraceRecord>* out) {
  const Layer::Impl& impl = *layer.impl_;
  out->clear();
  if (!impl.trace) return error_status(StatusCode::kInvalidArgument, "tracing is not enabled");
  std::vector<kernels::MegakernelTraceRecord> all(impl.trace_bytes() /
                                                  sizeof(kernels::MegakernelTraceRecord));
  EPFLOW_CUDA_RETURN(cudaDeviceSynchronize());
  EPFLOW_CUDA_RETURN(cudaMemcpy(all.data(), impl.trace, impl.trace_bytes(), cudaMemcpyDeviceToHost));
  for (const auto& r : all)
    if (r.task >= 0) out->push_back(r);
  return Status::ok_status();
}

Status LayerInternals::forward_with_stage_events(Layer& layer, const ForwardArgs& args,
                                                 cudaStream_t stream, const StageEvents& events) {
  EPFLOW_RETURN_IF_ERROR(validate(layer.impl_->config, args));
  return with_device_failure(layer, layer.impl_->forward(args, stream, nullptr, &events));
}

Status Layer::backward(const BackwardArgs& args, const SavedContext& saved, cudaStream_t stream) {
  EPFLOW_RETURN_IF_ERROR(validate(impl_->config, saved, args));
  EPFLOW_RETURN_IF_ERROR(with_device_failure(*this, impl_->backward(args, saved, stream, nullptr)));
  return impl_->routing_report();
}

Status LayerInternals::set_backward_side_sms(Layer& layer, int32_t side_sms) {
  Layer::Impl& impl = *layer.impl_;
  if (side_sms < 0 || side_sms >= impl.sm_count / 2)
    return error_status(StatusCode::kInvalidArgument, "backward side SMs (", side_sms,
                        ") must be in [0, ", impl.sm_count / 2, ")");
  impl.side_sms = side_sms;
  return Status::ok_status();
}

int32_t LayerInternals::backward_side_sms(const Layer& layer) { return layer.impl_->side_sms; }

Status LayerInternals::use_unfused_backward(Layer& layer, bool unfused) {
  Layer::Impl& impl = *layer.impl_;
  if (!impl.config.with_backward)
    return error_status(StatusCode::kInvalidArgument,
                        "the unfused backward needs a layer created with_backward");
  if (!unfused) {
    impl.unfused_backward = false;
    return Status::ok_status();
  }
  return impl.enable_unfused_backward();
}

Status LayerInternals::set_backward_comm_sms(Layer& layer, int32_t comm_sms) {
  Layer::Impl& impl = *layer.impl_;
  if (comm_sms < 1 || comm_sms >= impl.sm_count)
    return error_status(StatusCode::kInvalidArgument, "backward communication SMs (", comm_sms,
                        ") must be in [1, ", impl.sm_count, ")");
  impl.backward_comm_sms = comm_sms;
  return Status::ok_status();
}

int32_t LayerInternals::backward_comm_sms(const Layer& layer) {
  return layer.impl_->backward_comm_sms;
}

Status LayerInternals::backward_with_stage_events(Layer& layer, const BackwardArgs& args,
                                                  const SavedContext& saved, cudaStream_t stream,
                                                  const cudaEvent_t* marks) {
  EPFLOW_RETURN_IF_ERROR(validate(layer.impl_->config, saved, args));
  return with_device_failure(layer, layer.impl_->backward(args, saved, stream, marks));
}

const LayerConfig& Layer::config() const { return impl_->config; }

MemoryReport Layer::memory() const { return impl_->memory; }

}  // namespace epflow
