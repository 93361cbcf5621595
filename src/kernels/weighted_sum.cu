#include "kernels/layer_kernels.cuh"

namespace epflow::kernels {

namespace {

constexpr int kThreads = 256;

// NOTES: a thread owns 8 columns of one token and sums its K slots in increasing k with fp32
// accumulators: the same order on every run, so the output is bitwise reproducible. The slots
// are loaded kBatch at a time before any is summed: one load in flight per thread (a loop that
// adds each slot as it arrives) left the kernel at ~93% of the HBM copy rate.
constexpr int kBatch = 8;

// One thread per token (the one of its first 8 columns): out-of-range ids and experts repeated
// within the token's top-k, counted in the device tally. NOTES: K <= 16, so at most 120
// comparisons of ids the sum loads anyway.
__device__ void check_token_ids(const WeightedSumArgs& a, int64_t t) {
  const int32_t* ids = a.topk_idx + t * a.top_k;
  for (int32_t k = 0; k < a.top_k; ++k) {
    const int32_t e = ids[k];
    bool duplicate = false;
    if (e >= 0 && e < a.num_experts)
      for (int32_t j = 0; j < k && !duplicate; ++j) duplicate = ids[j] == e;
    if (!duplicate && e >= -1 && e < a.num_experts) continue;
    if (duplicate) atomicAdd(&a.tally->duplicated_slots, 1u);
    if (atomicAdd(&a.tally->bad_slots, 1u) == 0) {  // the first: its details
      a.tally->token = t;
      a.tally->k = k;
      a.tally->id = e;
      a.tally->duplicate = duplicate;
      __threadfence();  // before the block says it is done (publish_tally)
    }
  }
}

// The call's last block (thread 0): adds the tally to the host-mapped report (plain stores: the
// device is its only writer while calls run in stream order; the host clears it between reads),
// publishes the first bad slot if the report has none, and zeroes the tally for the next call.
__device__ void publish_tally(const WeightedSumArgs& a) {
  __threadfence();
  if (atomicAdd(&a.tally->blocks_done, 1u) != gridDim.x - 1) return;
  __threadfence();
  volatile RoutingTally* tally = a.tally;
  volatile RoutingCheck* check = a.check;
  if (tally->bad_slots > 0) {
    check->duplicated_slots = check->duplicated_slots + tally->duplicated_slots;
    const bool first = check->bad_slots == 0;
    check->bad_slots = check->bad_slots + tally->bad_slots;
    if (first) {
      check->token = tally->token;
      check->k = tally->k;
      check->id = tally->id;
      check->duplicate = tally->duplicate;
      __threadfence_system();
      check->published = 1;
    }
    __threadfence_system();
  }
  tally->bad_slots = 0;
  tally->duplicated_slots = 0;
  tally->blocks_done = 0;
}

// Thread i: 8 columns (v) of token t.
__device__ void sum_token_columns(const WeightedSumArgs& a, int64_t t, int64_t v) {
  if (a.check && v == 0) check_token_ids(a, t);
  float acc[8] = {};
  for (int32_t k0 = 0; k0 < a.top_k; k0 += kBatch) {
    int4 raw[kBatch];
    float w[kBatch];
    bool used[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int32_t k = k0 + b;
      const int32_t e = k < a.top_k ? a.topk_idx[t * a.top_k + k] : -1;
      used[b] = e >= 0 && e < a.num_experts;
      w[b] = 0.0f;
      raw[b] = make_int4(0, 0, 0, 0);
      if (used[b]) {
        w[b] = a.topk_weights ? a.topk_weights[t * a.top_k + k] : 1.0f;
        raw[b] = reinterpret_cast<const int4*>(a.combine + (t * a.top_k + k) * a.hidden)[v];
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      if (!used[b]) continue;  // an empty slot adds nothing (a NaN there must not leak in)
      const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw[b]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = __bfloat1622float2(h[j]);
        acc[2 * j] = fmaf(w[b], f.x, acc[2 * j]);
        acc[2 * j + 1] = fmaf(w[b], f.y, acc[2 * j + 1]);
      }
    }
  }
  int4 out;
  auto* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int j = 0; j < 4; ++j) o[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
  reinterpret_cast<int4*>(a.y + t * a.hidden)[v] = out;
}

__global__ void __launch_bounds__(kThreads) weighted_sum_kernel(WeightedSumArgs a) {
  const int64_t vecs_per_row = a.hidden / 8;
  const int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  if (i < a.num_tokens * vecs_per_row) sum_token_columns(a, i / vecs_per_row, i % vecs_per_row);
  if (!a.check) return;
  __syncthreads();  // the block's ids are counted
  if (threadIdx.x == 0) publish_tally(a);
}

}  // namespace

cudaError_t launch_weighted_sum(const WeightedSumArgs& args, cudaStream_t stream) {
  if (args.check && !args.tally) return cudaErrorInvalidValue;
  const int64_t threads = args.num_tokens * (args.hidden / 8);
  if (threads == 0) return cudaSuccess;
  weighted_sum_kernel<<<static_cast<unsigned>((threads + kThreads - 1) / kThreads), kThreads, 0,
                        stream>>>(args);
  return cudaGetLastError();
}

}  // namespace epflow::kernels
