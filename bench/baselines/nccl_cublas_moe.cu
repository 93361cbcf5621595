// The NCCL + cuBLAS baseline layer: see nccl_cublas_moe.h for the pipeline.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "../cublas_rows.h"
#include "../swiglu_baseline.cuh"
#include "nccl_cublas_moe.h"

namespace epflow::bench {

namespace {

using bf16 = __nv_bfloat16;

constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr int kVec = 8;               // bf16 per 16-byte vector
constexpr int64_t kSortChunk = 1024;  // keys one warp walks in order (the stable part)
constexpr int kSortWarpsPerBlock = 8;
// Bounds the [buckets, chunks] histogram: chunks grow instead when there are many buckets.
constexpr int64_t kMaxHistogramEntries = int64_t{1} << 22;
constexpr int kScanThreads = 1024;  // one block scans the whole histogram
constexpr int kRowWarpsPerBlock = 8;
constexpr int kElementwiseThreads = 256;
constexpr int64_t kMaxBlocks = 8192;  // grid-stride beyond: a few waves are enough for copies

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

#define NCB_RETURN_IF_ERROR(expr)                            \
  do {                                                       \
    if (Status ncb_s_ = (expr); !ncb_s_.ok()) return ncb_s_; \
  } while (0)

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

unsigned grid_for(int64_t work_items, int64_t per_block) {
  return static_cast<unsigned>(std::clamp<int64_t>(ceil_div(work_items, per_block), 1, kMaxBlocks));
}

// --- kernels ------------------------------------------------------------------------------------
// The stable counting sort of n keys into buckets [0, B): keys outside are dropped (position -1).
// Chunk c (kSortChunk keys or more) is walked in order by one warp, 32 keys at a time, so equal
// keys are numbered in index order; hist[b * chunks + c] holds chunk c's count of key b, and its
// exclusive scan in that (bucket-major) order is where chunk c's first key b goes.

// hist[key * chunks + c] = chunk c's count of key (hist zeroed before); *bad += keys that are
// neither -1 nor a bucket (null bad: not counted).
__global__ void sort_histogram(const int32_t* __restrict__ keys, int64_t n, int32_t buckets,
                               int64_t chunk, int64_t chunks, int32_t* __restrict__ hist,
                               int32_t* __restrict__ bad) {
  const int64_t c = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32;
  if (c >= chunks) return;  // the whole warp: c is uniform across it
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t begin = c * chunk, end = n < begin + chunk ? n : begin + chunk;
  int32_t bad_keys = 0;
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t i = base + lane;
    const int32_t key = i < end ? keys[i] : -1;
    const bool valid = key >= 0 && key < buckets;
    bad_keys += i < end && key != -1 && !valid;
    const unsigned peers = __match_any_sync(kFullMask, valid ? key : -1);
    // One lane per distinct key adds the key's count: no two lanes touch one counter at once.
    if (valid && lane == __ffs(peers) - 1) hist[int64_t{key} * chunks + c] += __popc(peers);
    __syncwarp();  // orders this step's counter updates before the next step's
  }
  if (bad && bad_keys) atomicAdd(bad, bad_keys);
}

// In place exclusive scan of hist[buckets * chunks]; bucket_offset[b] = the first position of
// bucket b, bucket_offset[buckets] = the keys kept; with group_count (non-null), group_count[g]
// = the keys of buckets [g * per_group, (g + 1) * per_group). One block of kScanThreads.
__global__ void __launch_bounds__(kScanThreads)
    sort_scan(int32_t* __restrict__ hist, int32_t buckets, int64_t chunks,
              int32_t* __restrict__ bucket_offset, int32_t per_group,
              int32_t* __restrict__ group_count) {
  __shared__ int32_t warp_sum[kScanThreads / 32];
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  const int64_t n = int64_t{buckets} * chunks;
  int32_t carry = 0;
  for (int64_t tile = 0; tile < n; tile += kScanThreads) {
    const int64_t i = tile + threadIdx.x;
    const int32_t v = i < n ? hist[i] : 0;
    int32_t incl = v;
    for (int d = 1; d < 32; d <<= 1) {
      const int32_t o = __shfl_up_sync(kFullMask, incl, d);
      if (lane >= d) incl += o;
    }
    if (lane == 31) warp_sum[warp] = incl;
    __syncthreads();
    if (warp == 0) {
      int32_t w = warp_sum[lane];
      for (int d = 1; d < 32; d <<= 1) {
        const int32_t o = __shfl_up_sync(kFullMask, w, d);
        if (lane >= d) w += o;
      }
      warp_sum[lane] = w;  // inclusive over warps
    }
    __syncthreads();
    const int32_t excl = carry + (warp > 0 ? warp_sum[warp - 1] : 0) + incl - v;
    if (i < n) {
      hist[i] = excl;
      if (i % chunks == 0) bucket_offset[i / chunks] = excl;
    }
    carry += warp_sum[kScanThreads / 32 - 1];
    __syncthreads();  // warp_sum is rewritten by the next tile
  }
  if (threadIdx.x == 0) bucket_offset[buckets] = carry;
  if (!group_count) return;
  __syncthreads();  // bucket_offset, written above by other threads, is read below
  for (int32_t g = threadIdx.x; g < buckets / per_group; g += kScanThreads)
    group_count[g] = bucket_offset[(g + 1) * per_group] - bucket_offset[g * per_group];
}

// pos[i] = key i's place in bucket order, stable in i; -1 for dropped keys. Advances hist (the
// scanned one) past every key placed.
__global__ void sort_positions(const int32_t* __restrict__ keys, int64_t n, int32_t buckets,
                               int64_t chunk, int64_t chunks, int32_t* __restrict__ hist,
                               int32_t* __restrict__ pos) {
  const int64_t c = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32;
  if (c >= chunks) return;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const unsigned lanes_below = (1u << lane) - 1;
  const int64_t begin = c * chunk, end = n < begin + chunk ? n : begin + chunk;
  for (int64_t base = begin; base < end; base += 32) {
    const int64_t i = base + lane;
    const int32_t key = i < end ? keys[i] : -1;
    const bool valid = key >= 0 && key < buckets;
    const unsigned peers = __match_any_sync(kFullMask, valid ? key : -1);
    int32_t p = -1;
    if (valid) p = hist[int64_t{key} * chunks + c] + __popc(peers & lanes_below);
    __syncwarp();  // every lane has read its key's counter before the leader moves it on
    if (valid && lane == __ffs(peers) - 1) hist[int64_t{key} * chunks + c] = p + __popc(peers);
    __syncwarp();
    if (i < end) pos[i] = p;
  }
}

// dst row pos[i] = src row i / src_div, for i < n with pos[i] >= 0. One warp per row.
__global__ void scatter_rows(uint4* __restrict__ dst, const uint4* __restrict__ src,
                             const int32_t* __restrict__ pos, int64_t n, int32_t src_div,
                             int64_t vecs) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = int64_t{gridDim.x} * blockDim.x / 32;
  for (int64_t i = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32; i < n; i += warps) {
    const int32_t p = pos[i];
    if (p < 0) continue;
    const uint4* s = src + (i / src_div) * vecs;
    uint4* d = dst + int64_t{p} * vecs;
    for (int64_t v = lane; v < vecs; v += 32) d[v] = s[v];
  }
}

// dst row i = src row pos[i], for i < n (every pos valid). One warp per row.
__global__ void gather_rows(uint4* __restrict__ dst, const uint4* __restrict__ src,
                            const int32_t* __restrict__ pos, int64_t n, int64_t vecs) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = int64_t{gridDim.x} * blockDim.x / 32;
  for (int64_t i = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32; i < n; i += warps) {
    const uint4* s = src + int64_t{pos[i]} * vecs;
    uint4* d = dst + i * vecs;
    for (int64_t v = lane; v < vecs; v += 32) d[v] = s[v];
  }
}

// local_expert[pos[s]] = topk_idx[s] % experts_per_rank for every routed slot s < n.
__global__ void scatter_local_expert(int32_t* __restrict__ local_expert,
                                     const int32_t* __restrict__ topk_idx,
                                     const int32_t* __restrict__ pos, int64_t n,
                                     int32_t experts_per_rank) {
  for (int64_t s = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; s < n;
       s += int64_t{gridDim.x} * blockDim.x)
    if (pos[s] >= 0) local_expert[pos[s]] = topk_idx[s] % experts_per_rank;
}

// y[t] = bf16(sum over k in order of topk_weights[t, k] * rows[pos[t * K + k]]) in fp32; slots
// with pos -1 add nothing (a token with none gets zeros). One thread per 8 columns of a token.
__global__ void weighted_sum(uint4* __restrict__ y, const uint4* __restrict__ rows,
                             const int32_t* __restrict__ pos, const float* __restrict__ weights,
                             int64_t tokens, int32_t top_k, int64_t vecs) {
  for (int64_t v = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; v < tokens * vecs;
       v += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = v / vecs, c = v % vecs;
    float acc[kVec] = {};
    for (int32_t k = 0; k < top_k; ++k) {
      const int32_t p = pos[t * top_k + k];
      if (p < 0) continue;
      const float w = weights[t * top_k + k];
      const uint4 r4 = rows[int64_t{p} * vecs + c];
      const auto* r = reinterpret_cast<const __nv_bfloat162*>(&r4);
#pragma unroll
      for (int j = 0; j < kVec / 2; ++j) {
        const float2 f = __bfloat1622float2(r[j]);
        acc[2 * j] += w * f.x;
        acc[2 * j + 1] += w * f.y;
      }
    }
    uint4 out;
    auto* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
    for (int j = 0; j < kVec / 2; ++j) o[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
    y[v] = out;
  }
}

// --- host helpers -------------------------------------------------------------------------------

// Device memory that only grows (contents are not kept). Growth frees first: callers grow only
// while the stream is synchronised.
class DeviceMem {
 public:
  DeviceMem() = default;
  ~DeviceMem() {
    if (p_) cudaFree(p_);  // nothing useful to do with an error in a destructor
  }
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;
  cudaError_t reserve(size_t bytes) {
    bytes = std::max<size_t>(bytes, 256);  // never zero bytes: pointers stay valid and distinct
    if (p_ && bytes <= bytes_) return cudaSuccess;
    if (p_) {
      const cudaError_t e = cudaFree(p_);
      p_ = nullptr;
      bytes_ = 0;
      if (e != cudaSuccess) return e;
    }
    const cudaError_t e = cudaMalloc(&p_, bytes);
    if (e != cudaSuccess) {
      p_ = nullptr;
      return e;
    }
    bytes_ = bytes;
    return cudaSuccess;
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// Pinned host memory: the counts come back through it and the GEMM pointer arrays go out.
class PinnedMem {
 public:
  PinnedMem() = default;
  ~PinnedMem() {
    if (p_) cudaFreeHost(p_);
  }
  PinnedMem(const PinnedMem&) = delete;
  PinnedMem& operator=(const PinnedMem&) = delete;
  cudaError_t allocate(size_t bytes) { return cudaMallocHost(&p_, std::max<size_t>(bytes, 256)); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }

 private:
  void* p_ = nullptr;
};

// The [buckets, chunks] histogram of a counting sort of n keys (see the kernels).
struct SortShape {
  int64_t n = 0;
  int32_t buckets = 0;
  int64_t chunk = kSortChunk;
  int64_t chunks = 1;
  int64_t entries() const { return int64_t{buckets} * chunks; }
};

// The most histogram entries a sort of at most max_n keys takes: what its buffer is sized by.
// (Not entries() of max_n: a shorter sort may keep smaller chunks and so use more entries.)
int64_t histogram_bound(int64_t max_n, int32_t buckets) {
  return std::max<int64_t>(
      buckets, std::min(kMaxHistogramEntries, int64_t{buckets} * ceil_div(max_n, kSortChunk)));
}

SortShape sort_shape(int64_t n, int32_t buckets) {
  SortShape s;
  s.n = n;
  s.buckets = buckets;
  for (;;) {
    s.chunks = std::max<int64_t>(1, ceil_div(n, s.chunk));
    if (s.chunks == 1 || s.entries() <= kMaxHistogramEntries) return s;
    s.chunk *= 2;
  }
}

// Rows every expert must have for one dense cublasGemmEx per expert instead of the grouped call.
constexpr int64_t kDenseGemmRows = 256;

// The arguments of one cublasGemmGroupedBatchedEx call: per-group arrays (the API reads them on
// the host), one group per run of experts with equal row counts. Cleared and refilled each call.
struct GroupedCall {
  std::vector<cublasOperation_t> transa, transb;
  std::vector<int> m, n, k, lda, ldb, ldc, group_size;
  std::vector<float> alpha, beta;  // CUBLAS_COMPUTE_32F: float scalars

  void clear() {
    for (auto* v : {&m, &n, &k, &lda, &ldb, &ldc, &group_size}) v->clear();
    transa.clear();
    transb.clear();
    alpha.clear();
    beta.clear();
  }
  // out[rows, N] = in[rows, K] W[N, K]^T in cuBLAS's column-major terms: out^T (N x rows) =
  // W^T (W: K x N column-major, transposed) * in^T (K x rows).
  void add_group(int N, int rows, int K, int ld_in, int ld_out) {
    transa.push_back(CUBLAS_OP_T);
    transb.push_back(CUBLAS_OP_N);
    m.push_back(N);
    n.push_back(rows);
    k.push_back(K);
    lda.push_back(K);
    ldb.push_back(ld_in);
    ldc.push_back(ld_out);
    alpha.push_back(1.0f);
    beta.push_back(0.0f);
    group_size.push_back(0);
  }
  int groups() const { return static_cast<int>(group_size.size()); }
};

}  // namespace

// --- the layer ----------------------------------------------------------------------------------

struct NcclCublasMoe::Impl {
  LayerConfig c;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  int32_t P = 0, rank = 0, E = 0, K = 0;  // ranks, this rank, experts per rank, top-k
  int64_t H = 0, I = 0;

  // Fixed, sized by max_tokens_per_rank * K slots.
  DeviceMem slot_pos;       // [S]: each slot's row in the send buffer, -1 unrouted
  DeviceMem home_rows;      // [S, H]: rows sent out, then the same rows' results coming back
  DeviceMem send_expert;    // [S]: local expert id of each sent row
  DeviceMem send_hist;      // the route sort's histogram
  DeviceMem send_offset;    // [P * E + 1]: first send row of each global expert (sort scratch)
  DeviceMem send_info;      // [P + 1]: rows for each destination, then this rank's bad ids
  DeviceMem all_info;       // [P, P + 1]: every rank's send_info (ncclAllGather)
  DeviceMem expert_offset;  // [E + 1]: first grouped row of each local expert
  DeviceMem gemm_ptrs;      // [9 * E]: the grouped GEMMs' A, B, C arrays (layout in plan_ffn)
  PinnedMem host_info, host_expert_offset, host_ptrs;  // host copies of the three above

  // Grow-only, sized by the rows this rank receives (R).
  int64_t recv_capacity = -1;
  DeviceMem recv_rows;    // [R, H]: rows as received, then their results in that order
  DeviceMem recv_expert;  // [R]
  DeviceMem recv_pos;     // [R]: each received row's place in expert order
  DeviceMem recv_hist;    // the grouping sort's histogram
  DeviceMem grouped;      // [R, H]: rows in expert order, then the down GEMM's output
  DeviceMem gate_up;      // [R, 2I]
  DeviceMem h;            // [R, I]

  // Per call, on the host.
  std::vector<int64_t> send_count, send_off, recv_count, recv_off;  // [P], [P + 1], ...
  std::vector<int32_t> expert_order;
  GroupedCall gu_call, down_call;

  ~Impl() {
    if (blas) cublasDestroy(blas);
  }

  template <typename... Parts>
  Status error(StatusCode code, const Parts&... parts) const {
    return Status(code, concat("nccl-cublas baseline, rank ", rank, ": ", parts...));
  }
  Status cuda(cudaError_t e, const char* what) const {
    if (e == cudaSuccess) return Status::ok_status();
    return error(StatusCode::kCudaError, what, ": ", cudaGetErrorName(e), " (",
                 cudaGetErrorString(e), ")");
  }
  Status nccl(ncclResult_t r, const char* what) const {
    if (r == ncclSuccess) return Status::ok_status();
    const char* last = comm ? ncclGetLastError(comm) : nullptr;
    return error(StatusCode::kNcclError, what, ": ", ncclGetErrorString(r),
                 last && *last ? concat(" (", last, ")") : std::string());
  }
  Status cublas(cublasStatus_t s, const char* what) const {
    if (s == CUBLAS_STATUS_SUCCESS) return Status::ok_status();
    return error(StatusCode::kInternal, what, ": ", cublasGetStatusName(s), " (",
                 cublasGetStatusString(s), ")");
  }
  Status launched(const char* kernel) const { return cuda(cudaGetLastError(), kernel); }
  Status mark(const cudaEvent_t* marks, int i) const {
    return marks ? cuda(cudaEventRecord(marks[i], stream), "cudaEventRecord") : Status();
  }
  // The host sync of the pipeline; NCCL errors raised asynchronously surface here too.
  Status sync(const char* what) const {
    NCB_RETURN_IF_ERROR(cuda(cudaStreamSynchronize(stream), what));
    ncclResult_t async = ncclSuccess;
    NCB_RETURN_IF_ERROR(nccl(ncclCommGetAsyncError(comm, &async), "ncclCommGetAsyncError"));
    return nccl(async, what);
  }

  struct Piece {
    DeviceMem* mem;
    int64_t bytes;
    const char* what;
  };
  Status reserve(const Piece& p) const {
    return cuda(p.mem->reserve(static_cast<size_t>(p.bytes)), p.what);
  }

  Status allocate();
  Status reserve_received(int64_t rows);
  Status enqueue_sort(const int32_t* keys, const SortShape& s, DeviceMem& hist,
                      int32_t* bucket_offset, int32_t per_group, int32_t* group_count, int32_t* bad,
                      int32_t* pos, const char* what);
  Status exchange_rows(const bf16* send, bf16* recv, bool with_expert_ids, bool back,
                       const char* what);
  Status plan_ffn(const ForwardArgs& a, int64_t received);
  Status forward(const ForwardArgs& a, const cudaEvent_t* marks);
};

Status NcclCublasMoe::Impl::allocate() {
  const int64_t S = c.max_tokens_per_rank * K;
  for (const Piece& p :
       {Piece{&slot_pos, S * 4, "cudaMalloc (slot positions)"},
        Piece{&home_rows, S * H * 2, "cudaMalloc (send/return rows)"},
        Piece{&send_expert, S * 4, "cudaMalloc (sent expert ids)"},
        Piece{&send_hist, histogram_bound(S, P * E) * 4, "cudaMalloc (route histogram)"},
        Piece{&send_offset, (int64_t{P} * E + 1) * 4, "cudaMalloc (offsets)"},
        Piece{&send_info, (P + 1) * 4, "cudaMalloc (send counts)"},
        Piece{&all_info, int64_t{P} * (P + 1) * 4, "cudaMalloc (all counts)"},
        Piece{&expert_offset, (E + 1) * 4, "cudaMalloc (expert offsets)"},
        Piece{&gemm_ptrs, 9 * E * int64_t{sizeof(void*)},
              "cudaMalloc (grouped GEMM pointer arrays)"}})
    NCB_RETURN_IF_ERROR(reserve(p));
  NCB_RETURN_IF_ERROR(
      cuda(host_info.allocate(int64_t{P} * (P + 1) * 4), "cudaMallocHost (counts)"));
  NCB_RETURN_IF_ERROR(
      cuda(host_expert_offset.allocate((E + 1) * 4), "cudaMallocHost (expert offsets)"));
  NCB_RETURN_IF_ERROR(
      cuda(host_ptrs.allocate(9 * E * sizeof(void*)), "cudaMallocHost (GEMM pointer arrays)"));
  send_count.resize(P);
  recv_count.resize(P);
  send_off.resize(P + 1);
  recv_off.resize(P + 1);
  return Status::ok_status();
}

Status NcclCublasMoe::Impl::reserve_received(int64_t rows) {
  if (rows <= recv_capacity) return Status::ok_status();
  for (const Piece& p :
       {Piece{&recv_rows, rows * H * 2, "cudaMalloc (received rows)"},
        Piece{&recv_expert, rows * 4, "cudaMalloc (received expert ids)"},
        Piece{&recv_pos, rows * 4, "cudaMalloc (received row positions)"},
        Piece{&recv_hist, histogram_bound(rows, E) * 4, "cudaMalloc (grouping histogram)"},
        Piece{&grouped, rows * H * 2, "cudaMalloc (grouped rows)"},
        Piece{&gate_up, rows * 2 * I * 2, "cudaMalloc (gate/up output)"},
        Piece{&h, rows * I * 2, "cudaMalloc (SwiGLU output)"}})
    NCB_RETURN_IF_ERROR(reserve(p));
  recv_capacity = rows;
  return Status::ok_status();
}

Status NcclCublasMoe::Impl::enqueue_sort(const int32_t* keys, const SortShape& s, DeviceMem& hist,
                                         int32_t* bucket_offset, int32_t per_group,
                                         int32_t* group_count, int32_t* bad, int32_t* pos,
                                         const char* what) {
  NCB_RETURN_IF_ERROR(cuda(cudaMemsetAsync(hist.as<int32_t>(), 0, s.entries() * 4, stream), what));
  const unsigned blocks = static_cast<unsigned>(ceil_div(s.chunks, kSortWarpsPerBlock));
  if (s.n > 0) {
    sort_histogram<<<blocks, kSortWarpsPerBlock * 32, 0, stream>>>(
        keys, s.n, s.buckets, s.chunk, s.chunks, hist.as<int32_t>(), bad);
    NCB_RETURN_IF_ERROR(launched("sort_histogram"));
  }
  // Even with no keys: the offsets and counts must be written (as zeros).
  sort_scan<<<1, kScanThreads, 0, stream>>>(hist.as<int32_t>(), s.buckets, s.chunks, bucket_offset,
                                            per_group, group_count);
  NCB_RETURN_IF_ERROR(launched("sort_scan"));
  if (s.n > 0) {
    sort_positions<<<blocks, kSortWarpsPerBlock * 32, 0, stream>>>(
        keys, s.n, s.buckets, s.chunk, s.chunks, hist.as<int32_t>(), pos);
    NCB_RETURN_IF_ERROR(launched("sort_positions"));
  }
  return Status::ok_status();
}

// One all-to-all of rows (and, on the way out, their local expert ids) in one NCCL group.
// Outbound (back = false): send[send_off[p]..] to p, recv[recv_off[p]..] from p; back = true
// swaps the two sides (results return the way the rows came).
Status NcclCublasMoe::Impl::exchange_rows(const bf16* send, bf16* recv, bool with_expert_ids,
                                          bool back, const char* what) {
  const auto& out_count = back ? recv_count : send_count;
  const auto& out_off = back ? recv_off : send_off;
  const auto& in_count = back ? send_count : recv_count;
  const auto& in_off = back ? send_off : recv_off;
  NCB_RETURN_IF_ERROR(nccl(ncclGroupStart(), "ncclGroupStart"));
  // Every call inside the group is attempted and the group always closed; the first error wins.
  Status first;
  auto keep = [&first](Status s) {
    if (first.ok()) std::swap(first, s);
  };
  for (int32_t p = 0; p < P; ++p) {
    if (out_count[p] > 0) {
      keep(nccl(ncclSend(send + out_off[p] * H, static_cast<size_t>(out_count[p] * H), ncclBfloat16,
                         p, comm, stream),
                "ncclSend (rows)"));
      if (with_expert_ids)
        keep(nccl(ncclSend(send_expert.as<int32_t>() + out_off[p],
                           static_cast<size_t>(out_count[p]), ncclInt32, p, comm, stream),
                  "ncclSend (expert ids)"));
    }
    if (in_count[p] > 0) {
      keep(nccl(ncclRecv(recv + in_off[p] * H, static_cast<size_t>(in_count[p] * H), ncclBfloat16,
                         p, comm, stream),
                "ncclRecv (rows)"));
      if (with_expert_ids)
        keep(nccl(ncclRecv(recv_expert.as<int32_t>() + in_off[p], static_cast<size_t>(in_count[p]),
                           ncclInt32, p, comm, stream),
                  "ncclRecv (expert ids)"));
    }
  }
  keep(nccl(ncclGroupEnd(), what));
  return first;
}

// The grouped GEMMs' per-group arrays on the host and pointer arrays on the device, from the
// per-expert offsets just copied back. Experts are taken in order of their row counts so equal
// counts form one group (all of them for balanced routing); empty experts get no problem.
// gemm_ptrs layout: gate/up A, B, C (2 per expert: gate, up) at [0, 2E), [2E, 4E), [4E, 6E);
// down A, B, C at [6E, 7E), [7E, 8E), [8E, 9E).
Status NcclCublasMoe::Impl::plan_ffn(const ForwardArgs& a, int64_t received) {
  const int32_t* off = host_expert_offset.as<int32_t>();
  if (off[E] != received)
    return error(StatusCode::kInternal, "grouping by expert kept ", off[E], " of ", received,
                 " received rows");
  expert_order.clear();
  for (int32_t e = 0; e < E; ++e)
    if (off[e + 1] > off[e]) expert_order.push_back(e);
  std::stable_sort(expert_order.begin(), expert_order.end(),
                   [&](int32_t x, int32_t y) { return off[x + 1] - off[x] < off[y + 1] - off[y]; });
  gu_call.clear();
  down_call.clear();
  const void** ptr = host_ptrs.as<const void*>();
  const bf16* x = grouped.as<bf16>();
  bf16* gu = gate_up.as<bf16>();
  const int Hi = static_cast<int>(H), Ii = static_cast<int>(I);  // checked in create()
  // Expert q of the order is problem q of the down call, problems 2q, 2q + 1 of gate/up.
  for (size_t q = 0; q < expert_order.size(); ++q) {
    const int32_t e = expert_order[q];
    const int rows = off[e + 1] - off[e];
    if (q == 0 || rows != off[expert_order[q - 1] + 1] - off[expert_order[q - 1]]) {
      gu_call.add_group(Ii, rows, Hi, Hi, 2 * Ii);
      down_call.add_group(Hi, rows, Ii, Ii, Hi);
    }
    gu_call.group_size.back() += 2;
    down_call.group_size.back() += 1;
    const int64_t r0 = off[e];
    ptr[2 * q] = a.weights.gate + e * I * H;
    ptr[2 * q + 1] = a.weights.up + e * I * H;
    ptr[2 * E + 2 * q] = ptr[2 * E + 2 * q + 1] = x + r0 * H;
    ptr[4 * E + 2 * q] = gu + r0 * 2 * I;
    ptr[4 * E + 2 * q + 1] = gu + r0 * 2 * I + I;
    ptr[6 * E + q] = a.weights.down + e * H * I;
    ptr[7 * E + q] = h.as<bf16>() + r0 * I;
    ptr[8 * E + q] = grouped.as<bf16>() + r0 * H;  // x is dead once gate/up has run
  }
  // host_ptrs and gemm_ptrs are free: the last call's upload and GEMMs ended before our syncs.
  return cuda(cudaMemcpyAsync(gemm_ptrs.as<void>(), ptr, 9 * E * sizeof(void*),
                              cudaMemcpyHostToDevice, stream),
              "cudaMemcpyAsync (grouped GEMM pointer arrays)");
}

Status NcclCublasMoe::Impl::forward(const ForwardArgs& a, const cudaEvent_t* marks) {
  const int64_t T = a.num_tokens, S = T * K, vecs = H / kVec;
  if (T < 0 || T > c.max_tokens_per_rank)
    return error(StatusCode::kInvalidArgument, "num_tokens ", T, " is outside [0, ",
                 c.max_tokens_per_rank, "]");
  // Weights are needed even without tokens: other ranks' rows come to this rank's experts.
  if (!a.weights.gate || !a.weights.up || !a.weights.down)
    return error(StatusCode::kInvalidArgument, "expert weights are null");
  if (T > 0 && (!a.x || !a.topk_idx || !a.topk_weights || !a.y))
    return error(StatusCode::kInvalidArgument, "x, topk_idx, topk_weights and y must be set");
  if (T > 0 && ((reinterpret_cast<uintptr_t>(a.x) | reinterpret_cast<uintptr_t>(a.y)) % 16))
    return error(StatusCode::kInvalidArgument, "x and y must be 16-byte aligned");

  // 1. Route: slots sorted by global expert id = (destination rank, local expert), rows and
  // local expert ids scattered into the send buffer in that order.
  NCB_RETURN_IF_ERROR(mark(marks, 0));
  int32_t* info = send_info.as<int32_t>();
  NCB_RETURN_IF_ERROR(cuda(cudaMemsetAsync(info, 0, (P + 1) * 4, stream), "cudaMemsetAsync"));
  NCB_RETURN_IF_ERROR(enqueue_sort(a.topk_idx, sort_shape(S, P * E), send_hist,
                                   send_offset.as<int32_t>(), E, info, info + P,
                                   slot_pos.as<int32_t>(), "cudaMemsetAsync (route histogram)"));
  if (S > 0) {
    scatter_rows<<<grid_for(S, kRowWarpsPerBlock), kRowWarpsPerBlock * 32, 0, stream>>>(
        home_rows.as<uint4>(), reinterpret_cast<const uint4*>(a.x), slot_pos.as<int32_t>(), S, K,
        vecs);
    NCB_RETURN_IF_ERROR(launched("scatter_rows (send buffer)"));
    scatter_local_expert<<<grid_for(S, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
        send_expert.as<int32_t>(), a.topk_idx, slot_pos.as<int32_t>(), S, E);
    NCB_RETURN_IF_ERROR(launched("scatter_local_expert"));
  }

  // 2. Counts: every rank's [rows per destination, bad ids] to every rank, then to the host.
  NCB_RETURN_IF_ERROR(
      nccl(ncclAllGather(info, all_info.as<int32_t>(), P + 1, ncclInt32, comm, stream),
           "ncclAllGather (row counts)"));
  const int32_t* all = host_info.as<int32_t>();
  NCB_RETURN_IF_ERROR(
      cuda(cudaMemcpyAsync(host_info.as<void>(), all_info.as<void>(), int64_t{P} * (P + 1) * 4,
                           cudaMemcpyDeviceToHost, stream),
           "cudaMemcpyAsync (row counts to host)"));
  NCB_RETURN_IF_ERROR(sync("cudaStreamSynchronize (row counts)"));
  // Every rank sees every rank's bad-id count, so all of them stop here together.
  for (int32_t src = 0; src < P; ++src)
    if (const int32_t bad = all[src * (P + 1) + P]; bad > 0)
      return error(StatusCode::kInvalidArgument, "rank ", src, " has ", bad,
                   " topk_idx entries outside [-1, num_experts=", c.num_experts, ")");
  send_off[0] = recv_off[0] = 0;
  for (int32_t p = 0; p < P; ++p) {
    send_count[p] = all[rank * (P + 1) + p];
    recv_count[p] = all[p * (P + 1) + rank];
    send_off[p + 1] = send_off[p] + send_count[p];
    recv_off[p + 1] = recv_off[p] + recv_count[p];
  }
  const int64_t R = recv_off[P];
  if (R > INT32_MAX)
    return error(StatusCode::kInvalidArgument, R, " received rows exceed int32 row positions");
  NCB_RETURN_IF_ERROR(reserve_received(R));
  NCB_RETURN_IF_ERROR(mark(marks, 1));

  // 3. Dispatch, then grouping by local expert (stable: by source rank, then slot order).
  NCB_RETURN_IF_ERROR(exchange_rows(home_rows.as<bf16>(), recv_rows.as<bf16>(), true, false,
                                    "ncclGroupEnd (dispatch)"));
  NCB_RETURN_IF_ERROR(enqueue_sort(recv_expert.as<int32_t>(), sort_shape(R, E), recv_hist,
                                   expert_offset.as<int32_t>(), 1, nullptr, nullptr,
                                   recv_pos.as<int32_t>(), "cudaMemsetAsync (grouping histogram)"));
  if (R > 0) {
    scatter_rows<<<grid_for(R, kRowWarpsPerBlock), kRowWarpsPerBlock * 32, 0, stream>>>(
        grouped.as<uint4>(), recv_rows.as<uint4>(), recv_pos.as<int32_t>(), R, 1, vecs);
    NCB_RETURN_IF_ERROR(launched("scatter_rows (group by expert)"));
  }
  NCB_RETURN_IF_ERROR(cuda(cudaMemcpyAsync(host_expert_offset.as<void>(), expert_offset.as<void>(),
                                           (E + 1) * 4, cudaMemcpyDeviceToHost, stream),
                           "cudaMemcpyAsync (expert offsets to host)"));
  NCB_RETURN_IF_ERROR(sync("cudaStreamSynchronize (expert offsets)"));
  NCB_RETURN_IF_ERROR(plan_ffn(a, R));
  NCB_RETURN_IF_ERROR(mark(marks, 2));

  // 4. Expert FFN: gate/up into the two halves of gate_up, SwiGLU, down into `grouped`.
  // NOTES: cublasGemmGroupedBatchedEx trails a dense GEMM of the same FLOPs from 128 rows per
  // expert (docs/benchmarks.md, history of 2026-11-29); with the counts on the host (this
  // pipeline synchronises for them anyway) a competent user calls one dense GEMM per expert
  // once every expert has many rows, and the grouped API otherwise.
  const int32_t* off = host_expert_offset.as<int32_t>();
  int64_t min_rows = R > 0 ? R : 0;
  for (int32_t e : expert_order) min_rows = std::min<int64_t>(min_rows, off[e + 1] - off[e]);
  if (R > 0 && min_rows >= kDenseGemmRows) {
    const void* const* hp = host_ptrs.as<const void*>();
    auto dense = [&](const void* w, const void* in, const void* out, int rows, int64_t N,
                     int64_t Kd, int64_t ld_in, int64_t ld_out, const char* what) {
      return cublas(gemm_rows_wt(blas, rows, N, Kd, in, ld_in, w, const_cast<void*>(out), ld_out),
                    what);
    };
    for (size_t q = 0; q < expert_order.size(); ++q) {
      const int rows = off[expert_order[q] + 1] - off[expert_order[q]];
      for (int half = 0; half < 2; ++half)
        NCB_RETURN_IF_ERROR(dense(hp[2 * q + half], hp[2 * E + 2 * q + half],
                                  hp[4 * E + 2 * q + half], rows, I, H, H, 2 * I,
                                  "cublasGemmEx (gate/up, per expert)"));
    }
    NCB_RETURN_IF_ERROR(
        cuda(swiglu_bf16(gate_up.as<bf16>(), h.as<bf16>(), R, I, stream), "swiglu_bf16"));
    for (size_t q = 0; q < expert_order.size(); ++q) {
      const int rows = off[expert_order[q] + 1] - off[expert_order[q]];
      NCB_RETURN_IF_ERROR(dense(hp[6 * E + q], hp[7 * E + q], hp[8 * E + q], rows, H, I, I, H,
                                "cublasGemmEx (down, per expert)"));
    }
  } else if (R > 0) {
    const void* const* ptrs = gemm_ptrs.as<const void*>();
    auto* out_ptrs = gemm_ptrs.as<void*>();
    NCB_RETURN_IF_ERROR(
        cublas(cublasGemmGroupedBatchedEx(
                   blas, gu_call.transa.data(), gu_call.transb.data(), gu_call.m.data(),
                   gu_call.n.data(), gu_call.k.data(), gu_call.alpha.data(), ptrs, CUDA_R_16BF,
                   gu_call.lda.data(), ptrs + 2 * E, CUDA_R_16BF, gu_call.ldb.data(),
                   gu_call.beta.data(), out_ptrs + 4 * E, CUDA_R_16BF, gu_call.ldc.data(),
                   gu_call.groups(), gu_call.group_size.data(), CUBLAS_COMPUTE_32F),
               "cublasGemmGroupedBatchedEx (gate/up)"));
    NCB_RETURN_IF_ERROR(
        cuda(swiglu_bf16(gate_up.as<bf16>(), h.as<bf16>(), R, I, stream), "swiglu_bf16"));
    NCB_RETURN_IF_ERROR(cublas(
        cublasGemmGroupedBatchedEx(
            blas, down_call.transa.data(), down_call.transb.data(), down_call.m.data(),
            down_call.n.data(), down_call.k.data(), down_call.alpha.data(), ptrs + 6 * E,
            CUDA_R_16BF, down_call.lda.data(), ptrs + 7 * E, CUDA_R_16BF, down_call.ldb.data(),
            down_call.beta.data(), out_ptrs + 8 * E, CUDA_R_16BF, down_call.ldc.data(),
            down_call.groups(), down_call.group_size.data(), CUBLAS_COMPUTE_32F),
        "cublasGemmGroupedBatchedEx (down)"));
  }
  NCB_RETURN_IF_ERROR(mark(marks, 3));

  // 5. Combine: results back into received order (over the received rows, dead by now), home
  // to their senders (over the sent rows), 6. then the weighted sum over k.
  if (R > 0) {
    gather_rows<<<grid_for(R, kRowWarpsPerBlock), kRowWarpsPerBlock * 32, 0, stream>>>(
        recv_rows.as<uint4>(), grouped.as<uint4>(), recv_pos.as<int32_t>(), R, vecs);
    NCB_RETURN_IF_ERROR(launched("gather_rows (ungroup)"));
  }
  NCB_RETURN_IF_ERROR(exchange_rows(recv_rows.as<bf16>(), home_rows.as<bf16>(), false, true,
                                    "ncclGroupEnd (combine)"));
  if (T > 0) {
    weighted_sum<<<grid_for(T * vecs, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
        reinterpret_cast<uint4*>(a.y), home_rows.as<uint4>(), slot_pos.as<int32_t>(),
        a.topk_weights, T, K, vecs);
    NCB_RETURN_IF_ERROR(launched("weighted_sum"));
  }
  return mark(marks, 4);
}

NcclCublasMoe::NcclCublasMoe(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NcclCublasMoe::~NcclCublasMoe() = default;

Status NcclCublasMoe::create(const LayerConfig& config, ncclComm_t comm, cudaStream_t stream,
                             std::unique_ptr<NcclCublasMoe>* out) {
  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  m.c = config;
  m.comm = comm;
  m.stream = stream;
  m.rank = config.ep_rank;
  if (Status s = validate(config); !s.ok()) return m.error(s.code(), "config: ", s.message());
  m.P = config.ep_size;
  m.E = config.experts_per_rank();
  m.K = config.top_k;
  m.H = config.hidden;
  m.I = config.intermediate;
  // Row positions, GEMM sizes and NCCL peers are int32/int: every rank's slots must fit.
  if (int64_t{m.P} * config.max_tokens_per_rank * m.K > INT32_MAX || 2 * m.I > INT_MAX ||
      m.H > INT_MAX)
    return m.error(StatusCode::kInvalidArgument,
                   "shape too large for int32 row positions: ", config.to_string());
  if (m.I % kVec != 0)  // validate() guarantees H % 64 == 0; the SwiGLU kernel needs I % 8 too
    return m.error(StatusCode::kInvalidArgument, "intermediate ", m.I, " is not a multiple of 8");
  int count = 0, user_rank = 0;
  NCB_RETURN_IF_ERROR(m.nccl(ncclCommCount(comm, &count), "ncclCommCount"));
  NCB_RETURN_IF_ERROR(m.nccl(ncclCommUserRank(comm, &user_rank), "ncclCommUserRank"));
  if (count != m.P || user_rank != m.rank)
    return m.error(StatusCode::kInvalidArgument, "communicator is rank ", user_rank, " of ", count,
                   ", config says rank ", m.rank, " of ", m.P);
  NCB_RETURN_IF_ERROR(m.cublas(cublasCreate(&m.blas), "cublasCreate"));
  NCB_RETURN_IF_ERROR(m.cublas(cublasSetStream(m.blas, stream), "cublasSetStream"));
  // The grouped calls' alpha/beta arrays are host values.
  NCB_RETURN_IF_ERROR(
      m.cublas(cublasSetPointerMode(m.blas, CUBLAS_POINTER_MODE_HOST), "cublasSetPointerMode"));
  NCB_RETURN_IF_ERROR(m.allocate());
  out->reset(new NcclCublasMoe(std::move(impl)));
  return Status::ok_status();
}

Status NcclCublasMoe::forward(const ForwardArgs& args, const cudaEvent_t* marks) {
  return impl_->forward(args, marks);
}

}  // namespace epflow::bench
