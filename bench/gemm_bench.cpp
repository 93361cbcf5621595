// epflow-gemm-bench: the expert FFN's grouped GEMMs against the best library GEMMs. In one run,
// on one GPU and the same data, it times
//   1. EPFlow's expert FFN (kernels::launch_expert_ffn: both GEMMs, SwiGLU fused),
//   2. cuBLAS dense bf16 GEMMs of the same FLOPs ([M,H]x[H,2I], [M,I]x[I,H], M = real rows),
//   3. cuBLAS grouped GEMMs on the same expert groups (gate+up, elementwise SwiGLU, down),
//   4. the HBM copy bandwidth (device-to-device cudaMemcpyAsync),
// and compares EPFlow's y with cuBLAS's on a few rows of every run (a fast kernel that is wrong
// must not be reported silently). --check verifies the cuBLAS argument conventions themselves
// against a CPU reference on a tiny shape.
//
// Layout conventions (all row-major, weights [N, K] like nn.Linear, so out = in W^T):
//   EPFlow:  x [padded rows, H], expert e's rows at [seg_offset[e], seg_offset[e+1]), padded to
//            kTileRows with zero rows (as the layer does);
//   cuBLAS:  the same rows packed, x [M, H], expert e's at [real_off[e], real_off[e+1]);
//            gate/up out gu [M, 2I] (gate columns, then up columns), h [M, I], y [M, H].
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iomanip>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bench_check.h"
#include "cublas_rows.h"
#include "bench_inputs.h"
#include "unfused/expert_ffn.cuh"
#include "presets.h"
#include "swiglu_baseline.cuh"

namespace {

using namespace epflow;
using bf16 = __nv_bfloat16;

constexpr double kRelTol = 2e-2;          // relative-norm tolerance of the correctness guard
constexpr int kMaxSets = 16;              // rotation sets at most (only tiny shapes need many)
constexpr uint64_t kHoldNs = 20'000'000;  // the host queues a timing batch in far less
constexpr int64_t kHbmCopyBytes = int64_t{2} << 30;
constexpr int64_t kWeightStreamMaxRows = 32;  // rows/expert up to which weights dominate traffic

// --- errors and device resources ----------------------------------------------------------------
// Every CUDA / cuBLAS status is checked; a failure throws, main prints it and exits 1. Resources
// are RAII, so an error anywhere unwinds cleanly.

struct BenchError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  return os.str();
}

void cuda_ok(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess)
    throw BenchError(concat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}

void cublas_ok(cublasStatus_t s, const std::string& what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw BenchError(
        concat(what, ": ", cublasGetStatusName(s), " (", cublasGetStatusString(s), ")"));
}

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(int64_t count, const char* what) : count_(count) {
    if (count < 0) throw BenchError(concat("negative size for ", what));
    // Never a zero-byte allocation: pointers handed to kernels stay valid and distinct.
    const size_t bytes = std::max<size_t>(static_cast<size_t>(count) * sizeof(T), 16);
    void* p = nullptr;
    cuda_ok(cudaMalloc(&p, bytes), concat("cudaMalloc of ", what, " (", bytes, " bytes)"));
    ptr_ = static_cast<T*>(p);
  }
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), count_(std::exchange(o.count_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      ptr_ = std::exchange(o.ptr_, nullptr);
      count_ = std::exchange(o.count_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return ptr_; }
  int64_t count() const { return count_; }
  int64_t bytes() const { return count_ * static_cast<int64_t>(sizeof(T)); }

 private:
  void reset() {
    if (ptr_) cudaFree(ptr_);  // nothing useful to do with an error while unwinding
    ptr_ = nullptr;
  }
  T* ptr_ = nullptr;
  int64_t count_ = 0;
};

class Stream {
 public:
  Stream() { cuda_ok(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking), "cudaStreamCreate"); }
  ~Stream() { cudaStreamDestroy(s_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

class Blas {
 public:
  explicit Blas(cudaStream_t stream) {
    cublas_ok(cublasCreate(&h_), "cublasCreate");
    cublas_ok(cublasSetStream(h_, stream), "cublasSetStream");
    // alpha/beta (and the grouped call's alpha/beta arrays) are host values.
    cublas_ok(cublasSetPointerMode(h_, CUBLAS_POINTER_MODE_HOST), "cublasSetPointerMode");
  }
  ~Blas() { cublasDestroy(h_); }
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;
  cublasHandle_t get() const { return h_; }

 private:
  cublasHandle_t h_ = nullptr;
};

class Events {
 public:
  explicit Events(int n) : ev_(n, nullptr) {
    for (auto& e : ev_) cuda_ok(cudaEventCreate(&e), "cudaEventCreate");
  }
  ~Events() {
    for (auto e : ev_)
      if (e) cudaEventDestroy(e);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  cudaEvent_t* data() { return ev_.data(); }

 private:
  std::vector<cudaEvent_t> ev_;
};

void record(const cudaEvent_t* after, int i, cudaStream_t s) {
  if (after) cuda_ok(cudaEventRecord(after[i], s), "cudaEventRecord");
}

float bf16_bits_to_float(uint16_t b) { return std::bit_cast<float>(uint32_t{b} << 16); }

// --- options ------------------------------------------------------------------------------------

struct Options {
  std::string preset = "deepseek-v3";
  std::vector<int64_t> rows = {8, 16, 32, 64, 128, 256, 512, 1024, 2048};  // per expert
  bool imbalanced = false;
  bool check = false;
  int device = 0;
  int warmup = 5;
  int iters = 20;
  uint64_t seed = 1;
  std::string json;
};

void usage(FILE* f) {
  std::fprintf(f,
               "usage: epflow-gemm-bench [--preset NAME] [--rows R[,R...]] [--imbalanced]\n"
               "                         [--iters N] [--warmup N] [--seed S] [--device D]\n"
               "                         [--json PATH] [--check]\n"
               "  --rows        rows per expert (default 8,16,32,64,128,256,512,1024,2048)\n"
               "  --imbalanced  uneven rows per expert (some empty), same total as --rows\n"
               "  --check       only verify the cuBLAS baselines and EPFlow against a CPU\n"
               "                reference on a tiny shape, then exit (0: all OK)\n"
               "  presets:");
  for (const auto& p : bench::presets()) std::fprintf(f, " %s", p.name.c_str());
  std::fprintf(f, " (default deepseek-v3)\n");
}

bool parse_int64(const std::string& s, int64_t* out) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end == s.c_str() || *end != '\0') return false;
  *out = v;
  return true;
}

bool parse(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--imbalanced") {
      o->imbalanced = true;
      continue;
    }
    if (a == "--check") {
      o->check = true;
      continue;
    }
    if (i + 1 >= argc) return false;
    const std::string v = argv[++i];
    int64_t n = 0;
    if (a == "--preset") {
      o->preset = v;
    } else if (a == "--json") {
      o->json = v;
    } else if (a == "--rows") {
      o->rows.clear();
      std::stringstream ss(v);
      for (std::string item; std::getline(ss, item, ',');) {
        if (!parse_int64(item, &n) || n <= 0) return false;
        o->rows.push_back(n);
      }
      if (o->rows.empty()) return false;
    } else if (!parse_int64(v, &n)) {
      return false;
    } else if (a == "--iters") {
      o->iters = static_cast<int>(n);
    } else if (a == "--warmup") {
      o->warmup = static_cast<int>(n);
    } else if (a == "--seed") {
      o->seed = static_cast<uint64_t>(n);
    } else if (a == "--device") {
      o->device = static_cast<int>(n);
    } else {
      return false;
    }
  }
  return o->iters > 0 && o->iters <= 100000 && o->warmup >= 0 && o->warmup <= 100000;
}

// --- shapes, row layout, grouped plan -----------------------------------------------------------

struct Shape {
  int64_t hidden = 0;        // H
  int64_t intermediate = 0;  // I
  int32_t experts = 0;       // E (local experts)
};

struct Layout {
  std::vector<int64_t> rows;      // real rows of each expert
  std::vector<int64_t> real_off;  // [E + 1]: packed offsets (cuBLAS)
  std::vector<int64_t> pad_off;   // [E + 1]: padded offsets (EPFlow's seg_offset)
  std::vector<int32_t> nonempty;  // experts with rows, ascending
  int64_t real_rows() const { return real_off.back(); }
  int64_t padded_rows() const { return pad_off.back(); }
};

Layout make_layout(std::vector<int64_t> rows) {
  Layout l;
  l.rows = std::move(rows);
  const int64_t tile = kTileRows;
  l.real_off.assign(1, 0);
  l.pad_off.assign(1, 0);
  for (size_t e = 0; e < l.rows.size(); ++e) {
    l.real_off.push_back(l.real_off.back() + l.rows[e]);
    l.pad_off.push_back(l.pad_off.back() + (l.rows[e] + tile - 1) / tile * tile);
    if (l.rows[e] > 0) l.nonempty.push_back(static_cast<int32_t>(e));
  }
  return l;
}

// Uneven rows per expert with the given total: about a quarter of the experts empty (at least
// one when E > 1), the rest weighted by an exponential draw (the busiest expert gets a few times
// the mean, like skewed routing), rounded by largest remainder so the total is exact.
// mt19937_64 is fully specified by the standard: a seed gives the same rows with any library.
std::vector<int64_t> imbalanced_rows(int32_t experts, int64_t total, uint64_t seed) {
  if (experts == 1) return {total};
  std::mt19937_64 rng(seed);
  auto uniform = [&] { return (static_cast<double>(rng() >> 11) + 0.5) * 0x1.0p-53; };  // (0,1)
  std::vector<double> w(experts);
  for (auto& x : w) {
    const bool empty = uniform() < 0.25;
    const double t = -std::log(uniform());
    x = empty ? 0.0 : t;
  }
  if (std::none_of(w.begin(), w.end(), [](double x) { return x == 0.0; }))
    *std::min_element(w.begin(), w.end()) = 0.0;
  if (std::all_of(w.begin(), w.end(), [](double x) { return x == 0.0; })) w[0] = 1.0;
  double sum = 0;
  for (double x : w) sum += x;
  std::vector<int64_t> rows(experts);
  std::vector<std::pair<double, int32_t>> rem;
  int64_t given = 0;
  for (int32_t e = 0; e < experts; ++e) {
    const double exact = static_cast<double>(total) * w[e] / sum;
    rows[e] = static_cast<int64_t>(std::floor(exact));
    given += rows[e];
    if (w[e] > 0) rem.push_back({exact - static_cast<double>(rows[e]), e});
  }
  std::stable_sort(rem.begin(), rem.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  for (size_t i = 0; given < total; i = (i + 1) % rem.size(), ++given) rows[rem[i].second]++;
  return rows;
}

// One cublasGemmGroupedBatchedEx call: per-group arrays on the host (the API reads them there),
// problems of a group contiguous in the device pointer arrays, in group order.
struct GroupedCall {
  std::vector<cublasOperation_t> transa, transb;
  std::vector<int> m, n, k, lda, ldb, ldc, group_size;
  std::vector<float> alpha, beta;  // CUBLAS_COMPUTE_32F: float scalars
  std::vector<int32_t> problem_expert;
  int group_count() const { return static_cast<int>(group_size.size()); }
  int problems() const { return static_cast<int>(problem_expert.size()); }
};

struct GroupedPlan {
  GroupedCall gate_up;  // 2 problems per non-empty expert: gate, then up
  GroupedCall down;     // 1 problem per non-empty expert
};

int to_int(int64_t v, const char* what) {
  if (v < 0 || v > INT_MAX) throw BenchError(concat(what, " = ", v, " does not fit cuBLAS's int"));
  return static_cast<int>(v);
}

// In cuBLAS's column-major terms, out[rows, N] = in[rows, K] W[N, K]^T is
// out^T (N x rows, ld N) = op_T(W: K x N col-major, ld K) * in^T (K x rows, ld K):
// m = N, n = rows, k = K, A = W (transa T, lda K), B = in (transb N, ldb ld_in), C ldc = ld_out.
// A group is a run of experts with the same row count (one group for balanced rows); empty
// experts get no problem at all.
GroupedPlan make_plan(const Shape& sh, const Layout& l) {
  std::vector<int32_t> order = l.nonempty;
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return l.rows[a] < l.rows[b]; });
  GroupedPlan p;
  auto add = [](GroupedCall* c, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb,
                int64_t ldc, int per_expert, int32_t e, bool new_group) {
    if (new_group) {
      c->transa.push_back(CUBLAS_OP_T);
      c->transb.push_back(CUBLAS_OP_N);
      c->m.push_back(to_int(m, "m"));
      c->n.push_back(to_int(n, "n"));
      c->k.push_back(to_int(k, "k"));
      c->lda.push_back(to_int(lda, "lda"));
      c->ldb.push_back(to_int(ldb, "ldb"));
      c->ldc.push_back(to_int(ldc, "ldc"));
      c->alpha.push_back(1.0f);
      c->beta.push_back(0.0f);
      c->group_size.push_back(0);
    }
    c->group_size.back() += per_expert;
    for (int i = 0; i < per_expert; ++i) c->problem_expert.push_back(e);
  };
  const int64_t H = sh.hidden, I = sh.intermediate;
  for (size_t i = 0; i < order.size(); ++i) {
    const int32_t e = order[i];
    const bool new_group = i == 0 || l.rows[e] != l.rows[order[i - 1]];
    add(&p.gate_up, I, l.rows[e], H, H, H, 2 * I, 2, e, new_group);
    add(&p.down, H, l.rows[e], I, I, I, H, 1, e, new_group);
  }
  return p;
}

// --- data -----------------------------------------------------------------------------------

// One rotation set: everything a timed call reads. Outputs are shared (see Outputs).
struct DataSet {
  DeviceBuffer<bf16> w_gate, w_up, w_down;               // [E, I, H], [E, I, H], [E, H, I]
  DeviceBuffer<bf16> w_gu_dense, w_down_dense;           // [2I, H] = [W_gate[e]; W_up[e]], [H, I]
  DeviceBuffer<bf16> x_packed;                           // [M, H]
  DeviceBuffer<bf16> x_padded;                           // [padded rows, H], padding rows zero
  DeviceBuffer<int64_t> seg_offset;                      // [E + 1] = Layout::pad_off
  DeviceBuffer<int32_t> expert_rows;                     // [E] = Layout::rows (as the layer has)
  DeviceBuffer<const void*> gu_a, gu_b, down_a, down_b;  // grouped pointer arrays
  DeviceBuffer<void*> gu_c, down_c;
};

struct Outputs {
  DeviceBuffer<bf16> h_ep, y_ep;          // EPFlow: [padded, I], [padded, H]
  DeviceBuffer<bf16> gu, hc;              // cuBLAS scratch: [M, 2I], [M, I]
  DeviceBuffer<bf16> y_dense, y_grouped;  // [M, H]
};

struct Point {
  Shape shape;
  Layout layout;
  GroupedPlan plan;
  int32_t dense_expert = 0;  // whose weights the dense baseline multiplies by
  Outputs out;
  std::vector<DataSet> sets;
};

template <typename T>
void upload(DeviceBuffer<T>* dst, const std::vector<T>& src, cudaStream_t s) {
  // Pageable H2D: returns once src is staged, so src may die after the call.
  cuda_ok(
      cudaMemcpyAsync(dst->get(), src.data(), src.size() * sizeof(T), cudaMemcpyHostToDevice, s),
      "cudaMemcpyAsync (upload)");
}

void copy_dense_weights(DataSet* d, const Shape& sh, int32_t e, cudaStream_t s) {
  const int64_t IH = sh.intermediate * sh.hidden;
  cuda_ok(cudaMemcpyAsync(d->w_gu_dense.get(), d->w_gate.get() + e * IH, IH * sizeof(bf16),
                          cudaMemcpyDeviceToDevice, s),
          "copy of the dense gate weight");
  cuda_ok(cudaMemcpyAsync(d->w_gu_dense.get() + IH, d->w_up.get() + e * IH, IH * sizeof(bf16),
                          cudaMemcpyDeviceToDevice, s),
          "copy of the dense up weight");
  cuda_ok(cudaMemcpyAsync(d->w_down_dense.get(), d->w_down.get() + e * IH, IH * sizeof(bf16),
                          cudaMemcpyDeviceToDevice, s),
          "copy of the dense down weight");
}

void fill(const DeviceBuffer<bf16>& b, float scale, uint64_t seed, cudaStream_t s) {
  cuda_ok(bench::fill_uniform_bf16(b.get(), b.count(), scale, seed, s), "fill_uniform_bf16");
}

Point build_point(const Shape& sh, std::vector<int64_t> rows, int n_sets, uint64_t seed,
                  cudaStream_t s) {
  Point p;
  p.shape = sh;
  p.layout = make_layout(std::move(rows));
  const Layout& l = p.layout;
  if (l.nonempty.empty()) throw BenchError("no rows to compute");
  p.plan = make_plan(sh, l);
  p.dense_expert = l.nonempty.front();
  const int64_t H = sh.hidden, I = sh.intermediate, E = sh.experts;
  const int64_t M = l.real_rows(), P = l.padded_rows();

  Outputs& o = p.out;
  o.h_ep = DeviceBuffer<bf16>(P * I, "EPFlow h");
  o.y_ep = DeviceBuffer<bf16>(P * H, "EPFlow y");
  o.gu = DeviceBuffer<bf16>(M * 2 * I, "cuBLAS gate/up out");
  o.hc = DeviceBuffer<bf16>(M * I, "cuBLAS h");
  o.y_dense = DeviceBuffer<bf16>(M * H, "cuBLAS dense y");
  o.y_grouped = DeviceBuffer<bf16>(M * H, "cuBLAS grouped y");
  // All-ones bytes are bf16 NaNs: a row some path never writes fails the check as non-finite.
  for (const auto* b : {&o.h_ep, &o.y_ep, &o.gu, &o.hc, &o.y_dense, &o.y_grouped})
    cuda_ok(cudaMemsetAsync(b->get(), 0xFF, b->bytes(), s), "cudaMemsetAsync (outputs)");

  for (int si = 0; si < n_sets; ++si) {
    DataSet d;
    const uint64_t ss = (seed * kMaxSets + si) * 16;
    d.w_gate = DeviceBuffer<bf16>(E * I * H, "W_gate");
    d.w_up = DeviceBuffer<bf16>(E * I * H, "W_up");
    d.w_down = DeviceBuffer<bf16>(E * H * I, "W_down");
    // nn.Linear-like scales keep g, u, h and y O(0.1..1): relative errors stay meaningful.
    fill(d.w_gate, 1.0f / std::sqrt(float(H)), ss + 1, s);
    fill(d.w_up, 1.0f / std::sqrt(float(H)), ss + 2, s);
    fill(d.w_down, 1.0f / std::sqrt(float(I)), ss + 3, s);
    d.w_gu_dense = DeviceBuffer<bf16>(2 * I * H, "dense W_gate|W_up");
    d.w_down_dense = DeviceBuffer<bf16>(H * I, "dense W_down");
    copy_dense_weights(&d, sh, p.dense_expert, s);

    d.x_packed = DeviceBuffer<bf16>(M * H, "packed x");
    fill(d.x_packed, 1.0f, ss + 4, s);
    d.x_padded = DeviceBuffer<bf16>(P * H, "padded x");
    cuda_ok(cudaMemsetAsync(d.x_padded.get(), 0, d.x_padded.bytes(), s), "zeroing padded x");
    for (int32_t e : l.nonempty)
      cuda_ok(
          cudaMemcpyAsync(d.x_padded.get() + l.pad_off[e] * H, d.x_packed.get() + l.real_off[e] * H,
                          l.rows[e] * H * sizeof(bf16), cudaMemcpyDeviceToDevice, s),
          "copy of x rows into the padded layout");
    d.seg_offset = DeviceBuffer<int64_t>(E + 1, "seg_offset");
    upload(&d.seg_offset, l.pad_off, s);
    d.expert_rows = DeviceBuffer<int32_t>(E, "expert_rows");
    upload(&d.expert_rows, std::vector<int32_t>(l.rows.begin(), l.rows.end()), s);

    // Grouped pointer arrays, in the plans' problem order (see make_plan for the conventions).
    std::vector<const void*> a1, b1, a2, b2;
    std::vector<void*> c1, c2;
    const auto& gp = p.plan.gate_up.problem_expert;
    for (size_t i = 0; i < gp.size(); i += 2) {
      const int32_t e = gp[i];
      bf16* gu_row = o.gu.get() + l.real_off[e] * 2 * I;
      a1.insert(a1.end(), {d.w_gate.get() + e * I * H, d.w_up.get() + e * I * H});
      b1.insert(b1.end(), 2, d.x_packed.get() + l.real_off[e] * H);
      c1.insert(c1.end(), {gu_row, gu_row + I});
    }
    for (int32_t e : p.plan.down.problem_expert) {
      a2.push_back(d.w_down.get() + e * H * I);
      b2.push_back(o.hc.get() + l.real_off[e] * I);
      c2.push_back(o.y_grouped.get() + l.real_off[e] * H);
    }
    d.gu_a = DeviceBuffer<const void*>(static_cast<int64_t>(a1.size()), "grouped A (gate/up)");
    d.gu_b = DeviceBuffer<const void*>(static_cast<int64_t>(b1.size()), "grouped B (gate/up)");
    d.gu_c = DeviceBuffer<void*>(static_cast<int64_t>(c1.size()), "grouped C (gate/up)");
    d.down_a = DeviceBuffer<const void*>(static_cast<int64_t>(a2.size()), "grouped A (down)");
    d.down_b = DeviceBuffer<const void*>(static_cast<int64_t>(b2.size()), "grouped B (down)");
    d.down_c = DeviceBuffer<void*>(static_cast<int64_t>(c2.size()), "grouped C (down)");
    upload(&d.gu_a, a1, s);
    upload(&d.gu_b, b1, s);
    upload(&d.gu_c, c1, s);
    upload(&d.down_a, a2, s);
    upload(&d.down_b, b2, s);
    upload(&d.down_c, c2, s);
    p.sets.push_back(std::move(d));
  }
  cuda_ok(cudaStreamSynchronize(s), "building the benchmark data");
  return p;
}

// --- the three methods ------------------------------------------------------------------------
// Each records after[i] (when given) at the end of its i-th timed segment.

void run_epflow(const Point& p, int set, cudaStream_t s, const cudaEvent_t* after) {
  const DataSet& d = p.sets[set];
  kernels::ExpertFfnArgs a;
  a.experts = p.shape.experts;
  a.hidden = p.shape.hidden;
  a.intermediate = p.shape.intermediate;
  a.max_rows = p.layout.padded_rows();
  a.seg_offset = d.seg_offset.get();
  a.expert_rows = d.expert_rows.get();
  a.x = d.x_padded.get();
  a.w_gate = d.w_gate.get();
  a.w_up = d.w_up.get();
  a.w_down = d.w_down.get();
  a.h = p.out.h_ep.get();
  a.y = p.out.y_ep.get();
  cuda_ok(kernels::launch_expert_ffn(a, s), "kernels::launch_expert_ffn");
  record(after, 0, s);
}

// out[rows, N] (ld ld_out) = in[rows, K] (ld ld_in) W[N, K]^T, bf16 in/out, fp32 accumulation.
void gemm_nt(cublasHandle_t h, int64_t rows, int64_t N, int64_t K, const bf16* in, int64_t ld_in,
             const bf16* w, bf16* out, int64_t ld_out, const char* what) {
  for (const auto& [v, name] : {std::pair{N, "N"}, {rows, "rows"}, {K, "K"}, {ld_in, "ld_in"},
                                {ld_out, "ld_out"}})
    to_int(v, name);
  cublas_ok(bench::gemm_rows_wt(h, rows, N, K, in, ld_in, w, out, ld_out), what);
}

// The dense baseline on `rows` packed rows: gu = x [W_gate; W_up]^T, h = swiglu(gu), y = h W_d^T.
void dense_ffn(const Point& p, cublasHandle_t h, cudaStream_t s, int64_t rows, const bf16* x,
               const bf16* w_gu, const bf16* w_down, bf16* y, const cudaEvent_t* after) {
  const int64_t H = p.shape.hidden, I = p.shape.intermediate;
  gemm_nt(h, rows, 2 * I, H, x, H, w_gu, p.out.gu.get(), 2 * I, "cublasGemmEx (dense gate/up)");
  record(after, 0, s);
  cuda_ok(bench::swiglu_bf16(p.out.gu.get(), p.out.hc.get(), rows, I, s), "swiglu_bf16 (dense)");
  record(after, 1, s);
  gemm_nt(h, rows, H, I, p.out.hc.get(), I, w_down, y, H, "cublasGemmEx (dense down)");
  record(after, 2, s);
}

void run_dense(const Point& p, int set, cublasHandle_t h, cudaStream_t s,
               const cudaEvent_t* after) {
  const DataSet& d = p.sets[set];
  dense_ffn(p, h, s, p.layout.real_rows(), d.x_packed.get(), d.w_gu_dense.get(),
            d.w_down_dense.get(), p.out.y_dense.get(), after);
}

void grouped_gemm(cublasHandle_t h, const GroupedCall& c, const void* const* A,
                  const void* const* B, void* const* C, const char* what) {
  cublas_ok(cublasGemmGroupedBatchedEx(h, c.transa.data(), c.transb.data(), c.m.data(), c.n.data(),
                                       c.k.data(), c.alpha.data(), A, CUDA_R_16BF, c.lda.data(), B,
                                       CUDA_R_16BF, c.ldb.data(), c.beta.data(), C, CUDA_R_16BF,
                                       c.ldc.data(), c.group_count(), c.group_size.data(),
                                       CUBLAS_COMPUTE_32F),
            what);
}

void run_grouped(const Point& p, int set, cublasHandle_t h, cudaStream_t s,
                 const cudaEvent_t* after) {
  const DataSet& d = p.sets[set];
  grouped_gemm(h, p.plan.gate_up, d.gu_a.get(), d.gu_b.get(), d.gu_c.get(),
               "cublasGemmGroupedBatchedEx (gate/up)");
  record(after, 0, s);
  cuda_ok(bench::swiglu_bf16(p.out.gu.get(), p.out.hc.get(), p.layout.real_rows(),
                             p.shape.intermediate, s),
          "swiglu_bf16 (grouped)");
  record(after, 1, s);
  grouped_gemm(h, p.plan.down, d.down_a.get(), d.down_b.get(), d.down_c.get(),
               "cublasGemmGroupedBatchedEx (down)");
  record(after, 2, s);
}

// --- timing -----------------------------------------------------------------------------------

double median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Per timed iteration, the µs of each of `segments` consecutive segments. One untimed call first
// (cuBLAS picks kernels, EPFlow sets attributes), then a bounded hold so the host queues the
// whole batch before the GPU reaches it: the events then time the device, not launch latency.
// Iteration i reads rotation set i % n_sets.
template <class Enqueue>
std::vector<std::vector<double>> time_segments(const Options& o, int n_sets, int segments,
                                               cudaStream_t s, const char* name,
                                               Enqueue&& enqueue) {
  enqueue(0, nullptr);
  cuda_ok(cudaStreamSynchronize(s), concat("first call of ", name));
  const int n = o.warmup + o.iters;
  Events ev(n * (segments + 1));
  cuda_ok(bench::hold_stream(kHoldNs, s), "hold_stream");
  for (int i = 0; i < n; ++i) {
    cudaEvent_t* marks = ev.data() + i * (segments + 1);
    cuda_ok(cudaEventRecord(marks[0], s), "cudaEventRecord");
    enqueue(i % n_sets, marks + 1);
  }
  cuda_ok(cudaStreamSynchronize(s), concat("timing ", name));
  std::vector<std::vector<double>> out;
  for (int i = o.warmup; i < n; ++i) {
    cudaEvent_t* marks = ev.data() + i * (segments + 1);
    std::vector<double> seg(segments);
    for (int k = 0; k < segments; ++k) {
      float ms = 0;
      cuda_ok(cudaEventElapsedTime(&ms, marks[k], marks[k + 1]), "cudaEventElapsedTime");
      seg[k] = ms * 1e3;
    }
    out.push_back(std::move(seg));
  }
  return out;
}

// Median over iterations of the sum of the chosen segments.
double median_sum(const std::vector<std::vector<double>>& t, std::initializer_list<int> segs) {
  std::vector<double> v;
  for (const auto& it : t) {
    double sum = 0;
    for (int k : segs) sum += it[k];
    v.push_back(sum);
  }
  return median(v);
}

// --- correctness ------------------------------------------------------------------------------

std::vector<float> fetch_rows(const bf16* base, const std::vector<int64_t>& rows, int64_t width,
                              cudaStream_t s) {
  std::vector<uint16_t> raw(rows.size() * width);
  for (size_t i = 0; i < rows.size(); ++i)
    cuda_ok(cudaMemcpyAsync(raw.data() + i * width, base + rows[i] * width, width * sizeof(bf16),
                            cudaMemcpyDeviceToHost, s),
            "cudaMemcpyAsync (fetch rows)");
  cuda_ok(cudaStreamSynchronize(s), "fetching rows");
  std::vector<float> out(raw.size());
  std::transform(raw.begin(), raw.end(), out.begin(), bf16_bits_to_float);
  return out;
}

std::vector<float> fetch_all(const DeviceBuffer<bf16>& b, cudaStream_t s) {
  std::vector<uint16_t> raw(b.count());
  cuda_ok(cudaMemcpyAsync(raw.data(), b.get(), b.bytes(), cudaMemcpyDeviceToHost, s),
          "cudaMemcpyAsync (fetch)");
  cuda_ok(cudaStreamSynchronize(s), "fetching a buffer");
  std::vector<float> out(raw.size());
  std::transform(raw.begin(), raw.end(), out.begin(), bf16_bits_to_float);
  return out;
}

bool within(double err) { return err <= kRelTol; }  // false for NaN and inf too

// A few rows of an expert with n rows: the ends (tile boundaries) and the middle.
std::vector<int64_t> sample_rows(int64_t n) {
  std::vector<int64_t> r;
  for (int64_t i : {int64_t{0}, int64_t{1}, n / 2, n - 2, n - 1})
    if (i >= 0 && i < n && std::find(r.begin(), r.end(), i) == r.end()) r.push_back(i);
  return r;
}

// Computes the dense baseline's y for all rows of each of `experts` (set 0, that expert's own
// weights copied into the dense weight buffers), then puts the dense expert's weights back.
void dense_per_expert(Point& p, const std::vector<int32_t>& experts, cublasHandle_t h,
                      cudaStream_t s) {
  DataSet& d = p.sets[0];
  const Layout& l = p.layout;
  const int64_t H = p.shape.hidden;
  for (int32_t e : experts) {
    copy_dense_weights(&d, p.shape, e, s);
    dense_ffn(p, h, s, l.rows[e], d.x_packed.get() + l.real_off[e] * H, d.w_gu_dense.get(),
              d.w_down_dense.get(), p.out.y_dense.get() + l.real_off[e] * H, nullptr);
  }
  copy_dense_weights(&d, p.shape, p.dense_expert, s);
  cuda_ok(cudaStreamSynchronize(s), "the dense reference runs");
}

struct CheckResult {
  double epflow_vs_dense = NAN;
  double grouped_vs_dense = NAN;   // NaN: grouped unavailable
  double epflow_vs_grouped = NAN;  // NaN: grouped unavailable
  int64_t rows = 0;                // rows compared
  bool ok = false;
};

// The guard of every run: EPFlow and cuBLAS grouped on everything (set 0), cuBLAS dense with
// each checked expert's own weights; compares sampled rows of the first, middle and last
// non-empty experts against dense, and the ends of every expert's rows EPFlow vs grouped.
CheckResult guard(Point& p, cublasHandle_t h, cudaStream_t s, bool* grouped_ok) {
  run_epflow(p, 0, s, nullptr);
  cuda_ok(cudaStreamSynchronize(s), "EPFlow expert FFN (check run)");
  if (*grouped_ok) {
    try {
      run_grouped(p, 0, h, s, nullptr);
      cuda_ok(cudaStreamSynchronize(s), "cuBLAS grouped (check run)");
    } catch (const BenchError& e) {
      // A baseline the installed cuBLAS refuses is reported as unavailable, not fatal: the run
      // still has EPFlow and dense. A sticky CUDA error resurfaces on the next call and ends it.
      std::printf("  cuBLAS grouped unavailable: %s\n", e.what());
      *grouped_ok = false;
    }
  }
  const Layout& l = p.layout;
  const int64_t H = p.shape.hidden;
  std::vector<int32_t> experts = {l.nonempty.front(), l.nonempty[l.nonempty.size() / 2],
                                  l.nonempty.back()};
  experts.erase(std::unique(experts.begin(), experts.end()), experts.end());
  dense_per_expert(p, experts, h, s);

  CheckResult r;
  r.epflow_vs_dense = r.grouped_vs_dense = 0;
  for (int32_t e : experts) {
    std::vector<int64_t> pad_rows, real_rows;
    for (int64_t i : sample_rows(l.rows[e])) {
      pad_rows.push_back(l.pad_off[e] + i);
      real_rows.push_back(l.real_off[e] + i);
    }
    r.rows += static_cast<int64_t>(real_rows.size());
    const auto dense = fetch_rows(p.out.y_dense.get(), real_rows, H, s);
    const auto ep = fetch_rows(p.out.y_ep.get(), pad_rows, H, s);
    r.epflow_vs_dense = std::max(r.epflow_vs_dense, bench::rel_err(ep, dense));
    if (*grouped_ok) {
      const auto gr = fetch_rows(p.out.y_grouped.get(), real_rows, H, s);
      r.grouped_vs_dense = std::max(r.grouped_vs_dense, bench::rel_err(gr, dense));
    }
  }
  r.ok = within(r.epflow_vs_dense);
  if (*grouped_ok) {
    std::vector<int64_t> pad_rows, real_rows;
    for (int32_t e : l.nonempty) {
      const int64_t last = l.rows[e] - 1;
      for (int64_t i : {int64_t{0}, last}) {
        if (i == last && last == 0) continue;  // a one-row expert: row 0 is already in
        pad_rows.push_back(l.pad_off[e] + i);
        real_rows.push_back(l.real_off[e] + i);
      }
    }
    r.epflow_vs_grouped = bench::rel_err(fetch_rows(p.out.y_ep.get(), pad_rows, H, s),
                                  fetch_rows(p.out.y_grouped.get(), real_rows, H, s));
    r.ok = r.ok && within(r.grouped_vs_dense) && within(r.epflow_vs_grouped);
  } else {
    r.grouped_vs_dense = r.epflow_vs_grouped = NAN;
  }
  return r;
}

// --check: the three paths on a tiny shape against a CPU reference (double accumulation over
// the same bf16 inputs, h rounded to bf16 as all three paths store it). The shape is chosen so
// that a swapped dimension or leading dimension cannot pass: H != I != rows, I and H not
// multiples of 128 (partial N tiles), one expert empty, one spanning two M tiles.
int run_check(const Options& o, cublasHandle_t h, cudaStream_t s) {
  const Shape sh{320, 192, 4};
  const std::vector<int64_t> rows = {5, 0, 130, 1};
  std::printf("--check: H %lld, I %lld, %d experts, rows per expert 5,0,130,1; tolerance %.0e\n",
              (long long)sh.hidden, (long long)sh.intermediate, sh.experts, kRelTol);
  Point p = build_point(sh, rows, 1, o.seed, s);
  const Layout& l = p.layout;
  const int64_t H = sh.hidden, I = sh.intermediate, M = l.real_rows();

  run_epflow(p, 0, s, nullptr);
  run_grouped(p, 0, h, s, nullptr);
  cuda_ok(cudaStreamSynchronize(s), "EPFlow and cuBLAS grouped (--check)");
  dense_per_expert(p, l.nonempty, h, s);

  const DataSet& d = p.sets[0];
  const auto x = fetch_all(d.x_packed, s), wg = fetch_all(d.w_gate, s);
  const auto wu = fetch_all(d.w_up, s), wd = fetch_all(d.w_down, s);
  // Round to nearest even, as the kernels' bf16 stores do (the values here are finite).
  auto round_bf16 = [](double v) {
    uint32_t b = std::bit_cast<uint32_t>(static_cast<float>(v));
    b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
    return static_cast<double>(std::bit_cast<float>(b));
  };
  std::vector<float> ref(M * H);
  std::vector<double> hrow(I);
  for (int32_t e : l.nonempty)
    for (int64_t r = l.real_off[e]; r < l.real_off[e + 1]; ++r) {
      for (int64_t j = 0; j < I; ++j) {
        double g = 0, u = 0;
        for (int64_t k = 0; k < H; ++k) {
          g += double(x[r * H + k]) * wg[(e * I + j) * H + k];
          u += double(x[r * H + k]) * wu[(e * I + j) * H + k];
        }
        hrow[j] = round_bf16(g / (1.0 + std::exp(-g)) * u);
      }
      for (int64_t c = 0; c < H; ++c) {
        double y = 0;
        for (int64_t j = 0; j < I; ++j) y += hrow[j] * wd[(e * H + c) * I + j];
        ref[r * H + c] = static_cast<float>(y);
      }
    }

  std::vector<int64_t> pad_rows, real_rows;
  for (int32_t e : l.nonempty)
    for (int64_t i = 0; i < l.rows[e]; ++i) {
      pad_rows.push_back(l.pad_off[e] + i);
      real_rows.push_back(l.real_off[e] + i);
    }
  struct Path {
    const char* name;
    const bf16* y;
    const std::vector<int64_t>* rows;
  };
  bool ok = true;
  for (const Path& path :
       {Path{"cuBLAS dense (cublasGemmEx)", p.out.y_dense.get(), &real_rows},
        Path{"cuBLAS grouped (cublasGemmGroupedBatchedEx)", p.out.y_grouped.get(), &real_rows},
        Path{"EPFlow expert FFN", p.out.y_ep.get(), &pad_rows}}) {
    const double err = bench::rel_err(fetch_rows(path.y, *path.rows, H, s), ref);
    std::printf("  %-46s rel. error %.3e  %s\n", path.name, err, within(err) ? "OK" : "MISMATCH");
    ok = ok && within(err);
  }
  std::printf("--check: %s\n", ok ? "OK" : "MISMATCH");
  return ok ? 0 : 1;
}

// --- the benchmark ----------------------------------------------------------------------------

std::string json_num(double v) {
  if (!std::isfinite(v)) return "null";
  std::ostringstream os;
  os << std::setprecision(12) << v;
  return os.str();
}

std::string json_str(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) out += c;
  }
  return out + "\"";
}

// Bytes one call of each method touches at least (each tensor once); rotation is needed only
// when the smallest of them fits in L2.
int64_t min_footprint(const Shape& sh, const Layout& l) {
  const int64_t H = sh.hidden, I = sh.intermediate, M = l.real_rows(), P = l.padded_rows();
  const int64_t W = 3 * I * H * static_cast<int64_t>(l.nonempty.size());
  const int64_t ep = W + P * (H + I + H);
  const int64_t dense = 3 * I * H + M * (H + 2 * I + I + H);
  const int64_t grouped = W + M * (H + 2 * I + I + H);
  return std::min({ep, dense, grouped}) * static_cast<int64_t>(sizeof(bf16));
}

// Everything one row count produced: the table row and the JSON record are both made from it.
struct RunResult {
  int64_t rows_per_expert = 0;  // nominal (the --rows value)
  std::vector<int64_t> rows;    // per expert, as run
  int64_t real_rows = 0, padded_rows = 0, nonempty = 0, min_footprint = 0;
  int sets = 1;
  double flops = 0, weight_bytes = 0;
  double ep_us = NAN;
  double dense_us = NAN, dense_gemm1_us = NAN, dense_swiglu_us = NAN, dense_gemm2_us = NAN;
  double grp_us = NAN, grp_gemm1_us = NAN, grp_swiglu_us = NAN, grp_gemm2_us = NAN;  // NaN: n/a
  double weight_stream_gbs = NAN;  // rows/expert <= kWeightStreamMaxRows only
  CheckResult check;

  double tflops(double us) const { return flops / us * 1e-6; }
};

struct RunInfo {
  std::string device, commit, preset;
  int cublas_version = 0, sm_count = 0;
  int64_t l2_bytes = 0;
  Shape shape;
  bool imbalanced = false;
  uint64_t seed = 0;
  int warmup = 0, iters = 0;
  double hbm_us = NAN, hbm_gbs = NAN;
};

void print_header() {
  std::printf("%9s %9s %4s %10s %9s %9s %9s %8s %8s %9s %7s  %s\n", "rows/exp", "real rows", "sets",
              "EPFlow us", "EPFlow TF", "dense TF", "grouped", "EP/dense", "EP/grp", "W GB/s",
              "vs HBM", "check (rel. err EP-dense / grp-dense / EP-grp)");
}

void print_row(const RunResult& r, double hbm_gbs) {
  const double ep_tf = r.tflops(r.ep_us), dense_tf = r.tflops(r.dense_us);
  const double grp_tf = r.tflops(r.grp_us);
  char grp[24] = "n/a", ep_grp[24] = "n/a", wgbs[24] = "", vs_hbm[24] = "";
  if (std::isfinite(grp_tf)) {
    std::snprintf(grp, sizeof grp, "%.1f", grp_tf);
    std::snprintf(ep_grp, sizeof ep_grp, "%.2f", ep_tf / grp_tf);
  }
  if (std::isfinite(r.weight_stream_gbs)) {
    std::snprintf(wgbs, sizeof wgbs, "%.0f", r.weight_stream_gbs);
    std::snprintf(vs_hbm, sizeof vs_hbm, "%.0f%%", 100.0 * r.weight_stream_gbs / hbm_gbs);
  }
  std::printf("%9lld %9lld %4d %10.1f %9.1f %9.1f %9s %8.2f %8s %9s %7s  %s (%.1e / %.1e / %.1e)\n",
              (long long)r.rows_per_expert, (long long)r.real_rows, r.sets, r.ep_us, ep_tf,
              dense_tf, grp, ep_tf / dense_tf, ep_grp, wgbs, vs_hbm, r.check.ok ? "OK" : "MISMATCH",
              r.check.epflow_vs_dense, r.check.grouped_vs_dense, r.check.epflow_vs_grouped);
  if (r.nonempty < static_cast<int64_t>(r.rows.size()) ||
      std::adjacent_find(r.rows.begin(), r.rows.end(), std::not_equal_to<>()) != r.rows.end()) {
    const auto [mn, mx] = std::minmax_element(r.rows.begin(), r.rows.end());
    std::printf("%9s rows per expert: min %lld, max %lld, %lld of %zu empty\n", "", (long long)*mn,
                (long long)*mx, (long long)(r.rows.size() - r.nonempty), r.rows.size());
  }
  std::fflush(stdout);
}

std::string gemm_json(const RunInfo& info, const std::vector<RunResult>& runs, bool all_ok) {
  std::ostringstream js;
  js << "{\n  \"kind\": \"gemm\",\n  \"device\": " << json_str(info.device)
     << ",\n  \"commit\": " << json_str(info.commit)
     << ",\n  \"cublas_version\": " << info.cublas_version << ",\n  \"sm_count\": " << info.sm_count
     << ",\n  \"l2_bytes\": " << info.l2_bytes << ",\n  \"preset\": " << json_str(info.preset)
     << ",\n  \"hidden\": " << info.shape.hidden
     << ",\n  \"intermediate\": " << info.shape.intermediate
     << ",\n  \"experts\": " << info.shape.experts
     << ",\n  \"imbalanced\": " << (info.imbalanced ? "true" : "false")
     << ",\n  \"seed\": " << info.seed << ",\n  \"warmup\": " << info.warmup
     << ",\n  \"iters\": " << info.iters << ",\n  \"check_tolerance\": " << json_num(kRelTol)
     << ",\n  \"all_checks_ok\": " << (all_ok ? "true" : "false")
     << ",\n  \"hbm_copy_bytes\": " << 2 * kHbmCopyBytes
     << ",\n  \"hbm_copy_us\": " << json_num(info.hbm_us)
     << ",\n  \"hbm_copy_gbs\": " << json_num(info.hbm_gbs) << ",\n  \"runs\": [";
  for (size_t i = 0; i < runs.size(); ++i) {
    const RunResult& r = runs[i];
    js << (i ? "," : "") << "\n    {\"rows_per_expert\": " << r.rows_per_expert << ", \"rows\": [";
    for (size_t e = 0; e < r.rows.size(); ++e) js << (e ? ", " : "") << r.rows[e];
    js << "], \"real_rows\": " << r.real_rows << ", \"padded_rows\": " << r.padded_rows
       << ", \"nonempty_experts\": " << r.nonempty << ", \"flops\": " << json_num(r.flops)
       << ", \"sets\": " << r.sets << ", \"min_footprint_bytes\": " << r.min_footprint
       << ",\n     \"epflow_us\": " << json_num(r.ep_us)
       << ", \"epflow_tflops\": " << json_num(r.tflops(r.ep_us))
       << ",\n     \"dense_us\": " << json_num(r.dense_us)
       << ", \"dense_gemm1_us\": " << json_num(r.dense_gemm1_us)
       << ", \"dense_swiglu_us\": " << json_num(r.dense_swiglu_us)
       << ", \"dense_gemm2_us\": " << json_num(r.dense_gemm2_us)
       << ", \"dense_tflops\": " << json_num(r.tflops(r.dense_us))
       << ",\n     \"grouped_us\": " << json_num(r.grp_us)
       << ", \"grouped_gemm1_us\": " << json_num(r.grp_gemm1_us)
       << ", \"grouped_swiglu_us\": " << json_num(r.grp_swiglu_us)
       << ", \"grouped_gemm2_us\": " << json_num(r.grp_gemm2_us)
       << ", \"grouped_tflops\": " << json_num(r.tflops(r.grp_us))
       << ",\n     \"epflow_vs_dense\": " << json_num(r.dense_us / r.ep_us)
       << ", \"epflow_vs_grouped\": " << json_num(r.grp_us / r.ep_us)
       << ", \"weight_bytes\": " << json_num(r.weight_bytes)
       << ", \"weight_stream_gbs\": " << json_num(r.weight_stream_gbs)
       << ", \"weight_stream_vs_hbm\": " << json_num(r.weight_stream_gbs / info.hbm_gbs)
       << ",\n     \"check\": " << json_str(r.check.ok ? "OK" : "MISMATCH")
       << ", \"check_rows\": " << r.check.rows
       << ", \"check_epflow_vs_dense\": " << json_num(r.check.epflow_vs_dense)
       << ", \"check_grouped_vs_dense\": " << json_num(r.check.grouped_vs_dense)
       << ", \"check_epflow_vs_grouped\": " << json_num(r.check.epflow_vs_grouped) << "}";
  }
  js << "\n  ]\n}\n";
  return js.str();
}

// One row count: build the data, check, time the three methods.
RunResult run_point(const Options& o, const Shape& sh, int64_t nominal, int64_t l2,
                    cublasHandle_t h, cudaStream_t s) {
  RunResult r;
  r.rows_per_expert = nominal;
  r.rows = o.imbalanced ? imbalanced_rows(sh.experts, nominal * sh.experts,
                                          o.seed * 1000003 + static_cast<uint64_t>(nominal))
                        : std::vector<int64_t>(sh.experts, nominal);
  r.min_footprint = min_footprint(sh, make_layout(r.rows));
  r.sets = r.min_footprint > l2
               ? 1
               : static_cast<int>(std::clamp<int64_t>(
                     (2 * l2 + r.min_footprint - 1) / r.min_footprint, 2, kMaxSets));
  Point p = build_point(sh, r.rows, r.sets, o.seed, s);
  const Layout& l = p.layout;
  r.real_rows = l.real_rows();
  r.padded_rows = l.padded_rows();
  r.nonempty = static_cast<int64_t>(l.nonempty.size());
  r.flops = 6.0 * static_cast<double>(r.real_rows) * sh.hidden * sh.intermediate;
  r.weight_bytes = 3.0 * sh.intermediate * sh.hidden * sizeof(bf16) * r.nonempty;

  bool grouped_ok = true;
  r.check = guard(p, h, s, &grouped_ok);

  const auto t_ep =
      time_segments(o, r.sets, 1, s, "EPFlow expert FFN",
                    [&](int set, const cudaEvent_t* after) { run_epflow(p, set, s, after); });
  r.ep_us = median_sum(t_ep, {0});
  const auto t_dense =
      time_segments(o, r.sets, 3, s, "cuBLAS dense",
                    [&](int set, const cudaEvent_t* after) { run_dense(p, set, h, s, after); });
  r.dense_us = median_sum(t_dense, {0, 2});  // the two GEMMs; the SwiGLU kernel apart
  r.dense_gemm1_us = median_sum(t_dense, {0});
  r.dense_swiglu_us = median_sum(t_dense, {1});
  r.dense_gemm2_us = median_sum(t_dense, {2});
  if (grouped_ok) {
    const auto t_grp =
        time_segments(o, r.sets, 3, s, "cuBLAS grouped",
                      [&](int set, const cudaEvent_t* after) { run_grouped(p, set, h, s, after); });
    r.grp_us = median_sum(t_grp, {0, 1, 2});
    r.grp_gemm1_us = median_sum(t_grp, {0});
    r.grp_swiglu_us = median_sum(t_grp, {1});
    r.grp_gemm2_us = median_sum(t_grp, {2});
  }
  if (nominal <= kWeightStreamMaxRows) r.weight_stream_gbs = r.weight_bytes / r.ep_us * 1e-3;
  return r;
}

// The HBM copy bandwidth: the roofline the weight-streaming (small-row) figures are held to.
void measure_hbm_copy(const Options& o, cudaStream_t s, RunInfo* info) {
  DeviceBuffer<uint8_t> src(kHbmCopyBytes, "HBM copy source"), dst(kHbmCopyBytes, "HBM copy dst");
  cuda_ok(cudaMemsetAsync(src.get(), 1, kHbmCopyBytes, s), "cudaMemsetAsync (HBM copy)");
  cuda_ok(cudaMemsetAsync(dst.get(), 0, kHbmCopyBytes, s), "cudaMemsetAsync (HBM copy)");
  const auto t = time_segments(o, 1, 1, s, "HBM copy", [&](int, const cudaEvent_t* after) {
    cuda_ok(cudaMemcpyAsync(dst.get(), src.get(), kHbmCopyBytes, cudaMemcpyDeviceToDevice, s),
            "cudaMemcpyAsync (HBM copy)");
    record(after, 0, s);
  });
  info->hbm_us = median_sum(t, {0});
  info->hbm_gbs = 2.0 * kHbmCopyBytes / info->hbm_us * 1e-3;  // read + write
}

int run_bench(const Options& o, const cudaDeviceProp& prop, cublasHandle_t h, cudaStream_t s) {
  const bench::Preset* preset = bench::find_preset(o.preset);  // checked in main
  RunInfo info;
  info.device = prop.name;
  const char* commit = std::getenv("EPFLOW_COMMIT");
  info.commit = commit ? commit : "unknown";
  info.preset = preset->name;
  cublas_ok(cublasGetVersion(h, &info.cublas_version), "cublasGetVersion");
  info.sm_count = prop.multiProcessorCount;
  info.l2_bytes = prop.l2CacheSize;
  info.shape = Shape{preset->hidden, preset->intermediate, preset->experts_per_rank};
  info.imbalanced = o.imbalanced;
  info.seed = o.seed;
  info.warmup = o.warmup;
  info.iters = o.iters;
  const Shape& sh = info.shape;

  std::printf(
      "epflow-gemm-bench: %s (sm_%d%d, %d SMs, L2 %.1f MB), cuBLAS %d, bf16 in/out, fp32 "
      "accumulation\n  median of %d iterations after %d warm-up, CUDA events, host queue "
      "ahead of the GPU (device time)\n",
      prop.name, prop.major, prop.minor, info.sm_count, info.l2_bytes * 1e-6, info.cublas_version,
      o.iters, o.warmup);
  std::printf(
      "preset %s: H %lld, I %lld, %d experts; %s rows per expert\n", preset->name.c_str(),
      (long long)sh.hidden, (long long)sh.intermediate, sh.experts,
      o.imbalanced ? "imbalanced (same total as the nominal count, some experts empty)" : "equal");
  if (o.imbalanced && sh.experts == 1)
    std::printf("  (one expert: --imbalanced cannot spread rows, it gets them all)\n");
  measure_hbm_copy(o, s, &info);
  std::printf("HBM copy (cudaMemcpyAsync D2D, 2 GiB, read + write counted): %.1f us, %.0f GB/s\n",
              info.hbm_us, info.hbm_gbs);
  std::printf(
      "TFLOP/s count 6 * real rows * H * I for all three. dense = its two GEMMs only (SwiGLU "
      "timed apart);\ngrouped = both grouped GEMMs + the SwiGLU kernel; EPFlow = both GEMMs, "
      "SwiGLU fused.\n\n");
  print_header();

  std::vector<RunResult> runs;
  bool all_ok = true;
  for (int64_t nominal : o.rows) {
    runs.push_back(run_point(o, sh, nominal, info.l2_bytes, h, s));
    print_row(runs.back(), info.hbm_gbs);
    all_ok = all_ok && runs.back().check.ok;
  }
  std::printf(
      "\nsets: rotation sets of inputs and weights; 1 when even the smallest per-call working "
      "set exceeds L2\n(%.0f MB), so every call streams from HBM. W GB/s (rows/expert <= %d): "
      "all three weight tensors of\nthe non-empty experts / EPFlow time; vs HBM: that over the "
      "HBM copy rate. check: EPFlow's y vs cuBLAS\ndense (each checked expert's own weights) and "
      "grouped, relative norm <= %.0e.\n",
      info.l2_bytes * 1e-6, static_cast<int>(kWeightStreamMaxRows), kRelTol);
  if (!all_ok) std::printf("\nMISMATCH: a checked output differs from cuBLAS beyond tolerance\n");

  if (!o.json.empty()) {
    std::ofstream f(o.json);
    f << gemm_json(info, runs, all_ok);
    f.close();
    if (!f) throw BenchError(concat("writing ", o.json));
    std::printf("wrote %s\n", o.json.c_str());
  }
  return all_ok ? 0 : 1;
}

int run(const Options& o) {
  int devices = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&devices); e != cudaSuccess || devices == 0) {
    std::printf("epflow-gemm-bench: no CUDA device (%s); this benchmark needs a GPU, nothing run\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "device count 0");
    return 0;
  }
  if (o.device < 0 || o.device >= devices) {
    std::fprintf(stderr, "epflow-gemm-bench: --device %d but %d device(s)\n", o.device, devices);
    return 2;
  }
  cuda_ok(cudaSetDevice(o.device), "cudaSetDevice");
  cudaDeviceProp prop;
  cuda_ok(cudaGetDeviceProperties(&prop, o.device), "cudaGetDeviceProperties");
  if (prop.major != 9 || prop.minor != 0) {
    std::fprintf(stderr,
                 "epflow-gemm-bench: EPFlow's kernels are built for sm_90a (Hopper); device %d "
                 "is %s (sm_%d%d)\n",
                 o.device, prop.name, prop.major, prop.minor);
    return 1;
  }
  Stream stream;
  Blas blas(stream.get());
  if (o.check) return run_check(o, blas.get(), stream.get());
  return run_bench(o, prop, blas.get(), stream.get());
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) {
      usage(stdout);
      return 0;
    }
  if (!parse(argc, argv, &o)) {
    usage(stderr);
    return 2;
  }
  if (!bench::find_preset(o.preset)) {
    std::fprintf(stderr, "epflow-gemm-bench: unknown preset '%s'\n", o.preset.c_str());
    usage(stderr);
    return 2;
  }
  try {
    return run(o);
  } catch (const BenchError& e) {
    std::fprintf(stderr, "epflow-gemm-bench: error: %s\n", e.what());
    return 1;
  }
}
