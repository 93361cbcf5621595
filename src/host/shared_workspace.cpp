#include "host/shared_workspace.h"

#include <cuda_runtime.h>

#include <vector>

#include "common/status_util.h"
#include "epflow/communicator.h"

namespace epflow {

namespace {

size_t aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Host-mapped memory the device writes and the host reads: *host zeroed, *device its address.
template <typename T>
Status alloc_mapped(T** host, T** device) {
  EPFLOW_CUDA_RETURN(cudaHostAlloc(reinterpret_cast<void**>(host), sizeof(T), cudaHostAllocMapped));
  **host = T{};
  EPFLOW_CUDA_RETURN(cudaHostGetDevicePointer(reinterpret_cast<void**>(device), *host, 0));
  return Status::ok_status();
}

// Replaces *p by `bytes` of device memory (the old contents are not kept).
Status reallocate(void** p, size_t bytes) {
  if (*p) EPFLOW_CUDA_RETURN(cudaFree(*p));
  *p = nullptr;
  EPFLOW_CUDA_RETURN(cudaMalloc(p, bytes));
  return Status::ok_status();
}

}  // namespace

Status SharedWorkspace::create(ncclComm_t comm, std::shared_ptr<SharedWorkspace>* out) {
  EPFLOW_RETURN_IF_ERROR(check_nccl_version());
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0)
    return error_status(StatusCode::kNoDevice, "no CUDA device found (",
                        err == cudaSuccess ? "0 devices" : cudaGetErrorString(err), ")");
  if (comm == nullptr) return invalid_argument("communicator is null");
  std::shared_ptr<SharedWorkspace> ws(new SharedWorkspace());
  ws->comm_ = comm;
  if (ncclCommCount(comm, &ws->world_) != ncclSuccess ||
      ncclCommUserRank(comm, &ws->rank_) != ncclSuccess)
    return error_status(StatusCode::kNcclError, "could not query the communicator's size and rank");
  EPFLOW_CUDA_RETURN(cudaGetDevice(&ws->device_));
  EPFLOW_CUDA_RETURN(
      cudaDeviceGetAttribute(&ws->sm_count_, cudaDevAttrMultiProcessorCount, ws->device_));
  const size_t small = aligned(sizeof(void*) * ws->world_) +
                       aligned(sizeof(int64_t) * ws->world_) + aligned(sizeof(uint64_t));
  EPFLOW_CUDA_RETURN(cudaMalloc(&ws->small_, small));
  char* p = static_cast<char*>(ws->small_);
  ws->peer_topk_idx_ = reinterpret_cast<const int32_t**>(p);
  p += aligned(sizeof(void*) * ws->world_);
  ws->tokens_ = reinterpret_cast<int64_t*>(p);
  p += aligned(sizeof(int64_t) * ws->world_);
  ws->epoch_ = reinterpret_cast<uint64_t*>(p);
  DeviceReports& r = ws->reports_;
  EPFLOW_RETURN_IF_ERROR(alloc_mapped(&r.megakernel, &r.megakernel_device));
  EPFLOW_RETURN_IF_ERROR(alloc_mapped(&r.barrier, &r.barrier_device));
  EPFLOW_RETURN_IF_ERROR(alloc_mapped(&r.routing, &r.routing_device));
  EPFLOW_CUDA_RETURN(cudaMalloc(&r.routing_tally, sizeof(kernels::RoutingTally)));
  EPFLOW_CUDA_RETURN(cudaMemset(r.routing_tally, 0, sizeof(kernels::RoutingTally)));
  EPFLOW_CUDA_RETURN(cudaEventCreateWithFlags(&ws->last_call_, cudaEventDisableTiming));
  *out = std::move(ws);
  return Status::ok_status();
}

SharedWorkspace::~SharedWorkspace() {
  // After a timed-out wait trapped a kernel the CUDA context is dead: nothing can be freed any
  // more (the process must exit), and NCCL's window teardown would use the context.
  if (reports_.megakernel && reports_.barrier && !device_failure().ok()) return;
  if (reports_.megakernel) cudaFreeHost(reports_.megakernel);
  if (reports_.barrier) cudaFreeHost(reports_.barrier);
  if (reports_.routing) cudaFreeHost(reports_.routing);
  if (reports_.routing_tally) cudaFree(reports_.routing_tally);
  if (last_call_) cudaEventDestroy(last_call_);
  for (void* p : {small_, ring_, backward_, schedule_})
    if (p) cudaFree(p);
  window_.destroy();
}

// A new window (collective): the flags every barrier reads start at zero on every rank, so the
// epoch starts again, and no rank may signal before every rank has zeroed its flags (one
// collective orders the two; creation may synchronize, a call never does).
Status SharedWorkspace::grow_window(size_t bytes) {
  window_.destroy();
  EPFLOW_RETURN_IF_ERROR(comm::LsaWindow::create(comm_, bytes, &window_));
  const kernels::WindowLayout fixed = kernels::WindowLayout::make(0, 0, 0);
  std::vector<const int32_t*> idx(world_);
  for (int32_t r = 0; r < world_; ++r)
    idx[r] = reinterpret_cast<const int32_t*>(window_.peer_bases()[r] + fixed.topk_idx);
  EPFLOW_CUDA_RETURN(
      cudaMemcpy(peer_topk_idx_, idx.data(), sizeof(void*) * world_, cudaMemcpyHostToDevice));
  EPFLOW_CUDA_RETURN(cudaMemset(epoch_, 0, sizeof(uint64_t)));
  EPFLOW_CUDA_RETURN(cudaMemset(static_cast<char*>(window_.local()) + fixed.flags, 0,
                                sizeof(uint64_t) * kernels::kMaxPeers));
  EPFLOW_CUDA_RETURN(cudaDeviceSynchronize());
  int32_t* one = reinterpret_cast<int32_t*>(tokens_);
  const ncclResult_t r = ncclAllReduce(one, one, 1, ncclInt32, ncclSum, comm_, nullptr);
  if (r != ncclSuccess)
    return error_status(StatusCode::kNcclError, "window handshake: ", ncclGetErrorString(r));
  EPFLOW_CUDA_RETURN(cudaDeviceSynchronize());
  return Status::ok_status();
}

Status SharedWorkspace::reserve(const Needs& n) {
  const bool window = n.window > have_.window, ring = n.ring > have_.ring,
             backward = n.backward > have_.backward, schedule = n.schedule > have_.schedule;
  if (!window && !ring && !backward && !schedule) return Status::ok_status();
  EPFLOW_CUDA_RETURN(cudaDeviceSynchronize());  // earlier calls may still use what moves
  if (window) EPFLOW_RETURN_IF_ERROR(grow_window(n.window));
  if (ring) EPFLOW_RETURN_IF_ERROR(reallocate(&ring_, n.ring));
  if (backward) EPFLOW_RETURN_IF_ERROR(reallocate(&backward_, n.backward));
  if (schedule) EPFLOW_RETURN_IF_ERROR(reallocate(&schedule_, n.schedule));
  if (window) have_.window = window_.bytes();
  if (ring) have_.ring = n.ring;
  if (backward) have_.backward = n.backward;
  if (schedule) have_.schedule = n.schedule;
  ++generation_;
  return Status::ok_status();
}

MemoryReport SharedWorkspace::memory() const {
  MemoryReport m;
  m.symmetric_bytes = static_cast<int64_t>(window_.bytes());
  m.ring_bytes = static_cast<int64_t>(have_.ring);
  m.schedule_bytes = static_cast<int64_t>(have_.schedule) +
                     static_cast<int64_t>(aligned(sizeof(void*) * world_) +
                                          aligned(sizeof(int64_t) * world_) +
                                          aligned(sizeof(uint64_t)));
  m.backward_bytes = static_cast<int64_t>(have_.backward);
  return m;
}

Status SharedWorkspace::begin_call(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  EPFLOW_CUDA_RETURN(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone || !any_call_ || stream == last_stream_)
    return Status::ok_status();
  EPFLOW_CUDA_RETURN(cudaStreamWaitEvent(stream, last_call_, 0));
  return Status::ok_status();
}

Status SharedWorkspace::end_call(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  EPFLOW_CUDA_RETURN(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return Status::ok_status();
  EPFLOW_CUDA_RETURN(cudaEventRecord(last_call_, stream));
  last_stream_ = stream;
  any_call_ = true;
  return Status::ok_status();
}

Status SharedWorkspace::device_failure() const {
  if (reports_.megakernel->set)
    return error_status(StatusCode::kTimeout, kernels::describe(*reports_.megakernel));
  const volatile kernels::BarrierTimeout* b = reports_.barrier;
  if (!b->set) return Status::ok_status();
  return error_status(StatusCode::kTimeout, "rank ", b->rank, " timed out after ", b->seconds,
                      " s in the ",
                      b->phase == static_cast<int32_t>(kernels::BarrierPhase::kDispatch)
                          ? "dispatch barrier (before pulling tokens)"
                          : "combine barrier (after pushing results)",
                      ", epoch ", b->epoch, ": rank ", b->peer,
                      " never arrived (its last epoch here: ", b->seen, ")");
}

}  // namespace epflow
