// epflow-row-copy-probe: how fast one SM moves routed rows (a token's hidden vector, bf16) from
// local HBM or a peer GPU into a contiguous buffer, the dispatch's job, with the copy schemes the
// megakernel could use: bulk copies (TMA) through shared memory, issued by one thread or by
// several warps, and register copies (a warp per row). Rows are picked at random among 8192
// tokens. Prints µs, GB/s in total and per SM. Needs one GPU; the peer rows need two.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "kernels/ptx/tma.cuh"
#include "unfused/warp_row_copy.cuh"

namespace {

#define CHECK_CUDA(x)                                                                    \
  do {                                                                                   \
    cudaError_t e = (x);                                                                 \
    if (e != cudaSuccess) {                                                              \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));    \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

constexpr int kThreads = 384;
constexpr int kSmemBytes = 224 * 1024;
constexpr int kMaxSlots = 64;

enum Scheme : int { kBulk = 0, kBulkLoadOnly = 1, kRegister = 2 };
const char* const kSchemeNames[] = {"bulk load+store", "bulk load only", "register copy"};

// Each CTA copies rows_per_cta rows (sources rows[]) into its part of dst. Bulk schemes: `warps`
// warps, lane 0 of each running its own chain through its share of the row buffers.
__global__ void __launch_bounds__(kThreads, 1)
    copy_rows(const uint8_t* src, uint8_t* dst, const int* rows, int rows_per_cta, int row_bytes,
              int scheme, int warps) {
  extern __shared__ __align__(1024) uint8_t smem[];
  __shared__ uint64_t full[kMaxSlots];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int* mine = rows + blockIdx.x * rows_per_cta;
  uint8_t* out = dst + static_cast<size_t>(blockIdx.x) * rows_per_cta * row_bytes;
  if (scheme == kRegister) {  // the megakernel's former copy: a warp per row, 16 x 16 B per lane
    for (int r = warp; r < rows_per_cta; r += kThreads / 32)
      epflow::kernels::warp_copy_row<16>(
          reinterpret_cast<const int4*>(src + static_cast<size_t>(mine[r]) * row_bytes),
          reinterpret_cast<int4*>(out + static_cast<size_t>(r) * row_bytes), row_bytes / 16, lane);
    return;
  }
  if (warp >= warps || lane != 0) return;
  namespace ptx = epflow::ptx;
  const int total = min(kMaxSlots, kSmemBytes / row_bytes);
  const int slots = total / warps;
  uint8_t* buf = smem + static_cast<size_t>(warp) * slots * row_bytes;
  uint64_t* bar = full + warp * slots;
  for (int i = 0; i < slots; ++i) ptx::mbarrier_init(&bar[i], 1);
  ptx::mbarrier_init_fence();
  const int n = (rows_per_cta - warp + warps - 1) / warps;  // rows warp, warp + warps, ...
  auto load = [&](int k) {
    const int b = k % slots;
    ptx::mbarrier_arrive_expect_tx(&bar[b], row_bytes);
    ptx::bulk_load(buf + b * row_bytes, src + static_cast<size_t>(mine[warp + k * warps]) * row_bytes,
                   row_bytes, &bar[b]);
  };
  for (int k = 0; k < n && k < slots; ++k) load(k);
  for (int k = 0; k < n; ++k) {
    ptx::mbarrier_wait(&bar[k % slots], (k / slots) & 1);
    if (scheme == kBulkLoadOnly) {
      if (k + slots < n) load(k + slots);
      continue;
    }
    ptx::bulk_store(out + static_cast<size_t>(warp + k * warps) * row_bytes,
                    buf + (k % slots) * row_bytes, row_bytes);
    ptx::tma_store_commit();
    if (k >= 1 && k - 1 + slots < n) {  // refill the previous row's buffer once it was read
      ptx::bulk_wait_read<1>();
      load(k - 1 + slots);
    }
  }
  ptx::tma_store_wait_all();
}

}  // namespace

int main() {
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus < 1) {
    std::printf("epflow-row-copy-probe: no CUDA device, nothing to measure\n");
    return 0;
  }
  constexpr int kTokens = 8192, kRowsPerCta = 512, kMaxCtas = 10;
  constexpr size_t kMaxRow = 14336;  // DeepSeek-V3: H = 7168
  const bool peer = gpus >= 2;
  uint8_t *local = nullptr, *remote = nullptr, *dst = nullptr;
  if (peer) {
    CHECK_CUDA(cudaSetDevice(1));
    CHECK_CUDA(cudaMalloc(&remote, kTokens * kMaxRow));
    CHECK_CUDA(cudaMemset(remote, 1, kTokens * kMaxRow));
  }
  CHECK_CUDA(cudaSetDevice(0));
  if (peer) CHECK_CUDA(cudaDeviceEnablePeerAccess(1, 0));
  CHECK_CUDA(cudaMalloc(&local, kTokens * kMaxRow));
  CHECK_CUDA(cudaMemset(local, 1, kTokens * kMaxRow));
  CHECK_CUDA(cudaMalloc(&dst, static_cast<size_t>(kMaxCtas) * kRowsPerCta * kMaxRow));
  std::vector<int> rows(kMaxCtas * kRowsPerCta);
  std::mt19937 rng(1);
  for (int& r : rows) r = static_cast<int>(rng() % kTokens);
  int* d_rows = nullptr;
  CHECK_CUDA(cudaMalloc(&d_rows, rows.size() * sizeof(int)));
  CHECK_CUDA(cudaMemcpy(d_rows, rows.data(), rows.size() * sizeof(int), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaFuncSetAttribute(copy_rows, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  kSmemBytes));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::printf("%-6s %-6s %-16s %5s %4s %10s %12s %12s\n", "row B", "source", "scheme", "warps",
              "SMs", "us", "GB/s", "GB/s per SM");
  for (int row_bytes : {14336, 4096})
    for (int from_peer = 0; from_peer <= (peer ? 1 : 0); ++from_peer)
      for (int scheme : {kBulk, kBulkLoadOnly, kRegister})
        for (int warps : {1, 4})
          for (int ctas : {1, kMaxCtas}) {
            if (scheme == kRegister && warps != 1) continue;
            const uint8_t* src = from_peer ? remote : local;
            auto launch = [&] {
              copy_rows<<<ctas, kThreads, kSmemBytes>>>(src, dst, d_rows, kRowsPerCta, row_bytes,
                                                        scheme, warps);
            };
            for (int i = 0; i < 3; ++i) launch();
            CHECK_CUDA(cudaEventRecord(start));
            constexpr int kIters = 10;
            for (int i = 0; i < kIters; ++i) launch();
            CHECK_CUDA(cudaEventRecord(stop));
            CHECK_CUDA(cudaEventSynchronize(stop));
            CHECK_CUDA(cudaGetLastError());
            float ms = 0;
            CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
            const double us = 1e3 * ms / kIters;
            const double gbs = static_cast<double>(ctas) * kRowsPerCta * row_bytes / (us * 1e3);
            std::printf("%-6d %-6s %-16s %5d %4d %10.1f %12.1f %12.1f\n", row_bytes,
                        from_peer ? "peer" : "local", kSchemeNames[scheme],
                        scheme == kRegister ? kThreads / 32 : warps, ctas, us, gbs, gbs / ctas);
          }
  return 0;
}
