// epflow-bench: the main job. On GPUs it runs the EPFlow layer on every GPU present (EP = GPU
// count unless --ep says fewer), a thread per GPU, and prints the median time and TFLOP/s per GPU
// of the whole layer and of each stage, and the NVLink bytes and GB/s of dispatch and combine.
// After EPFlow, in the same process, on the same inputs (bench/bench_inputs.h, generated again
// into each system's own buffers), it times the baselines of --baselines and checks their output
// against EPFlow's on a few tokens. --check compares both with the CPU reference on a small shape,
// and EPFlow's backward too.
// Without a GPU it runs the CPU reference layer on a small preset, on the same inputs (--routing's
// kind too), and says so.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <numeric>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "baselines/nccl_cublas_moe.h"
#include "bench_check.h"
#include "bench_inputs.h"
#include "bench_options.h"
#include "epflow/communicator.h"
#include "epflow/epflow.h"
#include "host/layer_core.h"
#include "common/fp8_blocks.h"
#include "common/status_util.h"
#include "presets.h"
#include "rooflines.h"
#include "settle.h"
#include "epflow/reference.h"
#include "unfused/unfused_executors.h"

namespace {

using namespace epflow;

using bench::kNcclCublas;
using bench::kUnfused;
using bench::Options;
using bench::RoutingKind;
using bench::yardstick_mode;

constexpr const char* kSweep = "epflow-sweep";  // EPFlow with --comm-sms / --minibatch-rows
constexpr double kRelTol = 2e-2;  // relative-norm tolerance of every output check

// --- GPU layer benchmark ---------------------------------------------------------------------

constexpr int kStages = 4;
const char* const kStageNames[kStages] = {"metadata+schedule", "dispatch", "expert FFN",
                                          "combine+sum"};
static_assert(bench::NcclCublasMoe::kStages == kStages, "the baseline reports the same stages");
// The most stages a backward reports (LayerCore::backward_stage_names: the unfused executor's).
constexpr int kMaxBackwardStages = 7;

struct RankResult {
  runtime::LayerPlan plan;  // EPFlow's resolved knobs (SM split, minibatch, ring)
  double total_us = 0;
  double stage_us[kStages] = {};
  int64_t routed_slots = 0;     // this rank's (token, k) slots with an expert
  int64_t rows_received = 0;    // rows this rank's experts computed
  int64_t nvlink_rows_in = 0;   // rows pulled from other ranks (dispatch)
  int64_t nvlink_rows_out = 0;  // rows pushed to other ranks (combine), same count
  double interleaved_dense_tflops = 0;  // --yardstick interleaved: cuBLAS between the calls
  double backward_us = 0;               // --backward: EPFlow's backward alone (median)
  std::vector<std::string> backward_stage_names;  // its stages
  double backward_stage_us[kMaxBackwardStages] = {};
  double forward_saving_us = 0;  // --backward: the forward that keeps g | u for it (median)
  double train_step_us = 0;      // --backward: that forward and its backward, timed as one
  double train_step_forward_us = 0;  // ... of which the forward (an event between the two)
  double train_step_quantize_us = 0;  // ... and (FP8) the weights' re-quantization before it
  double unfused_backward_us = 0;  // --backward-unfused: the unfused backward, its stages
  std::vector<std::string> unfused_stage_names;
  double unfused_stage_us[kMaxBackwardStages] = {};
  std::vector<double> backward_side_us;  // --backward-side-sms: the unfused one, each count
  std::vector<double> backward_comm_us;  // --backward-comm-sms: the megakernel, each count
  // FP8 layer: whether its weight gradients were FP8 (the layer's choice at this T), and its
  // backward again with them in the other precision, and that stage: what the choice gains.
  bool fp8_wgrad = false;
  double other_wgrad_backward_us = 0;
  double other_wgrad_us = 0;
  MemoryReport memory;  // --backward: the layer's memory (created with_backward)
  int64_t saved_context_bytes = 0;  // --backward: one forward's context
  double quantize_weights_us = 0;   // FP8: quantize_expert_weights of this rank's experts
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::ok_status();
  return error_status(StatusCode::kCudaError, what, ": ", cudaGetErrorName(e), " (",
                      cudaGetErrorString(e), ")");
}

class Stream {
 public:
  Stream() = default;
  ~Stream() {
    if (s_) cudaStreamDestroy(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  Status create() { return cuda_status(cudaStreamCreate(&s_), "cudaStreamCreate"); }
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

// The key of rank `rank`'s dy (bench_inputs.h): the same for every system's backward and for
// --check's reference, and independent of x (with dy = x, a backward that mixed up its dy and x
// rows would still pass the check).
uint64_t dy_key(uint64_t seed, uint32_t rank) {
  return bench::stream_key(seed, bench::InputStream::kDy, rank);
}

// One system's copy of a rank's inputs (the same numbers for every system: bench_inputs.h) and
// its output y, freed together.
class RankData {
 public:
  RankData() = default;
  ~RankData() {
    for (void* p : buffers_) cudaFree(p);
  }
  RankData(const RankData&) = delete;
  RankData& operator=(const RankData&) = delete;

  Status create(const LayerConfig& c, const bench::Routing& routing, int64_t T, uint64_t seed,
                cudaStream_t stream) {
    const int64_t H = c.hidden, I = c.intermediate, E = c.experts_per_rank(), K = c.top_k;
    EPFLOW_RETURN_IF_ERROR(alloc(&gate_, E * I * H, "cudaMalloc (W_gate)"));
    EPFLOW_RETURN_IF_ERROR(alloc(&up_, E * I * H, "cudaMalloc (W_up)"));
    EPFLOW_RETURN_IF_ERROR(alloc(&down_, E * H * I, "cudaMalloc (W_down)"));
    EPFLOW_RETURN_IF_ERROR(alloc(&x_, T * H, "cudaMalloc (x)"));
    EPFLOW_RETURN_IF_ERROR(alloc(&y_, T * H, "cudaMalloc (y)"));
    EPFLOW_RETURN_IF_ERROR(alloc(&idx_, T * K, "cudaMalloc (topk_idx)"));
    EPFLOW_RETURN_IF_ERROR(alloc(&tw_, T * K, "cudaMalloc (topk_weights)"));
    const uint32_t rank = static_cast<uint32_t>(c.ep_rank);
    using bench::InputStream;
    struct Fill {
      __nv_bfloat16* dst;
      int64_t count;
      float scale;
      InputStream stream;
    };
    for (const Fill& f : {Fill{gate_, E * I * H, bench::fan_in_scale(H), InputStream::kGate},
                          Fill{up_, E * I * H, bench::fan_in_scale(H), InputStream::kUp},
                          Fill{down_, E * H * I, bench::fan_in_scale(I), InputStream::kDown},
                          Fill{x_, T * H, 1.0f, InputStream::kX}})
      EPFLOW_RETURN_IF_ERROR(
          cuda_status(bench::fill_uniform_bf16(f.dst, f.count, f.scale,
                                               bench::stream_key(seed, f.stream, rank), stream),
                      "fill_uniform_bf16"));
    // All-ones bytes are bf16 NaNs: a row of y the system never writes fails the checks.
    EPFLOW_RETURN_IF_ERROR(
        cuda_status(cudaMemsetAsync(y_, 0xFF, T * H * 2, stream), "cudaMemsetAsync (y)"));
    EPFLOW_RETURN_IF_ERROR(cuda_status(
        cudaMemcpyAsync(idx_, routing.topk_idx.data(), T * K * 4, cudaMemcpyHostToDevice, stream),
        "cudaMemcpyAsync (topk_idx)"));
    EPFLOW_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(tw_, routing.topk_weights.data(), T * K * 4,
                                                       cudaMemcpyHostToDevice, stream),
                                       "cudaMemcpyAsync (topk_weights)"));
    args_.num_tokens = T;
    args_.x = x_;
    args_.topk_idx = idx_;
    args_.topk_weights = tw_;
    args_.weights = {gate_, up_, down_};
    args_.y = y_;
    return cuda_status(cudaStreamSynchronize(stream), "generating the bench inputs");
  }
  const ForwardArgs& args() const { return args_; }

  // FP8 layers: the weights quantized by quantize_expert_weights into args().weights.fp8, run
  // warmup + iters times (what a training step re-runs after each optimizer step); the median
  // of the timed runs into *us.
  Status quantize_weights(const LayerConfig& c, int warmup, int iters, cudaStream_t stream,
                          double* us) {
    const int64_t bytes = fp8_expert_weights_bytes(c);
    EPFLOW_RETURN_IF_ERROR(alloc(&fp8_buffer_, bytes, "cudaMalloc (FP8 weights)"));
    fp8_bytes_ = bytes;
    std::vector<double> ms;
    cudaEvent_t start = nullptr, end = nullptr;
    EPFLOW_RETURN_IF_ERROR(cuda_status(cudaEventCreate(&start), "cudaEventCreate"));
    EPFLOW_RETURN_IF_ERROR(cuda_status(cudaEventCreate(&end), "cudaEventCreate"));
    Status s = Status::ok_status();
    for (int i = 0; i < warmup + iters && s.ok(); ++i) {
      s = cuda_status(cudaEventRecord(start, stream), "cudaEventRecord");
      if (s.ok()) s = requantize_weights(c, stream);
      if (s.ok()) s = cuda_status(cudaEventRecord(end, stream), "cudaEventRecord");
      if (s.ok()) s = cuda_status(cudaEventSynchronize(end), "quantize_expert_weights");
      float v = 0;
      if (s.ok()) s = cuda_status(cudaEventElapsedTime(&v, start, end), "cudaEventElapsedTime");
      if (i >= warmup) ms.push_back(v);
    }
    cudaEventDestroy(start);
    cudaEventDestroy(end);
    if (s.ok()) *us = median(ms) * 1e3;
    return s;
  }
  // quantize_expert_weights into the buffer quantize_weights made (the FP8 training step's
  // re-quantization after an optimizer step; stream-ordered, untimed here).
  Status requantize_weights(const LayerConfig& c, cudaStream_t stream) {
    return quantize_expert_weights(c, args_.weights, c.fp8_power_of_two_scales, fp8_buffer_,
                                   fp8_bytes_, &args_.weights.fp8, stream);
  }

  // The backward's outputs (dx, d topk_weights, weight gradients in `dtype`), dy =
  // bench_inputs.h's dy (the same every system's backward gets), and one SavedContext's buffer
  // of context_bytes (Layer::saved_context_bytes()), reused by each forward-backward pair.
  // accumulate: the weight gradients start at zero and every backward adds into them.
  Status create_grads(const LayerConfig& c, int64_t T, GradDType dtype, uint64_t seed,
                      int64_t context_bytes, cudaStream_t stream, bool accumulate = false) {
    const int64_t H = c.hidden, I = c.intermediate, E = c.experts_per_rank(), K = c.top_k;
    const int64_t grad_words = (dtype == GradDType::kFP32 ? 2 : 1) * E * I * H / 2;
    __nv_bfloat16* dx = nullptr;
    float* dtw = nullptr;
    float *dg = nullptr, *du = nullptr, *dd = nullptr;  // 4-byte words, whatever the dtype
    EPFLOW_RETURN_IF_ERROR(alloc(&dx, T * H, "cudaMalloc (dx)"));
    EPFLOW_RETURN_IF_ERROR(alloc(&dtw, T * K, "cudaMalloc (d topk_weights)"));
    EPFLOW_RETURN_IF_ERROR(alloc(&dg, grad_words, "cudaMalloc (d W_gate)"));
    EPFLOW_RETURN_IF_ERROR(alloc(&du, grad_words, "cudaMalloc (d W_up)"));
    EPFLOW_RETURN_IF_ERROR(alloc(&dd, grad_words, "cudaMalloc (d W_down)"));
    __nv_bfloat16* dy = nullptr;
    EPFLOW_RETURN_IF_ERROR(alloc(&dy, T * H, "cudaMalloc (dy)"));
    EPFLOW_RETURN_IF_ERROR(cuda_status(
        bench::fill_uniform_bf16(dy, T * H, 1.0f, dy_key(seed, static_cast<uint32_t>(c.ep_rank)),
                                 stream),
        "fill_uniform_bf16 (dy)"));
    grads_.dy = dy;
    grads_.dx = dx;
    grads_.d_topk_weights = dtw;
    grads_.d_gate = dg;
    grads_.d_up = du;
    grads_.d_down = dd;
    grads_.grad_dtype = dtype;
    grads_.accumulate_weight_grads = accumulate;
    if (accumulate)
      for (float* g : {dg, du, dd})
        EPFLOW_RETURN_IF_ERROR(cuda_status(cudaMemsetAsync(g, 0, grad_words * 4, stream),
                                           "cudaMemsetAsync (weight gradients)"));
    char* context = nullptr;  // cudaMalloc's 256-byte alignment is what SavedContext needs
    EPFLOW_RETURN_IF_ERROR(alloc(&context, context_bytes, "cudaMalloc (saved context)"));
    context_.buffer = context;
    context_.buffer_bytes = context_bytes;
    return Status::ok_status();
  }
  const BackwardArgs& grads() const { return grads_; }
  // A context with the buffer and nothing filled, for the next forward.
  SavedContext fresh_context() const { return context_; }

 private:
  template <typename T>
  Status alloc(T** p, int64_t count, const char* what) {
    void* raw = nullptr;
    EPFLOW_RETURN_IF_ERROR(
        cuda_status(cudaMalloc(&raw, std::max<size_t>(count * sizeof(T), 16)), what));
    buffers_.push_back(raw);
    *p = static_cast<T*>(raw);
    return Status::ok_status();
  }
  std::vector<void*> buffers_;
  __nv_bfloat16 *gate_ = nullptr, *up_ = nullptr, *down_ = nullptr, *x_ = nullptr, *y_ = nullptr;
  int32_t* idx_ = nullptr;
  float* tw_ = nullptr;
  ForwardArgs args_;
  uint8_t* fp8_buffer_ = nullptr;  // FP8: quantize_weights' (freed with the other buffers)
  int64_t fp8_bytes_ = 0;
  BackwardArgs grads_;
  SavedContext context_;
};

// n + 1 events per iteration (n <= kMax stages): its start, then the end of each stage.
template <int kMax>
class IterationEvents {
 public:
  IterationEvents() = default;
  ~IterationEvents() {
    for (cudaEvent_t e : ev_)
      if (e) cudaEventDestroy(e);
  }
  IterationEvents(const IterationEvents&) = delete;
  IterationEvents& operator=(const IterationEvents&) = delete;

  Status create(int iterations, int stages = kMax) {
    n_ = stages;
    ev_.assign(static_cast<size_t>(iterations) * (n_ + 1), nullptr);
    for (cudaEvent_t& e : ev_)
      EPFLOW_RETURN_IF_ERROR(cuda_status(cudaEventCreate(&e), "cudaEventCreate"));
    return Status::ok_status();
  }
  const cudaEvent_t* marks(int i) const { return ev_.data() + i * (n_ + 1); }

  // Median of the whole and of each stage over the iterations after `warmup` (all recorded).
  Status summarize(int warmup, double* total_us, double* stage_us) const {
    std::vector<double> total, stage[kMax];
    for (int i = warmup; i < static_cast<int>(ev_.size()) / (n_ + 1); ++i) {
      const cudaEvent_t* m = marks(i);
      float ms = 0;
      EPFLOW_RETURN_IF_ERROR(
          cuda_status(cudaEventElapsedTime(&ms, m[0], m[n_]), "cudaEventElapsedTime"));
      total.push_back(ms * 1e3);
      for (int s = 0; s < n_; ++s) {
        EPFLOW_RETURN_IF_ERROR(
            cuda_status(cudaEventElapsedTime(&ms, m[s], m[s + 1]), "cudaEventElapsedTime"));
        stage[s].push_back(ms * 1e3);
      }
    }
    *total_us = median(total);
    for (int s = 0; s < n_; ++s) stage_us[s] = median(stage[s]);
    return Status::ok_status();
  }

 private:
  int n_ = kMax;
  std::vector<cudaEvent_t> ev_;
};
using ForwardEvents = IterationEvents<kStages>;

// The benchmark's instrumentation of a pass (PassHooks): an event at every stage boundary, into
// the marks of the current iteration; with tracing on, the buffer the megakernel records its
// tasks in (the last launch's records stay there).
class BenchHooks final : public PassHooks {
 public:
  ~BenchHooks() override {
    if (trace_) cudaFree(trace_);
  }
  Status enable_trace(int32_t sm_count) {
    bytes_ = sizeof(kernels::MegakernelTraceRecord) * kernels::kTraceRecordsPerCta * sm_count;
    return cuda_status(cudaMalloc(&trace_, bytes_), "cudaMalloc (trace)");
  }
  // The stage events of the next pass: marks[0 .. stages].
  void set_marks(const cudaEvent_t* marks) {
    marks_ = marks;
    next_ = 0;
  }
  cudaError_t stage_boundary(cudaStream_t stream) override {
    return marks_ ? cudaEventRecord(marks_[next_++], stream) : cudaSuccess;
  }
  kernels::MegakernelTraceRecord* megakernel_trace(cudaStream_t stream) override {
    if (!trace_) return nullptr;
    // task -1: an unused record
    return cudaMemsetAsync(trace_, 0xff, bytes_, stream) == cudaSuccess ? trace_ : nullptr;
  }
  // The last launch's records (device sync).
  Status fetch_trace(std::vector<kernels::MegakernelTraceRecord>* out) const {
    out->clear();
    std::vector<kernels::MegakernelTraceRecord> all(bytes_ / sizeof(kernels::MegakernelTraceRecord));
    EPFLOW_RETURN_IF_ERROR(cuda_status(cudaDeviceSynchronize(), "trace sync"));
    EPFLOW_RETURN_IF_ERROR(cuda_status(
        cudaMemcpy(all.data(), trace_, bytes_, cudaMemcpyDeviceToHost), "cudaMemcpy (trace)"));
    for (const auto& r : all)
      if (r.task >= 0) out->push_back(r);
    return Status::ok_status();
  }

 private:
  const cudaEvent_t* marks_ = nullptr;
  int next_ = 0;
  kernels::MegakernelTraceRecord* trace_ = nullptr;
  size_t bytes_ = 0;
};

// The megakernel's tasks of its last launch (the forward's, or with `backward` the backward
// pass's: dispatch = its dy and x pulls, dhp and dx its GEMM tiles; comm_ctas: its
// communication partition), one CSV line each, times relative to the first.
Status write_trace(const BenchHooks& hooks, int32_t comm_ctas, int rank, const std::string& path,
                   bool backward = false) {
  std::vector<kernels::MegakernelTraceRecord> recs;
  EPFLOW_RETURN_IF_ERROR(hooks.fetch_trace(&recs));
  uint64_t t0 = UINT64_MAX;
  for (const auto& r : recs) t0 = std::min(t0, r.taken_ns);
  std::ofstream f(path);
  f << "rank,cta,partition,kind,task,taken_us,ready_us,done_us,consumer_wait_us,"
       "consumer_begin_us,consumer_end_us\n";
  static const char* const kKinds[2][3] = {{"dispatch", "gate_up", "down"},
                                           {"dispatch", "dhp", "dx"}};
  // The consumers' times: empty where not recorded (dispatch tasks).
  auto consumer_us = [t0](uint64_t ns) {
    return ns == UINT64_MAX ? std::string() : std::to_string((ns - t0) * 1e-3);
  };
  for (const auto& r : recs)
    f << rank << ',' << r.cta << ',' << (r.cta < comm_ctas ? "comm" : "compute") << ','
      << kKinds[backward][r.kind] << ',' << r.task << ',' << (r.taken_ns - t0) * 1e-3 << ','
      << (r.ready_ns - t0) * 1e-3 << ',' << (r.done_ns - t0) * 1e-3 << ','
      << consumer_us(r.consumer_wait_ns) << ',' << consumer_us(r.consumer_begin_ns) << ','
      << consumer_us(r.consumer_end_ns) << '\n';
  f.close();
  return f ? Status::ok_status()
           : error_status(StatusCode::kInternal, "writing the trace ", path, " failed");
}

// --backward: warmup + iters forward calls that save their context (median in
// out->forward_saving_us), then warmup + iters forward-backward pairs with an event at each stage
// boundary of the backward (a context serves one backward; medians in out->backward_us and
// out->backward_stage_us), then warmup + iters training steps, forward and backward timed as one
// (out->train_step_us); with knobs, the backward again at each count of the A/B flags
// (--backward-comm-sms, --backward-side-sms, --backward-unfused).
Status time_backward(LayerCore& layer, BenchHooks& hooks, RankData& data, const LayerConfig& c,
                     int64_t T, const Options& o, cudaStream_t stream, RankResult* out,
                     const std::string& trace_path, bool knobs) {
  EPFLOW_RETURN_IF_ERROR(data.create_grads(c, T,
                                            o.fp32_grads ? GradDType::kFP32 : GradDType::kBF16,
                                            o.seed, layer.saved_context_bytes(), stream,
                                            o.accumulate_grads));
  out->memory = layer.memory();
  out->saved_context_bytes = layer.saved_context_bytes();
  SavedContext saved = data.fresh_context();
  const int n = o.warmup + o.iters;
  IterationEvents<1> fwd;
  EPFLOW_RETURN_IF_ERROR(fwd.create(n));
  for (int i = 0; i < n; ++i) {
    saved = data.fresh_context();
    EPFLOW_RETURN_IF_ERROR(cuda_status(cudaEventRecord(fwd.marks(i)[0], stream), "cudaEventRecord"));
    EPFLOW_RETURN_IF_ERROR(layer.forward(data.args(), stream, &saved));
    EPFLOW_RETURN_IF_ERROR(cuda_status(cudaEventRecord(fwd.marks(i)[1], stream), "cudaEventRecord"));
  }
  double unused_stage = 0;
  EPFLOW_RETURN_IF_ERROR(
      layer.with_device_failure(cuda_status(cudaStreamSynchronize(stream), "EPFlow forward")));
  EPFLOW_RETURN_IF_ERROR(fwd.summarize(o.warmup, &out->forward_saving_us, &unused_stage));
  // warmup + iters backwards, each of a fresh forward's context (untimed), with its stage
  // events; the medians of the timed ones.
  auto run = [&](double* total_us, double* stage_us, std::vector<std::string>* names) {
    const std::vector<const char*> stages = layer.backward_stage_names();
    if (names) names->assign(stages.begin(), stages.end());
    IterationEvents<kMaxBackwardStages> ev;
    EPFLOW_RETURN_IF_ERROR(ev.create(n, static_cast<int>(stages.size())));
    for (int i = 0; i < n; ++i) {
      saved = data.fresh_context();
      EPFLOW_RETURN_IF_ERROR(layer.forward(data.args(), stream, &saved));
      hooks.set_marks(ev.marks(i));
      EPFLOW_RETURN_IF_ERROR(layer.backward(data.grads(), saved, stream, &hooks));
      hooks.set_marks(nullptr);
    }
    hooks.set_marks(nullptr);
    EPFLOW_RETURN_IF_ERROR(
        layer.with_device_failure(cuda_status(cudaStreamSynchronize(stream), "EPFlow backward")));
    return ev.summarize(o.warmup, total_us, stage_us);
  };
  EPFLOW_RETURN_IF_ERROR(run(&out->backward_us, out->backward_stage_us,
                             &out->backward_stage_names));
  // The training step as a training loop runs it: (FP8) the weights re-quantized from the
  // master weights an optimizer step updated, a forward that keeps what its backward reads, then
  // that backward, timed as one.
  IterationEvents<3> step;
  EPFLOW_RETURN_IF_ERROR(step.create(n));
  const bool fp8 = c.dtype == DType::kFP8Blockwise;
  for (int i = 0; i < n; ++i) {
    saved = data.fresh_context();
    const cudaEvent_t* m = step.marks(i);
    EPFLOW_RETURN_IF_ERROR(cuda_status(cudaEventRecord(m[0], stream), "cudaEventRecord"));
    if (fp8) EPFLOW_RETURN_IF_ERROR(data.requantize_weights(c, stream));
    EPFLOW_RETURN_IF_ERROR(cuda_status(cudaEventRecord(m[1], stream), "cudaEventRecord"));
    EPFLOW_RETURN_IF_ERROR(layer.forward(data.args(), stream, &saved));
    EPFLOW_RETURN_IF_ERROR(cuda_status(cudaEventRecord(m[2], stream), "cudaEventRecord"));
    EPFLOW_RETURN_IF_ERROR(layer.backward(data.grads(), saved, stream));
    EPFLOW_RETURN_IF_ERROR(cuda_status(cudaEventRecord(m[3], stream), "cudaEventRecord"));
  }
  EPFLOW_RETURN_IF_ERROR(
      layer.with_device_failure(cuda_status(cudaStreamSynchronize(stream), "EPFlow training step")));
  double step_parts[3] = {};
  EPFLOW_RETURN_IF_ERROR(step.summarize(o.warmup, &out->train_step_us, step_parts));
  out->train_step_quantize_us = step_parts[0];
  out->train_step_forward_us = step_parts[1];
  if (!trace_path.empty())
    EPFLOW_RETURN_IF_ERROR(write_trace(hooks, layer.workspace().plan.backward_comm_sms,
                                       c.ep_rank, trace_path, true));
  if (!knobs) return Status::ok_status();
  if (fp8) {  // the FP8 layer's backward again, weight gradients in the precision it did not choose
    double stages[kMaxBackwardStages];
    out->fp8_wgrad = runtime::fp8_weight_gradients_pay(c, T);
    EPFLOW_RETURN_IF_ERROR(layer.set_wgrad_precision(out->fp8_wgrad ? WgradPrecision::kBf16
                                                                    : WgradPrecision::kFp8));
    EPFLOW_RETURN_IF_ERROR(run(&out->other_wgrad_backward_us, stages, nullptr));
    EPFLOW_RETURN_IF_ERROR(layer.set_wgrad_precision(WgradPrecision::kAuto));
    const auto& names = out->backward_stage_names;
    const auto at = std::find(names.begin(), names.end(), std::string("weight gradients"));
    if (at == names.end())
      return error_status(StatusCode::kInternal, "the backward has no weight gradients stage");
    out->other_wgrad_us = stages[at - names.begin()];
  }
  // The backward again with each SM count of an A/B knob: set(count) installs the executor.
  auto ab = [&](const std::vector<int64_t>& counts, const std::function<Status(int32_t)>& set,
                std::vector<double>* times) -> Status {
    double total = 0, stages[kMaxBackwardStages];
    times->clear();
    for (int64_t count : counts) {
      EPFLOW_RETURN_IF_ERROR(set(static_cast<int32_t>(count)));
      EPFLOW_RETURN_IF_ERROR(run(&total, stages, nullptr));
      times->push_back(total);
    }
    return Status::ok_status();
  };
  EPFLOW_RETURN_IF_ERROR(ab(
      o.backward_comm_sms, [&](int32_t sms) { return layer.set_backward_comm_sms(sms); },
      &out->backward_comm_us));
  auto unfused = [&](int32_t side_sms) {
    std::unique_ptr<bench::UnfusedBackward> executor;
    EPFLOW_RETURN_IF_ERROR(bench::UnfusedBackward::create(layer.workspace(), side_sms, &executor));
    layer.set_backward_executor(std::move(executor));
    return Status::ok_status();
  };
  if (o.backward_unfused) {
    EPFLOW_RETURN_IF_ERROR(unfused(bench::default_backward_side_sms(c, layer.workspace().sm_count)));
    EPFLOW_RETURN_IF_ERROR(run(&out->unfused_backward_us, out->unfused_stage_us,
                               &out->unfused_stage_names));
  }
  EPFLOW_RETURN_IF_ERROR(ab(o.backward_side_sms, unfused, &out->backward_side_us));
  return Status::ok_status();
}

// The rows of `tokens` of y [T, H] as floats, token after token.
Status fetch_rows(const __nv_bfloat16* y, const std::vector<int64_t>& tokens, int64_t H,
                  cudaStream_t stream, std::vector<float>* out) {
  std::vector<uint16_t> raw(tokens.size() * H);
  for (size_t i = 0; i < tokens.size(); ++i)
    EPFLOW_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(raw.data() + i * H, y + tokens[i] * H, H * 2,
                                                       cudaMemcpyDeviceToHost, stream),
                                       "cudaMemcpyAsync (y rows to host)"));
  EPFLOW_RETURN_IF_ERROR(cuda_status(cudaStreamSynchronize(stream), "fetching y rows"));
  out->resize(raw.size());
  std::transform(raw.begin(), raw.end(), out->begin(),
                 [](uint16_t b) { return std::bit_cast<float>(uint32_t{b} << 16); });
  return Status::ok_status();
}

// --check: one forward that saves its context, then its backward with dy_key's dy and
// fp32 weight gradients written over poisoned outputs (all-ones bytes, NaN: an element never
// written fails the check); every output into `fused` as floats, in reference::RankGrads'
// layout. With `unfused`, a second forward and the unfused backward of its context, into it.
Status run_checked_backward(LayerCore& layer, RankData& data, const LayerConfig& c, int64_t T,
                            uint64_t seed, cudaStream_t stream, reference::RankGrads* fused,
                            reference::RankGrads* unfused) {
  EPFLOW_RETURN_IF_ERROR(
      data.create_grads(c, T, GradDType::kFP32, seed, layer.saved_context_bytes(), stream));
  const BackwardArgs& b = data.grads();
  const int64_t H = c.hidden, K = c.top_k;
  const int64_t weights = c.experts_per_rank() * c.intermediate * c.hidden;
  std::vector<int64_t> tokens(T);
  std::iota(tokens.begin(), tokens.end(), int64_t{0});
  auto run = [&](reference::RankGrads* out) -> Status {
    for (auto [ptr, bytes] : {std::pair<void*, int64_t>{b.dx, T * H * 2},
                              {b.d_topk_weights, T * K * 4},
                              {b.d_gate, weights * 4},
                              {b.d_up, weights * 4},
                              {b.d_down, weights * 4}})
      EPFLOW_RETURN_IF_ERROR(cuda_status(cudaMemsetAsync(ptr, 0xFF, bytes, stream),
                                         "cudaMemsetAsync (poisoned backward outputs)"));
    SavedContext saved = data.fresh_context();
    EPFLOW_RETURN_IF_ERROR(layer.forward(data.args(), stream, &saved));
    EPFLOW_RETURN_IF_ERROR(layer.backward(b, saved, stream));
    EPFLOW_RETURN_IF_ERROR(layer.with_device_failure(
        cuda_status(cudaStreamSynchronize(stream), "EPFlow backward (--check)")));
    EPFLOW_RETURN_IF_ERROR(fetch_rows(b.dx, tokens, H, stream, &out->dx));
    for (auto [from, to, count] : {std::tuple<const void*, std::vector<float>*, int64_t>{
                                       b.d_topk_weights, &out->d_topk_weights, T * K},
                                   {b.d_gate, &out->d_gate, weights},
                                   {b.d_up, &out->d_up, weights},
                                   {b.d_down, &out->d_down, weights}}) {
      to->resize(count);
      EPFLOW_RETURN_IF_ERROR(
          cuda_status(cudaMemcpy(to->data(), from, count * 4, cudaMemcpyDeviceToHost),
                      "cudaMemcpy (backward outputs to host)"));
    }
    return Status::ok_status();
  };
  EPFLOW_RETURN_IF_ERROR(run(fused));
  if (unfused == nullptr) return Status::ok_status();
  std::unique_ptr<bench::UnfusedBackward> executor;
  EPFLOW_RETURN_IF_ERROR(bench::UnfusedBackward::create(
      layer.workspace(), bench::default_backward_side_sms(c, layer.workspace().sm_count),
      &executor));
  layer.set_backward_executor(std::move(executor));
  return run(unfused);
}

// One way of running EPFlow: the megakernel with given knobs (0 = automatic) or the unfused chain.
struct Variant {
  const char* system;
  int32_t comm_sms = 0;
  int64_t minibatch_rows = 0;
  bool unfused = false;
  int64_t ring_rows = 0;
  DType dtype = DType::kBF16;
};

// Bytes of one dispatched x row on NVLink (the combine's rows are bf16 either way).
double dispatch_row_bytes(const LayerConfig& c, DType dtype) {
  return dtype == DType::kFP8Blockwise ? double(fp8::packed_row_bytes(c.hidden)) : 2.0 * c.hidden;
}

// Untimed calls of one system for o.settle_ms of GPU time (settle.h; none with --check, whose
// figures are not the point). The calls are collective, so every rank makes the count of the
// slowest rank's call time (a max over the communicator).
Status settle(const std::function<Status()>& call, const Options& o, ncclComm_t comm,
              cudaStream_t stream, const char* system) {
  if (o.settle_ms <= 0 || o.check) return Status::ok_status();
  Status s = Status::ok_status();
  const double ms = bench::one_call_ms([&] { return (s = call()).ok(); }, stream);
  EPFLOW_RETURN_IF_ERROR(s);
  if (ms < 0)
    return error_status(StatusCode::kCudaError, system, ": timing a settling call failed");
  float* slowest = nullptr;
  EPFLOW_RETURN_IF_ERROR(cuda_status(cudaMalloc(&slowest, sizeof(float)), "cudaMalloc"));
  float host = static_cast<float>(ms);
  s = cuda_status(cudaMemcpy(slowest, &host, sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
  if (s.ok() && ncclAllReduce(slowest, slowest, 1, ncclFloat, ncclMax, comm, stream) != ncclSuccess)
    s = error_status(StatusCode::kNcclError, system, ": ncclAllReduce of the settling time failed");
  if (s.ok())
    s = cuda_status(
        cudaMemcpyAsync(&host, slowest, sizeof(float), cudaMemcpyDeviceToHost, stream),
        "cudaMemcpyAsync");
  if (s.ok()) s = cuda_status(cudaStreamSynchronize(stream), "settling time");
  cudaFree(slowest);
  EPFLOW_RETURN_IF_ERROR(s);
  for (int64_t i = bench::settle_calls(o.settle_ms, host); i > 0; --i)
    EPFLOW_RETURN_IF_ERROR(call());
  return Status::ok_status();
}

// EPFlow on this rank: timing of the layer and its stages, and the rows of y of `checked`.
// trace_path: where to write the megakernel's per-task trace of the last call (empty: none).
// interleave_rows > 0: after each layer call, the dense cuBLAS yardstick over that many rows runs
// on the same stream, timed apart (its median lands in out->interleaved_dense_tflops).
// backward_grads (--check): then run_checked_backward into it (and into unfused_backward_grads).
// with_backward: time the backward too; backward_knobs: and its A/B flags' variants.
Status bench_epflow_rank(const LayerConfig& base, const Variant& v,
                         const std::vector<bench::Routing>& routing, int64_t T, const Options& o,
                         ncclComm_t comm, const std::vector<int64_t>& checked, RankResult* out,
                         std::vector<float>* y_rows, const std::string& trace_path = "",
                         int64_t interleave_rows = 0, bool with_backward = false,
                         bool backward_knobs = false,
                         reference::RankGrads* backward_grads = nullptr,
                         reference::RankGrads* unfused_backward_grads = nullptr) {
  LayerConfig c = base;
  c.comm_sms = v.comm_sms;
  c.minibatch_rows = v.minibatch_rows;
  c.ring_rows = v.ring_rows;
  c.dtype = v.dtype;
  c.with_backward = with_backward || backward_grads != nullptr;
  std::unique_ptr<LayerCore> layer;  // the public Layer's core, with hooks and executors
  EPFLOW_RETURN_IF_ERROR(LayerCore::create(c, comm, &layer));
  if (v.unfused) {
    std::unique_ptr<bench::UnfusedForward> unfused;
    EPFLOW_RETURN_IF_ERROR(bench::UnfusedForward::create(layer->workspace(), &unfused));
    layer->set_forward_executor(std::move(unfused));
  }
  BenchHooks hooks;
  if (!trace_path.empty())
    EPFLOW_RETURN_IF_ERROR(hooks.enable_trace(layer->workspace().sm_count));
  out->plan = layer->workspace().plan;
  Stream stream;
  EPFLOW_RETURN_IF_ERROR(stream.create());
  RankData data;
  EPFLOW_RETURN_IF_ERROR(data.create(c, routing[c.ep_rank], T, o.seed, stream.get()));
  const int n = o.warmup + o.iters;
  if (c.dtype == DType::kFP8Blockwise)
    EPFLOW_RETURN_IF_ERROR(data.quantize_weights(c, o.warmup, o.iters, stream.get(),
                                                 &out->quantize_weights_us));
  ForwardEvents ev;
  EPFLOW_RETURN_IF_ERROR(ev.create(n));
  std::unique_ptr<bench::DenseFfn> dense;
  ForwardEvents dense_ev;  // one interval per call: its first two marks
  if (interleave_rows > 0) {
    EPFLOW_RETURN_IF_ERROR(
        bench::DenseFfn::create(interleave_rows, c.hidden, c.intermediate, stream.get(), &dense));
    EPFLOW_RETURN_IF_ERROR(dense_ev.create(n));
  }
  EPFLOW_RETURN_IF_ERROR(settle([&] { return layer->forward(data.args(), stream.get(), nullptr); },
                                o, comm, stream.get(), v.system));
  for (int i = 0; i < n; ++i) {
    hooks.set_marks(ev.marks(i));
    EPFLOW_RETURN_IF_ERROR(layer->forward(data.args(), stream.get(), nullptr, &hooks));
    if (dense) {
      const cudaEvent_t* d = dense_ev.marks(i);
      EPFLOW_RETURN_IF_ERROR(cuda_status(cudaEventRecord(d[0], stream.get()), "cudaEventRecord"));
      EPFLOW_RETURN_IF_ERROR(dense->run());
      EPFLOW_RETURN_IF_ERROR(cuda_status(cudaEventRecord(d[1], stream.get()), "cudaEventRecord"));
    }
  }
  hooks.set_marks(nullptr);
  // A timed-out wait traps its kernel: say which.
  EPFLOW_RETURN_IF_ERROR(layer->with_device_failure(
      cuda_status(cudaStreamSynchronize(stream.get()), "EPFlow benchmark run")));
  EPFLOW_RETURN_IF_ERROR(ev.summarize(o.warmup, &out->total_us, out->stage_us));
  if (dense) {
    std::vector<double> ms;
    for (int i = o.warmup; i < n; ++i) {
      float v = 0;
      EPFLOW_RETURN_IF_ERROR(cuda_status(
          cudaEventElapsedTime(&v, dense_ev.marks(i)[0], dense_ev.marks(i)[1]),
          "cudaEventElapsedTime"));
      ms.push_back(v);
    }
    out->interleaved_dense_tflops = dense->tflops(median(ms));
  }
  if (!trace_path.empty())
    EPFLOW_RETURN_IF_ERROR(write_trace(hooks, out->plan.comm_sms, c.ep_rank, trace_path));
  if (with_backward)
    EPFLOW_RETURN_IF_ERROR(time_backward(
        *layer, hooks, data, c, T, o, stream.get(), out,
        trace_path.empty() ? "" : trace_path.substr(0, trace_path.size() - 4) + "-bwd.csv",
        backward_knobs));
  EPFLOW_RETURN_IF_ERROR(fetch_rows(data.args().y, checked, c.hidden, stream.get(), y_rows));
  if (backward_grads == nullptr) return Status::ok_status();
  return run_checked_backward(*layer, data, c, T, o.seed, stream.get(), backward_grads,
                              unfused_backward_grads);
}

// The NCCL + cuBLAS baseline on this rank, on its own copy of the same inputs.
Status bench_nccl_cublas_rank(const LayerConfig& c, const std::vector<bench::Routing>& routing,
                              int64_t T, const Options& o, ncclComm_t comm,
                              const std::vector<int64_t>& checked, RankResult* out,
                              std::vector<float>* y_rows) {
  Stream stream;
  EPFLOW_RETURN_IF_ERROR(stream.create());
  RankData data;
  EPFLOW_RETURN_IF_ERROR(data.create(c, routing[c.ep_rank], T, o.seed, stream.get()));
  std::unique_ptr<bench::NcclCublasMoe> moe;
  EPFLOW_RETURN_IF_ERROR(bench::NcclCublasMoe::create(c, comm, stream.get(), &moe));
  // Untimed: NCCL connects the peers, cuBLAS picks its kernels, the receive buffers grow.
  EPFLOW_RETURN_IF_ERROR(moe->forward(data.args(), nullptr));
  EPFLOW_RETURN_IF_ERROR(settle([&] { return moe->forward(data.args(), nullptr); }, o, comm,
                                stream.get(), kNcclCublas));
  const int n = o.warmup + o.iters;
  ForwardEvents ev;
  EPFLOW_RETURN_IF_ERROR(ev.create(n));
  for (int i = 0; i < n; ++i) EPFLOW_RETURN_IF_ERROR(moe->forward(data.args(), ev.marks(i)));
  EPFLOW_RETURN_IF_ERROR(
      cuda_status(cudaStreamSynchronize(stream.get()), "nccl-cublas benchmark run"));
  EPFLOW_RETURN_IF_ERROR(ev.summarize(o.warmup, &out->total_us, out->stage_us));
  return fetch_rows(data.args().y, checked, c.hidden, stream.get(), y_rows);
}

// Routed rows per rank and the share that crosses NVLink, counted from the routing itself.
void count_traffic(const LayerConfig& c, const std::vector<bench::Routing>& inputs,
                   std::vector<RankResult>* results) {
  const int32_t E = c.experts_per_rank();
  for (int32_t src = 0; src < c.ep_size; ++src)
    for (int32_t id : inputs[src].topk_idx) {
      if (id < 0) continue;
      const int32_t dst = id / E;
      (*results)[src].routed_slots++;
      (*results)[dst].rows_received++;
      if (dst != src) {
        (*results)[dst].nvlink_rows_in++;
        (*results)[dst].nvlink_rows_out++;
      }
    }
}

// How skewed a routing is: the shares of every rank's routed slots that go to the busiest expert
// and to the busiest rank (its experts together). Uniform routing gives about 1 / num_experts
// and 1 / ep.
struct RoutingSkew {
  double busiest_expert = 0;
  double busiest_rank = 0;
};

RoutingSkew routing_skew(const LayerConfig& c, const std::vector<bench::Routing>& routing) {
  std::vector<int64_t> per_expert(c.num_experts, 0), per_rank(c.ep_size, 0);
  int64_t routed = 0;
  for (const bench::Routing& r : routing)
    for (int32_t id : r.topk_idx) {
      if (id < 0) continue;
      ++per_expert[id];
      ++per_rank[id / c.experts_per_rank()];
      ++routed;
    }
  if (routed == 0) return {};
  return {double(*std::max_element(per_expert.begin(), per_expert.end())) / routed,
          double(*std::max_element(per_rank.begin(), per_rank.end())) / routed};
}

// Under a point's heading: how skewed its zipf routing is, next to what uniform routing gives.
void print_routing_skew(const LayerConfig& c, const std::vector<bench::Routing>& routing) {
  const RoutingSkew skew = routing_skew(c, routing);
  std::printf("  zipf routing: the busiest expert gets %.1f%% of the routed slots, the busiest "
              "rank %.1f%% (uniform: %.1f%%, %.1f%%)\n",
              100 * skew.busiest_expert, 100 * skew.busiest_rank, 100.0 / c.num_experts,
              100.0 / c.ep_size);
}

// --- output checks ---------------------------------------------------------------------------

// One system's output against a reference: the worst rank's relative error.
// An FP8 layer against a bf16 one or the exact reference: e4m3 keeps 3 mantissa bits, so x, the
// weights and h each round by up to 2^-4 (the CPU reference's own FP8 test bounds the layer at
// 8%). Against the quantization-matched reference the FP8 layer keeps kRelTol.
constexpr double kFp8VsBf16Tol = 8e-2;

struct Check {
  std::string against;  // "epflow" or "reference"; empty: not checked
  double rel_err = 0;
  double tolerance = kRelTol;
  bool ok() const { return rel_err <= tolerance; }  // false for NaN and inf too
  const char* verdict() const { return ok() ? "OK" : "MISMATCH"; }
};

Check compare(const std::vector<std::vector<float>>& y, const std::vector<std::vector<float>>& ref,
              const char* against, double tolerance = kRelTol) {
  Check c;
  c.against = against;
  c.tolerance = tolerance;
  for (size_t r = 0; r < y.size(); ++r) {
    const double e = bench::rel_err(y[r], ref[r]);
    c.rel_err = std::isnan(e) || e > c.rel_err ? e : c.rel_err;
  }
  return c;
}

// The tokens whose rows a normal run compares: the ends and the middle.
std::vector<int64_t> guard_tokens(int64_t T) {
  std::vector<int64_t> t;
  for (int64_t i : {int64_t{0}, int64_t{1}, T / 2, T - 1})
    if (i >= 0 && i < T && std::find(t.begin(), t.end(), i) == t.end()) t.push_back(i);
  return t;
}

// fp32 copies of exactly the bf16 values the GPUs got, bf16(unit_value(key, i) * scale) for
// i < count (the formulas of bench_inputs.h; __float2bfloat16 rounds to nearest even, as the
// fill kernel).
std::vector<float> bf16_values(int64_t count, float scale, uint64_t key) {
  std::vector<float> v(count);
  for (int64_t i = 0; i < count; ++i)
    v[i] = __bfloat162float(__float2bfloat16(bench::unit_value(key, i) * scale));
  return v;
}

// Every rank's inputs and experts exactly as the GPUs got them, for the CPU reference.
void reference_layer(const LayerConfig& c, const std::vector<bench::Routing>& routing, int64_t T,
                     uint64_t seed, std::vector<reference::RankInput>* inputs,
                     std::vector<reference::RankExperts>* experts) {
  const int64_t H = c.hidden, I = c.intermediate, E = c.experts_per_rank();
  using bench::InputStream;
  inputs->assign(c.ep_size, {});
  experts->assign(c.ep_size, {});
  for (int32_t r = 0; r < c.ep_size; ++r) {
    const uint32_t ur = static_cast<uint32_t>(r);
    reference::RankExperts& ex = (*experts)[r];
    ex.gate = bf16_values(E * I * H, bench::fan_in_scale(H),
                          bench::stream_key(seed, InputStream::kGate, ur));
    ex.up = bf16_values(E * I * H, bench::fan_in_scale(H),
                        bench::stream_key(seed, InputStream::kUp, ur));
    ex.down = bf16_values(E * H * I, bench::fan_in_scale(I),
                          bench::stream_key(seed, InputStream::kDown, ur));
    reference::RankInput& in = (*inputs)[r];
    in.num_tokens = T;
    in.x = bf16_values(T * H, 1.0f, bench::stream_key(seed, InputStream::kX, ur));
    in.topk_idx = routing[r].topk_idx;
    in.topk_weights = routing[r].topk_weights;
  }
}

// Every rank's y from the CPU reference.
std::vector<std::vector<float>> reference_y(const LayerConfig& c,
                                            const std::vector<reference::RankInput>& inputs,
                                            const std::vector<reference::RankExperts>& experts) {
  const int64_t H = c.hidden, K = c.top_k;
  std::vector<std::vector<float>> y(c.ep_size);
  for (int32_t r = 0; r < c.ep_size; ++r) {
    const reference::RankInput& in = inputs[r];
    y[r].resize(in.num_tokens * H);
    for (int64_t t = 0; t < in.num_tokens; ++t)
      reference::forward_token(c, experts, in.x.data() + t * H, in.topk_idx.data() + t * K,
                               in.topk_weights.data() + t * K, y[r].data() + t * H);
  }
  return y;
}

// --check: one line per output of a backward against the reference backward's, each the worst
// rank's relative error; true when every one is within kRelTol.
bool check_backward_outputs(const char* system, const std::vector<reference::RankGrads>& got,
                            const std::vector<reference::RankGrads>& want) {
  using Output = std::vector<float> reference::RankGrads::*;
  bool ok = true;
  for (auto [name, output] : {std::pair<const char*, Output>{"dx", &reference::RankGrads::dx},
                              {"d topk_weights", &reference::RankGrads::d_topk_weights},
                              {"d W_gate", &reference::RankGrads::d_gate},
                              {"d W_up", &reference::RankGrads::d_up},
                              {"d W_down", &reference::RankGrads::d_down}}) {
    std::vector<std::vector<float>> got_ranks, want_ranks;
    for (size_t r = 0; r < got.size(); ++r) {
      got_ranks.push_back(got[r].*output);
      want_ranks.push_back(want[r].*output);
    }
    const Check check = compare(got_ranks, want_ranks, "reference");
    std::printf("  %-26s %-15s %s (rel. err %.1e vs reference, every element of every rank)\n",
                system, name, check.verdict(), check.rel_err);
    ok = ok && check.ok();
  }
  return ok;
}

// --- results ---------------------------------------------------------------------------------

std::string device_name() {
  cudaDeviceProp prop;
  return cudaGetDeviceProperties(&prop, 0) == cudaSuccess ? prop.name : "unknown";
}

std::string json_num(double v) {
  if (!std::isfinite(v)) return "null";
  std::ostringstream os;
  os << v;
  return os.str();
}

// The rank with the largest `field` (a call takes its slowest rank's time); the layer's total by
// default.
const RankResult& slowest(const std::vector<RankResult>& results,
                          double RankResult::*field = &RankResult::total_us) {
  return *std::max_element(results.begin(), results.end(),
                           [field](const RankResult& a, const RankResult& b) {
                             return a.*field < b.*field;
                           });
}

// --repeats: per rank, the median over the repeats of the total and of each stage, each on its
// own (the other fields come from the routing and the plan: the same in every repeat).
std::vector<RankResult> median_over_repeats(const std::vector<std::vector<RankResult>>& reps) {
  std::vector<RankResult> out = reps.front();
  for (size_t r = 0; r < out.size(); ++r) {
    std::vector<double> v;
    for (auto field : {&RankResult::total_us, &RankResult::backward_us,
                       &RankResult::forward_saving_us, &RankResult::train_step_us,
                       &RankResult::train_step_forward_us, &RankResult::train_step_quantize_us,
                       &RankResult::unfused_backward_us, &RankResult::quantize_weights_us,
                       &RankResult::other_wgrad_backward_us, &RankResult::other_wgrad_us}) {
      v.clear();
      for (const auto& rep : reps) v.push_back(rep[r].*field);
      out[r].*field = median(v);
    }
    for (auto list : {&RankResult::backward_side_us, &RankResult::backward_comm_us})
      for (size_t i = 0; i < (out[r].*list).size(); ++i) {
        v.clear();
        for (const auto& rep : reps) v.push_back((rep[r].*list)[i]);
        (out[r].*list)[i] = median(v);
      }
    for (auto stages : {&RankResult::backward_stage_us, &RankResult::unfused_stage_us})
      for (int st = 0; st < kMaxBackwardStages; ++st) {
        v.clear();
        for (const auto& rep : reps) v.push_back((rep[r].*stages)[st]);
        (out[r].*stages)[st] = median(v);
      }
    for (int st = 0; st < kStages; ++st) {
      v.clear();
      for (const auto& rep : reps) v.push_back(rep[r].stage_us[st]);
      out[r].stage_us[st] = median(v);
    }
  }
  return out;
}

// The slowest rank's layer time in each repeat.
// Per repeat, the slowest rank's value of `field` (a layer call takes its slowest rank's time).
std::vector<double> per_repeat(const std::vector<std::vector<RankResult>>& reps,
                               double RankResult::*field) {
  std::vector<double> out;
  for (const auto& rep : reps) out.push_back(slowest(rep, field).*field);
  return out;
}

std::vector<double> layer_us_per_repeat(const std::vector<std::vector<RankResult>>& reps) {
  return per_repeat(reps, &RankResult::total_us);
}

std::string join_numbers(const std::vector<double>& v, const char* sep, int precision) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(precision);
  for (size_t i = 0; i < v.size(); ++i) os << (i ? sep : "") << v[i];
  return os.str();
}

// One system's run object: time and rate of the layer and its stages (the slowest rank's), every
// rank's layer and stage times and computed rows (where the slowest rank's time goes: its own
// work, or waiting for another rank), the NVLink traffic (a property of the routing, the same for
// every system), the check if one ran.
// Bytes of this rank's expert weights (gate, up, down; bf16): what a decode-size call streams.
double weight_bytes(const LayerConfig& c) {
  return 3.0 * c.experts_per_rank() * c.hidden * c.intermediate * 2;
}

// The same-run yardsticks: their mean over the GPUs (the layer's rate is per GPU), each GPU's
// cuBLAS rate, and how they were measured (interleaved: also the dense rate measured at once
// after the systems, for comparison).
struct Yardsticks {
  bench::Rooflines mean;
  std::vector<double> dense_tflops_per_gpu;
  const char* mode = "at-once";
  double dense_after_tflops = 0;
  std::vector<double> dense_tflops_per_repeat;  // --repeats: the GPUs' mean in each repeat
};

// repeat_us (--repeats): the slowest rank's layer time in each repeat.
std::string run_json(const char* system, const bench::Preset& p, int64_t T, RoutingKind routing,
                     const LayerConfig& c, const std::vector<RankResult>& ranks, const Check& check,
                     const Variant* variant, const std::vector<double>& repeat_us,
                     const Yardsticks* yard = nullptr) {
  const RankResult& slow = slowest(ranks);
  const double flops = bench::forward_flops(c, slow.routed_slots);
  const double ffn_flops = bench::forward_flops(c, slow.rows_received);
  const double row_bytes = dispatch_row_bytes(c, variant ? variant->dtype : DType::kBF16);
  std::ostringstream js;
  js << "{\"system\": \"" << system << "\", \"direction\": \"fwd\", \"preset\": \"" << p.name
     << "\", \"tokens\": " << T << ", \"routing\": \"" << bench::routing_name(routing)
     << "\", \"layer_us\": " << json_num(slow.total_us)
     << ", \"layer_tflops_per_gpu\": " << json_num(flops / slow.total_us * 1e-6);
  for (int st = 0; st < kStages; ++st)
    js << ", \"stage_us_" << st << "\": " << json_num(slow.stage_us[st]);
  js << ", \"rank_layer_us\": [";
  for (size_t r = 0; r < ranks.size(); ++r) js << (r ? ", " : "") << json_num(ranks[r].total_us);
  js << "], \"rank_stage_us\": [";
  for (size_t r = 0; r < ranks.size(); ++r) {
    js << (r ? ", [" : "[");
    for (int st = 0; st < kStages; ++st) js << (st ? ", " : "") << json_num(ranks[r].stage_us[st]);
    js << "]";
  }
  js << "], \"rank_rows_received\": [";
  for (size_t r = 0; r < ranks.size(); ++r) js << (r ? ", " : "") << ranks[r].rows_received;
  js << "]";
  if (repeat_us.size() > 1)
    js << ", \"repeat_layer_us\": [" << join_numbers(repeat_us, ", ", 2) << "]";
  // json_num: a stage of 0 us (no rows received) gives inf, which is not JSON.
  js << ", \"ffn_tflops_per_gpu\": " << json_num(ffn_flops / slow.stage_us[2] * 1e-6)
     << ", \"dispatch_nvlink_bytes\": " << json_num(slow.nvlink_rows_in * row_bytes)
     << ", \"combine_nvlink_bytes\": " << json_num(slow.nvlink_rows_out * 2.0 * c.hidden);
  if (variant) {
    const bool fp8 = variant->dtype == DType::kFP8Blockwise;
    js << ", \"dtype\": \"" << (fp8 ? "fp8" : "bf16") << "\"";
    if (fp8) js << ", \"quantize_weights_us\": " << json_num(slow.quantize_weights_us);
    js << ", \"fused\": " << (variant->unfused ? "false" : "true");
    if (!variant->unfused)
      js << ", \"comm_sms\": " << slow.plan.comm_sms
         << ", \"minibatch_rows\": " << slow.plan.minibatch_rows
         << ", \"ring_rows\": " << slow.plan.ring_rows
         << ", \"ring_bytes\": " << slow.plan.ring_bytes;
  }
  if (yard) {
    const bench::Rooflines* roof = &yard->mean;
    const double stream_us = weight_bytes(c) / (roof->hbm_copy_gbs * 1e3);
    js << ", \"yardstick\": \"" << yard->mode << "\", \"cublas_dense_tflops_per_gpu\": [";
    for (size_t g = 0; g < yard->dense_tflops_per_gpu.size(); ++g)
      js << (g ? ", " : "") << json_num(yard->dense_tflops_per_gpu[g]);
    js << "], \"cublas_dense_tflops\": " << json_num(roof->dense_tflops)
       << ", \"layer_vs_cublas_dense\": "
       << json_num(flops / slow.total_us * 1e-6 / roof->dense_tflops);
    if (yard->dense_after_tflops > 0)
      js << ", \"cublas_dense_tflops_after\": " << json_num(yard->dense_after_tflops);
    if (yard->dense_tflops_per_repeat.size() > 1)
      js << ", \"repeat_cublas_dense_tflops\": ["
         << join_numbers(yard->dense_tflops_per_repeat, ", ", 2) << "]";
    js
       << ", \"hbm_copy_gbs\": " << json_num(roof->hbm_copy_gbs)
       << ", \"weight_stream_us\": " << json_num(stream_us)
       << ", \"layer_vs_weight_stream\": " << json_num(slow.total_us / stream_us);
    if (variant && variant->dtype == DType::kFP8Blockwise) {
      const double fp8_stream_us = fp8_expert_weights_bytes(c) / (roof->hbm_copy_gbs * 1e3);
      js << ", \"fp8_weight_stream_us\": " << json_num(fp8_stream_us)
         << ", \"layer_vs_fp8_weight_stream\": " << json_num(slow.total_us / fp8_stream_us);
    }
  }
  if (!check.against.empty())
    js << ", \"check\": \"" << check.verdict() << "\", \"check_against\": \"" << check.against
       << "\", \"check_rel_err\": " << json_num(check.rel_err);
  js << "}";
  return js.str();
}

// EPFlow's fused forward, per stage. Its events: start, schedule done, megakernel start (right
// after), megakernel end, end; so stage 1 is empty and stage 2 is the megakernel (dispatch,
// expert FFN and combine, overlapped). Under its heading, how skewed a zipf routing is.
void print_epflow(const bench::Preset& p, int64_t T, const LayerConfig& c, RoutingKind kind,
                  const std::vector<bench::Routing>& routing,
                  const std::vector<RankResult>& ranks, DType dtype) {
  const RankResult& slow = slowest(ranks);
  const double flops = bench::forward_flops(c, slow.routed_slots);
  const double ffn_flops = bench::forward_flops(c, slow.rows_received);
  const double nvlink_bytes =
      slow.nvlink_rows_in * dispatch_row_bytes(c, dtype) + slow.nvlink_rows_out * 2.0 * c.hidden;
  std::printf("\n%s (H %lld, I %lld, %d experts/rank, top-%d), %lld tokens/rank, %s routing; "
              "%s megakernel: %d comm + %d compute SMs, minibatch %lld rows, ring %lld rows "
              "(%.0f MB)\n",
              p.name.c_str(), (long long)c.hidden, (long long)c.intermediate, c.experts_per_rank(),
              c.top_k, (long long)T, bench::routing_name(kind),
              dtype == DType::kFP8Blockwise ? "fp8" : "bf16", slow.plan.comm_sms,
              slow.plan.compute_sms, (long long)slow.plan.minibatch_rows,
              (long long)slow.plan.ring_rows, slow.plan.ring_bytes * 1e-6);
  if (kind == RoutingKind::kZipf) print_routing_skew(c, routing);
  std::printf("  %-26s %10s %12s %14s %10s\n", "stage", "us", "TFLOP/s/GPU", "NVLink MB", "GB/s");
  std::printf("  %-26s %10.1f %12.1f\n", "layer", slow.total_us, flops / slow.total_us * 1e-6);
  std::printf("  %-26s %10.1f\n", "metadata+schedule", slow.stage_us[0]);
  const double mk = slow.stage_us[1] + slow.stage_us[2];
  std::printf("  %-26s %10.1f %12.1f %14.1f %10.1f\n", "megakernel (fused stages)", mk,
              ffn_flops / mk * 1e-6, nvlink_bytes * 1e-6, nvlink_bytes / mk * 1e-3);
  std::printf("  %-26s %10.1f\n", "barrier+sum", slow.stage_us[3]);
  if (ranks.size() < 2) return;
  std::printf("  per rank: megakernel / barrier+sum us (rows computed):");
  for (size_t r = 0; r < ranks.size(); ++r)
    std::printf("%s %zu: %.1f / %.1f (%lld)", r ? "," : "", r,
                ranks[r].stage_us[1] + ranks[r].stage_us[2], ranks[r].stage_us[3],
                static_cast<long long>(ranks[r].rows_received));
  std::printf("\n");
}

// A system's line of the comparison table under EPFlow's stages; `epflow` null on EPFlow's own.
void print_system(const char* system, const LayerConfig& c, const RankResult& slow,
                  const RankResult* epflow, const Check& check, size_t checked_tokens) {
  const double tflops = bench::forward_flops(c, slow.routed_slots) / slow.total_us * 1e-6;
  char ratio[32] = "";
  if (epflow) std::snprintf(ratio, sizeof ratio, "%.2fx", slow.total_us / epflow->total_us);
  std::printf("  %-26s %10.1f %12.1f %14s", system, slow.total_us, tflops, ratio);
  if (!check.against.empty())
    std::printf("  %s (rel. err %.1e vs %s, %zu tokens/rank)", check.verdict(), check.rel_err,
                check.against.c_str(), checked_tokens);
  std::printf("\n");
}

// The CPU reference on simulated ranks: proves the math end to end and times it (CPU timing).
int run_cpu_reference(const Options& o, const char* why) {
  // parse_options accepts known preset names only.
  const bench::Preset* p = bench::find_preset(o.presets.empty() ? "tiny" : o.presets[0]);
  const int32_t ep = o.ep > 0 ? o.ep : 2;
  const int64_t tokens = o.tokens.empty() ? 64 : o.tokens[0];
  const double macs = double(ep) * tokens * p->top_k * 3.0 * p->hidden * p->intermediate;
  if (macs > 2e10) {
    std::fprintf(stderr,
                 "epflow-bench: %s x %lld tokens x %d ranks is too large for the CPU reference "
                 "(%.1e MACs); use --preset tiny or fewer --tokens\n",
                 p->name.c_str(), static_cast<long long>(tokens), ep, macs);
    return 2;
  }
  std::printf("epflow-bench: %s\n", why);
  std::printf("running the CPU reference layer (fp32 storage, double accumulation) instead\n");

  const LayerConfig c = bench::layer_config(*p, ep, tokens);
  if (Status s = validate(c); !s.ok()) {
    std::fprintf(stderr, "epflow-bench: %s\n", s.to_string().c_str());
    return 2;
  }
  // The inputs every system of a GPU run gets (bench_inputs.h), --routing's kind included.
  std::vector<bench::Routing> routing;
  for (int32_t r = 0; r < ep; ++r)
    routing.push_back(
        bench::make_routing(o.seed, static_cast<uint32_t>(r), tokens, c.num_experts, c.top_k,
                            o.routing));
  std::vector<reference::RankInput> inputs;
  std::vector<reference::RankExperts> experts;
  reference_layer(c, routing, tokens, o.seed, &inputs, &experts);

  std::vector<std::vector<float>> y, dy(ep);
  const auto t0 = std::chrono::steady_clock::now();
  if (Status s = reference::forward(c, inputs, experts, &y); !s.ok()) {
    std::fprintf(stderr, "epflow-bench: %s\n", s.to_string().c_str());
    return 1;
  }
  const auto t1 = std::chrono::steady_clock::now();
  if (o.fp8) {
    // The FP8 forward's quantization-matched reference, against the exact one.
    std::vector<std::vector<float>> y_fp8;
    if (Status s = reference::forward_fp8(c, inputs, experts, false, &y_fp8); !s.ok()) {
      std::fprintf(stderr, "epflow-bench: %s\n", s.to_string().c_str());
      return 1;
    }
    std::printf("FP8 forward (e4m3, 1x128 / 128x128 scales): relative error %.2e against the "
                "exact forward\n",
                compare(y_fp8, y, "reference").rel_err);
  }
  for (int32_t r = 0; r < ep; ++r) dy[r] = y[r];  // loss = 0.5 * |y|^2
  std::vector<reference::RankGrads> grads;
  if (Status s = reference::backward(c, inputs, experts, dy, &grads); !s.ok()) {
    std::fprintf(stderr, "epflow-bench: %s\n", s.to_string().c_str());
    return 1;
  }
  const auto t2 = std::chrono::steady_clock::now();

  auto norm = [](const std::vector<float>& v) {
    double s = 0;
    for (float f : v) s += double(f) * f;
    return std::sqrt(s);
  };
  int64_t routed = 0;
  for (const auto& in : inputs)
    for (int32_t id : in.topk_idx) routed += (id >= 0);
  const double fwd_s = std::chrono::duration<double>(t1 - t0).count();
  const double bwd_s = std::chrono::duration<double>(t2 - t1).count();
  std::printf(
      "preset %s (H %lld, I %lld, %d experts, top-%d), %d simulated ranks x %lld tokens, %s "
      "routing\n",
      p->name.c_str(), static_cast<long long>(c.hidden), static_cast<long long>(c.intermediate),
      c.num_experts, c.top_k, ep, static_cast<long long>(tokens), bench::routing_name(o.routing));
  if (o.routing == RoutingKind::kZipf) print_routing_skew(c, routing);
  std::printf("%-6s %-8s %14s %14s %14s\n", "rank", "tokens", "|y|", "|dx|", "|dW_down|");
  for (int32_t r = 0; r < ep; ++r)
    std::printf("%-6d %-8lld %14.6f %14.6f %14.6f\n", r,
                static_cast<long long>(inputs[r].num_tokens), norm(y[r]), norm(grads[r].dx),
                norm(grads[r].d_down));
  const double flops = bench::forward_flops(c, routed);
  std::printf(
      "CPU reference: forward %.3f s (%.2f GFLOP/s), backward %.3f s (%.2f GFLOP/s); "
      "CPU timings, not a GPU benchmark\n",
      fwd_s, flops / fwd_s * 1e-9, bwd_s, 2 * flops / bwd_s * 1e-9);
  return 0;
}

int run_gpu(const Options& o, int devices) {
  const int32_t ep = o.ep > 0 ? o.ep : (o.check ? std::min(devices, 2) : devices);
  if (ep > devices) {
    std::fprintf(stderr, "epflow-bench: --ep %d but only %d GPUs\n", ep, devices);
    return 2;
  }
  const auto presets = !o.presets.empty() ? o.presets
                       : o.check          ? std::vector<std::string>{"tiny"}
                                          : std::vector<std::string>{"deepseek-v3"};
  const auto token_list = !o.tokens.empty() ? o.tokens
                          : o.check         ? std::vector<int64_t>{64}
                                            : std::vector<int64_t>{4096};
  const bool nccl_cublas =
      std::find(o.baselines.begin(), o.baselines.end(), kNcclCublas) != o.baselines.end();
  // --dtype fp8: the FP8 layer is EPFlow's first system (its stages, trace and yardsticks; every
  // ratio against it), its bf16 layer the second.
  const DType first_dtype = o.fp8 ? DType::kFP8Blockwise : DType::kBF16;
  std::vector<Variant> variants = {Variant{o.fp8 ? "epflow-fp8" : "epflow"}};
  variants[0].dtype = first_dtype;
  if (o.fp8) variants.push_back(Variant{"epflow"});
  if (!o.sweep_comm_sms.empty() || !o.sweep_minibatch_rows.empty() ||
      !o.sweep_ring_rows.empty()) {
    const std::vector<int64_t> none = {0};
    auto or_auto = [&](const std::vector<int64_t>& v) -> const std::vector<int64_t>& {
      return v.empty() ? none : v;
    };
    for (int64_t cs : or_auto(o.sweep_comm_sms))
      for (int64_t mb : or_auto(o.sweep_minibatch_rows))
        for (int64_t ring : or_auto(o.sweep_ring_rows))
          variants.push_back(
              Variant{kSweep, static_cast<int32_t>(cs), mb, false, ring, first_dtype});
  }
  const bool unfused_baseline =
      std::find(o.baselines.begin(), o.baselines.end(), kUnfused) != o.baselines.end();
  // --backward: EPFlow's first system's backward is timed, and with --dtype fp8 its bf16 layer's.
  auto timed_backward = [&](size_t v) {
    return o.backward && !o.check && (v == 0 || (o.fp8 && v == 1));
  };
  if (unfused_baseline) variants.push_back(Variant{kUnfused, 0, 0, true});
  const std::string device = device_name();
  const char* commit = std::getenv("EPFLOW_COMMIT");
  std::printf("epflow-bench: %d x %s, EP=%d, %s, %s routing, median of %d iterations after %d "
              "warm-up\n",
              ep, device.c_str(), ep, o.fp8 ? "fp8 (e4m3, 1x128 / 128x128 scales) and bf16" : "bf16",
              bench::routing_name(o.routing), o.iters, o.warmup);
  if (nccl_cublas)
    std::printf("baseline nccl-cublas: %s\n", bench::NcclCublasMoe::kDescription);
  if (o.check) {
    std::printf("--check: every token's y against the CPU reference, rel. error <= %.0e\n",
                kRelTol);
    std::printf(
        "--check: and EPFlow's backward (random dy, fp32 weight gradients; the unfused "
        "backward too with the %s baseline): dx, d topk_weights and the weight "
        "gradients against the CPU reference backward\n",
        kUnfused);
  }
  std::ostringstream json;
  json << "{\n  \"kind\": \"layer\",\n  \"device\": \"" << device << "\",\n  \"ep\": " << ep
       << ",\n  \"commit\": \"" << (commit ? commit : "unknown") << "\",\n  \"seed\": " << o.seed
       << ",\n  \"warmup\": " << o.warmup << ",\n  \"settle_ms\": " << o.settle_ms
       << ",\n  \"iters\": " << o.iters << ",\n  \"runs\": [";
  bool first = true, all_ok = true;
  for (const auto& name : presets) {
    const bench::Preset* p = bench::find_preset(name);  // a known name: parse_options checked
    for (int64_t T : token_list) {
      LayerConfig c = bench::layer_config(*p, ep, T);
      c.saved_gate_up_rows = o.saved_gate_up_rows;
      // The unfused backward reads every row's g | u from the context: with it (--check,
      // --backward-unfused, --backward-side-sms) both backwards run with contexts that keep
      // every row.
      if (o.check || o.backward_unfused || !o.backward_side_sms.empty())
        c.saved_gate_up_rows = int64_t{1} << 40;
      if (o.check) {
        const double macs = double(ep) * T * c.top_k * 3.0 * c.hidden * c.intermediate;
        if (macs > 2e10) {
          std::fprintf(stderr,
                       "epflow-bench --check: %s x %lld tokens x %d ranks is too large for the "
                       "CPU reference (%.1e MACs); use --preset tiny or fewer --tokens\n",
                       p->name.c_str(), static_cast<long long>(T), ep, macs);
          return 2;
        }
      }
      std::vector<bench::Routing> routing;
      for (int32_t r = 0; r < ep; ++r)
        routing.push_back(bench::make_routing(o.seed, r, T, c.num_experts, c.top_k, o.routing));
      std::vector<RankResult> results(ep);
      count_traffic(c, routing, &results);
      std::vector<RankResult> base_results = results;
      std::vector<int64_t> checked = guard_tokens(T);
      if (o.check) {
        checked.resize(T);
        for (int64_t t = 0; t < T; ++t) checked[t] = t;
      }
      // --check: the backward too, where the reference backward's weight gradients (every
      // expert's three, in double) fit in a few GB; every rank's outputs of EPFlow's backward
      // and, with the unfused baseline, of the unfused backward.
      const double reference_grad_bytes = 3.0 * 8 * c.num_experts * c.intermediate * c.hidden;
      const bool check_backward = o.check && reference_grad_bytes <= 4e9;
      std::vector<reference::RankGrads> backward_got(ep), unfused_backward_got(ep);
      std::vector<std::vector<RankResult>> variant_results(variants.size(), results);
      std::vector<std::vector<std::vector<float>>> y_variant(variants.size(),
                                                             std::vector<std::vector<float>>(ep));
      std::vector<std::vector<float>> y_base(ep);
      std::mutex mu;
      // Per GPU: its yardsticks (measured by its own rank thread when at once or interleaved).
      std::vector<bench::Rooflines> roof_of(ep);
      std::vector<int32_t> roof_ok(ep, 0);  // repeats that measured GPU g's yardsticks
      std::vector<double> interleaved_dense(ep, 0);
      const bool interleaved = o.yardstick == Options::Yardstick::kInterleaved && !o.check;
      // The dense yardstick runs on GPU g's own routed rows (at least one tile).
      auto yardstick_rows = [&](int g) { return std::max<int64_t>(results[g].rows_received, 128); };
      auto measure_yardsticks = [&](int g) {
        if (bench::measure_rooflines(yardstick_rows(g), c.hidden, c.intermediate, o.warmup,
                                     o.settle_ms, o.iters, &roof_of[g])
                .ok())
          ++roof_ok[g];
      };
      auto keep_times = [&mu](const RankResult& from, RankResult* to) {
        std::lock_guard<std::mutex> lock(mu);
        to->plan = from.plan;
        to->total_us = from.total_us;
        to->backward_us = from.backward_us;
        to->forward_saving_us = from.forward_saving_us;
        to->train_step_us = from.train_step_us;
        to->train_step_forward_us = from.train_step_forward_us;
        to->train_step_quantize_us = from.train_step_quantize_us;
        to->backward_side_us = from.backward_side_us;
        to->backward_comm_us = from.backward_comm_us;
        to->memory = from.memory;
        to->saved_context_bytes = from.saved_context_bytes;
        to->quantize_weights_us = from.quantize_weights_us;
        to->fp8_wgrad = from.fp8_wgrad;
        to->other_wgrad_backward_us = from.other_wgrad_backward_us;
        to->other_wgrad_us = from.other_wgrad_us;
        to->backward_stage_names = from.backward_stage_names;
        to->unfused_backward_us = from.unfused_backward_us;
        to->unfused_stage_names = from.unfused_stage_names;
        std::copy(from.stage_us, from.stage_us + kStages, to->stage_us);
        std::copy(from.backward_stage_us, from.backward_stage_us + kMaxBackwardStages,
                  to->backward_stage_us);
        std::copy(from.unfused_stage_us, from.unfused_stage_us + kMaxBackwardStages,
                  to->unfused_stage_us);
      };
      // Every system on one communicator, one after the other: every rank destroys each EPFlow
      // layer (and its windows) before the next system's calls, in the same order.
      auto measure = [&] {
        return run_on_local_gpus(ep, [&](int rank, ncclComm_t comm) {
          LayerConfig rc = c;
          rc.ep_rank = rank;
          RankResult r;
          for (size_t v = 0; v < variants.size(); ++v) {
            // With --dtype fp8 the bf16 layer's trace too (its dispatch against the FP8 rows').
            const bool traced = !o.trace.empty() && (v == 0 || (o.fp8 && v == 1));
            const std::string trace =
                traced ? o.trace + (v == 0 ? "" : "-bf16") + "-" + p->name + "-" +
                             std::to_string(T) + "-rank" + std::to_string(rank) + ".csv"
                       : "";
            const int64_t interleave_rows = v == 0 && interleaved ? yardstick_rows(rank) : 0;
            // The backward is checked on EPFlow's first bf16 system (the FP8 backward against
            // its quantization-matched reference is the GPU tests'); with --dtype fp8 it is
            // timed in both layers.
            const bool checked_backward = v == (o.fp8 ? 1 : 0) && check_backward;
            EPFLOW_RETURN_IF_ERROR(bench_epflow_rank(
                rc, variants[v], routing, T, o, comm, checked, &r, &y_variant[v][rank], trace,
                interleave_rows, timed_backward(v), v == 0,
                checked_backward ? &backward_got[rank] : nullptr,
                checked_backward && unfused_baseline ? &unfused_backward_got[rank] : nullptr));
            keep_times(r, &variant_results[v][rank]);
            if (interleave_rows > 0) interleaved_dense[rank] = r.interleaved_dense_tflops;
          }
          if (nccl_cublas) {
            EPFLOW_RETURN_IF_ERROR(
                bench_nccl_cublas_rank(rc, routing, T, o, comm, checked, &r, &y_base[rank]));
            keep_times(r, &base_results[rank]);
          }
          // NOTES: at once, every GPU busy as during the layer (one GPU after the other gave the
          // same rates in a same-call comparison: docs/benchmarks.md, "How we measure"). Like
          // every system, they settle first (settle.h).
          if (o.yardstick != Options::Yardstick::kOneByOne && !o.check) measure_yardsticks(rank);
          return Status::ok_status();
        });
      };
      // --repeats: the whole sequence again, each repeat's results kept; then their medians.
      std::vector<std::vector<std::vector<RankResult>>> variant_reps(variants.size());
      std::vector<std::vector<RankResult>> base_reps;
      std::vector<std::vector<bench::Rooflines>> roof_reps;
      std::vector<std::vector<double>> interleaved_reps;
      for (int32_t rep = 0; rep < o.repeats; ++rep) {
        if (const Status s = measure(); !s.ok()) {
          std::fprintf(stderr, "epflow-bench: %s\n", s.to_string().c_str());
          return 1;
        }
        // One GPU after the other, nothing else running (--yardstick one-by-one).
        if (o.yardstick == Options::Yardstick::kOneByOne && !o.check)
          for (int32_t g = 0; g < ep; ++g)
            if (cudaSetDevice(g) == cudaSuccess) measure_yardsticks(g);
        for (size_t v = 0; v < variants.size(); ++v) variant_reps[v].push_back(variant_results[v]);
        base_reps.push_back(base_results);
        roof_reps.push_back(roof_of);
        interleaved_reps.push_back(interleaved_dense);
      }
      for (size_t v = 0; v < variants.size(); ++v)
        variant_results[v] = median_over_repeats(variant_reps[v]);
      base_results = median_over_repeats(base_reps);
      for (int32_t g = 0; g < ep; ++g) {
        std::vector<double> dense, copy, inter;
        for (int32_t rep = 0; rep < o.repeats; ++rep) {
          dense.push_back(roof_reps[rep][g].dense_tflops);
          copy.push_back(roof_reps[rep][g].hbm_copy_gbs);
          inter.push_back(interleaved_reps[rep][g]);
        }
        roof_of[g].dense_tflops = median(dense);
        roof_of[g].hbm_copy_gbs = median(copy);
        interleaved_dense[g] = median(inter);
      }
      std::vector<Check> variant_check(variants.size());
      Check base_check;
      std::vector<reference::RankGrads> backward_want;  // --check: the reference backward's
      if (o.check) {
        std::vector<reference::RankInput> inputs;
        std::vector<reference::RankExperts> experts;
        reference_layer(c, routing, T, o.seed, &inputs, &experts);
        const auto ref = reference_y(c, inputs, experts);
        std::vector<std::vector<float>> ref_fp8;  // the quantization-matched reference
        if (o.fp8) {
          std::vector<reference::RankInput> checked_inputs = inputs;
          for (int32_t r = 0; r < ep; ++r) {
            reference::RankInput& in = checked_inputs[r];
            in.num_tokens = static_cast<int64_t>(checked.size());
            in.x.clear();
            in.topk_idx.clear();
            in.topk_weights.clear();
            for (int64_t t : checked) {
              in.x.insert(in.x.end(), inputs[r].x.begin() + t * c.hidden,
                          inputs[r].x.begin() + (t + 1) * c.hidden);
              in.topk_idx.insert(in.topk_idx.end(), inputs[r].topk_idx.begin() + t * c.top_k,
                                 inputs[r].topk_idx.begin() + (t + 1) * c.top_k);
              in.topk_weights.insert(in.topk_weights.end(),
                                     inputs[r].topk_weights.begin() + t * c.top_k,
                                     inputs[r].topk_weights.begin() + (t + 1) * c.top_k);
            }
          }
          if (Status s = reference::forward_fp8(c, checked_inputs, experts, false, &ref_fp8);
              !s.ok()) {
            std::fprintf(stderr, "epflow-bench: %s\n", s.to_string().c_str());
            return 1;
          }
        }
        for (size_t v = 0; v < variants.size(); ++v) {
          if (variants[v].dtype == DType::kFP8Blockwise) {
            variant_check[v] = compare(y_variant[v], ref_fp8, "fp8 reference");
            const Check exact = compare(y_variant[v], ref, "reference", kFp8VsBf16Tol);
            std::printf("  %s vs the exact reference: rel. err %.2e (tolerance %.0e; the FP8 "
                        "reference's own %.2e)\n",
                        variants[v].system, exact.rel_err, kFp8VsBf16Tol,
                        compare(ref_fp8, ref, "reference").rel_err);
          } else {
            variant_check[v] = compare(y_variant[v], ref, "reference");
          }
        }
        if (nccl_cublas) base_check = compare(y_base, ref, "reference");
        if (check_backward) {
          std::vector<std::vector<float>> dy(ep);
          for (int32_t r = 0; r < ep; ++r)
            dy[r] = bf16_values(T * c.hidden, 1.0f, dy_key(o.seed, static_cast<uint32_t>(r)));
          if (Status s = reference::backward(c, inputs, experts, dy, &backward_want); !s.ok()) {
            std::fprintf(stderr, "epflow-bench: %s\n", s.to_string().c_str());
            return 1;
          }
        }
      } else {
        // A bf16 system against the FP8 layer differs by FP8's rounding.
        auto against_first = [&](DType dtype) {
          return dtype == first_dtype ? kRelTol : kFp8VsBf16Tol;
        };
        for (size_t v = 1; v < variants.size(); ++v)
          variant_check[v] = compare(y_variant[v], y_variant[0], variants[0].system,
                                     against_first(variants[v].dtype));
        if (nccl_cublas)
          base_check = compare(y_base, y_variant[0], variants[0].system,
                               against_first(DType::kBF16));
      }
      // The slowest rank sets the layer's time; report it, per stage too.
      const RankResult& slow = slowest(variant_results[0]);
      print_epflow(*p, T, c, o.routing, routing, variant_results[0], variants[0].dtype);
      // Yardsticks from this run (their mean over the GPUs: GPUs of one host clock differently
      // under load): cuBLAS dense bf16 on each GPU's routed rows and the HBM copy rate (weights
      // streamed at decode sizes).
      Yardsticks yard;
      yard.mode = yardstick_mode(o.yardstick).name;
      bench::Rooflines& roof = yard.mean;
      std::string roof_per_gpu;
      const bool have_roof =
          !o.check && std::all_of(roof_ok.begin(), roof_ok.end(),
                                  [&](int32_t measured) { return measured == o.repeats; });
      for (int32_t g = 0; g < ep && have_roof; ++g) {
        const double dense = interleaved ? interleaved_dense[g] : roof_of[g].dense_tflops;
        roof.dense_tflops += dense / ep;
        roof.hbm_copy_gbs += roof_of[g].hbm_copy_gbs / ep;
        if (interleaved) yard.dense_after_tflops += roof_of[g].dense_tflops / ep;
        yard.dense_tflops_per_gpu.push_back(dense);
        roof_per_gpu += (g ? ", " : "") + std::to_string(static_cast<int>(dense));
      }
      for (int32_t rep = 0; rep < o.repeats && have_roof; ++rep) {
        double mean = 0;
        for (int32_t g = 0; g < ep; ++g)
          mean += (interleaved ? interleaved_reps[rep][g] : roof_reps[rep][g].dense_tflops) / ep;
        yard.dense_tflops_per_repeat.push_back(mean);
      }
      if (have_roof) {
        const double stream_us = weight_bytes(c) / (roof.hbm_copy_gbs * 1e3);
        const double layer_tflops = bench::forward_flops(c, slow.routed_slots) / slow.total_us * 1e-6;
        std::printf("  yardsticks (%s): cuBLAS dense bf16 on the same rows %.1f TFLOP/s (mean of "
                    "GPUs: %s; layer at %.0f%%); weights %.2f GB stream in %.1f us at the HBM copy "
                    "rate %.0f GB/s (layer = %.2fx that)\n",
                    yardstick_mode(o.yardstick).words,
                    roof.dense_tflops, roof_per_gpu.c_str(),
                    100.0 * layer_tflops / roof.dense_tflops,
                    weight_bytes(c) * 1e-9, stream_us, roof.hbm_copy_gbs, slow.total_us / stream_us);
        if (o.fp8) {
          const double fp8_stream_us = fp8_expert_weights_bytes(c) / (roof.hbm_copy_gbs * 1e3);
          std::printf("  FP8 weights (e4m3 + scales) %.2f GB stream in %.1f us (layer = %.2fx "
                      "that); quantizing them from bf16 (quantize_expert_weights) %.1f us\n",
                      fp8_expert_weights_bytes(c) * 1e-9, fp8_stream_us,
                      slow.total_us / fp8_stream_us, slow.quantize_weights_us);
        }
        if (interleaved)
          std::printf("  (the same dense GEMMs measured at once after the systems: %.1f TFLOP/s, "
                      "layer at %.0f%% of that)\n",
                      yard.dense_after_tflops,
                      100.0 * layer_tflops / yard.dense_after_tflops);
      }
      if (o.repeats > 1) {
        std::printf("  repeats (%d; every figure here is the median over them): layer us %s",
                    o.repeats,
                    join_numbers(layer_us_per_repeat(variant_reps[0]), " / ", 1).c_str());
        if (have_roof)
          std::printf("; cuBLAS dense TFLOP/s %s",
                      join_numbers(yard.dense_tflops_per_repeat, " / ", 1).c_str());
        std::printf("\n");
      }
      std::printf("  %-26s %10s %12s %14s  %s\n", "system", "us", "TFLOP/s/GPU",
                  "EPFlow speedup", "check");
      // --backward --dtype fp8: the FP8 layer's backward and step, for the bf16 one's ratios.
      double fp8_backward_us = 0, fp8_step_us = 0;
      for (size_t v = 0; v < variants.size(); ++v) {
        const RankResult& vs = slowest(variant_results[v]);
        char label[64];
        if (variants[v].system == std::string(kSweep))
          std::snprintf(label, sizeof label, "epflow comm %d, mb %lld, ring %lld",
                        vs.plan.comm_sms, static_cast<long long>(vs.plan.minibatch_rows),
                        static_cast<long long>(vs.plan.ring_rows));
        else
          std::snprintf(label, sizeof label, "%s", variants[v].system);
        print_system(label, c, vs, v == 0 ? nullptr : &slow, variant_check[v], checked.size());
        json << (first ? "" : ",") << "\n    "
             << run_json(variants[v].system, *p, T, o.routing, c, variant_results[v],
                         variant_check[v],
                         &variants[v], layer_us_per_repeat(variant_reps[v]),
                         v == 0 && have_roof ? &yard : nullptr);
        first = false;
        if (timed_backward(v)) {
          const std::string system = variants[v].system;
          const bool fp8_layer = variants[v].dtype == DType::kFP8Blockwise;
          const RankResult& b = slowest(variant_results[v], &RankResult::backward_us);
          const char* dtype = o.fp32_grads ? "fp32" : "bf16";
          std::printf("  %-26s %10.1f %12.1f  (weight gradients %s%s, %s)\n",
                      (system + " backward").c_str(), b.backward_us,
                      2 * bench::forward_flops(c, b.routed_slots) / b.backward_us * 1e-6,
                      !fp8_layer      ? ""
                      : b.fp8_wgrad   ? "in FP8, out in "
                                      : "in bf16 at these rows per expert, out in ",
                      dtype,
                      o.accumulate_grads ? "accumulated" : "written");
          const RankResult& f = slowest(variant_results[v], &RankResult::forward_saving_us);
          auto stages_text = [](const std::vector<std::string>& names, const double* us) {
            std::string text;
            for (size_t st = 0; st < names.size(); ++st) {
              char item[160];
              std::snprintf(item, sizeof item, "%s %s %.1f", st ? ";" : "", names[st].c_str(),
                            us[st]);
              text += item;
            }
            return text;
          };
          auto stages_json = [](const std::vector<std::string>& names, const double* us) {
            std::ostringstream js;
            for (size_t st = 0; st < names.size(); ++st)
              js << (st ? ", " : "") << '"' << names[st] << "\": " << json_num(us[st]);
            return js.str();
          };
          auto tflops = [&](double us) { return 2 * bench::forward_flops(c, b.routed_slots) / us * 1e-6; };
          std::printf("    its stages (us, slowest rank):%s\n",
                      stages_text(b.backward_stage_names, b.backward_stage_us).c_str());
          if (fp8_layer && b.other_wgrad_backward_us > 0)
            std::printf("    weight gradients in %s instead: %.1f us, the backward %.1f us (the "
                        "layer's choice, %s, %.2fx faster)\n",
                        b.fp8_wgrad ? "bf16 (dequantized rows)" : "FP8", b.other_wgrad_us,
                        b.other_wgrad_backward_us, b.fp8_wgrad ? "FP8" : "bf16",
                        b.other_wgrad_backward_us / b.backward_us);
          std::printf("    memory (GB): backward rows %.2f, layer total %.2f; a forward's "
                      "context (schedule, g|u of %lld rows) %.2f\n",
                      b.memory.backward_bytes * 1e-9, b.memory.total() * 1e-9,
                      static_cast<long long>(b.plan.saved_gate_up_rows),
                      b.saved_context_bytes * 1e-9);
          std::printf("  %-26s %10.1f %12.1f\n", (system + " fwd keeping g|u").c_str(),
                      f.forward_saving_us,
                      bench::forward_flops(c, f.routed_slots) / f.forward_saving_us * 1e-6);
          const RankResult& ts = slowest(variant_results[v], &RankResult::train_step_us);
          char requantize[64] = "";
          if (fp8_layer)
            std::snprintf(requantize, sizeof requantize, "weight re-quantization %.1f + ",
                          ts.train_step_quantize_us);
          std::printf("  %-26s %10.1f %12.1f  (%sforward keeping g|u %.1f + backward %.1f)\n",
                      (system + " training step").c_str(), ts.train_step_us,
                      3 * bench::forward_flops(c, ts.routed_slots) / ts.train_step_us * 1e-6,
                      requantize, ts.train_step_forward_us,
                      ts.train_step_us - ts.train_step_forward_us - ts.train_step_quantize_us);
          if (fp8_layer) {
            fp8_backward_us = b.backward_us;
            fp8_step_us = ts.train_step_us;
          } else if (fp8_backward_us > 0) {
            std::printf("  FP8 over bf16: backward %.2fx, training step %.2fx\n",
                        b.backward_us / fp8_backward_us, ts.train_step_us / fp8_step_us);
          }
          auto bwd_json = [&](const char* system, double us) {
            json << ",\n    {\"system\": \"" << system << "\", \"direction\": \"bwd\", "
                 << "\"preset\": \"" << p->name << "\", \"tokens\": " << T
                 << ", \"routing\": \"" << bench::routing_name(o.routing) << "\""
                 << ", \"layer_us\": " << json_num(us)
                 << ", \"layer_tflops_per_gpu\": " << json_num(tflops(us))
                 << ", \"grad_dtype\": \"" << dtype << "\""
                 << ", \"accumulate_grads\": " << (o.accumulate_grads ? "true" : "false");
          };
          bwd_json(system.c_str(), b.backward_us);
          json << ", \"dtype\": \"" << (fp8_layer ? "fp8" : "bf16") << "\""
               << ", \"forward_saving_us\": " << json_num(f.forward_saving_us)
               << ", \"train_step_us\": " << json_num(ts.train_step_us)
               << ", \"train_step_forward_us\": " << json_num(ts.train_step_forward_us)
               << ", \"repeat_layer_us\": ["
               << join_numbers(per_repeat(variant_reps[v], &RankResult::backward_us), ", ", 2)
               << "], \"repeat_train_step_us\": ["
               << join_numbers(per_repeat(variant_reps[v], &RankResult::train_step_us), ", ", 2)
               << "]";
          if (fp8_layer)
            json << ", \"train_step_quantize_us\": " << json_num(ts.train_step_quantize_us)
                 << ", \"weight_gradients\": \"" << (b.fp8_wgrad ? "fp8" : "bf16")
                 << "\", \"other_wgrad_backward_us\": " << json_num(b.other_wgrad_backward_us)
                 << ", \"other_wgrad_stage_us\": " << json_num(b.other_wgrad_us);
          json << ", \"backward_bytes\": " << b.memory.backward_bytes
               << ", \"saved_context_bytes\": " << b.saved_context_bytes
               << ", \"saved_gate_up_rows\": " << b.plan.saved_gate_up_rows
               << ", \"stage_us\": {" << stages_json(b.backward_stage_names, b.backward_stage_us)
               << "}}";
          if (o.backward_unfused && v == 0) {
            const RankResult& u = slowest(variant_results[0], &RankResult::unfused_backward_us);
            std::printf("  %-26s %10.1f %12.1f  (fused backward %.2fx faster)\n",
                        "epflow backward unfused", u.unfused_backward_us,
                        tflops(u.unfused_backward_us), u.unfused_backward_us / b.backward_us);
            std::printf("    its stages (us, slowest rank):%s\n",
                        stages_text(u.unfused_stage_names, u.unfused_stage_us).c_str());
            bwd_json("epflow-bwd-unfused", u.unfused_backward_us);
            json << ", \"stage_us\": {" << stages_json(u.unfused_stage_names, u.unfused_stage_us)
                 << "}}";
          }
          // The slowest rank's time of each A/B point.
          auto ab = [&](const std::vector<int64_t>& counts,
                        std::vector<double> RankResult::*times, const char* system,
                        const char* what, const char* key) {
            for (size_t i = 0; i < counts.size(); ++i) {
              double us = 0;
              for (const RankResult& r : variant_results[0]) us = std::max(us, (r.*times)[i]);
              std::printf("  %-26s %10.1f %12.1f  (%s %lld)\n", system, us, tflops(us), what,
                          static_cast<long long>(counts[i]));
              bwd_json(system, us);
              json << ", \"" << key << "\": " << counts[i] << "}";
            }
          };
          if (v == 0) {
            ab(o.backward_side_sms, &RankResult::backward_side_us, "epflow-bwd-side",
               "unfused, side-stream SMs", "backward_side_sms");
            ab(o.backward_comm_sms, &RankResult::backward_comm_us, "epflow-bwd-comm",
               "megakernel, communication SMs", "backward_comm_sms");
          }
        }
        all_ok = all_ok && (variant_check[v].against.empty() || variant_check[v].ok());
      }
      if (nccl_cublas) {
        const RankResult& base = slowest(base_results);
        print_system(kNcclCublas, c, base, &slow, base_check, checked.size());
        std::printf("  %-26s", "  its stages (us)");
        for (int st = 0; st < kStages; ++st)
          std::printf("%s %s %.1f", st ? "," : "", kStageNames[st], base.stage_us[st]);
        std::printf("\n");
        json << ",\n    "
             << run_json(kNcclCublas, *p, T, o.routing, c, base_results, base_check, nullptr,
                         layer_us_per_repeat(base_reps));
        all_ok = all_ok && base_check.ok();
      }
      if (check_backward) {
        all_ok = check_backward_outputs("epflow backward", backward_got, backward_want) && all_ok;
        if (unfused_baseline)
          all_ok = check_backward_outputs("epflow-unfused backward", unfused_backward_got,
                                          backward_want) &&
                   all_ok;
      } else if (o.check) {
        std::printf(
            "  backward not checked: the reference backward would hold %.1f GB of weight "
            "gradients\n",
            reference_grad_bytes * 1e-9);
      }
    }
  }
  json << "\n  ],\n  \"stages\": [";
  for (int st = 0; st < kStages; ++st) json << (st ? ", " : "") << "\"" << kStageNames[st] << "\"";
  json << "]\n}\n";
  if (!o.json.empty()) {
    std::ofstream f(o.json);
    f << json.str();
    f.close();
    if (!f) {
      std::fprintf(stderr, "epflow-bench: --json: writing \"%s\" failed: %s\n", o.json.c_str(),
                   std::strerror(errno));
      return 1;
    }
  }
  if (o.check)
    std::printf("\n--check: %s\n", all_ok ? "OK" : "MISMATCH");
  else if (!all_ok)
    std::printf("\nMISMATCH: a baseline's output differs from EPFlow's beyond tolerance\n");
  return all_ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const bench::ParseResult parsed = bench::parse_options(argc, argv);
  switch (parsed.outcome) {
    case bench::ParseResult::Outcome::kHelp:
      std::fputs(bench::usage_text().c_str(), stdout);
      return 0;
    case bench::ParseResult::Outcome::kError:
      std::fprintf(stderr, "epflow-bench: %s\n%s", parsed.error.c_str(),
                   bench::short_usage_text().c_str());
      return 2;
    case bench::ParseResult::Outcome::kOk: break;
  }
  const Options& o = parsed.options;
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    if (o.check) {
      // The check compares GPU outputs: without a GPU there is nothing to compare.
      std::printf("epflow-bench --check: no GPU found; nothing checked\n");
      return 0;
    }
    return run_cpu_reference(o, "no GPU found");
  }
  return run_gpu(o, devices);
}
