// Shared helpers of the gpu-labelled tests: skip cleanly without a device, check every CUDA call.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

// Skips the test (with the reason in the output) where no CUDA device can be used.
#define EPFLOW_SKIP_WITHOUT_GPU()                                                        \
  do {                                                                                   \
    int devices_ = 0;                                                                    \
    const cudaError_t err_ = cudaGetDeviceCount(&devices_);                              \
    if (err_ != cudaSuccess || devices_ == 0)                                            \
      GTEST_SKIP() << "no CUDA device (" << (err_ == cudaSuccess ? "0 devices"           \
                                                                 : cudaGetErrorString(err_)) \
                   << "): GPU test skipped";                                             \
  } while (0)

#define EPFLOW_CUDA_CHECK(expr)                                                 \
  do {                                                                          \
    const cudaError_t err_ = (expr);                                            \
    ASSERT_EQ(err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(err_);  \
  } while (0)
