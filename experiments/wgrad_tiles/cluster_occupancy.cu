// How many clusters of 1 and 2 CTAs of the FP8 weight-gradient kernel's shape (384 threads, one
// CTA per SM, SMEM_KB of dynamic shared memory) the GPU holds at once: the CTAs a persistent
// launch of b_multicast.patch's kernel gets. Usage: cluster_occupancy [SMEM_KB (default 220)].
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

__global__ void __launch_bounds__(384, 1) shaped_like_the_wgrad_kernel(int* out) {
  extern __shared__ int smem[];
  smem[threadIdx.x] = threadIdx.x;
  __syncthreads();
  if (out) out[blockIdx.x] = smem[(threadIdx.x + 1) % 384];
}

int main(int argc, char** argv) {
  const int smem = (argc > 1 ? std::atoi(argv[1]) : 220) * 1024;
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  if (cudaFuncSetAttribute(shaped_like_the_wgrad_kernel,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
    std::printf("cudaFuncSetAttribute failed\n");
    return 1;
  }
  for (unsigned cluster : {1u, 2u}) {
    cudaLaunchConfig_t config = {};
    cudaLaunchAttribute attribute;
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = cluster;
    attribute.val.clusterDim.y = attribute.val.clusterDim.z = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
    config.blockDim = dim3(384);
    config.gridDim = dim3(sms / cluster * cluster);
    config.dynamicSmemBytes = smem;
    int clusters = 0;
    const cudaError_t e =
        cudaOccupancyMaxActiveClusters(&clusters, shaped_like_the_wgrad_kernel, &config);
    std::printf("%d SMs, %d KB: clusters of %u: %d resident (%d CTAs) %s\n", sms, smem / 1024,
                cluster, clusters, clusters * cluster, cudaGetErrorString(e));
  }
  return 0;
}
