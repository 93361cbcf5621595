// epflow-bench: the main job. On GPUs it runs the EPFlow layer on every GPU present (EP = GPU
// count unless --ep says fewer), a thread per GPU, and prints the median time and TFLOP/s per GPU
// of the whole layer and of each stage, and the NVLink bytes and GB/s of dispatch and combine.
// Without a GPU it runs the CPU reference layer on a small preset and says so.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "bench_inputs.h"
#include "epflow/communicator.h"
#include "epflow/epflow.h"
#include "host/layer_internals.h"
#include "host/status_util.h"
#include "presets.h"
#include "reference/reference_layer.h"
#include "reference/synthetic.h"

namespace {

using namespace epflow;

struct Options {
  std::vector<std::string> presets;  // empty: deepseek-v3 on GPUs, tiny on the CPU reference
  std::vector<int64_t> tokens;       // per rank; empty: 4096 on GPUs, 64 on the CPU reference
  int32_t ep = 0;                    // ranks; 0: every GPU present (2 simulated on the CPU)
  int32_t warmup = 5;
  int32_t iters = 20;
  uint64_t seed = 1;
  std::string json;  // write results here as JSON
};

void usage() {
  std::printf(
      "usage: epflow-bench [--preset NAME[,NAME...]] [--tokens T[,T...]] [--ep N] [--iters N]\n"
      "                    [--warmup N] [--seed S] [--json PATH]\n"
      "  presets:");
  for (const auto& p : bench::presets()) std::printf(" %s", p.name.c_str());
  std::printf("\n");
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

bool parse(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) return false;
    const std::string v = argv[++i];
    if (a == "--preset")
      o->presets = split(v);
    else if (a == "--tokens")
      for (const auto& t : split(v)) o->tokens.push_back(std::atoll(t.c_str()));
    else if (a == "--ep")
      o->ep = std::atoi(v.c_str());
    else if (a == "--iters")
      o->iters = std::atoi(v.c_str());
    else if (a == "--warmup")
      o->warmup = std::atoi(v.c_str());
    else if (a == "--seed")
      o->seed = std::strtoull(v.c_str(), nullptr, 10);
    else if (a == "--json")
      o->json = v;
    else
      return false;
  }
  return o->iters > 0 && o->warmup >= 0;
}

// The CPU reference on simulated ranks: proves the math end to end and times it (CPU timing).
int run_cpu_reference(const Options& o, const char* why) {
  const bench::Preset* p = bench::find_preset(o.presets.empty() ? "tiny" : o.presets[0]);
  if (!p) {
    usage();
    return 2;
  }
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
  synthetic::InputSpec spec;
  spec.tokens_per_rank.assign(ep, tokens);
  spec.seed = o.seed;
  const auto inputs = synthetic::make_inputs(c, spec);
  const auto experts = synthetic::make_experts(c, o.seed + 1);

  std::vector<std::vector<float>> y, dy(ep);
  const auto t0 = std::chrono::steady_clock::now();
  if (Status s = reference::forward(c, inputs, experts, &y); !s.ok()) {
    std::fprintf(stderr, "epflow-bench: %s\n", s.to_string().c_str());
    return 1;
  }
  const auto t1 = std::chrono::steady_clock::now();
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
  std::printf("preset %s (H %lld, I %lld, %d experts, top-%d), %d simulated ranks x %lld tokens\n",
              p->name.c_str(), static_cast<long long>(c.hidden),
              static_cast<long long>(c.intermediate), c.num_experts, c.top_k, ep,
              static_cast<long long>(tokens));
  std::printf("%-6s %-8s %14s %14s %14s\n", "rank", "tokens", "|y|", "|dx|", "|dW_down|");
  for (int32_t r = 0; r < ep; ++r)
    std::printf("%-6d %-8lld %14.6f %14.6f %14.6f\n", r,
                static_cast<long long>(inputs[r].num_tokens), norm(y[r]), norm(grads[r].dx),
                norm(grads[r].d_down));
  const double flops = forward_flops(c, routed);
  std::printf(
      "CPU reference: forward %.3f s (%.2f GFLOP/s), backward %.3f s (%.2f GFLOP/s); "
      "CPU timings, not a GPU benchmark\n",
      fwd_s, flops / fwd_s * 1e-9, bwd_s, 2 * flops / bwd_s * 1e-9);
  return 0;
}

// --- GPU layer benchmark ---------------------------------------------------------------------

constexpr int kStages = 4;
const char* const kStageNames[kStages] = {"metadata+schedule", "dispatch", "expert FFN",
                                          "combine+sum"};

struct RankResult {
  double total_us = 0;
  double stage_us[kStages] = {};
  int64_t routed_slots = 0;     // this rank's (token, k) slots with an expert
  int64_t rows_received = 0;    // rows this rank's experts computed
  int64_t nvlink_rows_in = 0;   // rows pulled from other ranks (dispatch)
  int64_t nvlink_rows_out = 0;  // rows pushed to other ranks (combine), same count
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

Status bench_rank(const LayerConfig& c, const std::vector<bench::Routing>& routing, int64_t T,
                  const Options& o, ncclComm_t comm, RankResult* out) {
  std::unique_ptr<Layer> layer;
  EPFLOW_RETURN_IF_ERROR(Layer::create(c, comm, &layer));
  const int64_t H = c.hidden, I = c.intermediate;
  const int64_t E = c.experts_per_rank(), K = c.top_k;
  std::vector<void*> buffers;
  auto alloc = [&](size_t bytes) {
    void* p = nullptr;
    if (cudaMalloc(&p, std::max<size_t>(bytes, 16)) != cudaSuccess) return p;
    buffers.push_back(p);
    return p;
  };
  auto* gate = static_cast<__nv_bfloat16*>(alloc(E * I * H * 2));
  auto* up = static_cast<__nv_bfloat16*>(alloc(E * I * H * 2));
  auto* down = static_cast<__nv_bfloat16*>(alloc(E * H * I * 2));
  auto* x = static_cast<__nv_bfloat16*>(alloc(T * H * 2));
  auto* y = static_cast<__nv_bfloat16*>(alloc(T * H * 2));
  auto* idx = static_cast<int32_t*>(alloc(T * K * 4));
  auto* tw = static_cast<float*>(alloc(T * K * 4));
  if (buffers.size() != 7) return Status(StatusCode::kCudaError, "cudaMalloc of bench buffers");
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  // The inputs every system of the comparison sees (bench/bench_inputs.h).
  const uint32_t rank = static_cast<uint32_t>(c.ep_rank);
  using bench::InputStream;
  bench::fill_uniform_bf16(gate, E * I * H, bench::fan_in_scale(H),
                           bench::stream_key(o.seed, InputStream::kGate, rank), stream);
  bench::fill_uniform_bf16(up, E * I * H, bench::fan_in_scale(H),
                           bench::stream_key(o.seed, InputStream::kUp, rank), stream);
  bench::fill_uniform_bf16(down, E * H * I, bench::fan_in_scale(I),
                           bench::stream_key(o.seed, InputStream::kDown, rank), stream);
  bench::fill_uniform_bf16(x, T * H, 1.0f, bench::stream_key(o.seed, InputStream::kX, rank),
                           stream);
  const auto& in = routing[c.ep_rank];
  cudaMemcpy(idx, in.topk_idx.data(), T * K * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(tw, in.topk_weights.data(), T * K * 4, cudaMemcpyHostToDevice);

  ForwardArgs a;
  a.num_tokens = T;
  a.x = x;
  a.topk_idx = idx;
  a.topk_weights = tw;
  a.weights = {gate, up, down};
  a.y = y;
  const int n = o.warmup + o.iters;
  std::vector<StageEvents> ev(n);
  for (auto& e : ev)
    for (cudaEvent_t* p : {&e.start, &e.schedule_done, &e.dispatch_done, &e.ffn_done, &e.end})
      cudaEventCreate(p);
  for (int i = 0; i < n; ++i)
    EPFLOW_RETURN_IF_ERROR(LayerInternals::forward_with_stage_events(*layer, a, stream, ev[i]));
  if (cudaError_t e = cudaStreamSynchronize(stream); e != cudaSuccess)
    return error_status(StatusCode::kCudaError, "benchmark run: ", cudaGetErrorString(e));
  std::vector<double> total, stage[kStages];
  for (int i = o.warmup; i < n; ++i) {
    const cudaEvent_t marks[kStages + 1] = {ev[i].start, ev[i].schedule_done, ev[i].dispatch_done,
                                            ev[i].ffn_done, ev[i].end};
    float ms = 0;
    cudaEventElapsedTime(&ms, marks[0], marks[kStages]);
    total.push_back(ms * 1e3);
    for (int s = 0; s < kStages; ++s) {
      cudaEventElapsedTime(&ms, marks[s], marks[s + 1]);
      stage[s].push_back(ms * 1e3);
    }
  }
  out->total_us = median(total);
  for (int s = 0; s < kStages; ++s) out->stage_us[s] = median(stage[s]);
  for (auto& e : ev)
    for (cudaEvent_t p : {e.start, e.schedule_done, e.dispatch_done, e.ffn_done, e.end})
      cudaEventDestroy(p);
  for (void* p : buffers) cudaFree(p);
  cudaStreamDestroy(stream);
  return Status::ok_status();
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

std::string device_name() {
  cudaDeviceProp prop;
  return cudaGetDeviceProperties(&prop, 0) == cudaSuccess ? prop.name : "unknown";
}

int run_gpu(const Options& o, int devices) {
  const int32_t ep = o.ep > 0 ? o.ep : devices;
  if (ep > devices) {
    std::fprintf(stderr, "epflow-bench: --ep %d but only %d GPUs\n", ep, devices);
    return 2;
  }
  const auto presets = o.presets.empty() ? std::vector<std::string>{"deepseek-v3"} : o.presets;
  const auto token_list = o.tokens.empty() ? std::vector<int64_t>{4096} : o.tokens;
  const std::string device = device_name();
  const char* commit = std::getenv("EPFLOW_COMMIT");
  std::printf("epflow-bench: %d x %s, EP=%d, bf16, median of %d iterations after %d warm-up\n", ep,
              device.c_str(), ep, o.iters, o.warmup);
  std::ostringstream json;
  json << "{\n  \"device\": \"" << device << "\",\n  \"ep\": " << ep << ",\n  \"commit\": \""
       << (commit ? commit : "unknown") << "\",\n  \"runs\": [";
  bool first = true;
  for (const auto& name : presets) {
    const bench::Preset* p = bench::find_preset(name);
    if (!p) {
      usage();
      return 2;
    }
    for (int64_t T : token_list) {
      const LayerConfig c = bench::layer_config(*p, ep, T);
      std::vector<bench::Routing> routing;
      for (int32_t r = 0; r < ep; ++r)
        routing.push_back(bench::make_routing(o.seed, r, T, c.num_experts, c.top_k));
      std::vector<RankResult> results(ep);
      count_traffic(c, routing, &results);
      std::mutex mu;
      const Status s = run_on_local_gpus(ep, [&](int rank, ncclComm_t comm) {
        LayerConfig rc = c;
        rc.ep_rank = rank;
        RankResult r;
        Status st = bench_rank(rc, routing, T, o, comm, &r);
        std::lock_guard<std::mutex> lock(mu);
        results[rank].total_us = r.total_us;
        std::copy(r.stage_us, r.stage_us + kStages, results[rank].stage_us);
        return st;
      });
      if (!s.ok()) {
        std::fprintf(stderr, "epflow-bench: %s\n", s.to_string().c_str());
        return 1;
      }
      // The slowest rank sets the layer's time; report it, per stage too.
      const auto& slow = *std::max_element(
          results.begin(), results.end(),
          [](const RankResult& a, const RankResult& b) { return a.total_us < b.total_us; });
      const double flops = forward_flops(c, slow.routed_slots);
      const double ffn_flops = forward_flops(c, slow.rows_received);
      const double row_bytes = 2.0 * c.hidden;
      std::printf("\n%s (H %lld, I %lld, %d experts/rank, top-%d), %lld tokens/rank\n",
                  p->name.c_str(), (long long)c.hidden, (long long)c.intermediate,
                  c.experts_per_rank(), c.top_k, (long long)T);
      std::printf("  %-20s %10s %12s %14s %10s\n", "stage", "us", "TFLOP/s/GPU", "NVLink MB",
                  "GB/s");
      std::printf("  %-20s %10.1f %12.1f\n", "layer", slow.total_us, flops / slow.total_us * 1e-6);
      for (int st = 0; st < kStages; ++st) {
        const double us = slow.stage_us[st];
        std::printf("  %-20s %10.1f", kStageNames[st], us);
        if (st == 2) std::printf(" %12.1f", ffn_flops / us * 1e-6);
        if (st == 1 || st == 3) {
          const double bytes = (st == 1 ? slow.nvlink_rows_in : slow.nvlink_rows_out) * row_bytes;
          std::printf(" %12s %14.1f %10.1f", "", bytes * 1e-6, bytes / us * 1e-3);
        }
        std::printf("\n");
      }
      json << (first ? "" : ",") << "\n    {\"preset\": \"" << p->name << "\", \"tokens\": " << T
           << ", \"layer_us\": " << slow.total_us
           << ", \"layer_tflops_per_gpu\": " << flops / slow.total_us * 1e-6;
      for (int st = 0; st < kStages; ++st)
        json << ", \"stage_us_" << st << "\": " << slow.stage_us[st];
      json << ", \"ffn_tflops_per_gpu\": " << ffn_flops / slow.stage_us[2] * 1e-6
           << ", \"dispatch_nvlink_bytes\": " << slow.nvlink_rows_in * row_bytes
           << ", \"combine_nvlink_bytes\": " << slow.nvlink_rows_out * row_bytes << "}";
      first = false;
    }
  }
  json << "\n  ],\n  \"stages\": [";
  for (int st = 0; st < kStages; ++st) json << (st ? ", " : "") << "\"" << kStageNames[st] << "\"";
  json << "]\n}\n";
  if (!o.json.empty()) std::ofstream(o.json) << json.str();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse(argc, argv, &o)) {
    usage();
    return 2;
  }
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) return run_cpu_reference(o, "no GPU found");
  return run_gpu(o, devices);
}
