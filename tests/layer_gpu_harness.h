// Runs the EPFlow layer on `world` local GPUs (a thread per GPU) on synthetic inputs and checks it
// against the CPU reference: bf16-rounded inputs on both sides, outputs poisoned before every
// call, every element checked for being written, relative error per rank. FP8 layers
// (LayerConfig::dtype) get their weights from quantize_expert_weights on the device, and are
// checked against the quantization-matched reference (reference::forward_token_fp8) or the
// exact one.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "epflow/communicator.h"
#include "gpu_test_util.h"
#include "epflow/epflow.h"
#include "host/layer_core.h"
#include "epflow/reference.h"
#include "reference/synthetic.h"
#include "unfused/unfused_executors.h"

namespace epflow::testing {

inline void round_to_bf16(std::vector<float>* v) {
  for (float& f : *v) f = __bfloat162float(__float2bfloat16(f));
}

inline std::vector<__nv_bfloat16> to_bf16(const std::vector<float>& v) {
  std::vector<__nv_bfloat16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16(v[i]);
  return out;
}

inline int device_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

// A layer of `world` ranks with `experts_per_rank` experts each.
inline LayerConfig shape_config(int world, int64_t hidden, int64_t intermediate,
                                int32_t experts_per_rank, int32_t top_k, int64_t max_tokens) {
  LayerConfig c;
  c.hidden = hidden;
  c.intermediate = intermediate;
  c.num_experts = experts_per_rank * world;
  c.top_k = top_k;
  c.ep_size = world;
  c.max_tokens_per_rank = max_tokens;
  return c;
}

// The tests' small shape: H 256, I 128, 8 experts per rank, top-4.
inline LayerConfig small_config(int world, int64_t max_tokens) {
  return shape_config(world, 256, 128, 8, 4, max_tokens);
}

}  // namespace epflow::testing

// Skips the test (saying why) unless n CUDA devices are present.
#define EPFLOW_SKIP_WITHOUT_GPUS(n)                                                           \
  do {                                                                                        \
    EPFLOW_SKIP_WITHOUT_GPU();                                                                \
    if (::epflow::testing::device_count() < (n))                                              \
      GTEST_SKIP() << "needs " << (n) << " GPUs, found " << ::epflow::testing::device_count() \
                   << ": test skipped";                                                       \
  } while (0)

// A case fn(world) as suite.nameEp1 and suite.nameEp2; the EP=2 test reports a skip where fewer
// than two GPUs are present (never runs at EP=1 under an EP=2 name).
#define EPFLOW_EP1_AND_EP2_TESTS(suite, name, fn) \
  TEST(suite, name##Ep1) {                        \
    EPFLOW_SKIP_WITHOUT_GPUS(1);                  \
    fn(1);                                        \
  }                                               \
  TEST(suite, name##Ep2) {                        \
    EPFLOW_SKIP_WITHOUT_GPUS(2);                  \
    fn(2);                                        \
  }

namespace epflow::testing {

// One forward call's inputs on every rank.
using CallInputs = std::vector<reference::RankInput>;

struct LayerRunResult {
  std::vector<std::vector<std::vector<float>>> y;  // [call][rank][T * H]
};

#define EPFLOW_TRY_CUDA(expr)                                                                    \
  do {                                                                                           \
    const cudaError_t e_ = (expr);                                                               \
    if (e_ != cudaSuccess)                                                                       \
      return Status(StatusCode::kCudaError, std::string(#expr) + ": " + cudaGetErrorString(e_)); \
  } while (0)

// How a test lays out one rank's expert matrices (weights or their gradients) in device memory;
// the layer reads and writes the strided ones in place through ExpertWeights' / BackwardArgs'
// expert strides.
enum class ExpertLayout {
  kPacked,       // gate, up and down each [E, rows, cols], densely packed
  kFusedGateUp,  // Megatron-Core's linear_fc1: each expert's gate rows, then its up rows, in one
                 // [E, 2I, H] buffer; down with 64 elements between experts
  kDdpReversed,  // Megatron-Core's DDP buffer: one buffer, the last expert first, each expert's
                 // down (fc2) then its gate | up (fc1): negative expert strides
};

// Where matrix i (0 gate, 1 up, 2 down) of expert e lies: element offset[i] + e * stride[i] of
// buffer slot[i], rows * cols (matrix[i]) elements in a row.
struct ExpertPlacement {
  int slot[3];
  int64_t offset[3], stride[3], matrix[3];
  int64_t slot_elems[3];  // 0: slot unused
  int64_t at(int i, int64_t e) const { return offset[i] + e * stride[i]; }
  bool packed() const { return slot[1] == 1 && stride[0] == matrix[0] && stride[2] == matrix[2]; }
};

inline ExpertPlacement place_experts(ExpertLayout layout, int64_t E, int64_t H, int64_t I) {
  const int64_t IH = I * H;
  ExpertPlacement p{};
  switch (layout) {
    case ExpertLayout::kPacked:
      p = {{0, 1, 2}, {0, 0, 0}, {IH, IH, IH}, {IH, IH, IH}, {E * IH, E * IH, E * IH}};
      break;
    case ExpertLayout::kFusedGateUp:
      p = {{0, 0, 2}, {0, IH, 0}, {2 * IH, 2 * IH, IH + 64}, {IH, IH, IH},
           {E * 2 * IH, 0, E * (IH + 64)}};
      break;
    case ExpertLayout::kDdpReversed: {
      const int64_t S = 3 * IH, last = (E - 1) * S;  // down, then gate | up, per expert
      p = {{0, 0, 0}, {last + IH, last + 2 * IH, last}, {-S, -S, -S}, {IH, IH, IH},
           {E * S, 0, 0}};
      break;
    }
  }
  return p;
}

// `base` [slot] + expert 0's offset of each matrix, and the placement's strides (0: packed).
inline ExpertWeights placed_weights(const ExpertPlacement& p, __nv_bfloat16* const base[3]) {
  ExpertWeights w = {base[p.slot[0]] + p.offset[0], base[p.slot[1]] + p.offset[1],
                     base[p.slot[2]] + p.offset[2]};
  if (!p.packed()) {
    w.gate_expert_stride = p.stride[0];
    w.up_expert_stride = p.stride[1];
    w.down_expert_stride = p.stride[2];
  }
  return w;
}

// Allocates the placement's buffers (base[slot]) and copies into them each expert's matrices of
// host[i] (E matrices densely packed, gate, up, down).
inline Status upload_experts(const ExpertPlacement& p, const std::vector<__nv_bfloat16>* host[3],
                             __nv_bfloat16* base[3]) {
  for (int s = 0; s < 3; ++s) {
    base[s] = nullptr;
    if (p.slot_elems[s] > 0) EPFLOW_TRY_CUDA(cudaMalloc(&base[s], p.slot_elems[s] * 2));
  }
  for (int i = 0; i < 3; ++i)
    for (int64_t e = 0; e < static_cast<int64_t>(host[i]->size()) / p.matrix[i]; ++e)
      EPFLOW_TRY_CUDA(cudaMemcpy(base[p.slot[i]] + p.at(i, e), host[i]->data() + e * p.matrix[i],
                                 p.matrix[i] * 2, cudaMemcpyHostToDevice));
  return Status::ok_status();
}

struct RunOptions {
  bool unfused = false;     // the unfused chain (bench/unfused) instead of the megakernel
  bool cuda_graph = false;  // capture each call in a CUDA graph, then replay it twice
  // Run each call this many times back to back (not with cuda_graph); every output must be
  // bit-identical to the first (the layer is deterministic), which is the one returned.
  int repeat = 1;
  // Where the expert weights lie (the strided layouts read in place; FP8 layers quantize from
  // them).
  ExpertLayout weights = ExpertLayout::kPacked;
};

// Runs every call in order on one Layer per rank (so repeated calls reuse the workspace).
inline Status run_layer(const LayerConfig& base, const std::vector<reference::RankExperts>& experts,
                        const std::vector<CallInputs>& calls, LayerRunResult* result,
                        const RunOptions& options = {}) {
  const int world = base.ep_size;
  result->y.assign(calls.size(), std::vector<std::vector<float>>(world));
  return run_on_local_gpus(world, [&](int rank, ncclComm_t comm) -> Status {
    LayerConfig c = base;
    c.ep_rank = rank;
    std::unique_ptr<LayerCore> layer;  // the public Layer's core: its executor can be swapped
    if (Status s = LayerCore::create(c, comm, &layer); !s.ok()) return s;
    if (options.unfused) {
      std::unique_ptr<bench::UnfusedForward> unfused;
      if (Status s = bench::UnfusedForward::create(layer->workspace(), &unfused); !s.ok())
        return s;
      layer->set_forward_executor(std::move(unfused));
    }
    const auto& ex = experts[rank];
    const ExpertPlacement place =
        place_experts(options.weights, c.experts_per_rank(), c.hidden, c.intermediate);
    const std::vector<__nv_bfloat16> bf16[3] = {to_bf16(ex.gate), to_bf16(ex.up),
                                                to_bf16(ex.down)};
    const std::vector<__nv_bfloat16>* host_w[3] = {&bf16[0], &bf16[1], &bf16[2]};
    __nv_bfloat16* w[3];
    if (Status s = upload_experts(place, host_w, w); !s.ok()) return s;
    ExpertWeights weights = placed_weights(place, w);
    void* fp8_buffer = nullptr;
    if (c.dtype == DType::kFP8Blockwise) {
      const int64_t bytes = fp8_expert_weights_bytes(c);
      EPFLOW_TRY_CUDA(cudaMalloc(&fp8_buffer, bytes));
      if (Status s = quantize_expert_weights(c, weights, c.fp8_power_of_two_scales, fp8_buffer,
                                             bytes, &weights.fp8, nullptr);
          !s.ok())
        return s;
      EPFLOW_TRY_CUDA(cudaDeviceSynchronize());
    }
    const int64_t H = c.hidden, K = c.top_k, T_max = c.max_tokens_per_rank;
    __nv_bfloat16 *x = nullptr, *y = nullptr;
    int32_t* idx = nullptr;
    float* tw = nullptr;
    EPFLOW_TRY_CUDA(cudaMalloc(&x, T_max * H * 2));
    EPFLOW_TRY_CUDA(cudaMalloc(&y, T_max * H * 2));
    EPFLOW_TRY_CUDA(cudaMalloc(&idx, T_max * K * 4));
    EPFLOW_TRY_CUDA(cudaMalloc(&tw, T_max * K * 4));
    void* context = nullptr;  // with_backward: every forward fills a context over it
    if (c.with_backward) EPFLOW_TRY_CUDA(cudaMalloc(&context, layer->saved_context_bytes()));
    cudaStream_t stream;
    EPFLOW_TRY_CUDA(cudaStreamCreate(&stream));
    for (size_t call = 0; call < calls.size(); ++call) {
      const auto& in = calls[call][rank];
      const int64_t T = in.num_tokens;
      const auto xb = to_bf16(in.x);
      EPFLOW_TRY_CUDA(cudaMemcpy(x, xb.data(), T * H * 2, cudaMemcpyHostToDevice));
      EPFLOW_TRY_CUDA(cudaMemcpy(idx, in.topk_idx.data(), T * K * 4, cudaMemcpyHostToDevice));
      EPFLOW_TRY_CUDA(cudaMemcpy(tw, in.topk_weights.data(), T * K * 4, cudaMemcpyHostToDevice));
      ForwardArgs a;
      a.num_tokens = T;
      a.x = x;
      a.topk_idx = idx;
      a.topk_weights = tw;
      a.weights = weights;
      a.y = y;
      SavedContext saved;
      saved.buffer = context;
      saved.buffer_bytes = c.with_backward ? layer->saved_context_bytes() : 0;
      // A timed-out wait traps the megakernel (cudaErrorLaunchFailure): say which one.
      auto sync = [&]() -> Status {
        const cudaError_t e = cudaStreamSynchronize(stream);
        if (e == cudaSuccess) return Status::ok_status();
        return layer->with_device_failure(Status(
            StatusCode::kCudaError, std::string("cudaStreamSynchronize: ") + cudaGetErrorString(e)));
      };
      if (options.cuda_graph) {
        // Two replays of one capture: the second proves the graph (barrier epochs, counters)
        // is valid to relaunch, and its output is the one checked.
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        EPFLOW_TRY_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        const Status s = layer->forward(a, stream, c.with_backward ? &saved : nullptr);
        EPFLOW_TRY_CUDA(cudaStreamEndCapture(stream, &graph));
        if (!s.ok()) return s;
        EPFLOW_TRY_CUDA(cudaGraphInstantiate(&exec, graph, 0));
        for (int replay = 0; replay < 2; ++replay) {
          EPFLOW_TRY_CUDA(cudaMemsetAsync(y, 0xFF, T_max * H * 2, stream));
          EPFLOW_TRY_CUDA(cudaGraphLaunch(exec, stream));
        }
        if (Status s = sync(); !s.ok()) return s;
        EPFLOW_TRY_CUDA(cudaGraphExecDestroy(exec));
        EPFLOW_TRY_CUDA(cudaGraphDestroy(graph));
      }
      std::vector<__nv_bfloat16> yb(T * H), again(options.repeat > 1 ? T * H : 0);
      for (int r = 0; !options.cuda_graph && r < options.repeat; ++r) {
        EPFLOW_TRY_CUDA(cudaMemset(y, 0xFF, T_max * H * 2));  // bf16 0xFFFF is NaN: unwritten shows
        if (Status s = layer->forward(a, stream, c.with_backward ? &saved : nullptr); !s.ok())
          return s;
        if (Status s = sync(); !s.ok()) return s;
        EPFLOW_TRY_CUDA(cudaMemcpy(r == 0 ? yb.data() : again.data(), y, T * H * 2,
                                   cudaMemcpyDeviceToHost));
        if (r > 0 && std::memcmp(yb.data(), again.data(), T * H * 2) != 0)
          return Status(StatusCode::kInternal, "call " + std::to_string(call) + ", repeat " +
                                                   std::to_string(r) +
                                                   ": output differs from the first run");
      }
      if (options.cuda_graph)
        EPFLOW_TRY_CUDA(cudaMemcpy(yb.data(), y, T * H * 2, cudaMemcpyDeviceToHost));
      auto& out = result->y[call][rank];
      out.resize(T * H);
      for (int64_t i = 0; i < T * H; ++i) out[i] = __bfloat162float(yb[i]);
    }
    layer.reset();
    for (__nv_bfloat16* p : w)
      if (p) cudaFree(p);
    if (fp8_buffer) cudaFree(fp8_buffer);
    cudaFree(x);
    cudaFree(y);
    cudaFree(idx);
    cudaFree(tw);
    if (context) cudaFree(context);
    cudaStreamDestroy(stream);
    return Status::ok_status();
  });
}

// Compares rank outputs with the reference on up to `max_checked_tokens` tokens per rank (all of
// them when fewer), spread over the rank; every element of y must be finite (written). With
// `fp8`, the reference is the quantization-matched FP8 one over those quantized experts.
// The errors found: relative (L2 over the checked rows of a rank; the largest over the ranks),
// and the largest of one row's own relative error.
struct ReferenceErrors {
  double relative = 0.0;
  double worst_row = 0.0;
};
inline ReferenceErrors expect_matches_reference(const LayerConfig& c,
                                                const std::vector<reference::RankExperts>& experts,
                                                const CallInputs& in,
                                                const std::vector<std::vector<float>>& y,
                                                int64_t max_checked_tokens,
                                                double tolerance = 1e-2,
                                                const reference::Fp8Experts* fp8 = nullptr) {
  ReferenceErrors worst;
  for (int r = 0; r < c.ep_size; ++r) {
    const int64_t T = in[r].num_tokens;
    EXPECT_EQ(static_cast<int64_t>(y[r].size()), T * c.hidden);
    if (static_cast<int64_t>(y[r].size()) != T * c.hidden) return {INFINITY, INFINITY};
    int64_t unwritten = 0;
    for (float f : y[r]) unwritten += !std::isfinite(f);
    EXPECT_EQ(unwritten, 0) << "rank " << r << ": elements of y not written (still NaN)";
    std::vector<int64_t> tokens;
    if (T <= max_checked_tokens) {
      for (int64_t t = 0; t < T; ++t) tokens.push_back(t);
    } else {
      std::mt19937_64 rng(1234 + r);
      for (int64_t i = 0; i < max_checked_tokens; ++i) tokens.push_back(rng() % T);
    }
    std::vector<std::vector<float>> ref(tokens.size(), std::vector<float>(c.hidden));
    const unsigned workers = std::max(1u, std::thread::hardware_concurrency());
    std::vector<std::thread> pool;
    for (unsigned w = 0; w < workers; ++w)
      pool.emplace_back([&, w] {
        for (size_t i = w; i < tokens.size(); i += workers) {
          const int64_t t = tokens[i];
          if (fp8)
            reference::forward_token_fp8(c, *fp8, &in[r].x[t * c.hidden],
                                         &in[r].topk_idx[t * c.top_k],
                                         &in[r].topk_weights[t * c.top_k], ref[i].data());
          else
            reference::forward_token(c, experts, &in[r].x[t * c.hidden],
                                     &in[r].topk_idx[t * c.top_k],
                                     &in[r].topk_weights[t * c.top_k], ref[i].data());
        }
      });
    for (auto& t : pool) t.join();
    double err = 0, norm = 0;
    for (size_t i = 0; i < tokens.size(); ++i) {
      double row_err = 0, row_norm = 0;
      for (int64_t j = 0; j < c.hidden; ++j) {
        const double d = double(y[r][tokens[i] * c.hidden + j]) - ref[i][j];
        row_err += d * d;
        row_norm += double(ref[i][j]) * ref[i][j];
      }
      err += row_err;
      norm += row_norm;
      if (row_norm > 0) worst.worst_row = std::max(worst.worst_row, std::sqrt(row_err / row_norm));
    }
    if (norm > 0) {
      EXPECT_LE(std::sqrt(err / norm), tolerance)
          << "rank " << r << ": relative error over " << tokens.size() << " tokens";
      worst.relative = std::max(worst.relative, std::sqrt(err / norm));
    } else {
      EXPECT_EQ(err, 0.0) << "rank " << r << ": reference is zero, output is not";
    }
  }
  return worst;
}

// Synthetic inputs rounded to bf16, so the reference sees exactly what the GPU sees.
inline CallInputs make_call(const LayerConfig& c, const std::vector<int64_t>& tokens,
                            synthetic::Routing routing, uint64_t seed) {
  synthetic::InputSpec spec;
  spec.tokens_per_rank = tokens;
  spec.routing = routing;
  spec.seed = seed;
  auto in = synthetic::make_inputs(c, spec);
  for (auto& r : in) round_to_bf16(&r.x);
  return in;
}

inline std::vector<reference::RankExperts> make_bf16_experts(const LayerConfig& c, uint64_t seed) {
  auto ex = synthetic::make_experts(c, seed);
  for (auto& e : ex) {
    round_to_bf16(&e.gate);
    round_to_bf16(&e.up);
    round_to_bf16(&e.down);
  }
  return ex;
}

}  // namespace epflow::testing
