// Portable code: functions marked EPFLOW_HD compile for the host (tests, reference, CPU planning)
// and for the device (the kernels run the very same source).
#pragma once

#if defined(__CUDACC__)
#define EPFLOW_HD __host__ __device__ __forceinline__
#else
#define EPFLOW_HD inline
#endif
