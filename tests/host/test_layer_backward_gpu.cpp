// The GPU backward of the whole layer against the CPU reference backward (itself checked by
// finite differences): dx, d topk_weights and the three weight gradients of every rank, at EP=1
// and EP=2 (a thread per GPU), with imbalanced routing, every token to one expert, empty experts,
// empty slots, T not a tile multiple, T different on each rank and T = 0 on one rank, a forward
// ring that wraps (the backward reads the g | u the megakernel kept by pull-table row, not by
// ring slot) and an I that ends in a partial gate/up tile; fp32 gradients written, then
// accumulated (a second backward doubles them), and bf16 gradients; a repeated backward gives
// bitwise the same gradients (no atomics, fixed summation orders), and so does forward +
// backward captured in a CUDA graph and replayed. The backward megakernel (the default) with its
// default and with one communication SM, and the unfused backward with and without its side
// stream; the hooks the benchmark times them with. Outputs are poisoned first.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gpu_test_util.h"
#include "host/layer_core.h"
#include "unfused/unfused_executors.h"
#include "layer_gpu_harness.h"

namespace epflow {
namespace {

using synthetic::Routing;
using testing::CallInputs;

struct GradOptions {
  GradDType dtype = GradDType::kFP32;
  int backward_calls = 1;  // > 1: accumulate_weight_grads, weight gradients summed over calls
  bool check_repeatable = false;  // run the (writing) backward again: bitwise the same outputs
  // Then capture forward + backward in a CUDA graph and replay it: bitwise the same outputs.
  bool check_graph = false;
  bool unfused = false;    // the unfused backward (bench/unfused)
  int32_t side_sms = -1;  // unfused: its side-stream SMs (0: none; < 0: its default)
  int32_t comm_sms = 0;   // > 0: the backward megakernel's communication SMs
};

// Every rank's gradients as floats, in reference::RankGrads' layout.
using RankGrads = std::vector<reference::RankGrads>;

std::vector<std::vector<float>> make_dy(const LayerConfig& c, const CallInputs& in, uint64_t seed) {
  std::vector<std::vector<float>> dy(in.size());
  for (size_t r = 0; r < in.size(); ++r) {
    std::mt19937_64 rng(seed * 131 + r);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    dy[r].resize(in[r].num_tokens * c.hidden);
    for (float& f : dy[r]) f = u(rng);
    testing::round_to_bf16(&dy[r]);
  }
  return dy;
}

// A device buffer of `count` elements of `elem` bytes, filled with 0xFF bytes (bf16 and fp32
// NaN: unwritten elements show), copied back as floats.
struct Poisoned {
  void* ptr = nullptr;
  int64_t count = 0;
  size_t elem = 0;
  Status create(int64_t n, size_t bytes) {
    count = n;
    elem = bytes;
    EPFLOW_TRY_CUDA(cudaMalloc(&ptr, std::max<int64_t>(n, 1) * bytes));
    EPFLOW_TRY_CUDA(cudaMemset(ptr, 0xFF, std::max<int64_t>(n, 1) * bytes));
    return Status::ok_status();
  }
  Status fetch(std::vector<float>* out) const {
    out->resize(count);
    if (elem == 4) {
      EPFLOW_TRY_CUDA(cudaMemcpy(out->data(), ptr, count * 4, cudaMemcpyDeviceToHost));
    } else {
      std::vector<__nv_bfloat16> b(count);
      EPFLOW_TRY_CUDA(cudaMemcpy(b.data(), ptr, count * 2, cudaMemcpyDeviceToHost));
      for (int64_t i = 0; i < count; ++i) (*out)[i] = __bfloat162float(b[i]);
    }
    return Status::ok_status();
  }
  ~Poisoned() {
    if (ptr) cudaFree(ptr);
  }
};

Status run_backward(const LayerConfig& base, const std::vector<reference::RankExperts>& experts,
                    const CallInputs& in, const std::vector<std::vector<float>>& dy,
                    const GradOptions& options, RankGrads* grads) {
  grads->assign(base.ep_size, {});
  return run_on_local_gpus(base.ep_size, [&](int rank, ncclComm_t comm) -> Status {
    LayerConfig c = base;
    c.ep_rank = rank;
    std::unique_ptr<LayerCore> layer;  // the public Layer's core: its executors can be set
    if (Status s = LayerCore::create(c, comm, &layer); !s.ok()) return s;
    if (options.unfused) {
      const int32_t side_sms =
          options.side_sms >= 0
              ? options.side_sms
              : bench::default_backward_side_sms(c, layer->workspace().sm_count);
      std::unique_ptr<bench::UnfusedBackward> unfused;
      if (Status s = bench::UnfusedBackward::create(layer->workspace(), side_sms, &unfused);
          !s.ok())
        return s;
      layer->set_backward_executor(std::move(unfused));
    }
    if (options.comm_sms > 0)
      if (Status s = layer->set_backward_comm_sms(options.comm_sms); !s.ok()) return s;
    const int64_t H = c.hidden, I = c.intermediate, K = c.top_k, E = c.experts_per_rank();
    const int64_t T = in[rank].num_tokens;
    std::vector<__nv_bfloat16*> w(3, nullptr);
    const std::vector<float>* host_w[3] = {&experts[rank].gate, &experts[rank].up,
                                           &experts[rank].down};
    for (int i = 0; i < 3; ++i) {
      const auto b = testing::to_bf16(*host_w[i]);
      EPFLOW_TRY_CUDA(cudaMalloc(&w[i], b.size() * 2));
      EPFLOW_TRY_CUDA(cudaMemcpy(w[i], b.data(), b.size() * 2, cudaMemcpyHostToDevice));
    }
    Poisoned x, y, idx, tw, d_y, dx, dtw, dgate, dup, ddown;
    const size_t g = options.dtype == GradDType::kFP32 ? 4 : 2;
    for (auto [buf, n, bytes] : {std::tuple{&x, T * H, size_t{2}}, {&y, T * H, size_t{2}},
                                 {&idx, T * K, size_t{4}}, {&tw, T * K, size_t{4}},
                                 {&d_y, T * H, size_t{2}}, {&dx, T * H, size_t{2}},
                                 {&dtw, T * K, size_t{4}}, {&dgate, E * I * H, g},
                                 {&dup, E * I * H, g}, {&ddown, E * H * I, g}})
      if (Status s = buf->create(n, bytes); !s.ok()) return s;
    const auto xb = testing::to_bf16(in[rank].x), dyb = testing::to_bf16(dy[rank]);
    EPFLOW_TRY_CUDA(cudaMemcpy(x.ptr, xb.data(), T * H * 2, cudaMemcpyHostToDevice));
    EPFLOW_TRY_CUDA(cudaMemcpy(d_y.ptr, dyb.data(), T * H * 2, cudaMemcpyHostToDevice));
    EPFLOW_TRY_CUDA(
        cudaMemcpy(idx.ptr, in[rank].topk_idx.data(), T * K * 4, cudaMemcpyHostToDevice));
    EPFLOW_TRY_CUDA(
        cudaMemcpy(tw.ptr, in[rank].topk_weights.data(), T * K * 4, cudaMemcpyHostToDevice));
    ForwardArgs f;
    f.num_tokens = T;
    f.x = static_cast<__nv_bfloat16*>(x.ptr);
    f.topk_idx = static_cast<int32_t*>(idx.ptr);
    f.topk_weights = static_cast<float*>(tw.ptr);
    f.weights = {w[0], w[1], w[2]};
    f.y = static_cast<__nv_bfloat16*>(y.ptr);
    SavedContext saved;
    if (Status s = layer->forward(f, nullptr, &saved); !s.ok()) return s;
    BackwardArgs b;
    b.dy = static_cast<__nv_bfloat16*>(d_y.ptr);
    b.dx = static_cast<__nv_bfloat16*>(dx.ptr);
    b.d_topk_weights = static_cast<float*>(dtw.ptr);
    b.d_gate = dgate.ptr;
    b.d_up = dup.ptr;
    b.d_down = ddown.ptr;
    b.grad_dtype = options.dtype;
    for (int call = 0; call < options.backward_calls; ++call) {
      // Accumulating: the first call writes (over the poison), later calls add.
      b.accumulate_weight_grads = call > 0;
      if (Status s = layer->backward(b, saved, nullptr); !s.ok()) return s;
    }
    const cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess)
      return layer->with_device_failure(Status(StatusCode::kCudaError, cudaGetErrorString(e)));
    reference::RankGrads& out = (*grads)[rank];
    const std::vector<std::pair<Poisoned*, std::vector<float>*>> outputs = {
        {&dx, &out.dx}, {&dtw, &out.d_topk_weights}, {&dgate, &out.d_gate}, {&dup, &out.d_up},
        {&ddown, &out.d_down}};
    for (auto [buf, host] : outputs)
      if (Status s = buf->fetch(host); !s.ok()) return s;
    if (options.check_repeatable || options.check_graph) {
      b.accumulate_weight_grads = false;
      if (options.check_graph) {
        // The first backward allocated the layer's buffers: the captured calls only enqueue.
        for (auto [buf, host] : outputs)
          EPFLOW_TRY_CUDA(cudaMemset(buf->ptr, 0xFF, buf->count * buf->elem));
        cudaStream_t stream = nullptr;
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        EPFLOW_TRY_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        EPFLOW_TRY_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        SavedContext again;
        Status s = layer->forward(f, stream, &again);
        if (s.ok()) s = layer->backward(b, again, stream);
        const cudaError_t end = cudaStreamEndCapture(stream, &graph);
        if (!s.ok()) return s;
        EPFLOW_TRY_CUDA(end);
        EPFLOW_TRY_CUDA(cudaGraphInstantiate(&exec, graph, 0));
        EPFLOW_TRY_CUDA(cudaGraphLaunch(exec, stream));
        EPFLOW_TRY_CUDA(cudaStreamSynchronize(stream));
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        cudaStreamDestroy(stream);
      } else {
        if (Status s = layer->backward(b, saved, nullptr); !s.ok()) return s;
        EPFLOW_TRY_CUDA(cudaDeviceSynchronize());
      }
      for (auto [buf, host] : outputs) {
        std::vector<float> again;
        if (Status s = buf->fetch(&again); !s.ok()) return s;
        // Compared as bits: NaN == NaN would fail as floats, and -0 == 0 would pass.
        if (again.size() != host->size() ||
            std::memcmp(again.data(), host->data(), again.size() * sizeof(float)) != 0)
          return Status(StatusCode::kInternal, options.check_graph
                                                   ? "the CUDA graph gave different outputs"
                                                   : "a repeated backward gave different outputs");
      }
    }
    layer.reset();
    for (auto* p : w) cudaFree(p);
    return Status::ok_status();
  });
}

// Relative error of `got` against `want` (both every element); every element finite.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, double scale,
                  double tolerance, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double err = 0, norm = 0;
  int64_t not_finite = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    not_finite += !std::isfinite(got[i]);
    const double d = double(got[i]) - scale * want[i];
    err += d * d;
    norm += scale * scale * double(want[i]) * want[i];
  }
  EXPECT_EQ(not_finite, 0) << what << ": elements not written (or not finite)";
  if (norm > 0)
    EXPECT_LE(std::sqrt(err / norm), tolerance) << what << ": relative error";
  else
    EXPECT_EQ(err, 0.0) << what << ": the reference is zero, the output is not";
}

void run_and_check(const LayerConfig& c, const CallInputs& in, const GradOptions& options = {},
                   uint64_t seed = 9) {
  const auto experts = testing::make_bf16_experts(c, seed);
  const auto dy = make_dy(c, in, seed);
  RankGrads want;
  const Status ref = reference::backward(c, in, experts, dy, &want);
  ASSERT_TRUE(ref.ok()) << ref.to_string();
  RankGrads got;
  const Status s = run_backward(c, experts, in, dy, options, &got);
  ASSERT_TRUE(s.ok()) << s.to_string();
  // bf16 storage of dx rows, dg/du and the gradients themselves: a few 1e-3 in practice.
  const double tol = options.dtype == GradDType::kFP32 ? 2e-2 : 3e-2;
  const double weight_scale = options.backward_calls;
  for (int r = 0; r < c.ep_size; ++r) {
    SCOPED_TRACE(::testing::Message() << "rank " << r);
    expect_close(got[r].dx, want[r].dx, 1.0, tol, "dx");
    expect_close(got[r].d_topk_weights, want[r].d_topk_weights, 1.0, tol, "d topk_weights");
    expect_close(got[r].d_gate, want[r].d_gate, weight_scale, tol, "d W_gate");
    expect_close(got[r].d_up, want[r].d_up, weight_scale, tol, "d W_up");
    expect_close(got[r].d_down, want[r].d_down, weight_scale, tol, "d W_down");
  }
}

// The harness's small shape, created for the backward.
LayerConfig small_config(int world, int64_t max_tokens) {
  LayerConfig c = testing::small_config(world, max_tokens);
  c.with_backward = true;
  return c;
}

TEST(LayerBackwardGpu, Ep1UniformImbalancedAndEmptySlots) {
  EPFLOW_SKIP_WITHOUT_GPUS(1);
  const LayerConfig c = small_config(1, 300);
  run_and_check(c, testing::make_call(c, {100}, Routing::kUniform, 1));
  run_and_check(c, testing::make_call(c, {300}, Routing::kImbalanced, 2));
  run_and_check(c, testing::make_call(c, {37}, Routing::kWithEmptySlots, 3));
}

TEST(LayerBackwardGpu, Ep1AccumulatedAndBf16Gradients) {
  EPFLOW_SKIP_WITHOUT_GPUS(1);
  const LayerConfig c = small_config(1, 200);
  const CallInputs in = testing::make_call(c, {150}, Routing::kUniform, 4);
  run_and_check(c, in, GradOptions{GradDType::kFP32, 2});
  run_and_check(c, in, GradOptions{GradDType::kBF16, 1});
  run_and_check(c, in, GradOptions{GradDType::kBF16, 2});
}

TEST(LayerBackwardGpu, Ep2DifferentTokenCountsAndAnEmptyRank) {
  EPFLOW_SKIP_WITHOUT_GPUS(2);
  const LayerConfig c = small_config(2, 600);
  run_and_check(c, testing::make_call(c, {300, 77}, Routing::kUniform, 5));
  run_and_check(c, testing::make_call(c, {0, 513}, Routing::kImbalanced, 6));
  run_and_check(c, testing::make_call(c, {129, 128}, Routing::kWithEmptySlots, 7));
  // Every token of both ranks to expert 0 (rank 0's): 1 routed slot per token, all on one GPU.
  run_and_check(c, testing::make_call(c, {600, 451}, Routing::kSingleExpert, 13));
  GradOptions repeat;
  repeat.check_repeatable = true;
  run_and_check(c, testing::make_call(c, {200, 150}, Routing::kImbalanced, 8), repeat);
}

// The forward ring wraps many times (2-tile ring, 1-tile minibatches) and I = 320 ends in a
// partial gate/up tile (64 of 128 columns): the g | u the megakernel keeps for the backward.
// EP=2 where two GPUs are present, else EP=1; a forward ring of two 1-tile minibatches.
LayerConfig small_ring_config(int64_t max_tokens) {
  LayerConfig c = small_config(testing::device_count() >= 2 ? 2 : 1, max_tokens);
  c.ring_rows = 256;
  c.minibatch_rows = 128;
  return c;
}

// Token counts per rank: these on EP=2, the last one on EP=1.
std::vector<int64_t> tokens_for(const LayerConfig& c, int64_t first, int64_t second) {
  return c.ep_size == 2 ? std::vector<int64_t>{first, second} : std::vector<int64_t>{second};
}

TEST(LayerBackwardGpu, Ep2RingWrapAndIntermediateTail) {
  EPFLOW_SKIP_WITHOUT_GPUS(1);
  LayerConfig c = small_ring_config(700);
  c.intermediate = 320;
  const std::vector<int64_t> tokens = tokens_for(c, 700, 333);
  run_and_check(c, testing::make_call(c, tokens, Routing::kImbalanced, 10));
  GradOptions one_comm_sm;  // every dy and x row pulled by one CTA (and the head by all)
  one_comm_sm.comm_sms = 1;
  run_and_check(c, testing::make_call(c, tokens, Routing::kWithEmptySlots, 14), one_comm_sm);
}

TEST(LayerBackwardGpu, UnfusedBackwardWithAndWithoutSideStream) {
  EPFLOW_SKIP_WITHOUT_GPUS(1);
  LayerConfig c = small_ring_config(700);
  c.intermediate = 320;
  const std::vector<int64_t> tokens = tokens_for(c, 500, 333);
  GradOptions unfused;
  unfused.unfused = true;
  run_and_check(c, testing::make_call(c, tokens, Routing::kImbalanced, 15), unfused);
  unfused.side_sms = 0;  // no side stream: x pull and dx push in order on the caller's stream
  run_and_check(c, testing::make_call(c, tokens, Routing::kUniform, 12), unfused);
}

TEST(LayerBackwardGpu, CapturedInCudaGraph) {
  EPFLOW_SKIP_WITHOUT_GPUS(1);
  const LayerConfig c = small_ring_config(400);
  const std::vector<int64_t> tokens = tokens_for(c, 400, 211);
  GradOptions graph;
  graph.check_graph = true;
  run_and_check(c, testing::make_call(c, tokens, Routing::kWithEmptySlots, 11), graph);
}

// One token routed to expert 0 on a small EP=1 layer, its forward and backward arguments over
// poisoned buffers (dy = x, dx = y).
struct OneTokenCall {
  Poisoned w, x, y, idx, tw, grads, dtw;
  ForwardArgs forward;
  BackwardArgs backward;
  Status create(const LayerConfig& c) {
    const int64_t H = c.hidden, I = c.intermediate, E = c.experts_per_rank();
    for (auto [buf, n, bytes] :
         {std::tuple{&w, 3 * E * I * H, size_t{2}}, {&x, H, size_t{2}}, {&y, H, size_t{2}},
          {&idx, c.top_k, size_t{4}}, {&tw, c.top_k, size_t{4}}, {&grads, 3 * E * I * H, size_t{4}},
          {&dtw, c.top_k, size_t{4}}})
      if (Status e = buf->create(n, bytes); !e.ok()) return e;
    EPFLOW_TRY_CUDA(cudaMemset(idx.ptr, 0, 4));  // expert 0, then empty (-1) slots
    auto* wp = static_cast<__nv_bfloat16*>(w.ptr);
    forward.num_tokens = 1;
    forward.x = static_cast<__nv_bfloat16*>(x.ptr);
    forward.topk_idx = static_cast<int32_t*>(idx.ptr);
    forward.topk_weights = static_cast<float*>(tw.ptr);
    forward.weights = {wp, wp + E * I * H, wp + 2 * E * I * H};
    forward.y = static_cast<__nv_bfloat16*>(y.ptr);
    auto* gp = static_cast<float*>(grads.ptr);
    backward.dy = forward.x;
    backward.dx = forward.y;
    backward.d_topk_weights = static_cast<float*>(dtw.ptr);
    backward.d_gate = gp;
    backward.d_up = gp + E * I * H;
    backward.d_down = gp + 2 * E * I * H;
    return Status::ok_status();
  }
};

// A backward the layer must refuse before launching anything: of the unfused forward (the
// benchmark's comparison, it keeps no g | u: its forward with a context is refused already)
// or with a context an later forward made stale (it replaced the schedule and the window's x the
// backward reuses), even one without a context.
Status refused_backward(bool unfused, bool forward_again, StatusCode want) {
  const LayerConfig c = small_config(1, 64);
  return run_on_local_gpus(1, [&](int, ncclComm_t comm) -> Status {
    std::unique_ptr<LayerCore> layer;
    if (Status e = LayerCore::create(c, comm, &layer); !e.ok()) return e;
    if (unfused) {
      std::unique_ptr<bench::UnfusedForward> forward;
      if (Status e = bench::UnfusedForward::create(layer->workspace(), &forward); !e.ok())
        return e;
      layer->set_forward_executor(std::move(forward));
    }
    OneTokenCall call;
    if (Status e = call.create(c); !e.ok()) return e;
    SavedContext saved;
    const Status forward = layer->forward(call.forward, nullptr, &saved);
    if (unfused)  // refused at the forward already: it cannot keep what the backward reads
      return forward.code() == want
                 ? Status::ok_status()
                 : Status(StatusCode::kInternal, "expected " + std::string(to_string(want)) +
                                                     " from the forward, got " + forward.to_string());
    if (!forward.ok()) return forward;
    if (forward_again)
      if (Status e = layer->forward(call.forward, nullptr, nullptr); !e.ok()) return e;
    EPFLOW_TRY_CUDA(cudaDeviceSynchronize());
    const Status refused = layer->backward(call.backward, saved, nullptr);
    if (refused.code() != want)
      return Status(StatusCode::kInternal, "expected " + std::string(to_string(want)) +
                                               ", got " + refused.to_string());
    return Status::ok_status();
  });
}

TEST(LayerBackwardGpu, RefusesUnfusedOrStaleContexts) {
  EPFLOW_SKIP_WITHOUT_GPUS(1);
  const Status unfused = refused_backward(true, false, StatusCode::kNotImplemented);
  EXPECT_TRUE(unfused.ok()) << unfused.to_string();
  const Status stale = refused_backward(false, true, StatusCode::kInvalidArgument);
  EXPECT_TRUE(stale.ok()) << stale.to_string();
}

// Hooks that count the stage boundaries a pass marks and give the megakernel a trace buffer.
class CountingHooks final : public PassHooks {
 public:
  ~CountingHooks() override {
    if (trace) cudaFree(trace);
  }
  cudaError_t stage_boundary(cudaStream_t) override {
    ++boundaries;
    return cudaSuccess;
  }
  kernels::MegakernelTraceRecord* megakernel_trace(cudaStream_t stream) override {
    return cudaMemsetAsync(trace, 0xff, bytes, stream) == cudaSuccess ? trace : nullptr;
  }
  int boundaries = 0;
  kernels::MegakernelTraceRecord* trace = nullptr;
  size_t bytes = 0;
};

// The instrumentation the benchmark relies on: every pass marks one boundary more than it lists
// stages (with the fused and the unfused executors), and the megakernels record their tasks.
TEST(LayerBackwardGpu, HooksSeeEveryStageAndTheMegakernelTasks) {
  EPFLOW_SKIP_WITHOUT_GPUS(1);
  const LayerConfig c = small_config(1, 64);
  const Status s = run_on_local_gpus(1, [&](int, ncclComm_t comm) -> Status {
    std::unique_ptr<LayerCore> layer;
    if (Status e = LayerCore::create(c, comm, &layer); !e.ok()) return e;
    OneTokenCall call;
    if (Status e = call.create(c); !e.ok()) return e;
    CountingHooks hooks;
    hooks.bytes = sizeof(kernels::MegakernelTraceRecord) * kernels::kTraceRecordsPerCta *
                  layer->workspace().sm_count;
    EPFLOW_TRY_CUDA(cudaMalloc(&hooks.trace, hooks.bytes));
    auto expect = [](const char* pass, int seen, size_t stages) {
      return seen == static_cast<int>(stages) + 1
                 ? Status::ok_status()
                 : Status(StatusCode::kInternal, std::string(pass) + " marked " +
                                                     std::to_string(seen) + " boundaries for " +
                                                     std::to_string(stages) + " stages");
    };
    SavedContext saved;
    if (Status e = layer->forward(call.forward, nullptr, &saved, &hooks); !e.ok()) return e;
    if (Status e = expect("forward", hooks.boundaries, LayerCore::forward_stage_names().size());
        !e.ok())
      return e;
    EPFLOW_TRY_CUDA(cudaDeviceSynchronize());
    std::vector<kernels::MegakernelTraceRecord> records(hooks.bytes / sizeof(records[0]));
    EPFLOW_TRY_CUDA(cudaMemcpy(records.data(), hooks.trace, hooks.bytes, cudaMemcpyDeviceToHost));
    if (std::none_of(records.begin(), records.end(), [](const auto& r) { return r.task >= 0; }))
      return Status(StatusCode::kInternal, "the forward megakernel recorded no task");
    hooks.boundaries = 0;
    if (Status e = layer->backward(call.backward, saved, nullptr, &hooks); !e.ok()) return e;
    if (Status e = expect("backward", hooks.boundaries, layer->backward_stage_names().size());
        !e.ok())
      return e;
    std::unique_ptr<bench::UnfusedBackward> unfused;
    if (Status e = bench::UnfusedBackward::create(layer->workspace(), 0, &unfused); !e.ok())
      return e;
    layer->set_backward_executor(std::move(unfused));
    hooks.boundaries = 0;
    if (Status e = layer->backward(call.backward, saved, nullptr, &hooks); !e.ok()) return e;
    if (Status e = expect("unfused backward", hooks.boundaries,
                          layer->backward_stage_names().size());
        !e.ok())
      return e;
    EPFLOW_TRY_CUDA(cudaDeviceSynchronize());
    return Status::ok_status();
  });
  EXPECT_TRUE(s.ok()) << s.to_string();
}

}  // namespace
}  // namespace epflow
