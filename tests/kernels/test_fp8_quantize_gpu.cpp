// The FP8 quantization kernels (kernels/fp8_quantize.cuh) against the CPU reference's
// quantize_rows_1x128 / quantize_blocks_128x128: every e4m3 byte and every scale bit for bit,
// plain and power-of-two scales, partial blocks on every edge, a NaN and an infinity each lost
// in their own block only. Outputs are poisoned first.
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/fp8_blocks.h"
#include "epflow/reference.h"
#include "gpu_test_util.h"
#include "kernels/fp8_quantize.cuh"

namespace epflow {
namespace {

// Random bf16 values over several magnitudes (blocks of very different scales), a NaN and an
// infinity at the given positions.
std::vector<__nv_bfloat16> make_values(int64_t n, uint64_t seed, int64_t nan_at, int64_t inf_at) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<__nv_bfloat16> v(n);
  for (int64_t i = 0; i < n; ++i)
    v[i] = __float2bfloat16(u(rng) * std::ldexp(1.0f, static_cast<int>((i / 97) % 24) - 12));
  if (nan_at >= 0) v[nan_at] = __float2bfloat16(NAN);
  if (inf_at >= 0) v[inf_at] = __float2bfloat16(INFINITY);
  return v;
}

std::vector<float> to_float(const std::vector<__nv_bfloat16>& v) {
  std::vector<float> f(v.size());
  for (size_t i = 0; i < v.size(); ++i) f[i] = __bfloat162float(v[i]);
  return f;
}

// Bytes and scales as the reference's, and exactly nan_scales NaN scales: every test input holds
// one NaN and one infinity, each in its own block (two; more where a quantized input spread them).
void expect_same(const std::vector<uint8_t>& q, const std::vector<uint8_t>& want_q,
                 const std::vector<float>& s, const std::vector<float>& want_s,
                 int64_t nan_scales = 2) {
  int64_t bad_q = 0, bad_s = 0;
  for (size_t i = 0; i < q.size(); ++i) bad_q += q[i] != want_q[i];
  for (size_t i = 0; i < s.size(); ++i) {
    uint32_t a, b;
    std::memcpy(&a, &s[i], 4);
    std::memcpy(&b, &want_s[i], 4);
    bad_s += std::isnan(s[i]) ? !std::isnan(want_s[i]) : a != b;
  }
  EXPECT_EQ(bad_q, 0) << "e4m3 bytes differing from the reference, of " << q.size();
  EXPECT_EQ(bad_s, 0) << "scales differing from the reference, of " << s.size();
  int64_t lost = 0;
  for (float v : s) lost += std::isnan(v);
  EXPECT_EQ(lost, nan_scales) << "the NaN's and the infinity's blocks, and no other";
}

// Dense rows of 300 columns (a partial block, rows not 16-byte aligned: the warp-per-block
// kernel) and packed rows of 512 columns with their scales after the values, as the FP8 layer
// writes its window (whole aligned blocks: the 16-lanes-per-block kernel).
TEST(Fp8QuantizeGpu, RowsMatchTheReference) {
  EPFLOW_SKIP_WITHOUT_GPU();
  struct Case {
    int64_t rows, cols;
    bool packed;
  };
  for (const Case& c : {Case{37, 300, false}, Case{45, 512, true}})
  for (bool pow2 : {false, true}) {
    SCOPED_TRACE(::testing::Message() << c.rows << " x " << c.cols << (c.packed ? " packed" : "")
                                      << (pow2 ? ", power-of-two scales" : ", plain scales"));
    const int64_t rows = c.rows, cols = c.cols, nb = (cols + 127) / 128;
    const auto x = make_values(rows * cols, 5, 4 * cols + 130, 20 * cols + cols - 1);
    std::vector<uint8_t> want_q(rows * cols), q(rows * cols);
    std::vector<float> want_s(rows * nb), s(rows * nb);
    reference::quantize_rows_1x128(to_float(x).data(), rows, cols, pow2, want_q.data(),
                                   want_s.data());
    const int64_t row_bytes = c.packed ? fp8::packed_row_bytes(cols) : cols;
    __nv_bfloat16* dx = nullptr;
    uint8_t* dq = nullptr;
    float* ds = nullptr;
    EPFLOW_CUDA_CHECK(cudaMalloc(&dx, x.size() * 2));
    EPFLOW_CUDA_CHECK(cudaMalloc(&dq, rows * row_bytes));
    if (!c.packed) EPFLOW_CUDA_CHECK(cudaMalloc(&ds, s.size() * 4));
    EPFLOW_CUDA_CHECK(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
    EPFLOW_CUDA_CHECK(cudaMemset(dq, 0xFF, rows * row_bytes));  // NaN bytes and NaN scales
    if (!c.packed) EPFLOW_CUDA_CHECK(cudaMemset(ds, 0xFF, s.size() * 4));
    float* scales = c.packed ? reinterpret_cast<float*>(dq + cols) : ds;
    EPFLOW_CUDA_CHECK(kernels::launch_quantize_rows_1x128(
        dx, rows, cols, pow2, dq, scales, nullptr, row_bytes, c.packed ? row_bytes / 4 : 0));
    std::vector<uint8_t> got(rows * row_bytes);
    EPFLOW_CUDA_CHECK(cudaMemcpy(got.data(), dq, got.size(), cudaMemcpyDeviceToHost));
    if (!c.packed) EPFLOW_CUDA_CHECK(cudaMemcpy(s.data(), ds, s.size() * 4, cudaMemcpyDeviceToHost));
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(q.data() + r * cols, got.data() + r * row_bytes, cols);
      if (c.packed) std::memcpy(s.data() + r * nb, got.data() + r * row_bytes + cols, nb * 4);
    }
    for (void* p : {static_cast<void*>(dx), static_cast<void*>(dq), static_cast<void*>(ds)})
      EPFLOW_CUDA_CHECK(cudaFree(p));
    expect_same(q, want_q, s, want_s);
  }
}

// Matrices of partial blocks (200 x 264: 2 x 3 blocks; their transposed copy written bytewise)
// and of whole ones (256 x 384: 16-byte chunks), with the transposed copy a training layer's
// backward reads, placed as W_up^T in gate_up_t (the second of two matrices side by side: rows of
// twice the matrix's rows, starting at its rows), which must be exactly the quantized bytes and
// scales transposed.
TEST(Fp8QuantizeGpu, MatricesMatchTheReference) {
  EPFLOW_SKIP_WITHOUT_GPU();
  struct Case {
    int64_t rows, cols;
  };
  for (const Case& c : {Case{200, 264}, Case{256, 384}})
    for (bool pow2 : {false, true}) {
      SCOPED_TRACE(::testing::Message() << c.rows << " x " << c.cols
                                        << (pow2 ? ", power-of-two scales" : ", plain scales"));
      const int64_t matrices = 3, rows = c.rows, cols = c.cols, per = rows * cols;
      const int64_t nblocks = ((rows + 127) / 128) * ((cols + 127) / 128);
      const auto w = make_values(matrices * per, 6, per + 150 * cols + 10, 2 * per + 5);
      const int64_t rb = (rows + 127) / 128, cb = (cols + 127) / 128, ld = 2 * rows;
      std::vector<uint8_t> want_q(matrices * per), q(matrices * per), qt(matrices * cols * ld);
      std::vector<float> want_s(matrices * nblocks), s(matrices * nblocks), st(2 * s.size());
      const auto wf = to_float(w);
      for (int64_t m = 0; m < matrices; ++m)
        reference::quantize_blocks_128x128(wf.data() + m * per, rows, cols, pow2,
                                           want_q.data() + m * per, want_s.data() + m * nblocks);
      __nv_bfloat16* dw = nullptr;
      uint8_t *dq = nullptr, *dqt = nullptr;
      float *ds = nullptr, *dst = nullptr;
      EPFLOW_CUDA_CHECK(cudaMalloc(&dst, st.size() * 4));
      EPFLOW_CUDA_CHECK(cudaMemset(dst, 0xFF, st.size() * 4));
      EPFLOW_CUDA_CHECK(cudaMalloc(&dw, w.size() * 2));
      EPFLOW_CUDA_CHECK(cudaMalloc(&dq, q.size()));
      EPFLOW_CUDA_CHECK(cudaMalloc(&dqt, qt.size()));
      EPFLOW_CUDA_CHECK(cudaMalloc(&ds, s.size() * 4));
      EPFLOW_CUDA_CHECK(cudaMemcpy(dw, w.data(), w.size() * 2, cudaMemcpyHostToDevice));
      EPFLOW_CUDA_CHECK(cudaMemset(dq, 0xAB, q.size()));
      EPFLOW_CUDA_CHECK(cudaMemset(dqt, 0xAB, qt.size()));
      EPFLOW_CUDA_CHECK(cudaMemset(ds, 0xFF, s.size() * 4));
      // Without the transposed copy, then with it (the same bytes and scales both times).
      for (bool transposed : {false, true}) {
        kernels::TransposedCopy t;
        if (transposed) t = {dqt + rows, ld, cols * ld, dst + rb, 2 * rb, cb * 2 * rb};
        EPFLOW_CUDA_CHECK(kernels::launch_quantize_blocks_128x128(dw, matrices, rows, cols, pow2,
                                                                  dq, ds, nullptr, 0, t));
        EPFLOW_CUDA_CHECK(cudaMemcpy(q.data(), dq, q.size(), cudaMemcpyDeviceToHost));
        EPFLOW_CUDA_CHECK(cudaMemcpy(s.data(), ds, s.size() * 4, cudaMemcpyDeviceToHost));
        expect_same(q, want_q, s, want_s);
      }
      EPFLOW_CUDA_CHECK(cudaMemcpy(qt.data(), dqt, qt.size(), cudaMemcpyDeviceToHost));
      EPFLOW_CUDA_CHECK(cudaMemcpy(st.data(), dst, st.size() * 4, cudaMemcpyDeviceToHost));
      for (void* p : {static_cast<void*>(dw), static_cast<void*>(dq), static_cast<void*>(dqt),
                      static_cast<void*>(ds), static_cast<void*>(dst)})
        EPFLOW_CUDA_CHECK(cudaFree(p));
      int64_t wrong = 0, wrong_scales = 0;
      for (int64_t m = 0; m < matrices; ++m) {
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t col = 0; col < cols; ++col)
            wrong += qt[m * cols * ld + col * ld + rows + r] != want_q[m * per + r * cols + col];
        for (int64_t a = 0; a < rb; ++a)
          for (int64_t b = 0; b < cb; ++b)
            wrong_scales += std::memcmp(&st[m * cb * 2 * rb + b * 2 * rb + rb + a],
                                        &want_s[m * nblocks + a * cb + b], 4) != 0;
      }
      EXPECT_EQ(wrong, 0) << "bytes of the transposed copy differ from the transposed quantization";
      EXPECT_EQ(wrong_scales, 0) << "the transposed copy's scales differ from the transposed ones";
    }
}

// The weight gradients' FP8 operands: x [rows, cols] quantized along the rows and written
// transposed, by 128 x 1 blocks into packed rows and by 128 x 128 blocks with separate scales;
// bitwise the reference's quantization of the transposed matrix (1 x 128 rows, 128 x 128
// blocks). x as bf16 rows (a row stride past cols: launch_quantize_transposed) and as packed
// 1 x 128 rows (launch_requantize_transposed: the reference quantizes their dequantized values,
// each e4m3 value times its scale rounded to bf16). Of a capacity of 384 rows only the 256 the
// device says are written: the rest keeps its poison.
TEST(Fp8QuantizeGpu, TransposedOperandsMatchTheReference) {
  EPFLOW_SKIP_WITHOUT_GPU();
  const int64_t max_rows = 384, rows = 256, cols = 256, ld = cols + 64;
  const int64_t packed_row = fp8::packed_row_bytes(cols);
  for (bool from_packed : {false, true})
    for (auto scaling : {kernels::TransposedScaling::k128x1, kernels::TransposedScaling::k128x128})
      for (bool pow2 : {false, true}) {
        const bool per_column = scaling == kernels::TransposedScaling::k128x1;
        SCOPED_TRACE(::testing::Message() << (from_packed ? "packed rows, " : "bf16 rows, ")
                                          << (per_column ? "128 x 1" : "128 x 128")
                                          << (pow2 ? ", power-of-two scales" : ", plain scales"));
        // A NaN in row 5 of column 3, an infinity in row 200 of column 130: their blocks' scales.
        const auto x = make_values(max_rows * ld, 8, 5 * ld + 3, 200 * ld + 130);
        // The packed rows: x's rows quantized 1 x 128 by the reference.
        std::vector<uint8_t> packed(max_rows * packed_row, 0);
        for (int64_t r = 0; r < max_rows; ++r) {
          std::vector<float> row(cols);
          for (int64_t c = 0; c < cols; ++c) row[c] = __bfloat162float(x[r * ld + c]);
          reference::quantize_rows_1x128(row.data(), 1, cols, pow2, &packed[r * packed_row],
                                         reinterpret_cast<float*>(&packed[r * packed_row + cols]));
        }
        auto value = [&](int64_t r, int64_t c) {  // what the device reads at row r, column c
          if (!from_packed) return __bfloat162float(x[r * ld + c]);
          float scale;
          std::memcpy(&scale, &packed[r * packed_row + cols + c / 128 * 4], 4);
          return __bfloat162float(
              __float2bfloat16(fp8::to_float(packed[r * packed_row + c]) * scale));
        };
        std::vector<float> xt(cols * rows);  // the rows the device quantizes, transposed
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c) xt[c * rows + r] = value(r, c);
        std::vector<uint8_t> want_q(cols * rows);
        std::vector<float> want_s(per_column ? cols * rows / 128 : cols / 128 * rows / 128);
        if (per_column)
          reference::quantize_rows_1x128(xt.data(), cols, rows, pow2, want_q.data(), want_s.data());
        else
          reference::quantize_blocks_128x128(xt.data(), cols, rows, pow2, want_q.data(),
                                             want_s.data());
        const int64_t row_bytes = per_column ? fp8::packed_row_bytes(max_rows) : max_rows;
        __nv_bfloat16* dx = nullptr;
        uint8_t* dq = nullptr;
        float* ds = nullptr;
        int64_t* d_rows = nullptr;
        const int64_t n_scales = cols / 128 * max_rows / 128;
        uint8_t* dpacked = nullptr;
        EPFLOW_CUDA_CHECK(cudaMalloc(&dx, x.size() * 2));
        EPFLOW_CUDA_CHECK(cudaMalloc(&dpacked, packed.size()));
        EPFLOW_CUDA_CHECK(cudaMalloc(&dq, cols * row_bytes));
        EPFLOW_CUDA_CHECK(cudaMalloc(&ds, n_scales * 4));
        EPFLOW_CUDA_CHECK(cudaMalloc(&d_rows, sizeof(int64_t)));
        EPFLOW_CUDA_CHECK(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
        EPFLOW_CUDA_CHECK(
            cudaMemcpy(dpacked, packed.data(), packed.size(), cudaMemcpyHostToDevice));
        EPFLOW_CUDA_CHECK(cudaMemcpy(d_rows, &rows, sizeof rows, cudaMemcpyHostToDevice));
        EPFLOW_CUDA_CHECK(cudaMemset(dq, 0xAB, cols * row_bytes));
        EPFLOW_CUDA_CHECK(cudaMemset(ds, 0xFF, n_scales * 4));
        if (from_packed)
          EPFLOW_CUDA_CHECK(kernels::launch_requantize_transposed(dpacked, max_rows, d_rows, cols,
                                                                  scaling, pow2, dq, ds, nullptr));
        else
          EPFLOW_CUDA_CHECK(kernels::launch_quantize_transposed(dx, ld, max_rows, d_rows, cols,
                                                                scaling, pow2, dq, ds, nullptr));
        std::vector<uint8_t> got(cols * row_bytes);
        std::vector<float> got_block_scales(n_scales);
        EPFLOW_CUDA_CHECK(cudaMemcpy(got.data(), dq, got.size(), cudaMemcpyDeviceToHost));
        EPFLOW_CUDA_CHECK(cudaMemcpy(got_block_scales.data(), ds, n_scales * 4,
                                     cudaMemcpyDeviceToHost));
        for (void* p : {static_cast<void*>(dx), static_cast<void*>(dpacked), static_cast<void*>(dq),
                        static_cast<void*>(ds), static_cast<void*>(d_rows)})
          EPFLOW_CUDA_CHECK(cudaFree(p));
        std::vector<uint8_t> q(cols * rows);
        std::vector<float> sc(want_s.size());
        int64_t untouched_wrong = 0;
        for (int64_t c = 0; c < cols; ++c) {
          for (int64_t r = 0; r < max_rows; ++r) {
            if (r < rows)
              q[c * rows + r] = got[c * row_bytes + r];
            else
              untouched_wrong += got[c * row_bytes + r] != 0xAB;
          }
          if (per_column)
            for (int64_t b = 0; b < max_rows / 128; ++b) {
              float v;
              std::memcpy(&v, &got[c * row_bytes + max_rows + b * 4], 4);
              if (b < rows / 128)
                sc[c * rows / 128 + b] = v;
              else
                untouched_wrong += got[c * row_bytes + max_rows + b * 4] != 0xAB;
            }
        }
        if (!per_column)
          for (int64_t cb = 0; cb < cols / 128; ++cb)
            for (int64_t b = 0; b < max_rows / 128; ++b) {
              const float v = got_block_scales[cb * (max_rows / 128) + b];
              if (b < rows / 128)
                sc[cb * rows / 128 + b] = v;
              else
                untouched_wrong += !std::isnan(v);  // 0xFFFFFFFF: still the poison
            }
        // Packed rows hold the NaN and the infinity as NaN 1 x 128 row blocks: 128 columns each.
        expect_same(q, want_q, sc, want_s, from_packed && per_column ? 2 * 128 : 2);
        EXPECT_EQ(untouched_wrong, 0) << "bytes or scales past the device's row count written";
      }
}

TEST(Fp8QuantizeGpu, RejectsBadShapes) {
  EPFLOW_SKIP_WITHOUT_GPU();
  EXPECT_EQ(kernels::launch_quantize_rows_1x128(nullptr, 4, 0, false, nullptr, nullptr, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(kernels::launch_quantize_blocks_128x128(nullptr, 1, 128, 128, false, nullptr, nullptr,
                                                    nullptr),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace epflow
