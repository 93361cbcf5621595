#include "epflow/status.h"

namespace epflow {

const char* to_string(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "Ok";
    case StatusCode::kInvalidArgument:
      return "InvalidArgument";
    case StatusCode::kNotImplemented:
      return "NotImplemented";
    case StatusCode::kNoDevice:
      return "NoDevice";
    case StatusCode::kCudaError:
      return "CudaError";
    case StatusCode::kNcclError:
      return "NcclError";
    case StatusCode::kTimeout:
      return "Timeout";
    case StatusCode::kInternal:
      return "Internal";
  }
  return "Unknown";
}

std::string Status::to_string() const {
  if (ok()) return "Ok";
  return std::string(epflow::to_string(code_)) + ": " + message_;
}

}  // namespace epflow
