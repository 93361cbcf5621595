#include "epflow/communicator.h"

#include <cuda_runtime.h>

#include <thread>
#include <vector>

#include "epflow/layer.h"
#include "common/status_util.h"

namespace epflow {

Status check_nccl_version() {
  int loaded = 0;
  if (ncclGetVersion(&loaded) != ncclSuccess)
    return error_status(StatusCode::kNcclError, "ncclGetVersion failed");
  if (loaded != NCCL_VERSION_CODE)
    return error_status(
        StatusCode::kNcclError, "EPFlow was built with NCCL headers ", NCCL_VERSION_CODE,
        " but the loaded libnccl is ", loaded,
        ": the device communicator layout differs between releases. Rebuild with "
        "-DEPFLOW_NCCL_ROOT pointing at the NCCL you load (or fix LD_LIBRARY_PATH).");
  return Status::ok_status();
}

Status create_communicator(const ncclUniqueId& id, int world, int rank, ncclComm_t* out) {
  EPFLOW_RETURN_IF_ERROR(check_nccl_version());
  const ncclResult_t r = ncclCommInitRank(out, world, id, rank);
  if (r != ncclSuccess)
    return error_status(StatusCode::kNcclError, "ncclCommInitRank (rank ", rank, " of ", world,
                        "): ", ncclGetErrorString(r));
  return Status::ok_status();
}

Status run_on_local_gpus(int world, const std::function<Status(int rank, ncclComm_t comm)>& fn) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < world)
    return error_status(StatusCode::kNoDevice, "run_on_local_gpus needs ", world, " GPUs, found ",
                        devices);
  EPFLOW_RETURN_IF_ERROR(check_nccl_version());
  ncclUniqueId id;
  if (ncclGetUniqueId(&id) != ncclSuccess)
    return error_status(StatusCode::kNcclError, "ncclGetUniqueId failed");
  std::vector<Status> results(world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      if (cudaSetDevice(rank) != cudaSuccess) {
        results[rank] = error_status(StatusCode::kCudaError, "cudaSetDevice(", rank, ") failed");
        return;
      }
      ncclComm_t comm = nullptr;
      results[rank] = create_communicator(id, world, rank, &comm);
      if (!results[rank].ok()) return;
      results[rank] = fn(rank, comm);
      // NOTES: after a kernel of this rank trapped (a timed-out wait), its CUDA context is dead:
      // ncclCommDestroy would still try to use it; ncclCommAbort is NCCL's teardown for a
      // communicator in error (a process exited with a segfault after a destroy there).
      if (cudaDeviceSynchronize() != cudaSuccess)
        ncclCommAbort(comm);
      else
        ncclCommDestroy(comm);
    });
  }
  for (auto& t : threads) t.join();
  // Every failing rank: the cause is often on another rank than the first to report (a rank
  // whose peer died times out in a barrier).
  Status first = Status::ok_status();
  std::string all;
  for (int rank = 0; rank < world; ++rank) {
    if (results[rank].ok()) continue;
    if (first.ok()) first = results[rank];
    all += concat(all.empty() ? "" : "; ", "rank ", rank, ": ", results[rank].message());
  }
  return first.ok() ? first : Status(first.code(), all);
}

}  // namespace epflow
