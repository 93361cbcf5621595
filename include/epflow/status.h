// EPFlow: status type returned by every public call.
#pragma once

#include <string>
#include <utility>

namespace epflow {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,  // bad config, shapes or pointers: the caller can fix it
  kNotImplemented,   // a path EPFlow does not have yet (the message says which)
  kNoDevice,         // no usable CUDA device
  kCudaError,
  kNcclError,
  kTimeout,          // a wait on another SM or GPU ran past its budget
  kInternal,
};

const char* to_string(StatusCode code);

// Errors carry a message that names what was wrong and the value that was seen.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok_status() { return {}; }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "InvalidArgument: top_k (9) exceeds num_experts (8)"
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

}  // namespace epflow
