// Untimed calls that bring the GPU to its sustained clock before a system's warm-up and timing.
//
// NOTES: at large sizes the GPU runs under its power cap. After an idle phase (setup, the CPU
// reference) or another system's run the SM clock swings for about a second before it settles,
// and a fixed count of warm-up calls is short at large sizes: at DeepSeek-V3 8192 tokens, the
// system timed second at a point ran slower than the same system timed first, whichever it was
// (docs/benchmarks.md, "How we measure"). Every layer system and yardstick therefore first runs
// for a fixed GPU time (--settle-ms), then its warm-up calls, then its timed calls. The FP8 GEMM
// bench and its yardsticks do not by default: the DeepGEMM figures they are set against were
// measured with warm-up calls only.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace epflow::bench {

// How many calls of call_ms fill settle_ms (0 when settle_ms is 0; at most 1e6).
inline int64_t settle_calls(double settle_ms, double call_ms) {
  if (settle_ms <= 0) return 0;
  const double n = std::ceil(settle_ms / std::max(call_ms, 1e-3));
  return static_cast<int64_t>(std::min(n, 1e6));
}

// GPU time in ms of one call of `call` (which enqueues work on `stream` and returns false on an
// error it reports itself) after one untimed call; negative when a call or a CUDA call failed.
template <class Call>
double one_call_ms(Call&& call, cudaStream_t stream) {
  cudaEvent_t e[2] = {nullptr, nullptr};
  float ms = 0.0f;
  const bool ok = cudaEventCreate(&e[0]) == cudaSuccess && cudaEventCreate(&e[1]) == cudaSuccess &&
                  call() && cudaEventRecord(e[0], stream) == cudaSuccess && call() &&
                  cudaEventRecord(e[1], stream) == cudaSuccess &&
                  cudaEventSynchronize(e[1]) == cudaSuccess &&
                  cudaEventElapsedTime(&ms, e[0], e[1]) == cudaSuccess;
  for (cudaEvent_t ev : e)
    if (ev) cudaEventDestroy(ev);
  return ok ? ms : -1.0;
}

// One GPU's settling (no other rank to agree with): untimed calls of `call` for settle_ms of GPU
// time on `stream`, none when settle_ms is 0. False when a call or the timing failed.
template <class Call>
bool settle_locally(Call&& call, cudaStream_t stream, double settle_ms) {
  if (settle_ms <= 0) return true;
  const double ms = one_call_ms(call, stream);
  if (ms < 0) return false;
  for (int64_t i = settle_calls(settle_ms, ms); i > 0; --i)
    if (!call()) return false;
  return true;
}

}  // namespace epflow::bench
