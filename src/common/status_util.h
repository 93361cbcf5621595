// Building error statuses whose messages name the field and the value seen.
#pragma once

#include <sstream>
#include <string>

#include "epflow/status.h"

namespace epflow {

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

template <typename... Parts>
Status error_status(StatusCode code, const Parts&... parts) {
  return Status(code, concat(parts...));
}

template <typename... Parts>
Status invalid_argument(const Parts&... parts) {
  return Status(StatusCode::kInvalidArgument, concat(parts...));
}

#define EPFLOW_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::epflow::Status epflow_status_ = (expr);        \
    if (!epflow_status_.ok()) return epflow_status_; \
  } while (0)

// A failed CUDA runtime call as kCudaError naming the call and CUDA's reason.
#define EPFLOW_CUDA_RETURN(expr)                                                          \
  do {                                                                                    \
    const cudaError_t epflow_cuda_error_ = (expr);                                        \
    if (epflow_cuda_error_ != cudaSuccess)                                                \
      return ::epflow::error_status(::epflow::StatusCode::kCudaError, #expr, ": ",        \
                                    cudaGetErrorString(epflow_cuda_error_));              \
  } while (0)

}  // namespace epflow
