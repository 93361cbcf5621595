// The CPU reference of the block-scaled FP8 forward (reference.h: quantize_rows_1x128,
// quantize_blocks_128x128, forward_fp8). Quantization is src/common/fp8_blocks.h's, the code the
// GPU kernels run: the two agree bit for bit on every e4m3 value and scale.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/fp8_blocks.h"
#include "common/status_util.h"
#include "epflow/reference.h"

namespace epflow::reference {

namespace {

int64_t blocks_of(int64_t n) { return (n + fp8::kBlock - 1) / fp8::kBlock; }

// One block's scale and values: elements v[r * ld + c] for r < rows, c < cols.
void quantize_block(const float* v, int64_t ld, int64_t rows, int64_t cols, bool pow2,
                    uint8_t* q, float* scale) {
  float amax = 0.0f;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float a = std::fabs(v[r * ld + c]);
      amax = (a > amax || std::isnan(a)) ? a : amax;  // a NaN wins, as on the GPU
      if (std::isnan(amax)) break;
    }
  *scale = fp8::block_scale(amax, pow2);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) q[r * ld + c] = fp8::quantize(v[r * ld + c], *scale);
}

float value(const Fp8Matrix& m, int64_t i, int64_t j) { return fp8::to_float(m.q[i * m.k + j]); }
float scale(const Fp8Matrix& m, int64_t i, int64_t kb) {
  return m.scales[(i / fp8::kBlock) * blocks_of(m.k) + kb];
}

Fp8Matrix quantize_matrix(const float* w, int64_t n, int64_t k, bool pow2) {
  Fp8Matrix m;
  m.n = n;
  m.k = k;
  m.q.resize(n * k);
  m.scales.resize(blocks_of(n) * blocks_of(k));
  quantize_blocks_128x128(w, n, k, pow2, m.q.data(), m.scales.data());
  return m;
}

// out[i] = sum over 128-deep blocks kb of (sum_{j in kb} a[j] w[i, j]) * a_scale[kb] *
// w_scale[i / 128, kb], each block's sum exact in double, blocks added in order.
void fp8_matvec(const Fp8Matrix& w, const std::vector<float>& a_values,
                const std::vector<float>& a_scales, std::vector<double>* out) {
  out->assign(w.n, 0.0);
  for (int64_t i = 0; i < w.n; ++i) {
    double acc = 0.0;
    for (int64_t kb = 0; kb < blocks_of(w.k); ++kb) {
      double block = 0.0;
      const int64_t end = std::min(w.k, (kb + 1) * fp8::kBlock);
      for (int64_t j = kb * fp8::kBlock; j < end; ++j) block += double(a_values[j]) * value(w, i, j);
      acc += block * (double(a_scales[kb]) * scale(w, i, kb));
    }
    (*out)[i] = acc;
  }
}

// A row [n] quantized 1 x 128, as floats (values) and scales.
void quantize_row(const float* v, int64_t n, bool pow2, std::vector<float>* values,
                  std::vector<float>* scales) {
  std::vector<uint8_t> q(n);
  scales->resize(blocks_of(n));
  quantize_rows_1x128(v, 1, n, pow2, q.data(), scales->data());
  values->resize(n);
  for (int64_t j = 0; j < n; ++j) (*values)[j] = fp8::to_float(q[j]);
}

}  // namespace

void quantize_rows_1x128(const float* x, int64_t rows, int64_t cols, bool pow2, uint8_t* q,
                         float* scales) {
  const int64_t nb = blocks_of(cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t c0 = b * fp8::kBlock, w = std::min<int64_t>(fp8::kBlock, cols - c0);
      quantize_block(x + r * cols + c0, cols, 1, w, pow2, q + r * cols + c0, scales + r * nb + b);
    }
}

void quantize_blocks_128x128(const float* w, int64_t rows, int64_t cols, bool pow2, uint8_t* q,
                             float* scales) {
  const int64_t nb = blocks_of(cols);
  for (int64_t rb = 0; rb < blocks_of(rows); ++rb)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t r0 = rb * fp8::kBlock, c0 = b * fp8::kBlock;
      quantize_block(w + r0 * cols + c0, cols, std::min<int64_t>(fp8::kBlock, rows - r0),
                     std::min<int64_t>(fp8::kBlock, cols - c0), pow2, q + r0 * cols + c0,
                     scales + rb * nb + b);
    }
}

Fp8Experts quantize_experts_fp8(const LayerConfig& config, const std::vector<RankExperts>& experts,
                                bool pow2) {
  const int64_t H = config.hidden, I = config.intermediate;
  const int32_t e_local = config.experts_per_rank();
  Fp8Experts q;
  q.power_of_two_scales = pow2;
  for (int32_t r = 0; r < config.ep_size; ++r)
    for (int32_t e = 0; e < e_local; ++e) {
      q.gate.push_back(quantize_matrix(experts[r].gate.data() + e * I * H, I, H, pow2));
      q.up.push_back(quantize_matrix(experts[r].up.data() + e * I * H, I, H, pow2));
      q.down.push_back(quantize_matrix(experts[r].down.data() + e * H * I, H, I, pow2));
    }
  return q;
}

void forward_token_fp8(const LayerConfig& config, const Fp8Experts& experts, const float* x_row,
                       const int32_t* topk_idx_row, const float* topk_weights_row, float* y_row) {
  const int64_t H = config.hidden, I = config.intermediate, K = config.top_k;
  const bool pow2 = experts.power_of_two_scales;
  std::vector<float> xv, xs, hv, hs, h(I);
  std::vector<double> g, u, out, acc(H, 0.0);
  quantize_row(x_row, H, pow2, &xv, &xs);
  for (int64_t k = 0; k < K; ++k) {
    const int32_t e = topk_idx_row[k];
    if (e < 0) continue;
    fp8_matvec(experts.gate[e], xv, xs, &g);
    fp8_matvec(experts.up[e], xv, xs, &u);
    for (int64_t i = 0; i < I; ++i) {
      const float gi = static_cast<float>(g[i]), ui = static_cast<float>(u[i]);
      h[i] = gi / (1.0f + std::exp(-gi)) * ui;
    }
    quantize_row(h.data(), I, pow2, &hv, &hs);
    fp8_matvec(experts.down[e], hv, hs, &out);
    const double w = topk_weights_row[k];
    for (int64_t j = 0; j < H; ++j) acc[j] += w * static_cast<float>(out[j]);
  }
  for (int64_t j = 0; j < H; ++j) y_row[j] = static_cast<float>(acc[j]);
}

Status forward_fp8(const LayerConfig& config, const std::vector<RankInput>& inputs,
                   const std::vector<RankExperts>& experts, bool pow2,
                   std::vector<std::vector<float>>* y) {
  if (Status status = check_inputs(config, inputs, experts); !status.ok()) return status;
  if (y == nullptr) return invalid_argument("y is null");
  const int64_t H = config.hidden, K = config.top_k;
  const Fp8Experts q = quantize_experts_fp8(config, experts, pow2);
  y->assign(config.ep_size, {});
  for (int32_t r = 0; r < config.ep_size; ++r) {
    const RankInput& in = inputs[r];
    (*y)[r].assign(in.num_tokens * H, 0.0f);
    for (int64_t t = 0; t < in.num_tokens; ++t)
      forward_token_fp8(config, q, in.x.data() + t * H, in.topk_idx.data() + t * K,
                        in.topk_weights.data() + t * K, (*y)[r].data() + t * H);
  }
  return Status::ok_status();
}

}  // namespace epflow::reference
