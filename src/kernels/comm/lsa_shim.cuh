// The one shim over NCCL's device API (everything that includes <nccl_device.h> is in
// lsa_shim.cu). EPFlow's kernels never call NCCL device functions themselves: the shim resolves
// every peer's base address of a symmetric window once, at workspace creation, and the kernels
// use those plain NVLink-mapped pointers (vector loads/stores, bulk copies, flags).
// Multi-node (GIN) would be added here.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <vector>

#include "epflow/status.h"

namespace epflow::comm {

// A symmetric window registered on every rank of `comm`, with its peers' addresses.
class LsaWindow {
 public:
  // Collective: every rank calls it with the same size, in the same order.
  static Status create(ncclComm_t comm, size_t bytes, LsaWindow* out);
  // Collective as well; safe on a default-constructed window.
  void destroy();

  void* local() const { return local_; }
  size_t bytes() const { return bytes_; }
  // Base address of rank r's copy of the window, usable from this GPU's kernels.
  const std::vector<char*>& peer_bases() const { return peer_bases_; }

 private:
  ncclComm_t comm_ = nullptr;
  void* local_ = nullptr;
  size_t bytes_ = 0;
  ncclWindow_t window_ = nullptr;
  void* dev_comm_ = nullptr;  // ncclDevComm, owned (kept opaque: its size changes by release)
  std::vector<char*> peer_bases_;
};

}  // namespace epflow::comm
