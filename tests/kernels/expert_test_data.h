// Test data of the expert-GEMM gpu tests: bf16 conversions, the synthetic uniform draws (never
// 0), a host parallel-for, and the rows each test checks. Header-only, test code.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include "common/splitmix64.h"

namespace epflow::test_data {

inline constexpr uint16_t kPoison = 0xFFFF;  // a bf16 NaN
inline constexpr double kMaxRelError = 1e-2;

inline float bf16_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even (the inputs are finite).
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Element `index` of stream `stream`: uniform over the odd multiples of 2^-24 in (-1, 1), as
// the synthetic inputs draw them (never 0, and bf16 keeps float's exponent range, so never 0
// after rounding either). Counter-based, so parallel fills give the same data.
inline float signed_unit(uint64_t seed, uint64_t stream, uint64_t index) {
  const uint64_t draw = splitmix64(splitmix64(seed ^ (stream << 56)) ^ index);
  const int32_t odd = static_cast<int32_t>(2 * static_cast<uint32_t>(draw >> 40) + 1) - (1 << 24);
  return static_cast<float>(odd) * 0x1p-24f;
}

// f(i) for i in [0, n), spread over the host's cores.
template <class F>
inline void parallel_for(int64_t n, const F& f) {
  const int64_t workers =
      std::clamp<int64_t>(static_cast<int64_t>(std::thread::hardware_concurrency()), 1, 64);
  std::vector<std::thread> pool;
  for (int64_t w = 0; w < std::min(workers, n); ++w)
    pool.emplace_back([&f, n, w, workers] {
      for (int64_t i = w; i < n; i += workers) f(i);
    });
  for (auto& t : pool) t.join();
}

// rows x cols bf16, element (r, c) = scale * signed_unit(seed, stream, r * cols + c).
inline void fill_uniform(std::vector<uint16_t>* v, int64_t rows, int64_t cols, float scale, uint64_t seed,
                  uint64_t stream) {
  v->resize(rows * cols);
  parallel_for(rows, [&](int64_t r) {
    for (int64_t c = 0; c < cols; ++c)
      (*v)[r * cols + c] =
          float_to_bf16(scale * signed_unit(seed, stream, static_cast<uint64_t>(r * cols + c)));
  });
}

// Routed rows of an expert that a reference checks: all, or an even spread that includes the
// first and the last.
inline std::vector<int64_t> sampled_rows(int64_t rows, int64_t sample) {
  std::vector<int64_t> out;
  if (sample == 0 || sample >= rows) {
    for (int64_t i = 0; i < rows; ++i) out.push_back(i);
  } else {
    for (int64_t j = 0; j < sample; ++j) out.push_back(j * (rows - 1) / (sample - 1));
  }
  return out;
}

// run(pass_expert_rows) twice: the kernels told the real rows per expert (padding halves of a
// tile skipped, as the layer runs them) and not told.
template <class Run>
inline void with_and_without_expert_rows(Run&& run) {
  for (bool pass_expert_rows : {false, true}) {
    SCOPED_TRACE(pass_expert_rows ? "with expert_rows" : "without expert_rows");
    run(pass_expert_rows);
  }
}

// A weight-gradient GEMM's dw [experts, m, n] (bf16, or fp32 with fp32_out) copied back as
// floats, checked: every element written (finite over its poison), an expert without rows
// exactly zero.
inline std::vector<float> fetch_dw(const void* d_dw, const std::vector<int64_t>& rows, int64_t m,
                                   int64_t n, bool fp32_out) {
  const int64_t experts = static_cast<int64_t>(rows.size());
  std::vector<float> dw(experts * m * n);
  if (fp32_out) {
    EXPECT_EQ(cudaMemcpy(dw.data(), d_dw, 4 * dw.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  } else {
    std::vector<uint16_t> bits(dw.size());
    EXPECT_EQ(cudaMemcpy(bits.data(), d_dw, 2 * bits.size(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    for (size_t i = 0; i < bits.size(); ++i) dw[i] = bf16_to_float(bits[i]);
  }
  int64_t not_finite = 0, empty_nonzero = 0;
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t i = e * m * n; i < (e + 1) * m * n; ++i) {
      not_finite += !std::isfinite(dw[i]);
      empty_nonzero += rows[e] == 0 && dw[i] != 0.0f;
    }
  EXPECT_EQ(not_finite, 0) << "elements of dw not written (or not finite)";
  EXPECT_EQ(empty_nonzero, 0) << "nonzero gradient for an expert without rows";
  return dw;
}

// An output of max_rows x cols bf16 over expert segments seg[e] .. seg[e + 1] (rows[e] of them
// routed), poisoned before the launch: (a) every routed row, and unless only_routed every padding
// row too, holds finite values; (b) rows past the last segment still hold the poison, bit for bit.
inline void expect_written(const std::vector<uint16_t>& out, int64_t cols,
                           const std::vector<int64_t>& seg, const std::vector<int64_t>& rows,
                           bool only_routed, int64_t max_rows, const char* what) {
  const int64_t experts = static_cast<int64_t>(rows.size()), total = seg[experts];
  int64_t bad_written = 0, bad_poison = 0, first_written = -1, first_poison = -1;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t end = only_routed ? seg[e] + rows[e] : seg[e + 1];
    for (int64_t i = seg[e] * cols; i < end * cols; ++i)
      if (!std::isfinite(bf16_to_float(out[i])) && bad_written++ == 0) first_written = i;
  }
  for (int64_t i = total * cols; i < max_rows * cols; ++i)
    if (out[i] != kPoison && bad_poison++ == 0) first_poison = i;
  EXPECT_EQ(bad_written, 0) << what << ": non-finite elements in segment rows, first at row "
                            << first_written / cols << " col " << first_written % cols;
  EXPECT_EQ(bad_poison, 0) << what << ": elements written past seg_offset[E] = " << total
                           << ", first at row " << first_poison / cols << " col "
                           << first_poison % cols;
}

}  // namespace epflow::test_data
