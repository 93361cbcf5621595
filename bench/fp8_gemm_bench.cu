// epflow-fp8-gemm-bench: the block-scaled FP8 grouped GEMM alone (kernels/fp8_grouped_gemm.cuh,
// the mainloop of the FP8 megakernel) at DeepSeek-V3's expert shapes: 32 experts, gate|up
// 7168 -> 4096 (gate and up stacked) and down 2048 -> 7168, equal rows per expert. Operands are
// random e4m3 bytes (no NaN) with random positive scales (1 x 128 on the rows, 128 x 128 on the
// weights). Per point: --warmup untimed calls (optionally --settle-ms of GPU time before them,
// settle.h; DeepGEMM's figures it is compared with were measured without), then --repeats rounds
// of --iters calls timed one by one with CUDA events; a round's figure is its median, the
// point's the median over rounds. Afterwards a few rows of the output are checked against a CPU
// computation from the same bytes and scales (a fast kernel that is wrong must not be reported).
// Results as JSON (--json, kind "fp8-gemm"); bench/report.py renders them against DeepGEMM's
// grouped FP8 GEMM, normalised by the block-wise dense FP8 yardstick of bench/fp8_yardsticks.py.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "bench_check.h"
#include "common/fp8_blocks.h"
#include "fp8_gemm_common.cuh"
#include "kernels/fp8_grouped_gemm.cuh"
#include "settle.h"

namespace {

using namespace epflow;

constexpr int32_t kExperts = 32;
constexpr double kRelTol = 1e-2;  // bf16 output rounding is ~2e-3 of a row's norm

struct Options {
  std::vector<int64_t> rows = {128, 512, 1024, 2048};
  int warmup = 100, iters = 20, repeats = 3;
  int64_t settle_ms = 0;
  uint64_t seed = 1;
  std::string json;
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "epflow-fp8-gemm-bench: %s\n"
               "usage: epflow-fp8-gemm-bench [--rows R[,R...]] [--warmup N] [--settle-ms N]\n"
               "                             [--iters N] [--repeats N] [--seed S] [--json PATH]\n"
               "  --rows  rows per expert (default 128,512,1024,2048)\n"
               "  --settle-ms  untimed calls for N ms of GPU time before the warm-up (default 0)\n",
               why);
  std::exit(2);
}

int64_t positive(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const long long n = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || n <= 0) usage((flag + " takes a positive integer").c_str());
  return n;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) usage(("missing value after " + a).c_str());
    const std::string v = argv[++i];
    if (a == "--rows") {
      o.rows.clear();
      std::stringstream ss(v);
      for (std::string item; std::getline(ss, item, ',');) {
        o.rows.push_back(positive(a, item));
        // Expert segments are whole tiles (the layer pads them; this bench does not).
        if (o.rows.back() % 128 != 0) usage("--rows takes multiples of 128, the tile height");
      }
    } else if (a == "--warmup") {
      o.warmup = static_cast<int>(positive(a, v));
    } else if (a == "--settle-ms") {
      o.settle_ms = v == "0" ? 0 : positive(a, v);
    } else if (a == "--iters") {
      o.iters = static_cast<int>(positive(a, v));
    } else if (a == "--repeats") {
      o.repeats = static_cast<int>(positive(a, v));
    } else if (a == "--seed") {
      o.seed = static_cast<uint64_t>(positive(a, v));
    } else if (a == "--json") {
      o.json = v;
    } else {
      usage(("unknown option " + a).c_str());
    }
  }
  return o;
}

using bench::check;
using bench::DeviceBuffer;
using bench::fill_e4m3;
using bench::fill_scales;
using bench::median;
using bench::median_call_us;
using bench::Shape;
using bench::to_host;

struct Result {
  Shape shape;
  int64_t rows_per_expert = 0;
  double median_us = 0, tflops = 0, check_rel_err = 0;
  std::vector<double> repeat_us;
};

// out[r, :] of the checked rows from the same bytes and scales on the CPU (double sums of each
// 128-deep block, promoted with both scales as the kernel does): the worst row's relative error
// (bench::rel_err: infinite for a non-finite output, a row never written).
double check_rows(const Shape& s, int64_t per, const uint8_t* d_a, const float* d_as,
                  int64_t as_stride, const uint8_t* d_w, const float* d_ws,
                  const __nv_bfloat16* d_out) {
  const int64_t kb_n = s.k / fp8::kBlock, nb_n = s.n / fp8::kBlock;
  double worst = 0.0;
  const int64_t rows = kExperts * per;
  for (int64_t r : {int64_t{0}, rows / 2 + per / 3, rows - 1}) {
    const int64_t e = r / per;
    const auto a = to_host(d_a + r * s.k, s.k);
    const auto as = to_host(d_as + r * as_stride, kb_n);
    const auto w = to_host(d_w + e * s.n * s.k, s.n * s.k);
    const auto ws = to_host(d_ws + e * nb_n * kb_n, nb_n * kb_n);
    const auto out = to_host(d_out + r * s.n, s.n);
    float lut[256];
    for (int b = 0; b < 256; ++b) lut[b] = fp8::to_float(static_cast<__nv_fp8_storage_t>(b));
    std::vector<float> want(s.n), got(s.n);
    for (int64_t c = 0; c < s.n; ++c) {
      double y = 0.0;
      for (int64_t kb = 0; kb < kb_n; ++kb) {
        double part = 0.0;
        for (int64_t i = kb * fp8::kBlock; i < (kb + 1) * fp8::kBlock; ++i)
          part += double{lut[a[i]]} * lut[w[c * s.k + i]];
        y += part * as[kb] * ws[(c / fp8::kBlock) * kb_n + kb];
      }
      want[c] = static_cast<float>(y);
      got[c] = __bfloat162float(out[c]);
    }
    worst = std::max(worst, bench::rel_err(got, want));
  }
  return worst;
}

Result run_point(const Shape& s, int64_t per, const Options& o) {
  const int64_t rows = kExperts * per, kb_n = s.k / fp8::kBlock, nb_n = s.n / fp8::kBlock;
  const int64_t as_stride = (kb_n + 3) / 4 * 4;  // the kernel's scale rows: whole float4s
  std::vector<int64_t> seg(kExperts + 1);
  for (int32_t e = 0; e <= kExperts; ++e) seg[e] = e * per;
  DeviceBuffer<int64_t> d_seg(kExperts + 1);
  DeviceBuffer<uint8_t> a(rows * s.k), w(kExperts * s.n * s.k);
  DeviceBuffer<float> as(rows * as_stride), ws(kExperts * nb_n * kb_n);
  DeviceBuffer<__nv_bfloat16> out(rows * s.n);
  check(cudaMemcpy(d_seg.p, seg.data(), sizeof(int64_t) * seg.size(), cudaMemcpyHostToDevice),
        "copy segments");
  fill_e4m3<<<1024, 256>>>(a.p, rows * s.k, o.seed * 4 + 0);
  fill_e4m3<<<1024, 256>>>(w.p, kExperts * s.n * s.k, o.seed * 4 + 1);
  fill_scales<<<256, 256>>>(as.p, rows * as_stride, o.seed * 4 + 2);
  fill_scales<<<256, 256>>>(ws.p, kExperts * nb_n * kb_n, o.seed * 4 + 3);
  check(cudaMemset(out.p, 0xFF, sizeof(__nv_bfloat16) * rows * s.n), "poison the output");
  kernels::Fp8GroupedGemmArgs g;
  g.segments = kernels::ExpertSegments{kExperts, rows, d_seg.p, nullptr};
  g.n = s.n;
  g.k = s.k;
  g.a = a.p;
  g.a_scales = as.p;
  g.a_scale_stride = as_stride;
  g.w = w.p;
  g.w_scales = ws.p;
  g.out = out.p;
  auto launch = [&] {
    check(kernels::launch_fp8_grouped_gemm(g, nullptr), "launch");
    return true;
  };
  if (!bench::settle_locally(launch, nullptr, static_cast<double>(o.settle_ms)))
    check(cudaErrorUnknown, "timing a settling call");
  for (int i = 0; i < o.warmup; ++i) launch();
  Result res{s, per};
  for (int rep = 0; rep < o.repeats; ++rep)
    res.repeat_us.push_back(median_call_us(launch, o.iters));
  res.median_us = median(res.repeat_us);
  res.tflops = 2.0 * rows * s.n * s.k / res.median_us * 1e-6;
  res.check_rel_err = check_rows(s, per, a.p, as.p, as_stride, w.p, ws.p, out.p);
  return res;
}

std::string json_of(const std::vector<Result>& results, const Options& o, const char* device,
                    const char* commit) {
  std::ostringstream js;
  js.precision(6);
  js << "{\n  \"kind\": \"fp8-gemm\",\n  \"device\": \"" << device << "\",\n  \"commit\": \""
     << commit << "\",\n  \"experts\": " << kExperts << ",\n  \"warmup\": " << o.warmup
     << ",\n  \"settle_ms\": " << o.settle_ms << ",\n  \"iters\": " << o.iters
     << ",\n  \"repeats\": " << o.repeats
     << ",\n  \"seed\": " << o.seed << ",\n  \"check_tolerance\": " << kRelTol
     << ",\n  \"runs\": [";
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    js << (i ? "," : "") << "\n    {\"shape\": \"" << r.shape.name << "\", \"n\": " << r.shape.n
       << ", \"k\": " << r.shape.k << ", \"rows_per_expert\": " << r.rows_per_expert
       << ", \"median_us\": " << r.median_us << ", \"tflops\": " << r.tflops
       << ", \"repeat_us\": [";
    for (size_t j = 0; j < r.repeat_us.size(); ++j) js << (j ? ", " : "") << r.repeat_us[j];
    js << "], \"check_rel_err\": ";
    if (std::isfinite(r.check_rel_err))
      js << r.check_rel_err;
    else
      js << "null";  // an output that was not finite
    js << ", \"check\": \""
       << (r.check_rel_err <= kRelTol ? "OK" : "MISMATCH") << "\"}";
  }
  js << "\n  ]\n}\n";
  return js.str();
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("epflow-fp8-gemm-bench: no CUDA GPU visible: nothing to time\n");
    return 0;
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "device properties");
  if (prop.major != 9) {
    std::printf("epflow-fp8-gemm-bench: %s is not a Hopper GPU (sm_90a): nothing to time\n",
                prop.name);
    return 0;
  }
  const char* commit_env = std::getenv("EPFLOW_COMMIT");
  const char* commit = commit_env ? commit_env : "unknown";
  std::printf("FP8 grouped GEMM (1 x 128 / 128 x 128 block scales), %d experts, %s; %lld ms and "
              "%d calls of warm-up, %d repeats x %d calls\n",
              kExperts, prop.name, static_cast<long long>(o.settle_ms), o.warmup, o.repeats,
              o.iters);
  std::printf("%-22s %12s %10s %10s  %-24s %s\n", "shape", "rows/expert", "us", "TFLOP/s",
              "repeats us", "check (rel. err)");
  std::vector<Result> results;
  bool ok = true;
  for (const Shape& s : {Shape{"gate|up 7168 -> 4096", 4096, 7168},
                         Shape{"down 2048 -> 7168", 7168, 2048}}) {
    for (int64_t per : o.rows) {
      const Result r = run_point(s, per, o);
      std::ostringstream reps;
      for (size_t j = 0; j < r.repeat_us.size(); ++j)
        reps << (j ? " / " : "") << static_cast<long long>(std::lround(r.repeat_us[j]));
      const bool good = r.check_rel_err <= kRelTol;
      ok = ok && good;
      std::printf("%-22s %12lld %10.1f %10.0f  %-24s %s (%.1e)\n", s.name,
                  static_cast<long long>(per), r.median_us, r.tflops, reps.str().c_str(),
                  good ? "OK" : "MISMATCH", r.check_rel_err);
      results.push_back(r);
    }
  }
  if (!o.json.empty()) {
    std::ofstream f(o.json);
    f << json_of(results, o, prop.name, commit);
    if (!f) {
      std::fprintf(stderr, "epflow-fp8-gemm-bench: cannot write %s\n", o.json.c_str());
      return 1;
    }
    std::printf("results: %s\n", o.json.c_str());
  }
  if (!ok) std::fprintf(stderr, "epflow-fp8-gemm-bench: an output differs from the CPU's\n");
  return ok ? 0 : 1;
}
