// Experiment (not part of EPFlow): DeepGEMM's SM90 FP8 m-grouped contiguous GEMM (1D2D kernel,
// the configuration its own heuristic picks for these shapes: 128 x 192 tiles, 4 stages, CTA
// pairs multicasting the weight tile) and EPFlow's standalone FP8 grouped GEMM on the same
// inputs, in the same process, timed alike: DeepSeek-V3's expert shapes (32 experts, gate|up
// 7168 -> 4096, down 2048 -> 7168), equal rows per expert. Both outputs are checked against a CPU
// computation on sampled rows and against each other over the whole output.
//
// Protocol (as epflow-fp8-gemm-bench): per point and kernel, --settle-ms of untimed calls (default
// 0), 100 untimed calls, then 3 rounds of 20 calls timed one by one with CUDA events; a round's
// figure is its median, the kernel's the median of rounds. The two kernels alternate: EPFlow then
// DeepGEMM, then DeepGEMM then EPFlow, and each kernel's figure is the median over both passes'
// rounds.
//
// Build and run: experiments/deepgemm_same_run/README.md.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh>
#include <string>
#include <vector>

#include "common/fp8_blocks.h"
#include "fp8_gemm_common.cuh"
#include "kernels/fp8_grouped_gemm.cuh"
#include "settle.h"

namespace {

using epflow::bench::check;
using epflow::bench::fill_e4m3;
using epflow::bench::fill_scales;
using epflow::bench::median;
using epflow::bench::median_call_us;
using epflow::bench::Shape;
using epflow::bench::to_host;
template <class T>
using Buf = epflow::bench::DeviceBuffer<T>;

constexpr int kExperts = 32;
constexpr int kBlockM = 128, kBlockN = 192, kBlockK = 128, kStages = 4, kSms = 132;

template <uint32_t N, uint32_t K>
constexpr auto dg_kernel = &deep_gemm::sm90_fp8_gemm_1d2d_impl<
    cute::UMMA::Major::K, 0, N, K, kExperts, kBlockM, kBlockN, kBlockK, 128, 128, 128, kStages, 128,
    256, 2, false, kSms, deep_gemm::GemmType::MGroupedContiguous, cutlass::bfloat16_t,
    deep_gemm::epilogue::transform::EpilogueIdentity>;

// DeepGEMM's shared memory for this configuration (its SM90 heuristic's pipeline config).
int dg_smem_bytes(int64_t k) {
  auto align = [](int64_t x, int64_t a) { return (x + a - 1) / a * a; };
  const int64_t cd = align(kBlockM * kBlockN * 2, 1024), barriers = 16 * 8 * 2;
  const int64_t sfb = align((k + kBlockK - 1) / kBlockK * 4 * 2, 8);  // 128 % 192 != 0: two rows
  const int64_t per_stage = kBlockM * kBlockK + kBlockN * kBlockK + align(kBlockM * 4, 128);
  return static_cast<int>(cd + barriers + sfb + kStages * per_stage);
}

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled encode_tiled() {
  static EncodeTiled fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    check(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                           &q),
          "cuTensorMapEncodeTiled entry point");
    return reinterpret_cast<EncodeTiled>(p);
  }();
  return fn;
}

// DeepGEMM's make_tma_2d_desc: dims {inner, outer}, the outer stride in elements.
CUtensorMap tma_2d(CUtensorMapDataType type, int elem, void* p, uint64_t inner, uint64_t outer,
                   uint32_t box_inner, uint32_t box_outer, uint64_t outer_stride, int swizzle) {
  if (swizzle != 0) box_inner = swizzle / elem;
  CUtensorMap m;
  const cuuint64_t dims[2] = {inner, outer};
  const cuuint64_t strides[1] = {outer_stride * elem};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t estr[2] = {1, 1};
  const CUtensorMapSwizzle sw = swizzle == 128  ? CU_TENSOR_MAP_SWIZZLE_128B
                                : swizzle == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                : swizzle == 32 ? CU_TENSOR_MAP_SWIZZLE_32B
                                                : CU_TENSOR_MAP_SWIZZLE_NONE;
  const CUresult r =
      encode_tiled()(&m, type, 2, p, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, sw,
                     CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "dg_vs_epflow: cuTensorMapEncodeTiled failed (%d)\n", static_cast<int>(r));
    std::exit(1);
  }
  return m;
}

// DeepGEMM's A scales: MN-major [k_blocks][rows_aligned]; ours: [rows][stride].
__global__ void transpose_scales(const float* ours, int64_t stride, int64_t rows, int64_t kb_n,
                                 int64_t rows_aligned, float* dg) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < rows * kb_n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / kb_n, kb = i % kb_n;
    dg[kb * rows_aligned + r] = ours[r * stride + kb];
  }
}

__global__ void group_of_rows(int* layout, int64_t rows, int64_t per) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < rows;
       i += int64_t{gridDim.x} * blockDim.x)
    layout[i] = static_cast<int>(i / per);
}

struct Options {
  std::vector<int64_t> rows = {128, 512, 1024, 2048};
  int warmup = 100, iters = 20, rounds = 3;
  int64_t settle_ms = 0;
  std::string json;
};

// Rounds of one kernel: settle, warm up, then `rounds` rounds of `iters` timed calls.
template <class Launch>
std::vector<double> time_rounds(Launch&& launch, const Options& o) {
  auto call = [&] {
    launch();
    return true;
  };
  if (!epflow::bench::settle_locally(call, nullptr, static_cast<double>(o.settle_ms)))
    check(cudaErrorUnknown, "timing a settling call");
  for (int i = 0; i < o.warmup; ++i) launch();
  std::vector<double> rounds;
  for (int r = 0; r < o.rounds; ++r) rounds.push_back(median_call_us(launch, o.iters));
  return rounds;
}

double rel_err(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    num += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    den += double(want[i]) * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

struct Point {
  Shape shape;
  int64_t per;
  std::vector<double> ours_rounds, dg_rounds;
  double ours_err = 0, dg_err = 0, ours_vs_dg = 0;
};

template <uint32_t N, uint32_t K>
Point run_point(const Shape& s, int64_t per, const Options& o) {
  const int64_t rows = kExperts * per, kb_n = s.k / 128, nb_n = s.n / 128;
  const int64_t as_stride = (kb_n + 3) / 4 * 4, rows_aligned = (rows + 3) / 4 * 4;
  Buf<uint8_t> a(rows * s.k), w(kExperts * s.n * s.k);
  Buf<float> as(rows * as_stride), ws(kExperts * nb_n * kb_n), sfa(kb_n * rows_aligned);
  Buf<__nv_bfloat16> out_ours(rows * s.n), out_dg(rows * s.n);
  Buf<int64_t> seg(kExperts + 1);
  Buf<int> layout(rows);
  std::vector<int64_t> h_seg(kExperts + 1);
  for (int e = 0; e <= kExperts; ++e) h_seg[e] = e * per;
  check(cudaMemcpy(seg.p, h_seg.data(), sizeof(int64_t) * h_seg.size(), cudaMemcpyHostToDevice),
        "segments");
  fill_e4m3<<<1024, 256>>>(a.p, rows * s.k, 11);
  fill_e4m3<<<1024, 256>>>(w.p, kExperts * s.n * s.k, 12);
  fill_scales<<<256, 256>>>(as.p, rows * as_stride, 13);
  fill_scales<<<256, 256>>>(ws.p, kExperts * nb_n * kb_n, 14);
  transpose_scales<<<1024, 256>>>(as.p, as_stride, rows, kb_n, rows_aligned, sfa.p);
  group_of_rows<<<256, 256>>>(layout.p, rows, per);
  check(cudaMemset(out_ours.p, 0xFF, sizeof(__nv_bfloat16) * rows * s.n), "poison");
  check(cudaMemset(out_dg.p, 0xFF, sizeof(__nv_bfloat16) * rows * s.n), "poison");
  check(cudaDeviceSynchronize(), "inputs");

  const epflow::kernels::Fp8GroupedGemmArgs g{
      .segments = epflow::kernels::ExpertSegments{kExperts, rows, seg.p, nullptr},
      .n = s.n,
      .k = s.k,
      .a = a.p,
      .a_scales = as.p,
      .a_scale_stride = as_stride,
      .w = w.p,
      .w_scales = ws.p,
      .out = out_ours.p};
  auto ours = [&] { check(epflow::kernels::launch_fp8_grouped_gemm(g, nullptr), "EPFlow GEMM"); };

  const CUtensorMap ta =
      tma_2d(CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, a.p, s.k, rows, kBlockK, kBlockM, s.k, 128);
  const CUtensorMap tb = tma_2d(CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, w.p, s.k, s.n * kExperts, kBlockK,
                                kBlockN, s.k, 128);
  const CUtensorMap td =
      tma_2d(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, out_dg.p, s.n, rows, kBlockN, kBlockM, s.n, 128);
  const CUtensorMap tsfa = tma_2d(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, sfa.p, rows_aligned, kb_n,
                                  kBlockM, 1, rows_aligned, 0);
  const int smem = dg_smem_bytes(s.k);
  auto kernel = dg_kernel<N, K>;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
        "DeepGEMM smem attribute");
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim = {2, 1, 1};
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(kSms);
  cfg.blockDim = dim3(384);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = nullptr;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  float* sfb = ws.p;
  int* gl = layout.p;
  const uint32_t m32 = static_cast<uint32_t>(rows), n32 = N, k32 = K;
  auto dg = [&] {
    check(cudaLaunchKernelEx(&cfg, kernel, sfb, gl, m32, n32, k32, ta, tb, td, tsfa),
          "DeepGEMM GEMM");
  };

  Point pt{s, per};
  // Correctness first: one call each, then the checks.
  ours();
  dg();
  check(cudaDeviceSynchronize(), "first calls");
  {
    const auto o_all = to_host(out_ours.p, rows * s.n), d_all = to_host(out_dg.p, rows * s.n);
    std::vector<float> of(o_all.size()), df(d_all.size());
    for (size_t i = 0; i < of.size(); ++i)
      of[i] = __bfloat162float(o_all[i]), df[i] = __bfloat162float(d_all[i]);
    pt.ours_vs_dg = rel_err(of, df);
    float lut[256];
    for (int b = 0; b < 256; ++b)
      lut[b] = epflow::fp8::to_float(static_cast<__nv_fp8_storage_t>(b));
    const auto ha = to_host(a.p, rows * s.k);
    const auto has = to_host(as.p, rows * as_stride);
    const auto hws = to_host(ws.p, kExperts * nb_n * kb_n);
    for (int64_t r : {int64_t{0}, rows / 2 + per / 3, rows - 1}) {
      const int64_t e = r / per;
      const auto hw = to_host(w.p + e * s.n * s.k, s.n * s.k);
      std::vector<float> want(s.n), got_o(s.n), got_d(s.n);
      for (int64_t c = 0; c < s.n; ++c) {
        double y = 0;
        for (int64_t kb = 0; kb < kb_n; ++kb) {
          double part = 0;
          for (int64_t kk = kb * 128; kk < kb * 128 + 128; ++kk)
            part += double(lut[ha[r * s.k + kk]]) * lut[hw[c * s.k + kk]];
          y += part * has[r * as_stride + kb] * hws[(e * nb_n + c / 128) * kb_n + kb];
        }
        want[c] = static_cast<float>(y);
        got_o[c] = of[r * s.n + c];
        got_d[c] = df[r * s.n + c];
      }
      pt.ours_err = std::max(pt.ours_err, rel_err(got_o, want));
      pt.dg_err = std::max(pt.dg_err, rel_err(got_d, want));
    }
  }
  for (int pass = 0; pass < 2; ++pass) {
    auto first = pass == 0 ? time_rounds(ours, o) : time_rounds(dg, o);
    auto second = pass == 0 ? time_rounds(dg, o) : time_rounds(ours, o);
    auto& o_r = pass == 0 ? first : second;
    auto& d_r = pass == 0 ? second : first;
    pt.ours_rounds.insert(pt.ours_rounds.end(), o_r.begin(), o_r.end());
    pt.dg_rounds.insert(pt.dg_rounds.end(), d_r.begin(), d_r.end());
  }
  return pt;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string f = argv[i], v = argv[i + 1];
    if (f == "--rows") {
      o.rows.clear();
      for (size_t p = 0; p < v.size();) {
        const size_t q = v.find(',', p);
        o.rows.push_back(std::stoll(v.substr(p, q - p)));
        p = q == std::string::npos ? v.size() : q + 1;
      }
    } else if (f == "--settle-ms") {
      o.settle_ms = std::stoll(v);
    } else if (f == "--json") {
      o.json = v;
    } else {
      std::fprintf(stderr, "usage: dg_vs_epflow [--rows R,..] [--settle-ms N] [--json PATH]\n");
      return 2;
    }
  }
  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, 0), "device");
  if (prop.multiProcessorCount != kSms) {
    std::fprintf(stderr, "dg_vs_epflow: built for %d SMs, the device has %d\n", kSms,
                 prop.multiProcessorCount);
    return 1;
  }
  const char* commit = std::getenv("EPFLOW_COMMIT");
  std::printf(
      "DeepGEMM (SM90 1D2D, 128 x 192, 4 stages, pairs multicasting B) vs EPFlow FP8 "
      "grouped GEMM, %d experts, %s; settle %lld ms, %d warm-up, 2 passes x %d rounds x "
      "%d calls\n",
      kExperts, prop.name, static_cast<long long>(o.settle_ms), o.warmup, o.rounds, o.iters);
  std::printf("%-22s %6s %10s %10s %10s %10s %8s  %-10s %-10s %-10s\n", "shape", "rows",
              "EPFlow us", "DG us", "EPFlow TF", "DG TF", "EP/DG", "err EP", "err DG", "EP vs DG");
  std::vector<Point> pts;
  const Shape gu{"gate|up 7168 -> 4096", 4096, 7168}, dn{"down 2048 -> 7168", 7168, 2048};
  for (int which = 0; which < 2; ++which)
    for (int64_t per : o.rows) {
      Point p = which == 0 ? run_point<4096, 7168>(gu, per, o) : run_point<7168, 2048>(dn, per, o);
      const double flops = 2.0 * kExperts * per * p.shape.n * p.shape.k;
      const double ou = median(p.ours_rounds), du = median(p.dg_rounds);
      std::printf("%-22s %6lld %10.1f %10.1f %10.0f %10.0f %8.3f  %-10.1e %-10.1e %-10.1e\n",
                  p.shape.name, static_cast<long long>(per), ou, du, flops / ou * 1e-6,
                  flops / du * 1e-6, du / ou, p.ours_err, p.dg_err, p.ours_vs_dg);
      std::fflush(stdout);
      pts.push_back(p);
    }
  if (!o.json.empty()) {
    FILE* f = std::fopen(o.json.c_str(), "w");
    if (!f) return 1;
    std::fprintf(
        f,
        "{\n  \"kind\": \"fp8-gemm-vs-deepgemm\",\n  \"device\": \"%s\",\n"
        "  \"commit\": \"%s\",\n  \"experts\": %d,\n  \"settle_ms\": %lld,\n  \"warmup\": %d,\n"
        "  \"iters\": %d,\n  \"rounds_per_pass\": %d,\n  \"runs\": [",
        prop.name, commit ? commit : "unknown", kExperts, static_cast<long long>(o.settle_ms),
        o.warmup, o.iters, o.rounds);
    for (size_t i = 0; i < pts.size(); ++i) {
      const Point& p = pts[i];
      std::fprintf(f,
                   "%s\n    {\"shape\": \"%s\", \"rows_per_expert\": %lld, \"epflow_rounds_us\": [",
                   i ? "," : "", p.shape.name, static_cast<long long>(p.per));
      for (size_t j = 0; j < p.ours_rounds.size(); ++j)
        std::fprintf(f, "%s%.3f", j ? ", " : "", p.ours_rounds[j]);
      std::fprintf(f, "], \"deepgemm_rounds_us\": [");
      for (size_t j = 0; j < p.dg_rounds.size(); ++j)
        std::fprintf(f, "%s%.3f", j ? ", " : "", p.dg_rounds[j]);
      std::fprintf(f,
                   "], \"epflow_rel_err\": %.3e, \"deepgemm_rel_err\": %.3e, "
                   "\"epflow_vs_deepgemm\": %.3e}",
                   p.ours_err, p.dg_err, p.ours_vs_dg);
    }
    std::fprintf(f, "\n  ]\n}\n");
    std::fclose(f);
  }
  return 0;
}
