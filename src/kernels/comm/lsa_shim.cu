#include <nccl_device.h>

#include "common/status_util.h"
#include "kernels/comm/lsa_shim.cuh"

namespace epflow::comm {

namespace {

__global__ void peer_bases_kernel(ncclWindow_t window, int world, char** out) {
  const int peer = threadIdx.x;
  if (peer < world) out[peer] = static_cast<char*>(ncclGetPeerPointer(window, 0, peer));
}

#define EPFLOW_NCCL_RETURN(expr, what)                                                      \
  do {                                                                                      \
    const ncclResult_t r_ = (expr);                                                         \
    if (r_ != ncclSuccess)                                                                  \
      return error_status(StatusCode::kNcclError, what, ": ", ncclGetErrorString(r_), " (", \
                          ncclGetLastError(comm), ")");                                     \
  } while (0)

}  // namespace

Status LsaWindow::create(ncclComm_t comm, size_t bytes, LsaWindow* out) {
  int world = 0, rank = 0;
  EPFLOW_NCCL_RETURN(ncclCommCount(comm, &world), "ncclCommCount");
  EPFLOW_NCCL_RETURN(ncclCommUserRank(comm, &rank), "ncclCommUserRank");
  LsaWindow w;
  w.comm_ = comm;
  w.bytes_ = (bytes + NCCL_WIN_REQUIRED_ALIGNMENT - 1) / NCCL_WIN_REQUIRED_ALIGNMENT *
             NCCL_WIN_REQUIRED_ALIGNMENT;
  EPFLOW_NCCL_RETURN(ncclMemAlloc(&w.local_, w.bytes_), "ncclMemAlloc of the symmetric window");
  // NOTES: ncclCommWindowRegister reports success even where the communicator has no symmetric
  // (LSA) support; only a device communicator whose LSA team spans every rank proves the peers'
  // windows are mapped here.
  ncclResult_t r = ncclCommWindowRegister(comm, w.local_, w.bytes_, &w.window_,
                                          NCCL_WIN_COLL_SYMMETRIC);
  if (r != ncclSuccess) {
    ncclMemFree(w.local_);
    return error_status(StatusCode::kNcclError,
                        "ncclCommWindowRegister: ", ncclGetErrorString(r));
  }
  auto* dev_comm = new ncclDevComm{};
  ncclDevCommRequirements reqs;
  memset(&reqs, 0, sizeof(reqs));  // 2.28 has no initializer; multimem stays off (lsaMultimem=0)
  r = ncclDevCommCreate(comm, &reqs, dev_comm);
  w.dev_comm_ = dev_comm;
  if (r != ncclSuccess || dev_comm->lsaSize != world) {
    const int lsa = r == ncclSuccess ? dev_comm->lsaSize : -1;
    if (r != ncclSuccess) {
      delete dev_comm;
      w.dev_comm_ = nullptr;
    }
    w.destroy();
    return error_status(StatusCode::kNcclError, "rank ", rank, ": no symmetric memory across all ",
                        world, " ranks (ncclDevCommCreate: ",
                        r == ncclSuccess ? "ok" : ncclGetErrorString(r), ", LSA team size ", lsa,
                        "): EPFlow needs every rank in one NVLink domain with CUDA P2P and cuMem");
  }
  char** d_bases = nullptr;
  EPFLOW_CUDA_RETURN(cudaMalloc(&d_bases, sizeof(char*) * world));
  peer_bases_kernel<<<1, 128>>>(w.window_, world, d_bases);
  w.peer_bases_.resize(world);
  const cudaError_t e = cudaMemcpy(w.peer_bases_.data(), d_bases, sizeof(char*) * world,
                                   cudaMemcpyDeviceToHost);
  cudaFree(d_bases);
  if (e != cudaSuccess)
    return error_status(StatusCode::kCudaError, "reading the peers' window addresses: ",
                        cudaGetErrorString(e));
  *out = w;
  return Status::ok_status();
}

void LsaWindow::destroy() {
  if (!comm_) return;
  if (dev_comm_) {
    auto* dev_comm = static_cast<ncclDevComm*>(dev_comm_);
    ncclDevCommDestroy(comm_, dev_comm);
    delete dev_comm;
  }
  if (window_) ncclCommWindowDeregister(comm_, window_);
  if (local_) ncclMemFree(local_);
  *this = LsaWindow{};
}

}  // namespace epflow::comm
