// The NCCL + cuBLAS baseline layer: see nccl_cublas_moe.h for the pipeline.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <span>
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

// Rows between receive order (by source rank, then local expert) and expert order (by local
// expert, then source rank). Block b = s * E + e of the receive order starts at row
// recv_start[b] (nondecreasing, recv_start[blocks] = rows) and lands at row grouped_start[b].
// to_grouped: grouped row = recv row i; otherwise recv row i = grouped row. One warp per row i.
__global__ void permute_blocks(uint4* __restrict__ grouped, uint4* __restrict__ recv,
                               const int32_t* __restrict__ recv_start,
                               const int32_t* __restrict__ grouped_start, int32_t blocks,
                               int64_t rows, int64_t vecs, bool to_grouped) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t warps = int64_t{gridDim.x} * blockDim.x / 32;
  for (int64_t i = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) / 32; i < rows; i += warps) {
    // The last block starting at or before i: recv_start[lo] <= i < recv_start[hi] throughout
    // (recv_start[0] = 0, recv_start[blocks] = rows), so it is the non-empty block holding i.
    int32_t lo = 0, hi = blocks;
    while (hi - lo > 1) {
      const int32_t mid = lo + (hi - lo) / 2;
      if (recv_start[mid] <= i)
        lo = mid;
      else
        hi = mid;
    }
    const int64_t g = grouped_start[lo] + (i - recv_start[lo]);
    uint4* d = to_grouped ? grouped + g * vecs : recv + i * vecs;
    const uint4* s = to_grouped ? recv + i * vecs : grouped + g * vecs;
    for (int64_t v = lane; v < vecs; v += 32) d[v] = s[v];
  }
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
// buffers that no queued work uses.
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

// Pinned host memory: the counts come back through it, the plan (block table, GEMM pointer
// arrays) goes out.
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

// Rows from which an expert gets one dense cublasGemmEx per projection; experts with fewer go
// into one cublasGemmGroupedBatchedEx call per projection.
constexpr int64_t kDenseGemmRows = 64;

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
  cudaEvent_t counts_ready = nullptr;     // recorded after the counts' copy to the host
  int32_t P = 0, rank = 0, E = 0, K = 0;  // ranks, this rank, experts per rank, top-k
  int32_t blocks = 0;  // P * E: global experts = (source rank, local expert) blocks received
  int64_t H = 0, I = 0;
  int64_t table_bytes = 0, plan_bytes = 0;  // host_plan's block table; all of it (see plan())

  // Fixed: the fused weight, and buffers sized by max_tokens_per_rank * K slots or by P and E.
  DeviceMem gate_up_w;               // [E, 2I, H]: expert e's gate rows, then its up rows
  const bf16* fused_gate = nullptr;  // the gate and up pointers gate_up_w was copied from
  const bf16* fused_up = nullptr;
  DeviceMem slot_pos;     // [S]: each slot's row in the send buffer, -1 unrouted
  DeviceMem home_rows;    // [S, H]: rows sent out, then the same rows' results coming back
  DeviceMem send_hist;    // the route sort's histogram
  DeviceMem send_offset;  // [P * E + 1]: first send row of each global expert (sort scratch)
  DeviceMem counts;       // [P * E + 1]: rows for each global expert, then this rank's bad ids
  DeviceMem all_counts;   // [P, P * E + 1]: every rank's counts (ncclAllGather)
  DeviceMem plan_dev;     // [plan_bytes]: host_plan uploaded
  PinnedMem host_counts, host_plan;  // all_counts downloaded; the plan (layout in plan())

  // Grow-only, sized by the rows this rank receives (R).
  int64_t recv_capacity = -1;
  DeviceMem recv_rows;  // [R, H]: rows as received, then their results in that order
  DeviceMem grouped;    // [R, H]: rows in expert order, then the down GEMM's output
  DeviceMem gate_up;    // [R, 2I]
  DeviceMem h;          // [R, I]

  // Per call, on the host: plan()'s results.
  std::vector<int64_t> send_count, send_off, recv_count, recv_off;  // [P], [P + 1], ...
  std::vector<int64_t> expert_off, expert_next;  // [E + 1]: first row of each expert; [E] scratch
  std::vector<int32_t> expert_order;             // non-empty experts by ascending row count
  int64_t R = 0;                                 // rows received
  bool in_order = false;  // the received order already is expert order: no permutation
  size_t small_experts = 0;  // expert_order[0, small_experts): the grouped calls' problems;
                             // the rest (kDenseGemmRows rows or more) one cublasGemmEx each
  GroupedCall gu_call, down_call;

  ~Impl() {
    if (blas) cublasDestroy(blas);
    if (counts_ready) cudaEventDestroy(counts_ready);
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
  // The pipeline's one host sync: until the counts are on the host. NCCL errors raised
  // asynchronously surface here too.
  Status wait_for_counts() const {
    NCB_RETURN_IF_ERROR(
        cuda(cudaEventSynchronize(counts_ready), "cudaEventSynchronize (row counts)"));
    ncclResult_t async = ncclSuccess;
    NCB_RETURN_IF_ERROR(nccl(ncclCommGetAsyncError(comm, &async), "ncclCommGetAsyncError"));
    return nccl(async, "row counts");
  }
  // Where the FFN reads its input rows and writes its output rows, in expert order.
  bf16* ffn_rows() const { return in_order ? recv_rows.as<bf16>() : grouped.as<bf16>(); }

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
  Status fuse_weights(const ExpertWeights& w);
  Status enqueue_sort(const int32_t* keys, const SortShape& s, DeviceMem& hist,
                      int32_t* bucket_offset, int32_t per_group, int32_t* group_count, int32_t* bad,
                      int32_t* pos, const char* what);
  Status exchange_rows(const bf16* send, bf16* recv, bool back, const char* what);
  Status permute(bool to_grouped, const char* what);
  Status plan(const ForwardArgs& a);
  Status forward(const ForwardArgs& a, const cudaEvent_t* marks);
};

Status NcclCublasMoe::Impl::allocate() {
  const int64_t S = c.max_tokens_per_rank * K;
  table_bytes = ceil_div((2 * int64_t{blocks} + 1) * 4, 16) * 16;  // pointers follow, aligned
  plan_bytes = table_bytes + 6 * E * int64_t{sizeof(void*)};
  for (const Piece& p :
       {Piece{&gate_up_w, E * 2 * I * H * 2, "cudaMalloc (fused gate|up weight)"},
        Piece{&slot_pos, S * 4, "cudaMalloc (slot positions)"},
        Piece{&home_rows, S * H * 2, "cudaMalloc (send/return rows)"},
        Piece{&send_hist, histogram_bound(S, blocks) * 4, "cudaMalloc (route histogram)"},
        Piece{&send_offset, (int64_t{blocks} + 1) * 4, "cudaMalloc (offsets)"},
        Piece{&counts, (int64_t{blocks} + 1) * 4, "cudaMalloc (send counts)"},
        Piece{&all_counts, int64_t{P} * (blocks + 1) * 4, "cudaMalloc (all counts)"},
        Piece{&plan_dev, plan_bytes, "cudaMalloc (block table, GEMM pointer arrays)"}})
    NCB_RETURN_IF_ERROR(reserve(p));
  NCB_RETURN_IF_ERROR(
      cuda(host_counts.allocate(int64_t{P} * (blocks + 1) * 4), "cudaMallocHost (counts)"));
  NCB_RETURN_IF_ERROR(cuda(host_plan.allocate(plan_bytes), "cudaMallocHost (plan)"));
  NCB_RETURN_IF_ERROR(cuda(cudaEventCreateWithFlags(&counts_ready, cudaEventDisableTiming),
                           "cudaEventCreateWithFlags"));
  send_count.resize(P);
  recv_count.resize(P);
  send_off.resize(P + 1);
  recv_off.resize(P + 1);
  expert_off.resize(E + 1);
  expert_next.resize(E);
  return Status::ok_status();
}

// Called after the host sync; cudaFree itself waits for the device, and nothing in flight then
// (the send buffer's permutation) touches these buffers.
Status NcclCublasMoe::Impl::reserve_received(int64_t rows) {
  if (rows <= recv_capacity) return Status::ok_status();
  for (const Piece& p : {Piece{&recv_rows, rows * H * 2, "cudaMalloc (received rows)"},
                         Piece{&grouped, rows * H * 2, "cudaMalloc (grouped rows)"},
                         Piece{&gate_up, rows * 2 * I * 2, "cudaMalloc (gate|up output)"},
                         Piece{&h, rows * I * 2, "cudaMalloc (SwiGLU output)"}})
    NCB_RETURN_IF_ERROR(reserve(p));
  recv_capacity = rows;
  return Status::ok_status();
}

// The fused gate|up weight from the caller's gate and up [E, I, H] (what a user would store:
// the weight of one GEMM). Stream-ordered copies, made only for pointers not fused before.
Status NcclCublasMoe::Impl::fuse_weights(const ExpertWeights& w) {
  if (w.gate == fused_gate && w.up == fused_up) return Status::ok_status();
  fused_gate = fused_up = nullptr;  // set again once every copy is enqueued
  bf16* fused = gate_up_w.as<bf16>();
  const int64_t n = I * H;  // one projection of one expert
  for (int64_t e = 0; e < E; ++e) {
    NCB_RETURN_IF_ERROR(cuda(
        cudaMemcpyAsync(fused + 2 * e * n, w.gate + e * n, n * 2, cudaMemcpyDeviceToDevice, stream),
        "cudaMemcpyAsync (fused gate|up weight, gate)"));
    NCB_RETURN_IF_ERROR(cuda(cudaMemcpyAsync(fused + 2 * e * n + n, w.up + e * n, n * 2,
                                             cudaMemcpyDeviceToDevice, stream),
                             "cudaMemcpyAsync (fused gate|up weight, up)"));
  }
  fused_gate = w.gate;
  fused_up = w.up;
  return Status::ok_status();
}

Status NcclCublasMoe::Impl::enqueue_sort(const int32_t* keys, const SortShape& s, DeviceMem& hist,
                                         int32_t* bucket_offset, int32_t per_group,
                                         int32_t* group_count, int32_t* bad, int32_t* pos,
                                         const char* what) {
  NCB_RETURN_IF_ERROR(cuda(cudaMemsetAsync(hist.as<int32_t>(), 0, s.entries() * 4, stream), what));
  const unsigned grid = static_cast<unsigned>(ceil_div(s.chunks, kSortWarpsPerBlock));
  if (s.n > 0) {
    sort_histogram<<<grid, kSortWarpsPerBlock * 32, 0, stream>>>(keys, s.n, s.buckets, s.chunk,
                                                                 s.chunks, hist.as<int32_t>(), bad);
    NCB_RETURN_IF_ERROR(launched("sort_histogram"));
  }
  // Even with no keys: the offsets and counts must be written (as zeros).
  sort_scan<<<1, kScanThreads, 0, stream>>>(hist.as<int32_t>(), s.buckets, s.chunks, bucket_offset,
                                            per_group, group_count);
  NCB_RETURN_IF_ERROR(launched("sort_scan"));
  if (s.n > 0) {
    sort_positions<<<grid, kSortWarpsPerBlock * 32, 0, stream>>>(keys, s.n, s.buckets, s.chunk,
                                                                 s.chunks, hist.as<int32_t>(), pos);
    NCB_RETURN_IF_ERROR(launched("sort_positions"));
  }
  return Status::ok_status();
}

// One all-to-all of rows in one NCCL group. Outbound (back = false): send[send_off[p]..] to p,
// recv[recv_off[p]..] from p; back = true swaps the two sides (results return the way the rows
// came).
Status NcclCublasMoe::Impl::exchange_rows(const bf16* send, bf16* recv, bool back,
                                          const char* what) {
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
    if (out_count[p] > 0)
      keep(nccl(ncclSend(send + out_off[p] * H, static_cast<size_t>(out_count[p] * H), ncclBfloat16,
                         p, comm, stream),
                "ncclSend (rows)"));
    if (in_count[p] > 0)
      keep(nccl(ncclRecv(recv + in_off[p] * H, static_cast<size_t>(in_count[p] * H), ncclBfloat16,
                         p, comm, stream),
                "ncclRecv (rows)"));
  }
  keep(nccl(ncclGroupEnd(), what));
  return first;
}

// Received rows into expert order (to_grouped) or back, by the uploaded block table.
Status NcclCublasMoe::Impl::permute(bool to_grouped, const char* what) {
  if (R == 0 || in_order) return Status::ok_status();
  const int32_t* table = plan_dev.as<int32_t>();
  permute_blocks<<<grid_for(R, kRowWarpsPerBlock), kRowWarpsPerBlock * 32, 0, stream>>>(
      grouped.as<uint4>(), recv_rows.as<uint4>(), table, table + blocks + 1, blocks, R, H / kVec,
      to_grouped);
  return launched(what);
}

// Everything this call needs from every rank's counts, on the host right after the sync: the
// bad-id error (every rank sees every rank's, so all of them stop here together), the all-to-all
// splits, the block table from received order to expert order, the received buffers, the FFN's
// GEMM calls. Received rows come by source rank; within a source, by local expert (the sender's
// sort order); within a (source, expert) block, in the sender's slot order. Expert order is by
// local expert, then source rank, then slot order.
// host_plan layout: int32 recv_start[P * E + 1] and grouped_start[P * E] (block b = source * E +
// local expert, in received order; recv_start[P * E] = R), padded to table_bytes; then the grouped
// GEMMs' pointer arrays: gate|up A, B, C at [0, E), [E, 2E), [2E, 3E); down A, B, C at [3E, 4E),
// [4E, 5E), [5E, 6E).
Status NcclCublasMoe::Impl::plan(const ForwardArgs& a) {
  const int32_t* all = host_counts.as<int32_t>();
  const int64_t per_rank = int64_t{blocks} + 1;
  for (int32_t src = 0; src < P; ++src)
    if (const int32_t bad = all[src * per_rank + blocks]; bad > 0)
      return error(StatusCode::kInvalidArgument, "rank ", src, " has ", bad,
                   " topk_idx entries outside [-1, num_experts=", c.num_experts, ")");
  // Rows rank s sends to rank p's local expert e.
  auto count = [&](int32_t s, int32_t p, int32_t e) -> int64_t {
    return all[s * per_rank + int64_t{p} * E + e];
  };
  send_off[0] = recv_off[0] = 0;
  for (int32_t p = 0; p < P; ++p) {
    send_count[p] = recv_count[p] = 0;
    for (int32_t e = 0; e < E; ++e) {
      send_count[p] += count(rank, p, e);
      recv_count[p] += count(p, rank, e);
    }
    send_off[p + 1] = send_off[p] + send_count[p];
    recv_off[p + 1] = recv_off[p] + recv_count[p];
  }
  R = recv_off[P];
  if (R > INT32_MAX)
    return error(StatusCode::kInvalidArgument, R, " received rows exceed int32 row positions");
  expert_off[0] = 0;
  for (int32_t e = 0; e < E; ++e) {
    int64_t rows = 0;
    for (int32_t s = 0; s < P; ++s) rows += count(s, rank, e);
    expert_off[e + 1] = expert_off[e] + rows;
  }
  int32_t* recv_start = host_plan.as<int32_t>();
  int32_t* grouped_start = recv_start + blocks + 1;
  std::copy(expert_off.begin(), expert_off.end() - 1, expert_next.begin());
  in_order = true;
  int64_t row = 0;  // in received order
  for (int32_t s = 0; s < P; ++s)
    for (int32_t e = 0; e < E; ++e) {
      const int32_t b = s * E + e;
      const int64_t n = count(s, rank, e);
      recv_start[b] = static_cast<int32_t>(row);
      grouped_start[b] = static_cast<int32_t>(expert_next[e]);
      in_order = in_order && (n == 0 || expert_next[e] == row);
      expert_next[e] += n;
      row += n;
    }
  recv_start[blocks] = static_cast<int32_t>(R);
  NCB_RETURN_IF_ERROR(reserve_received(R));

  // Experts taken in order of their row counts, so equal counts form one group of the grouped
  // calls (all of them for balanced routing); empty experts get no GEMM.
  expert_order.clear();
  for (int32_t e = 0; e < E; ++e)
    if (expert_off[e + 1] > expert_off[e]) expert_order.push_back(e);
  auto rows_of = [&](int32_t e) { return expert_off[e + 1] - expert_off[e]; };
  std::stable_sort(expert_order.begin(), expert_order.end(),
                   [&](int32_t x, int32_t y) { return rows_of(x) < rows_of(y); });
  // NOTES: cublasGemmGroupedBatchedEx trails a dense GEMM of the same FLOPs once experts have
  // many rows (docs/benchmarks.md, history of 2026-11-29), and runs far slower still when skewed
  // routing gives it many distinct row counts (groups of one); with the counts on the host (this
  // pipeline synchronises for them anyway) a competent user gives every expert with many rows a
  // dense GEMM of its own and leaves only the small ones to the grouped call.
  small_experts = static_cast<size_t>(
      std::partition_point(expert_order.begin(), expert_order.end(),
                           [&](int32_t e) { return rows_of(e) < kDenseGemmRows; }) -
      expert_order.begin());
  if (small_experts == 0) return Status::ok_status();

  gu_call.clear();
  down_call.clear();
  const void** ptr = reinterpret_cast<const void**>(host_plan.as<char>() + table_bytes);
  const bf16* w_gu = gate_up_w.as<bf16>();
  bf16* rows = ffn_rows();
  bf16* gu = gate_up.as<bf16>();
  const bf16* hp = h.as<bf16>();
  const int Hi = static_cast<int>(H), Ii = static_cast<int>(I);  // checked in create()
  // Expert q of the order is problem q of both calls.
  for (size_t q = 0; q < small_experts; ++q) {
    const int32_t e = expert_order[q];
    const int n = static_cast<int>(rows_of(e));
    if (q == 0 || n != rows_of(expert_order[q - 1])) {
      gu_call.add_group(2 * Ii, n, Hi, Hi, 2 * Ii);
      down_call.add_group(Hi, n, Ii, Ii, Hi);
    }
    gu_call.group_size.back() += 1;
    down_call.group_size.back() += 1;
    const int64_t r0 = expert_off[e];
    ptr[q] = w_gu + e * 2 * I * H;
    ptr[E + q] = rows + r0 * H;
    ptr[2 * E + q] = gu + r0 * 2 * I;
    ptr[3 * E + q] = a.weights.down + e * H * I;
    ptr[4 * E + q] = hp + r0 * I;
    ptr[5 * E + q] = rows + r0 * H;  // the input rows are dead once gate|up has run
  }
  return Status::ok_status();
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
  NCB_RETURN_IF_ERROR(fuse_weights(a.weights));  // new weights only: before the first mark

  // 1. Route: slots sorted by global expert id = (destination rank, local expert), every global
  // expert's count; the counts of every rank to every rank and to the host, the one host sync.
  // The rows are permuted into the send buffer behind the copy the host waits for.
  NCB_RETURN_IF_ERROR(mark(marks, 0));
  int32_t* cnt = counts.as<int32_t>();
  NCB_RETURN_IF_ERROR(
      cuda(cudaMemsetAsync(cnt, 0, (int64_t{blocks} + 1) * 4, stream), "cudaMemsetAsync"));
  NCB_RETURN_IF_ERROR(enqueue_sort(a.topk_idx, sort_shape(S, blocks), send_hist,
                                   send_offset.as<int32_t>(), 1, cnt, cnt + blocks,
                                   slot_pos.as<int32_t>(), "cudaMemsetAsync (route histogram)"));
  NCB_RETURN_IF_ERROR(
      nccl(ncclAllGather(cnt, all_counts.as<int32_t>(), blocks + 1, ncclInt32, comm, stream),
           "ncclAllGather (row counts)"));
  NCB_RETURN_IF_ERROR(
      cuda(cudaMemcpyAsync(host_counts.as<void>(), all_counts.as<void>(),
                           int64_t{P} * (blocks + 1) * 4, cudaMemcpyDeviceToHost, stream),
           "cudaMemcpyAsync (row counts to host)"));
  NCB_RETURN_IF_ERROR(cuda(cudaEventRecord(counts_ready, stream), "cudaEventRecord (counts)"));
  if (S > 0) {
    scatter_rows<<<grid_for(S, kRowWarpsPerBlock), kRowWarpsPerBlock * 32, 0, stream>>>(
        home_rows.as<uint4>(), reinterpret_cast<const uint4*>(a.x), slot_pos.as<int32_t>(), S, K,
        vecs);
    NCB_RETURN_IF_ERROR(launched("scatter_rows (send buffer)"));
  }
  NCB_RETURN_IF_ERROR(wait_for_counts());
  NCB_RETURN_IF_ERROR(plan(a));
  NCB_RETURN_IF_ERROR(mark(marks, 1));

  // 2. Dispatch: rows to their experts' ranks, then from (source, expert) blocks into expert
  // order. The plan's upload is free to overwrite plan_dev: the last call's GEMMs and
  // permutations ran before this call's counts reached the host, and so did its upload, which
  // read host_plan.
  NCB_RETURN_IF_ERROR(
      exchange_rows(home_rows.as<bf16>(), recv_rows.as<bf16>(), false, "ncclGroupEnd (dispatch)"));
  const int64_t upload = R == 0 ? 0 : small_experts > 0 ? plan_bytes : !in_order ? table_bytes : 0;
  if (upload > 0)
    NCB_RETURN_IF_ERROR(cuda(cudaMemcpyAsync(plan_dev.as<void>(), host_plan.as<void>(), upload,
                                             cudaMemcpyHostToDevice, stream),
                             "cudaMemcpyAsync (block table, GEMM pointer arrays)"));
  NCB_RETURN_IF_ERROR(permute(true, "permute_blocks (to expert order)"));
  NCB_RETURN_IF_ERROR(mark(marks, 2));

  // 3. Expert FFN on the rows in expert order: the fused gate|up GEMM into gate_up [R, 2I],
  // SwiGLU over its two halves into h [R, I], down back over the input rows.
  bf16* rows = ffn_rows();
  if (R > 0) {
    const auto* ptrs = reinterpret_cast<const void* const*>(plan_dev.as<char>() + table_bytes);
    auto* out_ptrs = reinterpret_cast<void* const*>(plan_dev.as<char>() + table_bytes);
    const std::span<const int32_t> dense_experts(expert_order.data() + small_experts,
                                                 expert_order.size() - small_experts);
    if (small_experts > 0)
      NCB_RETURN_IF_ERROR(cublas(
          cublasGemmGroupedBatchedEx(
              blas, gu_call.transa.data(), gu_call.transb.data(), gu_call.m.data(),
              gu_call.n.data(), gu_call.k.data(), gu_call.alpha.data(), ptrs, CUDA_R_16BF,
              gu_call.lda.data(), ptrs + E, CUDA_R_16BF, gu_call.ldb.data(), gu_call.beta.data(),
              out_ptrs + 2 * E, CUDA_R_16BF, gu_call.ldc.data(), gu_call.groups(),
              gu_call.group_size.data(), CUBLAS_COMPUTE_32F),
          "cublasGemmGroupedBatchedEx (gate|up)"));
    for (int32_t e : dense_experts) {
      const int64_t r0 = expert_off[e], n = expert_off[e + 1] - r0;
      NCB_RETURN_IF_ERROR(cublas(
          gemm_rows_wt(blas, n, 2 * I, H, rows + r0 * H, H, gate_up_w.as<bf16>() + e * 2 * I * H,
                       gate_up.as<bf16>() + r0 * 2 * I, 2 * I),
          "cublasGemmEx (gate|up, per expert)"));
    }
    NCB_RETURN_IF_ERROR(
        cuda(swiglu_bf16(gate_up.as<bf16>(), h.as<bf16>(), R, I, stream), "swiglu_bf16"));
    if (small_experts > 0)
      NCB_RETURN_IF_ERROR(cublas(
          cublasGemmGroupedBatchedEx(
              blas, down_call.transa.data(), down_call.transb.data(), down_call.m.data(),
              down_call.n.data(), down_call.k.data(), down_call.alpha.data(), ptrs + 3 * E,
              CUDA_R_16BF, down_call.lda.data(), ptrs + 4 * E, CUDA_R_16BF, down_call.ldb.data(),
              down_call.beta.data(), out_ptrs + 5 * E, CUDA_R_16BF, down_call.ldc.data(),
              down_call.groups(), down_call.group_size.data(), CUBLAS_COMPUTE_32F),
          "cublasGemmGroupedBatchedEx (down)"));
    for (int32_t e : dense_experts) {
      const int64_t r0 = expert_off[e], n = expert_off[e + 1] - r0;
      NCB_RETURN_IF_ERROR(cublas(gemm_rows_wt(blas, n, H, I, h.as<bf16>() + r0 * I, I,
                                              a.weights.down + e * H * I, rows + r0 * H, H),
                                 "cublasGemmEx (down, per expert)"));
    }
  }
  NCB_RETURN_IF_ERROR(mark(marks, 3));

  // 4. Combine: results back into received order (over the received rows, dead by now), home to
  // their senders (over the sent rows), then the weighted sum over k.
  NCB_RETURN_IF_ERROR(permute(false, "permute_blocks (to received order)"));
  NCB_RETURN_IF_ERROR(
      exchange_rows(recv_rows.as<bf16>(), home_rows.as<bf16>(), true, "ncclGroupEnd (combine)"));
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
  m.blocks = m.P * m.E;
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
