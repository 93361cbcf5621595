// EPFlow from C++: checks a config, then runs one MoE layer forward over every local GPU (one
// expert-parallel rank per GPU, as threads of this process). Build it against an installed EPFlow:
// scripts/build_example.sh, or examples/cpp/CMakeLists.txt with -DCMAKE_PREFIX_PATH=<prefix>.
#include <epflow/epflow.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#define RETURN_IF_ERROR(expr)                            \
  do {                                                   \
    if (epflow::Status s_ = (expr); !s_.ok()) return s_; \
  } while (0)

namespace {

epflow::Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return epflow::Status::ok_status();
  return {epflow::StatusCode::kCudaError, std::string(what) + ": " + cudaGetErrorString(e)};
}

// Device copies of host vectors, freed together.
struct DeviceArrays {
  std::vector<void*> allocations;
  ~DeviceArrays() {
    for (void* p : allocations) cudaFree(p);
  }
  template <typename T, typename P>
  epflow::Status upload(const std::vector<T>& host, P** out) {
    void* p = nullptr;
    RETURN_IF_ERROR(cuda_status(cudaMalloc(&p, host.size() * sizeof(T)), "cudaMalloc"));
    allocations.push_back(p);
    *out = static_cast<P*>(p);
    return cuda_status(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
                       "cudaMemcpy");
  }
};

// Deterministic pseudo-random numbers, the same on every platform (std:: distributions are not).
struct Rng {
  uint64_t state;
  uint32_t next() {  // 31 bits
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<uint32_t>(state >> 33);
  }
  std::vector<__nv_bfloat16> bf16(int64_t n, float scale) {  // uniform in [-scale, scale)
    std::vector<__nv_bfloat16> v(n);
    for (auto& e : v) e = __float2bfloat16(scale * (next() * 0x1p-30f - 1.0f));
    return v;
  }
};

// One rank: its tokens and experts, one forward, the memory report and a checksum of y.
epflow::Status run_rank(int rank, int world, ncclComm_t comm) {
  const epflow::LayerConfig config{.hidden = 1024,
                                   .intermediate = 512,
                                   .num_experts = 8 * world,  // 8 experts on every rank
                                   .top_k = 2,
                                   .ep_size = world,
                                   .ep_rank = rank,
                                   .max_tokens_per_rank = 256};
  std::unique_ptr<epflow::Layer> layer;
  RETURN_IF_ERROR(epflow::Layer::create(config, comm, &layer));

  const int64_t T = config.max_tokens_per_rank, H = config.hidden, I = config.intermediate;
  const int64_t E_local = config.experts_per_rank(), K = config.top_k;
  Rng rng{static_cast<uint64_t>(rank) + 1};
  std::vector<int32_t> topk_idx(T * K);  // global expert ids: K consecutive from a random one
  for (int64_t t = 0; t < T; ++t) {
    const uint32_t first = rng.next();
    for (int64_t k = 0; k < K; ++k)
      topk_idx[t * K + k] = static_cast<int32_t>((first + k) % config.num_experts);
  }

  epflow::ForwardArgs args;  // every array row-major on the device, weights bf16 [E_local, ...]
  args.num_tokens = T;
  DeviceArrays dev;
  RETURN_IF_ERROR(dev.upload(rng.bf16(T * H, 1.0f), &args.x));
  RETURN_IF_ERROR(dev.upload(topk_idx, &args.topk_idx));
  RETURN_IF_ERROR(dev.upload(std::vector<float>(T * K, 1.0f / K), &args.topk_weights));
  RETURN_IF_ERROR(dev.upload(rng.bf16(E_local * I * H, 1 / std::sqrt(H)), &args.weights.gate));
  RETURN_IF_ERROR(dev.upload(rng.bf16(E_local * I * H, 1 / std::sqrt(H)), &args.weights.up));
  RETURN_IF_ERROR(dev.upload(rng.bf16(E_local * H * I, 1 / std::sqrt(I)), &args.weights.down));
  std::vector<__nv_bfloat16> y(T * H);
  RETURN_IF_ERROR(dev.upload(y, &args.y));

  RETURN_IF_ERROR(layer->forward(args, /*stream=*/nullptr, /*saved=*/nullptr));
  // A kernel's error surfaces here; with_device_failure names the wait behind it if one timed out.
  RETURN_IF_ERROR(
      epflow::with_device_failure(*layer, cuda_status(cudaStreamSynchronize(nullptr), "forward")));
  RETURN_IF_ERROR(cuda_status(
      cudaMemcpy(y.data(), args.y, y.size() * sizeof(y[0]), cudaMemcpyDeviceToHost), "cudaMemcpy"));
  double checksum = 0;
  for (__nv_bfloat16 v : y) checksum += __bfloat162float(v);
  const epflow::MemoryReport m = layer->memory();
  std::printf(
      "rank %d: memory symmetric %lld ring %lld schedule %lld backward %lld total %lld bytes; "
      "sum(y) = %.6f\n",
      rank, (long long)m.symmetric_bytes, (long long)m.ring_bytes, (long long)m.schedule_bytes,
      (long long)m.backward_bytes, (long long)m.total(), checksum);
  return epflow::Status::ok_status();
}

}  // namespace

int main() {
  // validate() needs no device: a config the kernels cannot run is refused with the reason.
  const epflow::LayerConfig bad{.hidden = 1024,
                                .intermediate = 512,
                                .num_experts = 8,
                                .top_k = 9,
                                .max_tokens_per_rank = 256};
  std::printf("validate(top_k 9 of 8 experts): %s\n", epflow::validate(bad).to_string().c_str());

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: skipping the forward\n");
    return 0;
  }
  const epflow::Status s = epflow::run_on_local_gpus(
      devices, [devices](int rank, ncclComm_t comm) { return run_rank(rank, devices, comm); });
  if (!s.ok()) std::fprintf(stderr, "%s\n", s.to_string().c_str());
  return s.ok() ? 0 : 1;
}
