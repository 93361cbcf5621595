#include "kernels/tensor_map.h"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <mutex>

#include "common/status_util.h"

namespace epflow {

namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  });
  return fn;
}

Status encode_tensor_map(CUtensorMap* map, CUtensorMapDataType type, uint64_t elem_bytes,
                         const void* base, int rank, const uint64_t* dims, const uint32_t* box,
                         const uint64_t* strides_bytes,
                         CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B) {
  auto fn = encode_fn();
  if (!fn) return error_status(StatusCode::kCudaError, "cuTensorMapEncodeTiled is unavailable");
  cuuint64_t global_dims[3];
  cuuint64_t strides[2];  // bytes, for dims 1..rank-1
  cuuint32_t box_dims[3], elem_strides[3] = {1, 1, 1};
  uint64_t stride = elem_bytes;
  for (int i = 0; i < rank; ++i) {
    global_dims[i] = dims[i];
    box_dims[i] = box[i];
    if (i > 0) strides[i - 1] = strides_bytes ? strides_bytes[i - 1] : stride;
    stride *= dims[i];
  }
  const CUresult r = fn(map, type, rank, const_cast<void*>(base),
                        global_dims, strides, box_dims, elem_strides,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return error_status(StatusCode::kCudaError, "cuTensorMapEncodeTiled failed (", int(r),
                        ") for a rank-", rank, " tensor with inner dim ", dims[0]);
  return Status::ok_status();
}

}  // namespace

Status encode_bf16_tensor_map(CUtensorMap* map, const void* base, int rank, const uint64_t* dims,
                              const uint32_t* box, const uint64_t* strides_bytes) {
  return encode_tensor_map(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, rank, dims, box,
                           strides_bytes);
}

Status encode_u8_tensor_map(CUtensorMap* map, const void* base, int rank, const uint64_t* dims,
                            const uint32_t* box, const uint64_t* strides_bytes) {
  return encode_tensor_map(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, base, rank, dims, box,
                           strides_bytes);
}

Status encode_u8_tensor_map_unswizzled(CUtensorMap* map, const void* base, int rank,
                                       const uint64_t* dims, const uint32_t* box,
                                       const uint64_t* strides_bytes) {
  return encode_tensor_map(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, base, rank, dims, box,
                           strides_bytes, CU_TENSOR_MAP_SWIZZLE_NONE);
}

Status encode_f32_vector_map(CUtensorMap* map, const void* base, uint64_t n, uint32_t box) {
  return encode_tensor_map(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, base, 1, &n, &box, nullptr,
                           CU_TENSOR_MAP_SWIZZLE_NONE);
}

Status encode_f32_tensor_map(CUtensorMap* map, const void* base, int rank, const uint64_t* dims,
                             const uint32_t* box, const uint64_t* strides_bytes) {
  return encode_tensor_map(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, base, rank, dims, box,
                           strides_bytes);
}

}  // namespace epflow
