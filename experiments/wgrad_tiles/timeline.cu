// Experiment (not part of EPFlow; experiments/wgrad_tiles/README.md): where the FP8
// weight-gradient GEMM's time per output tile goes. Runs launch_fp8_expert_wgrad, from a build
// patched by timeline.patch to stamp each tile's phases with clock64, on DeepSeek-V3's two
// weight-gradient shapes (32 experts; d W_down [7168, 2048], d W_gate and d W_up [2048, 7168]) at
// the given tokens per rank (top-8, the same rows per expert), random e4m3 operands and scales.
// Prints each shape's time (CUDA events: 5 untimed launches, then the median of 10 timed one by
// one) and writes the stamps of one more launch, every CTA's tiles, to a CSV for summarize.py.
//
//   timeline TOKENS OUT.csv
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common/fp8_blocks.h"
#include "fp8_gemm_common.cuh"
#include "kernels/expert_wgrad.cuh"

namespace {

using epflow::bench::check;
using epflow::bench::fill_e4m3;
using epflow::bench::fill_scales;
using epflow::bench::median_call_us;
template <class T>
using Buf = epflow::bench::DeviceBuffer<T>;
namespace k = epflow::kernels;

constexpr int kExperts = 32, kTopK = 8;

// The packed rows' scales (after each row's max_rows e4m3 bytes), as fill_scales' values.
__global__ void fill_row_scales(uint8_t* packed, int64_t rows, int64_t row_bytes, int64_t max_rows,
                                uint64_t seed) {
  const int64_t per_row = max_rows / epflow::fp8::kBlock;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < rows * per_row;
       i += int64_t{gridDim.x} * blockDim.x) {
    reinterpret_cast<float*>(packed + (i / per_row) * row_bytes + max_rows)[i % per_row] =
        epflow::bench::random_scale(i, seed);
  }
}

struct WgradShape {
  const char* name;
  int64_t m, n;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s TOKENS_PER_RANK OUT.csv\n", argv[0]);
    return 2;
  }
  const int64_t tokens = std::atoll(argv[1]);
  const int64_t kB = epflow::fp8::kBlock;
  const int64_t rows = (tokens * kTopK / kExperts + kB - 1) / kB * kB;  // per expert
  const int64_t max_rows = rows * kExperts;
  if (tokens <= 0 || rows == 0) {
    std::fprintf(stderr, "timeline: TOKENS_PER_RANK must give every expert rows\n");
    return 2;
  }
  std::vector<int64_t> seg(kExperts + 1);
  for (int e = 0; e <= kExperts; ++e) seg[e] = e * rows;
  std::vector<int32_t> real(kExperts, static_cast<int32_t>(rows));
  Buf<int64_t> seg_d(kExperts + 1);
  Buf<int32_t> real_d(kExperts);
  check(cudaMemcpy(seg_d.p, seg.data(), sizeof(int64_t) * seg.size(), cudaMemcpyHostToDevice),
        "copy segments");
  check(cudaMemcpy(real_d.p, real.data(), sizeof(int32_t) * real.size(), cudaMemcpyHostToDevice),
        "copy rows");
  std::FILE* out = std::fopen(argv[2], "w");
  if (!out) {
    std::perror(argv[2]);
    return 1;
  }
  std::fprintf(out, "shape,m,n,k_blocks,cta,tile");
  for (int s = 0; s < k::kWgradStampSlots; ++s) std::fprintf(out, ",s%d", s);
  std::fprintf(out, "\n");
  const WgradShape shapes[] = {{"d_down", 7168, 2048}, {"d_gate", 2048, 7168}};
  for (const WgradShape& sh : shapes) {
    const int64_t row_bytes = epflow::fp8::packed_row_bytes(max_rows);
    Buf<uint8_t> a_t(sh.m * row_bytes), b_t(sh.n * max_rows);
    Buf<float> b_scales(sh.n / kB * (max_rows / kB));
    Buf<__nv_bfloat16> dw(kExperts * sh.m * sh.n);
    fill_e4m3<<<1024, 256>>>(a_t.p, sh.m * row_bytes, 1);
    fill_row_scales<<<1024, 256>>>(a_t.p, sh.m, row_bytes, max_rows, 2);
    fill_e4m3<<<1024, 256>>>(b_t.p, sh.n * max_rows, 3);
    fill_scales<<<1024, 256>>>(b_scales.p, sh.n / kB * (max_rows / kB), 4);
    check(cudaGetLastError(), "fill");
    k::Fp8ExpertWgradArgs a;
    a.segments = k::ExpertSegments{kExperts, max_rows, seg_d.p, real_d.p};
    a.m = sh.m;
    a.n = sh.n;
    a.a_t = a_t.p;
    a.b_t = b_t.p;
    a.b_scales = b_scales.p;
    a.dw = dw.p;
    auto launch = [&] { check(k::launch_fp8_expert_wgrad(a, nullptr), "launch"); };
    for (int i = 0; i < 5; ++i) launch();
    const double us = median_call_us(launch, 10);
    const double flops = 2.0 * kExperts * sh.m * sh.n * rows;
    std::printf("%s [%lld, %lld], %lld tokens/rank (%lld rows per expert): %.1f us, %.0f TFLOPS\n",
                sh.name, static_cast<long long>(sh.m), static_cast<long long>(sh.n),
                static_cast<long long>(tokens), static_cast<long long>(rows), us,
                flops / us * 1e-6);
    check(k::fp8_wgrad_stamps(nullptr, true), "clear stamps");
    launch();
    check(cudaDeviceSynchronize(), "stamped launch");
    std::vector<int64_t> st(static_cast<size_t>(k::kWgradStampCtas) * k::kWgradStampTiles *
                            k::kWgradStampSlots);
    check(k::fp8_wgrad_stamps(st.data(), false), "copy stamps");
    for (int c = 0; c < k::kWgradStampCtas; ++c)
      for (int t = 0; t < k::kWgradStampTiles; ++t) {
        const int64_t* s = &st[(static_cast<size_t>(c) * k::kWgradStampTiles + t) *
                               k::kWgradStampSlots];
        if (s[0] == 0) continue;  // no such tile
        std::fprintf(out, "%s,%lld,%lld,%lld,%d,%d", sh.name, static_cast<long long>(sh.m),
                     static_cast<long long>(sh.n), static_cast<long long>(rows / kB), c, t);
        for (int i = 0; i < k::kWgradStampSlots; ++i)
          std::fprintf(out, ",%lld", static_cast<long long>(s[i]));
        std::fprintf(out, "\n");
      }
  }
  std::fclose(out);
  return 0;
}
