// Robustness at the layer's boundary. Bad routing never passes silently: a topk_idx
// with an expert id out of range and an expert repeated within a token's top-k is reported,
// once, by Layer::check_routing (or by the call after it), with the first bad slot; the report
// is then cleared and good calls report nothing; the call with bad ids still runs to the end
// (peers are never left waiting). NaN and Inf in x stay in their tokens' outputs. Configs that
// differ across ranks fail Layer::create on every rank, naming the field, instead of hanging. A
// rank that skips a call makes its peer's call fail within the timeout, naming it.
#include <gtest/gtest.h>

#include <cuda_bf16.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <thread>
#include <vector>

#include "layer_gpu_harness.h"

namespace epflow {
namespace {

// The harness's small shape on rank `rank` of `world`.
LayerConfig small_config(int world, int rank, int64_t max_tokens) {
  LayerConfig c = testing::small_config(world, max_tokens);
  c.ep_rank = rank;
  return c;
}

// Token t's slot k routed to expert (t + k) % experts: distinct experts within a token.
std::vector<int32_t> spread_ids(int64_t tokens, int32_t top_k, int32_t experts) {
  std::vector<int32_t> ids(tokens * top_k);
  for (int64_t t = 0; t < tokens; ++t)
    for (int32_t k = 0; k < top_k; ++k) ids[t * top_k + k] = static_cast<int32_t>((t + k) % experts);
  return ids;
}

struct CallResult {
  Status call = Status::ok_status();  // what forward() returned
  cudaError_t sync = cudaSuccess;     // the device sync after it
  std::vector<__nv_bfloat16> y;       // [T, H], when the sync succeeded
};

// One forward of T = ids.size() / K tokens on zeroed weights, router weights and x (x_host:
// these tokens instead), in buffers of its own, then a device sync.
CallResult forward_with_ids(Layer& layer, const std::vector<int32_t>& ids,
                            const std::vector<__nv_bfloat16>* x_host = nullptr) {
  const LayerConfig& c = layer.config();
  const int64_t T = static_cast<int64_t>(ids.size()) / c.top_k, H = c.hidden, I = c.intermediate;
  const int64_t E = c.experts_per_rank();
  const size_t bytes = 2 * (3 * E * I * H + 2 * T * H) + 8 * T * c.top_k;
  CallResult r;
  void* buffers = nullptr;
  if (cudaMalloc(&buffers, bytes) != cudaSuccess ||
      cudaMemset(buffers, 0, bytes) != cudaSuccess) {
    r.call = Status(StatusCode::kCudaError, "test buffers");
    return r;
  }
  auto* w = static_cast<__nv_bfloat16*>(buffers);  // weights, then x, then y (zeros: finite)
  auto* x = w + 3 * E * I * H;
  auto* y = x + T * H;
  auto* idx = reinterpret_cast<int32_t*>(y + T * H);
  auto* tw = reinterpret_cast<float*>(idx + T * c.top_k);
  cudaMemcpy(idx, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice);
  if (x_host) cudaMemcpy(x, x_host->data(), x_host->size() * 2, cudaMemcpyHostToDevice);
  ForwardArgs f;
  f.num_tokens = T;
  f.x = x;
  f.topk_idx = idx;
  f.topk_weights = tw;
  f.weights = {w, w + E * I * H, w + 2 * E * I * H};
  f.y = y;
  r.call = layer.forward(f, nullptr, nullptr);
  r.sync = cudaDeviceSynchronize();
  if (r.sync == cudaSuccess) {
    r.y.resize(T * H);
    r.sync = cudaMemcpy(r.y.data(), y, T * H * 2, cudaMemcpyDeviceToHost);
  }
  cudaFree(buffers);
  return r;
}

// fn on a one-rank layer of the small shape (8 experts, top-4, up to 8 tokens).
Status on_small_layer(const std::function<Status(Layer&)>& fn) {
  return run_on_local_gpus(1, [&](int, ncclComm_t comm) -> Status {
    std::unique_ptr<Layer> layer;
    if (Status e = Layer::create(small_config(1, 0, 8), comm, &layer); !e.ok()) return e;
    return fn(*layer);
  });
}

TEST(LayerRobustnessGpu, ReportsOutOfRangeAndRepeatedExpertsOnce) {
  EPFLOW_SKIP_WITHOUT_GPUS(1);
  const Status s = on_small_layer([](Layer& layer) -> Status {
    std::vector<int32_t> good = spread_ids(8, 4, 8);
    good[2 * 4 + 3] = -1;  // an empty slot is fine
    std::vector<int32_t> bad = good;
    bad[3 * 4 + 1] = 99;  // out of range: token 3, slot 1
    bad[5 * 4 + 2] = bad[5 * 4 + 0];  // token 5's slot 2 repeats its slot 0's expert
    const CallResult during = forward_with_ids(layer, bad);
    if (during.sync != cudaSuccess) return Status(StatusCode::kCudaError, "bad-id call failed");
    const Status after = layer.check_routing();
    // The report comes from whichever looked once the check had run (almost always `after`).
    const Status& report = during.call.ok() ? after : during.call;
    if (report.code() != StatusCode::kInvalidArgument)
      return Status(StatusCode::kInternal, "bad ids not reported: " + report.to_string());
    if (during.call.ok() && (report.message().find("2 bad slots") == std::string::npos ||
                             report.message().find("1 repeating") == std::string::npos ||
                             report.message().find("first seen: token") == std::string::npos))
      return Status(StatusCode::kInternal, "unexpected report: " + report.to_string());
    if (!layer.check_routing().ok())
      return Status(StatusCode::kInternal, "the report was not cleared");
    const CallResult again = forward_with_ids(layer, good);
    const Status check = layer.check_routing();
    if (!again.call.ok() || again.sync != cudaSuccess || !check.ok())
      return Status(StatusCode::kInternal,
                    "good ids reported: " + again.call.to_string() + " / " + check.to_string());
    return Status::ok_status();
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
}

// NaN and Inf in x stay in their tokens' outputs (as in the reference: every GEMM row depends on
// its own input row only) and the call completes.
TEST(LayerRobustnessGpu, NanAndInfStayInTheirTokens) {
  EPFLOW_SKIP_WITHOUT_GPUS(1);
  const Status s = on_small_layer([](Layer& layer) -> Status {
    const int64_t H = layer.config().hidden;
    std::vector<__nv_bfloat16> x(8 * H, __float2bfloat16(0.0f));
    x[2 * H + 17] = __float2bfloat16(std::numeric_limits<float>::quiet_NaN());
    x[4 * H + 5] = __float2bfloat16(std::numeric_limits<float>::infinity());
    const CallResult r = forward_with_ids(layer, spread_ids(8, 4, 8), &x);  // tokens share experts
    if (!r.call.ok()) return r.call;
    if (r.sync != cudaSuccess) return Status(StatusCode::kCudaError, cudaGetErrorString(r.sync));
    for (int t = 0; t < 8; ++t) {
      int64_t finite = 0;
      for (int64_t h = 0; h < H; ++h) finite += std::isfinite(__bfloat162float(r.y[t * H + h]));
      const bool poisoned = t == 2 || t == 4;
      if (poisoned ? finite == H : finite != H)
        return Status(StatusCode::kInternal, "token " + std::to_string(t) + ": " +
                                                 std::to_string(finite) + " finite outputs");
    }
    return Status::ok_status();
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
}

TEST(LayerRobustnessGpu, ConfigsThatDifferAcrossRanksFailCreateOnEveryRank) {
  EPFLOW_SKIP_WITHOUT_GPUS(2);
  std::vector<Status> created(2);
  const Status s = run_on_local_gpus(2, [&](int rank, ncclComm_t comm) -> Status {
    LayerConfig c = small_config(2, rank, 64);
    c.hidden = rank == 0 ? 256 : 512;
    std::unique_ptr<Layer> layer;
    created[rank] = Layer::create(c, comm, &layer);
    return Status::ok_status();
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(created[rank].code(), StatusCode::kInvalidArgument) << created[rank].to_string();
    EXPECT_NE(created[rank].message().find("hidden from 256 to 512"), std::string::npos)
        << created[rank].to_string();
  }
}

// A rank that never arrives (rank 1 skips the call) makes the other rank's call fail within its
// timeout with an error naming the missing peer, never a hang. NOTES: the barrier traps, which
// ends rank 0's CUDA context, so this test comes last in the file (ctest runs each test in its
// own process anyway); rank 1 waits for rank 0 to have failed before tearing down.
// Rank 1 skips the call; rank 0 must fail within its timeout, naming rank 1. Exits the process:
// 0 when the failure was named as expected, else 1 (with the reason on stderr).
[[noreturn]] void missing_peer_scenario() {
  std::atomic<bool> rank0_done{false};
  Status failure = Status::ok_status();
  const Status s = run_on_local_gpus(2, [&](int rank, ncclComm_t comm) -> Status {
    LayerConfig c = small_config(2, rank, 8);
    c.timeout_seconds = 0.5;
    std::unique_ptr<Layer> layer;
    if (Status e = Layer::create(c, comm, &layer); !e.ok()) return e;
    if (rank == 1) {  // skips the call
      while (!rank0_done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      return Status::ok_status();
    }
    std::vector<int32_t> ids(8 * 4, -1);
    for (int t = 0; t < 8; ++t) ids[t * 4] = t % 8;
    const auto start = std::chrono::steady_clock::now();
    const CallResult r = forward_with_ids(*layer, ids);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    failure = layer->device_failure();
    Status result = Status::ok_status();
    if (r.call.ok() && r.sync == cudaSuccess)
      result = Status(StatusCode::kInternal, "the call succeeded without its peer");
    else if (seconds > 10.0)
      result = Status(StatusCode::kInternal, "took " + std::to_string(seconds) + " s");
    rank0_done.store(true);
    return result;
  });
  bool named = s.ok() && failure.code() == StatusCode::kTimeout;
  for (const char* part : {"rank 0 timed out", "dispatch barrier", "rank 1 never arrived"})
    named = named && failure.message().find(part) != std::string::npos;
  std::fprintf(stderr, "%s: %s / %s\n", named ? "named" : "NOT NAMED", s.to_string().c_str(),
               failure.to_string().c_str());
  std::fflush(stderr);
  // NOTES: _Exit, not a return: the timed-out kernel trapped, so GPU 0's context is dead, and
  // CUDA's and NCCL's teardown at a normal exit crashed the process now and then (a segfault
  // after the test passed, about one run in four on 2xH200). The failure path is what is tested.
  std::_Exit(named ? 0 : 1);
}

// In a child process of its own (gtest's threadsafe death-test style re-runs this binary for
// this test alone), which leaves with the scenario's verdict and skips the dead context's
// teardown.
TEST(LayerRobustnessGpu, MissingPeerIsNamedWithinTheTimeout) {
  EPFLOW_SKIP_WITHOUT_GPUS(2);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(missing_peer_scenario(), ::testing::ExitedWithCode(0), "named: ");
}

}  // namespace
}  // namespace epflow
