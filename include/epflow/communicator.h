// EPFlow: communicators. A layer runs on an NCCL communicator with one rank per GPU, all in one
// NVLink domain. Bring your own (torch.distributed / mpirun / torchrun: one process per GPU) or
// create one here; run_on_local_gpus() runs N ranks as N threads of one process.
#pragma once

#include <nccl.h>

#include <functional>

#include "epflow/status.h"

namespace epflow {

// NCCL's device-communicator struct changes size between releases: the headers EPFlow was built
// with must be those of the libnccl loaded at run time. Layer::create() and
// create_communicator() call this.
Status check_nccl_version();

// ncclCommInitRank on the current CUDA device, with the NCCL version checked first.
Status create_communicator(const ncclUniqueId& id, int world, int rank, ncclComm_t* out);

// Runs fn(rank, comm) on `world` threads, thread r bound to GPU r with a communicator of the
// group; destroys the communicators afterwards. Returns the first rank's error, if any.
Status run_on_local_gpus(int world, const std::function<Status(int rank, ncclComm_t comm)>& fn);

}  // namespace epflow
