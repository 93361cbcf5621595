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
// stream; the hooks the benchmark times them with. The DeepSeek-V3 per-rank shape (H 7168, I 2048,
// 32 experts per rank, top-8) at T = 1, 129 and 4096, EP=1 and EP=2, checked on sampled tokens and
// weight-gradient elements against the CPU reference's per-token and per-element functions.
// Expert weights and gradients in Megatron-Core's layouts (fused gate|up, padded experts) read
// and written in place through the expert strides. The FP8 backward against the
// quantization-matched reference and the exact one. Outputs are poisoned first.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "common/megakernel_tasks.h"
#include "common/status_util.h"
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
  // An FP8 layer's weight gradients (set_wgrad_precision): FP8 whatever the row count (the small
  // shapes here would choose bf16), bf16, or as the layer chooses.
  WgradPrecision wgrad = WgradPrecision::kFp8;
  // Where the expert weights and the weight gradients lie (the strided layouts read and written
  // in place; whole gradients only).
  testing::ExpertLayout weights = testing::ExpertLayout::kPacked;
  testing::ExpertLayout grads = testing::ExpertLayout::kPacked;
};

// Every rank's gradients as floats, in reference::RankGrads' layout.
using RankGrads = std::vector<reference::RankGrads>;

using reference::WeightGradElement;
using reference::WeightGradMatrix;

// Elements of every rank's weight gradients ([rank][n]) that run_backward fetches instead of
// the whole gradients (at the DeepSeek-V3 shape they are 0.5 G elements per matrix), and their
// values.
struct SampledWeightGrads {
  std::vector<std::vector<WeightGradElement>> elements;
  std::vector<std::vector<float>> values;  // run_backward's output
};

// Where an element lies in its gradient buffer (RankGrads' layouts).
int64_t element_offset(const LayerConfig& c, const WeightGradElement& e) {
  const bool down = e.matrix == WeightGradMatrix::kDown;
  const int64_t rows = down ? c.hidden : c.intermediate;
  const int64_t cols = down ? c.intermediate : c.hidden;
  return (e.expert * rows + e.row) * cols + e.col;
}

// fn(0) .. fn(n - 1) spread over every core (the reference's spot checks and the weights'
// conversion at the DeepSeek-V3 shape).
void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) {
  const int64_t workers = std::min<int64_t>(n, std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int64_t w = 0; w < workers; ++w)
    pool.emplace_back([&, w] {
      for (int64_t i = w; i < n; i += workers) fn(i);
    });
  for (std::thread& t : pool) t.join();
}

// testing::to_bf16 on every core: a DeepSeek-V3 rank's weights are 1.4 G elements.
std::vector<__nv_bfloat16> to_bf16_on_every_core(const std::vector<float>& v) {
  std::vector<__nv_bfloat16> out(v.size());
  const int64_t size = static_cast<int64_t>(v.size()), chunk = int64_t{1} << 20;
  parallel_for((size + chunk - 1) / chunk, [&](int64_t c) {
    for (int64_t i = c * chunk; i < std::min(size, (c + 1) * chunk); ++i)
      out[i] = __float2bfloat16(v[i]);
  });
  return out;
}

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
  // Element `at` alone (sampled from a gradient too large to copy back whole).
  Status fetch_element(int64_t at, float* out) const {
    const char* from = static_cast<const char*>(ptr) + at * elem;
    if (elem == 4) {
      EPFLOW_TRY_CUDA(cudaMemcpy(out, from, 4, cudaMemcpyDeviceToHost));
    } else {
      __nv_bfloat16 b;
      EPFLOW_TRY_CUDA(cudaMemcpy(&b, from, 2, cudaMemcpyDeviceToHost));
      *out = __bfloat162float(b);
    }
    return Status::ok_status();
  }
  ~Poisoned() {
    if (ptr) cudaFree(ptr);
  }
};

// One forward + backward on poisoned outputs. Every rank's dx and d topk_weights come back
// whole; its weight gradients too, or with `sampled` only the elements it lists.
Status run_backward(const LayerConfig& base, const std::vector<reference::RankExperts>& experts,
                    const CallInputs& in, const std::vector<std::vector<float>>& dy,
                    const GradOptions& options, RankGrads* grads,
                    SampledWeightGrads* sampled = nullptr) {
  grads->assign(base.ep_size, {});
  if (sampled) sampled->values.assign(base.ep_size, {});
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
    if (c.dtype == DType::kFP8Blockwise)
      if (Status s = layer->set_wgrad_precision(options.wgrad); !s.ok()) return s;
    const int64_t H = c.hidden, I = c.intermediate, K = c.top_k, E = c.experts_per_rank();
    const int64_t T = in[rank].num_tokens;
    const testing::ExpertPlacement wp = testing::place_experts(options.weights, E, H, I);
    const testing::ExpertPlacement gp = testing::place_experts(options.grads, E, H, I);
    if (!gp.packed() && sampled)
      return Status(StatusCode::kInvalidArgument, "strided gradients: whole gradients only");
    const std::vector<__nv_bfloat16> bf16[3] = {to_bf16_on_every_core(experts[rank].gate),
                                                to_bf16_on_every_core(experts[rank].up),
                                                to_bf16_on_every_core(experts[rank].down)};
    const std::vector<__nv_bfloat16>* host_w[3] = {&bf16[0], &bf16[1], &bf16[2]};
    __nv_bfloat16* w[3];
    if (Status s = testing::upload_experts(wp, host_w, w); !s.ok()) return s;
    Poisoned x, y, idx, tw, d_y, dx, dtw, context;
    Poisoned dw[3];  // by slot of gp
    const size_t g = options.dtype == GradDType::kFP32 ? 4 : 2;
    // The contexts' memory, NaN-filled like the outputs: nothing may read what no forward wrote.
    if (Status s = context.create(layer->saved_context_bytes(), 1); !s.ok()) return s;
    for (auto [buf, n, bytes] : {std::tuple{&x, T * H, size_t{2}}, {&y, T * H, size_t{2}},
                                 {&idx, T * K, size_t{4}}, {&tw, T * K, size_t{4}},
                                 {&d_y, T * H, size_t{2}}, {&dx, T * H, size_t{2}},
                                 {&dtw, T * K, size_t{4}}})
      if (Status s = buf->create(n, bytes); !s.ok()) return s;
    std::vector<const Poisoned*> outputs = {&dx, &dtw};
    for (int s = 0; s < 3; ++s)
      if (gp.slot_elems[s] > 0) {
        if (Status st = dw[s].create(gp.slot_elems[s], g); !st.ok()) return st;
        outputs.push_back(&dw[s]);
      }
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
    f.weights = testing::placed_weights(wp, w);
    // FP8: the weights quantized on the device (with the transposed copies the backward reads).
    void* fp8_buffer = nullptr;
    if (c.dtype == DType::kFP8Blockwise) {
      const int64_t bytes = fp8_expert_weights_bytes(c);
      EPFLOW_TRY_CUDA(cudaMalloc(&fp8_buffer, bytes));
      if (Status s = quantize_expert_weights(c, f.weights, c.fp8_power_of_two_scales, fp8_buffer,
                                             bytes, &f.weights.fp8, nullptr);
          !s.ok())
        return s;
    }
    f.y = static_cast<__nv_bfloat16*>(y.ptr);
    // A context serves one backward: each backward below has a forward of its own.
    const auto forward = [&](SavedContext* saved, cudaStream_t stream) {
      *saved = SavedContext{};
      saved->buffer = context.ptr;
      saved->buffer_bytes = context.count;
      return layer->forward(f, stream, saved);
    };
    SavedContext saved;
    BackwardArgs b;
    b.dy = static_cast<__nv_bfloat16*>(d_y.ptr);
    b.dx = static_cast<__nv_bfloat16*>(dx.ptr);
    b.d_topk_weights = static_cast<float*>(dtw.ptr);
    void* grad_at[3];
    for (int i = 0; i < 3; ++i)
      grad_at[i] = static_cast<char*>(dw[gp.slot[i]].ptr) + gp.offset[i] * g;
    b.d_gate = grad_at[0];
    b.d_up = grad_at[1];
    b.d_down = grad_at[2];
    if (!gp.packed()) {
      b.d_gate_expert_stride = gp.stride[0];
      b.d_up_expert_stride = gp.stride[1];
      b.d_down_expert_stride = gp.stride[2];
    }
    b.grad_dtype = options.dtype;
    for (int call = 0; call < options.backward_calls; ++call) {
      // Accumulating: the first call writes (over the poison), later calls add.
      b.accumulate_weight_grads = call > 0;
      if (Status s = forward(&saved, nullptr); !s.ok()) return s;
      if (Status s = layer->backward(b, saved, nullptr); !s.ok()) return s;
    }
    const cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess)
      return layer->with_device_failure(Status(StatusCode::kCudaError, cudaGetErrorString(e)));
    // Into `host`, and the sampled elements (if any) into `values`.
    const auto fetch = [&](reference::RankGrads* host, std::vector<float>* values) -> Status {
      std::vector<std::pair<const Poisoned*, std::vector<float>*>> whole = {
          {&dx, &host->dx}, {&dtw, &host->d_topk_weights}};
      for (auto [buf, to] : whole)
        if (Status s = buf->fetch(to); !s.ok()) return s;
      if (sampled == nullptr) {
        // Each expert's matrix out of its buffer, densely packed; what lies between experts
        // (the padding of the strided layout) keeps its poison.
        std::vector<float>* to[3] = {&host->d_gate, &host->d_up, &host->d_down};
        std::vector<float> buffer[3];
        std::vector<bool> written[3];
        for (int s = 0; s < 3; ++s)
          if (gp.slot_elems[s] > 0) {
            if (Status st = dw[s].fetch(&buffer[s]); !st.ok()) return st;
            written[s].assign(buffer[s].size(), false);
          }
        for (int i = 0; i < 3; ++i) {
          const std::vector<float>& from = buffer[gp.slot[i]];
          to[i]->resize(E * gp.matrix[i]);
          for (int64_t e = 0; e < E; ++e)
            for (int64_t j = 0; j < gp.matrix[i]; ++j) {
              const int64_t at = gp.at(i, e) + j;
              (*to[i])[e * gp.matrix[i] + j] = from[at];
              written[gp.slot[i]][at] = true;
            }
        }
        for (int i = 0; i < 3; ++i)
          for (size_t at = 0; at < buffer[i].size(); ++at)
            if (!written[i][at] && !std::isnan(buffer[i][at]))
              return Status(StatusCode::kInternal, "a weight gradient was written between experts");
        return Status::ok_status();
      }
      const std::vector<WeightGradElement>& elements = sampled->elements[rank];
      values->resize(elements.size());
      for (size_t n = 0; n < elements.size(); ++n) {
        const Poisoned& buf = dw[static_cast<int>(elements[n].matrix)];
        if (Status s = buf.fetch_element(element_offset(c, elements[n]), &(*values)[n]); !s.ok())
          return s;
      }
      return Status::ok_status();
    };
    reference::RankGrads& out = (*grads)[rank];
    std::vector<float> values;
    if (Status s = fetch(&out, &values); !s.ok()) return s;
    if (options.check_repeatable || options.check_graph) {
      b.accumulate_weight_grads = false;
      if (options.check_graph) {
        // The first backward allocated the layer's buffers: the captured calls only enqueue.
        for (const Poisoned* buf : outputs)
          EPFLOW_TRY_CUDA(cudaMemset(buf->ptr, 0xFF, buf->count * buf->elem));
        cudaStream_t stream = nullptr;
        cudaGraph_t graph = nullptr;
        cudaGraphExec_t exec = nullptr;
        EPFLOW_TRY_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        EPFLOW_TRY_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        SavedContext again;
        Status s = forward(&again, stream);
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
        if (Status s = forward(&saved, nullptr); !s.ok()) return s;
        if (Status s = layer->backward(b, saved, nullptr); !s.ok()) return s;
        EPFLOW_TRY_CUDA(cudaDeviceSynchronize());
      }
      reference::RankGrads again;
      std::vector<float> again_values;
      if (Status s = fetch(&again, &again_values); !s.ok()) return s;
      for (auto [first, second] : {std::pair{&out.dx, &again.dx},
                                   {&out.d_topk_weights, &again.d_topk_weights},
                                   {&out.d_gate, &again.d_gate},
                                   {&out.d_up, &again.d_up},
                                   {&out.d_down, &again.d_down},
                                   {&values, &again_values}}) {
        // Compared as bits: NaN == NaN would fail as floats, and -0 == 0 would pass.
        if (first->size() != second->size() ||
            std::memcmp(first->data(), second->data(), first->size() * sizeof(float)) != 0)
          return Status(StatusCode::kInternal, options.check_graph
                                                   ? "the CUDA graph gave different outputs"
                                                   : "a repeated backward gave different outputs");
      }
    }
    if (sampled) sampled->values[rank] = std::move(values);
    layer.reset();
    if (fp8_buffer) cudaFree(fp8_buffer);
    for (__nv_bfloat16* p : w)
      if (p) cudaFree(p);
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

// Relative errors of FP8 gradients (LayerConfig::dtype = kFP8Blockwise). Against the
// quantization-matched reference (reference::backward_fp8: the same e4m3 operands), the
// differences are fp32 vs double accumulation, bf16 storage and the values a rounding flips by one
// e4m3 step (dg, du: quantized from bf16 values whose last bit can differ); against the exact
// bf16 reference, FP8's own error (the reference's CPU test measures 5-7% on synthetic inputs).
constexpr double kFp8VsMatched = 3e-2;
constexpr double kFp8VsExact = 0.12;

void run_and_check(const LayerConfig& c, const CallInputs& in, const GradOptions& options = {},
                   uint64_t seed = 9) {
  const auto experts = testing::make_bf16_experts(c, seed);
  const auto dy = make_dy(c, in, seed);
  const bool fp8 = c.dtype == DType::kFP8Blockwise;
  // The matched reference's weight gradients as the layer runs them (forced: each rank's own T
  // would decide kAuto).
  ASSERT_TRUE(!fp8 || options.wgrad != WgradPrecision::kAuto);
  RankGrads want, exact;
  const Status ref = fp8 ? reference::backward_fp8(c, in, experts, dy, c.fp8_power_of_two_scales,
                                                   &want, options.wgrad == WgradPrecision::kFp8)
                         : reference::backward(c, in, experts, dy, &want);
  ASSERT_TRUE(ref.ok()) << ref.to_string();
  if (fp8) ASSERT_TRUE(reference::backward(c, in, experts, dy, &exact).ok());
  RankGrads got;
  const Status s = run_backward(c, experts, in, dy, options, &got);
  ASSERT_TRUE(s.ok()) << s.to_string();
  // bf16 storage of dx rows, dg/du and the gradients themselves: a few 1e-3 in practice.
  const double tol = fp8 ? kFp8VsMatched : options.dtype == GradDType::kFP32 ? 2e-2 : 3e-2;
  const double weight_scale = options.backward_calls;
  for (int r = 0; r < c.ep_size; ++r) {
    SCOPED_TRACE(::testing::Message() << "rank " << r);
    expect_close(got[r].dx, want[r].dx, 1.0, tol, "dx");
    expect_close(got[r].d_topk_weights, want[r].d_topk_weights, 1.0, tol, "d topk_weights");
    expect_close(got[r].d_gate, want[r].d_gate, weight_scale, tol, "d W_gate");
    expect_close(got[r].d_up, want[r].d_up, weight_scale, tol, "d W_up");
    expect_close(got[r].d_down, want[r].d_down, weight_scale, tol, "d W_down");
    if (!fp8) continue;
    SCOPED_TRACE("against the exact bf16 reference");
    expect_close(got[r].dx, exact[r].dx, 1.0, kFp8VsExact, "dx");
    expect_close(got[r].d_topk_weights, exact[r].d_topk_weights, 1.0, kFp8VsExact,
                 "d topk_weights");
    expect_close(got[r].d_gate, exact[r].d_gate, weight_scale, kFp8VsExact, "d W_gate");
    expect_close(got[r].d_up, exact[r].d_up, weight_scale, kFp8VsExact, "d W_up");
    expect_close(got[r].d_down, exact[r].d_down, weight_scale, kFp8VsExact, "d W_down");
  }
}

// Every rank's gradients the same in both runs (as floats of the same bf16 / fp32 values).
void expect_bitwise_equal(const RankGrads& a, const RankGrads& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t r = 0; r < a.size(); ++r) {
    EXPECT_EQ(a[r].dx, b[r].dx) << "rank " << r << ": dx";
    EXPECT_EQ(a[r].d_topk_weights, b[r].d_topk_weights) << "rank " << r << ": d topk_weights";
    EXPECT_EQ(a[r].d_gate, b[r].d_gate) << "rank " << r << ": d W_gate";
    EXPECT_EQ(a[r].d_up, b[r].d_up) << "rank " << r << ": d W_up";
    EXPECT_EQ(a[r].d_down, b[r].d_down) << "rank " << r << ": d W_down";
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

// A forward ring of two 1-tile minibatches at EP=world.
LayerConfig small_ring_config(int world, int64_t max_tokens) {
  LayerConfig c = small_config(world, max_tokens);
  c.ring_rows = 256;
  c.minibatch_rows = 128;
  return c;
}

// Token counts per rank: these on EP=2, the last one on EP=1.
std::vector<int64_t> tokens_for(const LayerConfig& c, int64_t first, int64_t second) {
  return c.ep_size == 2 ? std::vector<int64_t>{first, second} : std::vector<int64_t>{second};
}

// The forward ring wraps many times and I = 320 ends in a partial gate/up tile (64 of 128
// columns): the g | u the megakernel keeps for the backward.
void ring_wrap_and_intermediate_tail(int world) {
  LayerConfig c = small_ring_config(world, 700);
  c.intermediate = 320;
  const std::vector<int64_t> tokens = tokens_for(c, 700, 333);
  run_and_check(c, testing::make_call(c, tokens, Routing::kImbalanced, 10));
  GradOptions one_comm_sm;  // every dy and x row pulled by one CTA (and the head by all)
  one_comm_sm.comm_sms = 1;
  run_and_check(c, testing::make_call(c, tokens, Routing::kWithEmptySlots, 14), one_comm_sm);
}

void unfused_backward_with_and_without_side_stream(int world) {
  LayerConfig c = small_ring_config(world, 700);
  c.intermediate = 320;
  const std::vector<int64_t> tokens = tokens_for(c, 500, 333);
  GradOptions unfused;
  unfused.unfused = true;
  run_and_check(c, testing::make_call(c, tokens, Routing::kImbalanced, 15), unfused);
  unfused.side_sms = 0;  // no side stream: x pull and dx push in order on the caller's stream
  run_and_check(c, testing::make_call(c, tokens, Routing::kUniform, 12), unfused);
}

void captured_in_cuda_graph(int world) {
  const LayerConfig c = small_ring_config(world, 400);
  const std::vector<int64_t> tokens = tokens_for(c, 400, 211);
  GradOptions graph;
  graph.check_graph = true;
  run_and_check(c, testing::make_call(c, tokens, Routing::kWithEmptySlots, 11), graph);
}

// Contexts that keep g | u for only the pull table's first tile (LayerConfig::
// saved_gate_up_rows): the backward recomputes the other rows' from their gathered x rows. A hot
// expert, every token on one expert, empty slots, token counts off the tile, I = 320 (a partial
// n tile of each matrix), and a captured graph; against the reference, and bitwise equal to
// the backward of contexts that keep every row (the recomputed values are the forward's).
void contexts_keeping_few_rows(int world) {
  LayerConfig all = small_ring_config(world, 500);
  all.intermediate = 320;
  all.saved_gate_up_rows = int64_t{1} << 40;  // the whole table
  LayerConfig few = all;
  few.saved_gate_up_rows = 100;  // rounded up to one tile
  const struct {
    std::vector<int64_t> tokens;
    Routing routing;
    uint64_t seed;
  } cases[] = {{tokens_for(all, 500, 333), Routing::kImbalanced, 20},
               {tokens_for(all, 129, 500), Routing::kSingleExpert, 21},
               {tokens_for(all, 77, 1), Routing::kWithEmptySlots, 22}};
  for (const auto& k : cases) {
    SCOPED_TRACE(::testing::Message() << "routing seed " << k.seed);
    const CallInputs in = testing::make_call(all, k.tokens, k.routing, k.seed);
    run_and_check(few, in);
    const auto experts = testing::make_bf16_experts(all, 9);
    const auto dy = make_dy(all, in, 9);
    RankGrads kept, recomputed;
    const Status a = run_backward(all, experts, in, dy, {}, &kept);
    ASSERT_TRUE(a.ok()) << a.to_string();
    const Status b = run_backward(few, experts, in, dy, {}, &recomputed);
    ASSERT_TRUE(b.ok()) << b.to_string();
    expect_bitwise_equal(kept, recomputed);
  }
  GradOptions graph;
  graph.check_graph = true;
  run_and_check(few, testing::make_call(few, tokens_for(few, 400, 211), Routing::kImbalanced, 23),
                graph);
}

// Megatron-Core's layouts read and written in place through the expert strides: weights and
// gradients in a fused gate|up [E, 2I, H] with a padded down, or in DDP's buffers with the experts
// in reverse order, and the two mixed (weights fused, gradients DDP's). Against the reference, and
// bitwise equal to the densely packed run (only addresses differ), what lies between the experts'
// gradients untouched. Contexts keep one tile's g | u (the backward recomputes the rest from the
// strided gate and up weights), I = 320 (partial tiles), gradients fp32 and bf16, written then
// accumulated.
void megatron_layouts_in_place(int world) {
  using testing::ExpertLayout;
  LayerConfig c = small_ring_config(world, 500);
  c.intermediate = 320;
  c.saved_gate_up_rows = 128;
  const CallInputs in =
      testing::make_call(c, tokens_for(c, 400, 257), Routing::kImbalanced, 24);
  const auto experts = testing::make_bf16_experts(c, 9);
  const auto dy = make_dy(c, in, 9);
  const std::pair<ExpertLayout, ExpertLayout> layouts[] = {
      {ExpertLayout::kFusedGateUp, ExpertLayout::kFusedGateUp},
      {ExpertLayout::kDdpReversed, ExpertLayout::kDdpReversed},
      {ExpertLayout::kFusedGateUp, ExpertLayout::kDdpReversed}};
  for (GradDType dtype : {GradDType::kFP32, GradDType::kBF16}) {
    SCOPED_TRACE(dtype == GradDType::kFP32 ? "fp32 gradients" : "bf16 gradients");
    const GradOptions dense{dtype, 2};
    RankGrads packed;
    const Status a = run_backward(c, experts, in, dy, dense, &packed);
    ASSERT_TRUE(a.ok()) << a.to_string();
    for (auto [weights, grads] : layouts) {
      SCOPED_TRACE(::testing::Message() << "weights layout " << static_cast<int>(weights)
                                        << ", gradients layout " << static_cast<int>(grads));
      GradOptions strided = dense;
      strided.weights = weights;
      strided.grads = grads;
      run_and_check(c, in, strided);
      RankGrads in_place;
      const Status b = run_backward(c, experts, in, dy, strided, &in_place);
      ASSERT_TRUE(b.ok()) << b.to_string();
      expect_bitwise_equal(packed, in_place);
    }
  }
}

EPFLOW_EP1_AND_EP2_TESTS(LayerBackwardGpu, ContextsKeepingFewRowsRecomputeTheRest,
                         contexts_keeping_few_rows)
EPFLOW_EP1_AND_EP2_TESTS(LayerBackwardGpu, MegatronLayoutsReadAndWrittenInPlace,
                         megatron_layouts_in_place)
EPFLOW_EP1_AND_EP2_TESTS(LayerBackwardGpu, RingWrapAndIntermediateTail,
                         ring_wrap_and_intermediate_tail)
EPFLOW_EP1_AND_EP2_TESTS(LayerBackwardGpu, UnfusedBackwardWithAndWithoutSideStream,
                         unfused_backward_with_and_without_side_stream)
EPFLOW_EP1_AND_EP2_TESTS(LayerBackwardGpu, CapturedInCudaGraph, captured_in_cuda_graph)

// --- FP8 (LayerConfig::dtype = kFP8Blockwise) ---------------------------------------------

// The small FP8 training layer of the tests below: H 256, I 384 (the last dhp tile's second
// 128-column block lies past I), 8 experts per rank, top-4, a ring that wraps.
LayerConfig fp8_small_config(int world) {
  LayerConfig c = small_ring_config(world, 600);
  c.hidden = 256;
  c.intermediate = 384;
  c.dtype = DType::kFP8Blockwise;
  return c;
}

// The FP8 backward (weight gradients in FP8 whatever the row count) against the
// quantization-matched reference (its weight gradients' operands quantized along the tokens too)
// and the exact one, on fp8_small_config; uniform,
// imbalanced, one-expert and empty-slot routings, token counts off the tile, T = 0 on a rank;
// power-of-two scales; bf16 gradients and accumulated fp32 ones; a forward ring that wraps with
// one communication SM; weights in Megatron-Core's fused layout and gradients in its reversed
// one; a repeated backward and a captured graph bitwise the same.
void fp8_backward(int world) {
  const LayerConfig c = fp8_small_config(world);
  run_and_check(c, testing::make_call(c, tokens_for(c, 300, 77), Routing::kUniform, 30));
  run_and_check(c, testing::make_call(c, tokens_for(c, 0, 513), Routing::kImbalanced, 31));
  run_and_check(c, testing::make_call(c, tokens_for(c, 600, 129), Routing::kSingleExpert, 32));
  GradOptions one_comm_sm;
  one_comm_sm.comm_sms = 1;
  run_and_check(c, testing::make_call(c, tokens_for(c, 129, 37), Routing::kWithEmptySlots, 33),
                one_comm_sm);
  GradOptions repeat;
  repeat.check_repeatable = true;
  run_and_check(c, testing::make_call(c, tokens_for(c, 200, 150), Routing::kImbalanced, 34),
                repeat);
  GradOptions graph;
  graph.check_graph = true;
  run_and_check(c, testing::make_call(c, tokens_for(c, 400, 211), Routing::kUniform, 35), graph);
  const CallInputs in = testing::make_call(c, tokens_for(c, 150, 250), Routing::kUniform, 36);
  run_and_check(c, in, GradOptions{GradDType::kBF16, 1});
  GradOptions strided{GradDType::kFP32, 2};
  strided.weights = testing::ExpertLayout::kFusedGateUp;
  strided.grads = testing::ExpertLayout::kDdpReversed;
  run_and_check(c, in, strided);
  LayerConfig pow2 = c;
  pow2.fp8_power_of_two_scales = true;
  run_and_check(pow2, testing::make_call(pow2, tokens_for(pow2, 333, 500), Routing::kImbalanced,
                                         37));
}

EPFLOW_EP1_AND_EP2_TESTS(LayerBackwardGpu, Fp8MatchesTheReferences, fp8_backward)

// The FP8 layer with its weight gradients in bf16 on the dequantized rows (what the bench compares
// the FP8 ones with): every gradient tightly against the matched reference, on the routings
// above, accumulated fp32 and bf16 gradients, Megatron-Core's layouts, a graph.
void fp8_bf16_weight_gradients(int world) {
  const LayerConfig c = fp8_small_config(world);
  GradOptions fp8;
  fp8.wgrad = WgradPrecision::kBf16;
  run_and_check(c, testing::make_call(c, tokens_for(c, 300, 77), Routing::kUniform, 40), fp8);
  run_and_check(c, testing::make_call(c, tokens_for(c, 0, 513), Routing::kImbalanced, 41), fp8);
  run_and_check(c, testing::make_call(c, tokens_for(c, 129, 37), Routing::kWithEmptySlots, 42),
                fp8);
  GradOptions accumulated = fp8;
  accumulated.backward_calls = 2;
  accumulated.weights = testing::ExpertLayout::kFusedGateUp;
  accumulated.grads = testing::ExpertLayout::kDdpReversed;
  run_and_check(c, testing::make_call(c, tokens_for(c, 150, 250), Routing::kUniform, 43),
                accumulated);
  GradOptions bf16 = fp8;
  bf16.dtype = GradDType::kBF16;
  bf16.check_graph = true;
  run_and_check(c, testing::make_call(c, tokens_for(c, 400, 211), Routing::kSingleExpert, 44),
                bf16);
}

EPFLOW_EP1_AND_EP2_TESTS(LayerBackwardGpu, Fp8WithBf16WeightGradientsMatchesTheReferences,
                         fp8_bf16_weight_gradients)

// --- the DeepSeek-V3 per-rank shape, checked on samples --------------------------------------

// H 7168, I 2048, 32 experts per rank, top-8, up to 4096 tokens per rank: the shape the backward
// is benchmarked at. Its weight gradients alone are 3 * 2 * 7168 * 2048 * 32K FLOPs at T = 4096
// (2.9 TFLOP), far too many for the whole CPU reference backward.
LayerConfig deepseek_v3_config(int world) {
  LayerConfig c = testing::shape_config(world, 7168, 2048, 32, 8, 4096);
  c.with_backward = true;
  return c;
}

// Routed rows of every global expert, over all ranks' tokens.
std::vector<int64_t> rows_per_expert(const LayerConfig& c, const CallInputs& in) {
  std::vector<int64_t> rows(c.num_experts, 0);
  for (const reference::RankInput& r : in)
    for (int32_t expert : r.topk_idx)
      if (expert >= 0) ++rows[expert];
  return rows;
}

// The local experts of `rank` whose weight gradients are sampled: the busiest, the one with the
// fewest rows but some, one without rows where there is one, and one more at random.
std::vector<int32_t> sampled_experts(const LayerConfig& c, const std::vector<int64_t>& rows,
                                     int rank, std::mt19937_64& rng) {
  const int32_t E = c.experts_per_rank();
  const auto rows_of = [&](int32_t local) { return rows[rank * E + local]; };
  int32_t busiest = 0, fewest = -1, empty = -1;
  for (int32_t e = 0; e < E; ++e) {
    if (rows_of(e) > rows_of(busiest)) busiest = e;
    if (rows_of(e) > 0 && (fewest < 0 || rows_of(e) < rows_of(fewest))) fewest = e;
    if (rows_of(e) == 0 && empty < 0) empty = e;
  }
  std::vector<int32_t> experts;
  for (int32_t e : {busiest, fewest, empty, static_cast<int32_t>(rng() % E)})
    if (e >= 0 && std::find(experts.begin(), experts.end(), e) == experts.end())
      experts.push_back(e);
  return experts;
}

// Per expert, 16 intermediate indices i at random, and per index 3 elements of each matrix at
// random h (dW_gate[e][i][h], dW_up[e][i][h], dW_down[e][h][i]); grouped by (expert, i), the
// unit of the reference's cost (3 * H MACs per routed row of the expert).
std::vector<std::vector<WeightGradElement>> sample_elements(const LayerConfig& c,
                                                            const std::vector<int32_t>& experts,
                                                            std::mt19937_64& rng) {
  std::vector<std::vector<WeightGradElement>> groups;
  for (int32_t e : experts) {
    for (int index = 0; index < 16; ++index) {
      const int64_t i = static_cast<int64_t>(rng() % c.intermediate);
      std::vector<WeightGradElement> group;
      for (int n = 0; n < 3; ++n) {
        group.push_back({WeightGradMatrix::kGate, e, i, static_cast<int64_t>(rng() % c.hidden)});
        group.push_back({WeightGradMatrix::kUp, e, i, static_cast<int64_t>(rng() % c.hidden)});
        group.push_back({WeightGradMatrix::kDown, e, static_cast<int64_t>(rng() % c.hidden), i});
      }
      groups.push_back(std::move(group));
    }
  }
  return groups;
}

// The tokens whose dx rows and d topk_weights are checked: every one of a small T, else the
// first, the last and 30 more at random.
std::vector<int64_t> sampled_tokens(int64_t T, std::mt19937_64& rng) {
  constexpr int64_t kTokens = 32;
  std::vector<int64_t> tokens;
  if (T <= kTokens) {
    for (int64_t t = 0; t < T; ++t) tokens.push_back(t);
    return tokens;
  }
  tokens = {0, T - 1};
  while (static_cast<int64_t>(tokens.size()) < kTokens) {
    const int64_t t = static_cast<int64_t>(rng() % T);
    if (std::find(tokens.begin(), tokens.end(), t) == tokens.end()) tokens.push_back(t);
  }
  return tokens;
}

// One forward + backward against the reference on samples, with a random dy: every element of
// dx and d topk_weights written (finite) and every empty slot's d topk_weights exactly 0; the
// dx rows and d topk_weights of the sampled tokens, and the sampled weight-gradient elements of
// each matrix, within run_and_check's tolerances as one relative error per rank; the experts
// without rows' elements exactly 0 (written as zeros). FP8 layers: dx and d topk_weights against
// the quantization-matched reference (backward_token_fp8), the FP8 weight gradients against the
// exact ones at FP8's tolerance.
void check_samples(const LayerConfig& c, const std::vector<reference::RankExperts>& experts,
                   const CallInputs& in, GradDType dtype, uint64_t seed, const char* what) {
  SCOPED_TRACE(what);
  const int64_t H = c.hidden, K = c.top_k;
  const auto dy = make_dy(c, in, seed);
  const std::vector<int64_t> rows = rows_per_expert(c, in);
  std::mt19937_64 rng(seed);
  std::vector<std::vector<std::vector<WeightGradElement>>> groups(c.ep_size);  // [rank][group]
  SampledWeightGrads sampled;
  sampled.elements.resize(c.ep_size);
  for (int r = 0; r < c.ep_size; ++r) {
    groups[r] = sample_elements(c, sampled_experts(c, rows, r, rng), rng);
    for (const auto& group : groups[r])
      sampled.elements[r].insert(sampled.elements[r].end(), group.begin(), group.end());
  }
  GradOptions options;
  options.dtype = dtype;
  options.wgrad = WgradPrecision::kAuto;  // FP8: bf16 weight gradients at few rows per expert
  RankGrads got;
  const Status s = run_backward(c, experts, in, dy, options, &got, &sampled);
  ASSERT_TRUE(s.ok()) << s.to_string();
  const bool fp8 = c.dtype == DType::kFP8Blockwise;
  const double tol = fp8                         ? kFp8VsMatched
                     : dtype == GradDType::kFP32 ? 2e-2
                                                 : 3e-2;  // run_and_check's
  const double weight_tol = fp8 ? kFp8VsExact : tol;
  const reference::Fp8Experts fp8_experts =
      fp8 ? reference::quantize_experts_fp8(c, experts, c.fp8_power_of_two_scales)
          : reference::Fp8Experts{};

  for (int r = 0; r < c.ep_size; ++r) {
    SCOPED_TRACE(::testing::Message() << "rank " << r);
    const reference::RankInput& rank_in = in[r];
    const int64_t T = rank_in.num_tokens;
    ASSERT_EQ(static_cast<int64_t>(got[r].dx.size()), T * H);
    ASSERT_EQ(static_cast<int64_t>(got[r].d_topk_weights.size()), T * K);
    int64_t not_finite = 0, nonzero_empty_slots = 0;
    for (float v : got[r].dx) not_finite += !std::isfinite(v);
    for (int64_t slot = 0; slot < T * K; ++slot) {
      not_finite += !std::isfinite(got[r].d_topk_weights[slot]);
      nonzero_empty_slots += rank_in.topk_idx[slot] == -1 && got[r].d_topk_weights[slot] != 0.0f;
    }
    EXPECT_EQ(not_finite, 0) << "elements of dx or d topk_weights not written (still NaN)";
    EXPECT_EQ(nonzero_empty_slots, 0) << "empty slots whose d topk_weights is not 0";

    const std::vector<int64_t> tokens = sampled_tokens(T, rng);
    const int64_t n = static_cast<int64_t>(tokens.size());
    std::vector<float> want_dx(n * H), want_dtw(n * K), got_dx(n * H), got_dtw(n * K);
    parallel_for(n, [&](int64_t i) {
      const int64_t t = tokens[i];
      if (fp8)
        reference::backward_token_fp8(c, fp8_experts, &rank_in.x[t * H], &rank_in.topk_idx[t * K],
                                      &rank_in.topk_weights[t * K], &dy[r][t * H],
                                      &want_dx[i * H], &want_dtw[i * K]);
      else
        reference::backward_token(c, experts, &rank_in.x[t * H], &rank_in.topk_idx[t * K],
                                  &rank_in.topk_weights[t * K], &dy[r][t * H], &want_dx[i * H],
                                  &want_dtw[i * K]);
      std::copy_n(&got[r].dx[t * H], H, &got_dx[i * H]);
      std::copy_n(&got[r].d_topk_weights[t * K], K, &got_dtw[i * K]);
    });
    const std::string of_tokens = " of " + std::to_string(n) + " sampled tokens";
    expect_close(got_dx, want_dx, 1.0, tol, "dx" + of_tokens);
    expect_close(got_dtw, want_dtw, 1.0, tol, "d topk_weights" + of_tokens);

    std::vector<std::vector<float>> want_groups(groups[r].size());
    std::vector<Status> statuses(groups[r].size());
    parallel_for(static_cast<int64_t>(groups[r].size()), [&](int64_t g) {
      statuses[g] =
          reference::weight_grad_elements(c, in, experts, dy, r, groups[r][g], &want_groups[g]);
    });
    for (const Status& status : statuses) ASSERT_TRUE(status.ok()) << status.to_string();
    std::vector<float> want;
    for (const auto& values : want_groups) want.insert(want.end(), values.begin(), values.end());
    const std::vector<WeightGradElement>& elements = sampled.elements[r];
    const std::vector<float>& values = sampled.values[r];
    ASSERT_EQ(values.size(), elements.size());
    ASSERT_EQ(want.size(), elements.size());
    int64_t nonzero_without_rows = 0;
    for (size_t i = 0; i < elements.size(); ++i)
      nonzero_without_rows +=
          rows[r * c.experts_per_rank() + elements[i].expert] == 0 && values[i] != 0.0f;
    EXPECT_EQ(nonzero_without_rows, 0) << "elements of experts without rows that are not 0";
    for (auto [matrix, name] : {std::pair{WeightGradMatrix::kGate, "d W_gate"},
                                {WeightGradMatrix::kUp, "d W_up"},
                                {WeightGradMatrix::kDown, "d W_down"}}) {
      std::vector<float> got_m, want_m;
      for (size_t i = 0; i < elements.size(); ++i) {
        if (elements[i].matrix != matrix) continue;
        got_m.push_back(values[i]);
        want_m.push_back(want[i]);
      }
      expect_close(got_m, want_m, 1.0, weight_tol,
                   std::string(name) + ": " + std::to_string(got_m.size()) + " sampled elements");
    }
  }
}

// Imbalanced routing (the busiest expert gets nearly every token) with local expert 3 of every
// rank emptied: an expert without rows at any T.
CallInputs imbalanced_without_expert_3(const LayerConfig& c, const std::vector<int64_t>& tokens,
                                       uint64_t seed) {
  CallInputs in = testing::make_call(c, tokens, Routing::kImbalanced, seed);
  for (reference::RankInput& r : in)
    for (int32_t& expert : r.topk_idx)
      if (expert >= 0 && expert % c.experts_per_rank() == 3) expert = -1;
  return in;
}

// The backward at the DeepSeek-V3 per-rank shape on `world` GPUs, checked on samples
// (check_samples), one set of experts for every case: T = 1 (most experts without rows), T = 129
// (a partial row tile) with empty slots, T = 4096 with uniform routing and bf16 weight
// gradients, and T = 4096 with imbalanced routing (the busiest expert gets nearly every token)
// and local expert 3 of every rank emptied (an expert without rows at T = 4096); fp32 weight
// gradients but where said.
void deepseek_v3(int world) {
  const LayerConfig c = deepseek_v3_config(world);
  const auto experts = testing::make_bf16_experts(c, 21);
  const std::vector<int64_t> tokens_1(world, 1), tokens_129(world, 129), tokens_4096(world, 4096);
  check_samples(c, experts, testing::make_call(c, tokens_1, Routing::kUniform, 31),
                GradDType::kFP32, 41, "T = 1, uniform routing");
  check_samples(c, experts, testing::make_call(c, tokens_129, Routing::kWithEmptySlots, 32),
                GradDType::kFP32, 42, "T = 129, empty slots");
  check_samples(c, experts, testing::make_call(c, tokens_4096, Routing::kUniform, 33),
                GradDType::kBF16, 43, "T = 4096, uniform routing, bf16 weight gradients");
  check_samples(c, experts, imbalanced_without_expert_3(c, tokens_4096, 34), GradDType::kFP32, 44,
                "T = 4096, imbalanced routing, local expert 3 of every rank emptied");
}

TEST(LayerBackwardGpu, DeepSeekV3ShapeEp1) {
  EPFLOW_SKIP_WITHOUT_GPUS(1);
  deepseek_v3(1);
}

TEST(LayerBackwardGpu, DeepSeekV3ShapeEp2) {
  EPFLOW_SKIP_WITHOUT_GPUS(2);
  deepseek_v3(2);
}

// The FP8 layer at the DeepSeek-V3 per-rank shape, weight gradients as it chooses: T = 129 with
// empty slots (bf16 ones: 32 rows per expert), and T = 4096 with imbalanced routing and local
// expert 3 of every rank emptied (FP8 ones; the busiest expert's K past 31 blocks); fp32 weight
// gradients.
void deepseek_v3_fp8(int world) {
  LayerConfig c = deepseek_v3_config(world);
  c.dtype = DType::kFP8Blockwise;
  const auto experts = testing::make_bf16_experts(c, 22);
  const std::vector<int64_t> tokens_129(world, 129), tokens_4096(world, 4096);
  check_samples(c, experts, testing::make_call(c, tokens_129, Routing::kWithEmptySlots, 35),
                GradDType::kFP32, 45, "FP8, T = 129, empty slots");
  check_samples(c, experts, imbalanced_without_expert_3(c, tokens_4096, 36), GradDType::kFP32, 46,
                "FP8, T = 4096, imbalanced routing, local expert 3 of every rank emptied");
}

TEST(LayerBackwardGpu, Fp8DeepSeekV3ShapeEp1) {
  EPFLOW_SKIP_WITHOUT_GPUS(1);
  deepseek_v3_fp8(1);
}

TEST(LayerBackwardGpu, Fp8DeepSeekV3ShapeEp2) {
  EPFLOW_SKIP_WITHOUT_GPUS(2);
  deepseek_v3_fp8(2);
}

// Contexts in flight: several layers (experts of their own, shapes their own) on one shared
// workspace and micro-batches, run in a schedule's order, a context per (layer, micro-batch)
// forward, each call on the step's stream (the workspace orders calls of different streams);
// every y, dx, d topk_weights and fp32 weight gradient against the reference of that layer and
// micro-batch alone. Inputs are independent per (layer, micro-batch): what is checked is that a
// backward reads its own forward's state, whatever ran in between. The workspace's memory is
// what its largest layer needs: a layer whose shape fits adds nothing.
enum class StepKind { kForward, kInference, kBackward };
struct Step {
  StepKind kind;
  int layer;
  int mb;
  int stream = 0;  // 0 or 1
};

void run_schedule(const std::vector<LayerConfig>& cs, const std::vector<std::vector<CallInputs>>& mbs,
                  const std::vector<Step>& steps) {
  const int layers = static_cast<int>(cs.size()), world = cs[0].ep_size;
  const int n_mb = static_cast<int>(mbs[0].size());
  std::vector<std::vector<reference::RankExperts>> experts;
  for (int l = 0; l < layers; ++l) experts.push_back(testing::make_bf16_experts(cs[l], 50 + l));
  std::vector<std::vector<std::vector<std::vector<float>>>> dy(layers);  // [l][m][rank]
  for (int l = 0; l < layers; ++l)
    for (int m = 0; m < n_mb; ++m) dy[l].push_back(make_dy(cs[l], mbs[l][m], 60 + 10 * l + m));
  // got[l][m][rank]
  std::vector<std::vector<RankGrads>> got(layers, std::vector<RankGrads>(n_mb, RankGrads(world)));
  std::vector<std::vector<std::vector<std::vector<float>>>> got_y(
      layers, std::vector<std::vector<std::vector<float>>>(
                  n_mb, std::vector<std::vector<float>>(world)));
  const Status s = run_on_local_gpus(world, [&](int rank, ncclComm_t comm) -> Status {
    struct PerLayer {
      std::unique_ptr<LayerCore> core;
      Poisoned w[3];
      Poisoned fp8;  // FP8 layers: the weights quantized (with the backward's transposed copies)
      Fp8ExpertWeights fp8_weights;
    };
    struct PerCall {
      Poisoned x, y, idx, tw, d_y, dx, dtw, dgate, dup, ddown, context;
      ForwardArgs f;
      BackwardArgs b;
      SavedContext saved;
    };
    std::vector<PerLayer> L(layers);
    std::vector<std::vector<PerCall>> calls(layers);
    std::shared_ptr<SharedWorkspace> shared;
    if (Status e = SharedWorkspace::create(comm, &shared); !e.ok()) return e;
    cudaStream_t streams[2] = {nullptr, nullptr};
    EPFLOW_TRY_CUDA(cudaStreamCreateWithFlags(&streams[1], cudaStreamNonBlocking));
    struct Destroy {
      cudaStream_t stream;
      ~Destroy() { cudaStreamDestroy(stream); }
    } destroy{streams[1]};
    int64_t T_max = 0, H_max = 0;
    for (int l = 0; l < layers; ++l) {
      const LayerConfig& c = cs[l];
      LayerConfig rc = c;
      rc.ep_rank = rank;
      const int64_t H = c.hidden, I = c.intermediate, K = c.top_k, E = c.experts_per_rank();
      const SharedWorkspace::Needs before = shared->capacity();
      if (Status e = LayerCore::create(rc, shared, &L[l].core); !e.ok()) return e;
      if (c.dtype == DType::kFP8Blockwise)  // FP8 weight gradients at these small shapes too
        if (Status e = L[l].core->set_wgrad_precision(WgradPrecision::kFp8); !e.ok()) return e;
      // The workspace holds, per purpose, the most any of its layers needs (the window rounded
      // up to NCCL's granularity): a layer whose needs fit adds nothing.
      const SharedWorkspace::Needs need = L[l].core->workspace().needs(), after = shared->capacity();
      if (after.ring != std::max(before.ring, need.ring) ||
          after.backward != std::max(before.backward, need.backward) ||
          after.schedule != std::max(before.schedule, need.schedule) ||
          (need.window <= before.window ? after.window != before.window
                                        : after.window < need.window) ||
          L[l].core->memory().total() - shared->memory().total() != 0)
        return error_status(StatusCode::kInternal, "layer ", l, " of rank ", rank,
                      ": the workspace does not hold the most its layers need");
      const std::vector<float>* host_w[3] = {&experts[l][rank].gate, &experts[l][rank].up,
                                             &experts[l][rank].down};
      for (int i = 0; i < 3; ++i) {
        const auto b = to_bf16_on_every_core(*host_w[i]);
        if (Status e = L[l].w[i].create(static_cast<int64_t>(b.size()), 2); !e.ok()) return e;
        EPFLOW_TRY_CUDA(cudaMemcpy(L[l].w[i].ptr, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
      }
      if (c.dtype == DType::kFP8Blockwise) {
        const int64_t bytes = fp8_expert_weights_bytes(c);
        if (Status e = L[l].fp8.create(bytes, 1); !e.ok()) return e;
        const ExpertWeights bf16{static_cast<__nv_bfloat16*>(L[l].w[0].ptr),
                                 static_cast<__nv_bfloat16*>(L[l].w[1].ptr),
                                 static_cast<__nv_bfloat16*>(L[l].w[2].ptr)};
        if (Status e = quantize_expert_weights(rc, bf16, c.fp8_power_of_two_scales, L[l].fp8.ptr,
                                               bytes, &L[l].fp8_weights, nullptr);
            !e.ok())
          return e;
      }
      calls[l] = std::vector<PerCall>(n_mb);
      for (int m = 0; m < n_mb; ++m) {
        PerCall& pc = calls[l][m];
        const reference::RankInput& in = mbs[l][m][rank];
        const int64_t T = in.num_tokens;
        T_max = std::max(T_max, T);
        H_max = std::max(H_max, H);
        for (auto [buf, n, bytes] :
             {std::tuple{&pc.x, T * H, size_t{2}}, {&pc.y, T * H, size_t{2}},
              {&pc.idx, T * K, size_t{4}}, {&pc.tw, T * K, size_t{4}}, {&pc.d_y, T * H, size_t{2}},
              {&pc.dx, T * H, size_t{2}}, {&pc.dtw, T * K, size_t{4}},
              {&pc.dgate, E * I * H, size_t{4}}, {&pc.dup, E * I * H, size_t{4}},
              {&pc.ddown, E * H * I, size_t{4}},
              {&pc.context, L[l].core->saved_context_bytes(), size_t{1}}})
          if (Status e = buf->create(n, bytes); !e.ok()) return e;
        const auto xb = testing::to_bf16(in.x), dyb = testing::to_bf16(dy[l][m][rank]);
        EPFLOW_TRY_CUDA(cudaMemcpy(pc.x.ptr, xb.data(), T * H * 2, cudaMemcpyHostToDevice));
        EPFLOW_TRY_CUDA(cudaMemcpy(pc.d_y.ptr, dyb.data(), T * H * 2, cudaMemcpyHostToDevice));
        EPFLOW_TRY_CUDA(
            cudaMemcpy(pc.idx.ptr, in.topk_idx.data(), T * K * 4, cudaMemcpyHostToDevice));
        EPFLOW_TRY_CUDA(
            cudaMemcpy(pc.tw.ptr, in.topk_weights.data(), T * K * 4, cudaMemcpyHostToDevice));
        pc.f.num_tokens = T;
        pc.f.x = static_cast<__nv_bfloat16*>(pc.x.ptr);
        pc.f.topk_idx = static_cast<int32_t*>(pc.idx.ptr);
        pc.f.topk_weights = static_cast<float*>(pc.tw.ptr);
        pc.f.weights = {static_cast<__nv_bfloat16*>(L[l].w[0].ptr),
                        static_cast<__nv_bfloat16*>(L[l].w[1].ptr),
                        static_cast<__nv_bfloat16*>(L[l].w[2].ptr)};
        pc.f.weights.fp8 = L[l].fp8_weights;
        pc.f.y = static_cast<__nv_bfloat16*>(pc.y.ptr);
        pc.b.dy = static_cast<__nv_bfloat16*>(pc.d_y.ptr);
        pc.b.dx = static_cast<__nv_bfloat16*>(pc.dx.ptr);
        pc.b.d_topk_weights = static_cast<float*>(pc.dtw.ptr);
        pc.b.d_gate = pc.dgate.ptr;
        pc.b.d_up = pc.dup.ptr;
        pc.b.d_down = pc.ddown.ptr;
        pc.b.grad_dtype = GradDType::kFP32;
        pc.saved.buffer = pc.context.ptr;
        pc.saved.buffer_bytes = pc.context.count;
      }
    }
    Poisoned scratch_y;  // an inference forward's output, not checked
    if (Status e = scratch_y.create(T_max * H_max, 2); !e.ok()) return e;
    for (const Step& step : steps) {
      PerCall& pc = calls[step.layer][step.mb];
      LayerCore& layer = *L[step.layer].core;
      cudaStream_t stream = streams[step.stream];
      Status e;
      if (step.kind == StepKind::kForward) {
        e = layer.forward(pc.f, stream, &pc.saved);
      } else if (step.kind == StepKind::kInference) {
        ForwardArgs f = pc.f;
        f.y = static_cast<__nv_bfloat16*>(scratch_y.ptr);
        e = layer.forward(f, stream, nullptr);
      } else {
        e = layer.backward(pc.b, pc.saved, stream);
      }
      if (!e.ok()) return e;
    }
    const cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess)
      return L[0].core->with_device_failure(
          Status(StatusCode::kCudaError, cudaGetErrorString(err)));
    for (int l = 0; l < layers; ++l)
      for (int m = 0; m < n_mb; ++m) {
        PerCall& pc = calls[l][m];
        reference::RankGrads& out = got[l][m][rank];
        for (auto [buf, to] : {std::pair{&pc.y, &got_y[l][m][rank]}, {&pc.dx, &out.dx},
                               {&pc.dtw, &out.d_topk_weights}, {&pc.dgate, &out.d_gate},
                               {&pc.dup, &out.d_up}, {&pc.ddown, &out.d_down}})
          if (Status e = buf->fetch(to); !e.ok()) return e;
      }
    return Status::ok_status();
  });
  ASSERT_TRUE(s.ok()) << s.to_string();
  for (int l = 0; l < layers; ++l)
    for (int m = 0; m < n_mb; ++m) {
      // FP8 layers (FP8 weight gradients) against the quantization-matched references, bf16
      // layers against the exact ones.
      const LayerConfig& c = cs[l];
      const bool fp8 = c.dtype == DType::kFP8Blockwise;
      std::vector<std::vector<float>> want_y;
      RankGrads want;
      ASSERT_TRUE((fp8 ? reference::forward_fp8(c, mbs[l][m], experts[l],
                                                c.fp8_power_of_two_scales, &want_y)
                       : reference::forward(c, mbs[l][m], experts[l], &want_y))
                      .ok());
      ASSERT_TRUE((fp8 ? reference::backward_fp8(c, mbs[l][m], experts[l], dy[l][m],
                                                 c.fp8_power_of_two_scales, &want, true)
                       : reference::backward(c, mbs[l][m], experts[l], dy[l][m], &want))
                      .ok());
      const double tol = fp8 ? kFp8VsMatched : 2e-2;
      for (int r = 0; r < world; ++r) {
        SCOPED_TRACE(::testing::Message() << "layer " << l << ", micro-batch " << m << ", rank "
                                          << r);
        expect_close(got_y[l][m][r], want_y[r], 1.0, tol, "y");
        expect_close(got[l][m][r].dx, want[r].dx, 1.0, tol, "dx");
        expect_close(got[l][m][r].d_topk_weights, want[r].d_topk_weights, 1.0, tol,
                     "d topk_weights");
        expect_close(got[l][m][r].d_gate, want[r].d_gate, 1.0, tol, "d W_gate");
        expect_close(got[l][m][r].d_up, want[r].d_up, 1.0, tol, "d W_up");
        expect_close(got[l][m][r].d_down, want[r].d_down, 1.0, tol, "d W_down");
      }
    }
}

// Forward through three layers, then their backwards in reverse (as a model runs them); and
// the 1F1B order over two layers and two micro-batches with an inference forward in between,
// some calls on a second stream. bf16 or FP8 layers.
void contexts_in_flight(int world, DType dtype = DType::kBF16) {
  LayerConfig c = small_ring_config(world, 400);
  c.dtype = dtype;
  const CallInputs a = testing::make_call(c, tokens_for(c, 300, 211), Routing::kImbalanced, 70);
  const CallInputs b = testing::make_call(c, tokens_for(c, 77, 400), Routing::kWithEmptySlots, 71);
  using K = StepKind;
  run_schedule({c, c, c}, {{a}, {a}, {a}},
               {{K::kForward, 0, 0}, {K::kForward, 1, 0}, {K::kForward, 2, 0},
                {K::kBackward, 2, 0}, {K::kBackward, 1, 0}, {K::kBackward, 0, 0}});
  run_schedule({c, c}, {{a, b}, {a, b}},
               {{K::kForward, 0, 0}, {K::kForward, 1, 0, 1}, {K::kForward, 0, 1},
                {K::kBackward, 1, 0, 1}, {K::kInference, 0, 0}, {K::kForward, 1, 1, 1},
                {K::kBackward, 0, 0}, {K::kBackward, 1, 1}, {K::kBackward, 0, 1, 1}});
}

TEST(LayerBackwardGpu, ContextsInFlightInAnyOrderEp1) {
  EPFLOW_SKIP_WITHOUT_GPUS(1);
  contexts_in_flight(1);
}

TEST(LayerBackwardGpu, ContextsInFlightInAnyOrderEp2) {
  EPFLOW_SKIP_WITHOUT_GPUS(2);
  contexts_in_flight(2);
}

TEST(LayerBackwardGpu, Fp8ContextsInFlightInAnyOrderEp1) {
  EPFLOW_SKIP_WITHOUT_GPUS(1);
  contexts_in_flight(1, DType::kFP8Blockwise);
}

TEST(LayerBackwardGpu, Fp8ContextsInFlightInAnyOrderEp2) {
  EPFLOW_SKIP_WITHOUT_GPUS(2);
  contexts_in_flight(2, DType::kFP8Blockwise);
}

// Layers of three shapes on one workspace, created small, large, small (the large one grows
// the memory; the later small one fits): forwards of all, backwards in reverse with an inference
// forward between, calls alternating between two streams. All bf16, or the large one FP8 (an
// FP8 layer beside bf16 ones on one workspace).
void shapes_share_one_workspace(int world, DType large_dtype = DType::kBF16) {
  const LayerConfig small = small_ring_config(world, 300);
  LayerConfig large = small_ring_config(world, 520);
  large.hidden = small.hidden + 128;
  large.intermediate = 320;
  large.top_k = small.top_k + 2;
  large.ring_rows = 512;
  large.dtype = large_dtype;
  if (large_dtype == DType::kFP8Blockwise) large.intermediate = 384;  // FP8: whole 128-blocks
  LayerConfig other = small;
  other.num_experts = small.num_experts / 2;
  const CallInputs s0 = testing::make_call(small, tokens_for(small, 300, 123), Routing::kImbalanced, 80);
  const CallInputs l0 = testing::make_call(large, tokens_for(large, 100, 520), Routing::kWithEmptySlots, 81);
  const CallInputs o0 = testing::make_call(other, tokens_for(other, 7, 250), Routing::kImbalanced, 82);
  using K = StepKind;
  run_schedule({small, large, other}, {{s0}, {l0}, {o0}},
               {{K::kForward, 0, 0}, {K::kForward, 1, 0, 1}, {K::kForward, 2, 0},
                {K::kBackward, 2, 0, 1}, {K::kInference, 0, 0}, {K::kBackward, 1, 0},
                {K::kBackward, 0, 0, 1}});
}

TEST(LayerBackwardGpu, ShapesShareOneWorkspaceEp1) {
  EPFLOW_SKIP_WITHOUT_GPUS(1);
  shapes_share_one_workspace(1);
}

TEST(LayerBackwardGpu, ShapesShareOneWorkspaceEp2) {
  EPFLOW_SKIP_WITHOUT_GPUS(2);
  shapes_share_one_workspace(2);
}

TEST(LayerBackwardGpu, Fp8AndBf16LayersShareOneWorkspaceEp1) {
  EPFLOW_SKIP_WITHOUT_GPUS(1);
  shapes_share_one_workspace(1, DType::kFP8Blockwise);
}

TEST(LayerBackwardGpu, Fp8AndBf16LayersShareOneWorkspaceEp2) {
  EPFLOW_SKIP_WITHOUT_GPUS(2);
  shapes_share_one_workspace(2, DType::kFP8Blockwise);
}

// One token routed to expert 0 on a small EP=1 layer, its forward and backward arguments over
// poisoned buffers (dy = x, dx = y).
struct OneTokenCall {
  Poisoned w, x, y, idx, tw, grads, dtw, context_buffer;
  ForwardArgs forward;
  BackwardArgs backward;
  // A context over this call's buffer, not yet filled.
  SavedContext context() const {
    SavedContext s;
    s.buffer = context_buffer.ptr;
    s.buffer_bytes = context_buffer.count;
    return s;
  }
  Status create(const LayerConfig& c, int64_t context_bytes) {
    const int64_t H = c.hidden, I = c.intermediate, E = c.experts_per_rank();
    for (auto [buf, n, bytes] :
         {std::tuple{&w, 3 * E * I * H, size_t{2}}, {&x, H, size_t{2}}, {&y, H, size_t{2}},
          {&idx, c.top_k, size_t{4}}, {&tw, c.top_k, size_t{4}}, {&grads, 3 * E * I * H, size_t{4}},
          {&dtw, c.top_k, size_t{4}}, {&context_buffer, context_bytes, size_t{1}}})
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

// Calls the layer must refuse before launching anything, each with kInvalidArgument unless
// said: a forward with a SavedContext but no buffer, or one too small; a forward of the unfused
// executor with a context (kNotImplemented: it keeps no g | u); a context used by a second
// backward; a context given to another layer's backward.
TEST(LayerBackwardGpu, RefusesContextsItCannotServe) {
  EPFLOW_SKIP_WITHOUT_GPUS(1);
  const LayerConfig c = small_config(1, 64);
  const Status s = run_on_local_gpus(1, [&](int rank, ncclComm_t comm) -> Status {
    std::unique_ptr<LayerCore> layer, other;
    if (Status e = LayerCore::create(c, comm, &layer); !e.ok()) return e;
    OneTokenCall call;
    if (Status e = call.create(c, layer->saved_context_bytes()); !e.ok()) return e;
    auto expect = [](const Status& got, StatusCode want, const char* what) {
      return got.code() == want ? Status::ok_status()
                                : Status(StatusCode::kInternal,
                                         std::string(what) + ": expected " + to_string(want) +
                                             ", got " + got.to_string());
    };
    SavedContext no_buffer;
    if (Status e = expect(layer->forward(call.forward, nullptr, &no_buffer),
                          StatusCode::kInvalidArgument, "a context without a buffer");
        !e.ok())
      return e;
    SavedContext small = call.context();
    small.buffer_bytes = layer->saved_context_bytes() - 1;
    if (Status e = expect(layer->forward(call.forward, nullptr, &small),
                          StatusCode::kInvalidArgument, "a context buffer too small");
        !e.ok())
      return e;
    SavedContext saved = call.context();
    if (Status e = layer->forward(call.forward, nullptr, &saved); !e.ok()) return e;
    if (Status e = layer->backward(call.backward, saved, nullptr); !e.ok()) return e;
    const SavedContext copy = saved;  // copies share the context's state
    if (Status e = expect(layer->backward(call.backward, copy, nullptr),
                          StatusCode::kInvalidArgument, "a context used twice");
        !e.ok())
      return e;
    ncclComm_t other_comm = nullptr;
    if (ncclCommSplit(comm, 0, rank, &other_comm, nullptr) != ncclSuccess)
      return Status(StatusCode::kNcclError, "ncclCommSplit");
    Status e = LayerCore::create(c, other_comm, &other);
    if (e.ok()) {
      SavedContext mine = call.context();
      e = layer->forward(call.forward, nullptr, &mine);
      if (e.ok())
        e = expect(other->backward(call.backward, mine, nullptr), StatusCode::kInvalidArgument,
                   "another layer's context");
    }
    if (e.ok()) {
      std::unique_ptr<bench::UnfusedForward> unfused;
      e = bench::UnfusedForward::create(layer->workspace(), &unfused);
      if (e.ok()) {
        layer->set_forward_executor(std::move(unfused));
        SavedContext again = call.context();
        e = expect(layer->forward(call.forward, nullptr, &again), StatusCode::kNotImplemented,
                   "the unfused forward with a context");
      }
    }
    if (cudaDeviceSynchronize() != cudaSuccess && e.ok())
      e = Status(StatusCode::kCudaError, "cudaDeviceSynchronize");
    other.reset();
    ncclCommDestroy(other_comm);
    return e;
  });
  EXPECT_TRUE(s.ok()) << s.to_string();
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
    if (Status e = call.create(c, layer->saved_context_bytes()); !e.ok()) return e;
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
    SavedContext saved = call.context();
    if (Status e = layer->forward(call.forward, nullptr, &saved, &hooks); !e.ok()) return e;
    if (Status e = expect("forward", hooks.boundaries, LayerCore::forward_stage_names().size());
        !e.ok())
      return e;
    EPFLOW_TRY_CUDA(cudaDeviceSynchronize());
    std::vector<kernels::MegakernelTraceRecord> records(hooks.bytes / sizeof(records[0]));
    EPFLOW_TRY_CUDA(cudaMemcpy(records.data(), hooks.trace, hooks.bytes, cudaMemcpyDeviceToHost));
    if (std::none_of(records.begin(), records.end(), [](const auto& r) { return r.task >= 0; }))
      return Status(StatusCode::kInternal, "the forward megakernel recorded no task");
    // Every GEMM task also has its consumers' times, in order.
    for (const auto& r : records) {
      if (r.task < 0 || r.kind == static_cast<int16_t>(mega::TaskKind::kDispatch)) continue;
      if (r.consumer_wait_ns == UINT64_MAX || r.consumer_end_ns == UINT64_MAX ||
          r.consumer_wait_ns > r.consumer_begin_ns || r.consumer_begin_ns > r.consumer_end_ns)
        return error_status(StatusCode::kInternal, "GEMM task ", r.task, " of CTA ", r.cta,
                            " has no ordered consumer times (wait ", r.consumer_wait_ns,
                            ", begin ", r.consumer_begin_ns, ", end ", r.consumer_end_ns, ")");
    }
    hooks.boundaries = 0;
    if (Status e = layer->backward(call.backward, saved, nullptr, &hooks); !e.ok()) return e;
    if (Status e = expect("backward", hooks.boundaries, layer->backward_stage_names().size());
        !e.ok())
      return e;
    std::unique_ptr<bench::UnfusedBackward> unfused;
    if (Status e = bench::UnfusedBackward::create(layer->workspace(), 0, &unfused); !e.ok())
      return e;
    layer->set_backward_executor(std::move(unfused));
    saved = call.context();  // a context serves one backward
    if (Status e = layer->forward(call.forward, nullptr, &saved); !e.ok()) return e;
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
