// The CPU reference of the block-scaled FP8 layer (reference.h: quantize_rows_1x128,
// quantize_blocks_128x128, forward_fp8, backward_fp8). Quantization is src/common/fp8_blocks.h's,
// the code the GPU kernels run: the two agree bit for bit on every e4m3 value and scale.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "common/fp8_blocks.h"
#include "common/routing_schedule_host.h"
#include "common/status_util.h"
#include "common/tile.h"
#include "epflow/reference.h"
#include "reference/reference_internal.h"

namespace epflow::reference {

namespace {

int64_t blocks_of(int64_t n) { return (n + fp8::kBlock - 1) / fp8::kBlock; }

// One block's scale and values: elements v[r * ld + c] for r < rows, c < cols.
void quantize_block(const float* v, int64_t ld, int64_t rows, int64_t cols, bool pow2, uint8_t* q,
                    float* scale) {
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
      for (int64_t j = kb * fp8::kBlock; j < end; ++j)
        block += double(a_values[j]) * value(w, i, j);
      acc += block * (double(a_scales[kb]) * scale(w, i, kb));
    }
    (*out)[i] = acc;
  }
}

// out[c] += sum over 128-deep blocks rb of w's rows of (sum_{r in rb} a[r] w[r, c]) * a_scale[rb]
// * w_scale[rb, c / 128], block by block in order: the product with w's transpose, whose 128 x
// 128 blocks (and so scales) are w's own. Each block's sum exact in double.
void fp8_matvec_transposed(const Fp8Matrix& w, const std::vector<float>& a_values,
                           const std::vector<float>& a_scales, std::vector<double>* out) {
  for (int64_t c = 0; c < w.k; ++c) {
    double acc = (*out)[c];
    for (int64_t rb = 0; rb < blocks_of(w.n); ++rb) {
      double block = 0.0;
      const int64_t end = std::min(w.n, (rb + 1) * fp8::kBlock);
      for (int64_t r = rb * fp8::kBlock; r < end; ++r)
        block += double(a_values[r]) * value(w, r, c);
      acc += block * (double(a_scales[rb]) * w.scales[rb * blocks_of(w.k) + c / fp8::kBlock]);
    }
    (*out)[c] = acc;
  }
}

// v rounded to bf16 (to nearest, ties to even), as the forward keeps g | u for the backward.
float round_bf16(float v) {
  if (std::isnan(v)) return v;
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
  float r;
  std::memcpy(&r, &b, sizeof r);
  return r;
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

// The dequantized row: values times their block's scale.
std::vector<float> dequantized(const std::vector<float>& values, const std::vector<float>& scales) {
  std::vector<float> d(values.size());
  for (size_t j = 0; j < values.size(); ++j) d[j] = values[j] * scales[j / fp8::kBlock];
  return d;
}

// A routed row's weight-gradient operands as the FP8 layer holds them for FP8 weight gradients:
// Q(dy), Q(x) and Q([dg | du]) read back as bf16 (launch_requantize_transposed's reading of the
// packed rows: the pulled dy and x rows, the dx GEMM's [dg | du] rows) and w·h = bf16(w h).
struct WgradRow {
  std::vector<float> dy, x, wh, dg, du;
};

// Weight gradients of all experts by global id, summed in double.
struct Fp8WeightGradSums {
  std::vector<double> gate, up, down;  // [num_experts, I, H], [num_experts, I, H], [.., H, I]
};

// One token's backward (backward_fp8's arithmetic): its dx row, d topk_weights and, with `sums`,
// its routed rows' terms of the weight gradients.
void token_backward_fp8(const LayerConfig& config, const Fp8Experts& experts, const float* x_row,
                        const int32_t* topk_idx_row, const float* topk_weights_row,
                        const float* dy_row, float* dx_row, float* d_topk_weights_row,
                        Fp8WeightGradSums* sums, WgradRow* rows = nullptr) {
  const int64_t H = config.hidden, I = config.intermediate;
  const bool pow2 = experts.power_of_two_scales;
  std::vector<float> xv, xs, dyv, dys, gk(I), uk(I), h(I), dgf(I), duf(I), dgv, dgs, duv, dus;
  std::vector<double> g, u, dhp, dg(I), du(I), dx(H, 0.0);
  quantize_row(x_row, H, pow2, &xv, &xs);
  quantize_row(dy_row, H, pow2, &dyv, &dys);  // by dy's owner, once per token
  const std::vector<float> x_q = dequantized(xv, xs), dy_q = dequantized(dyv, dys);
  for (int64_t k = 0; k < config.top_k; ++k) {
    const int32_t e = topk_idx_row[k];
    d_topk_weights_row[k] = 0.0f;
    if (e == -1) continue;
    if (e < -1 || e >= config.num_experts)
      throw std::out_of_range(concat("backward_token_fp8: k ", k, ": expert id ", e,
                                     " is outside [-1, num_experts=", config.num_experts, ")"));
    // The forward's g | u as the training forward keeps them (bf16), and h recomputed from them
    // (rounded to bf16, as the backward's epilogue does).
    fp8_matvec(experts.gate[e], xv, xs, &g);
    fp8_matvec(experts.up[e], xv, xs, &u);
    for (int64_t i = 0; i < I; ++i) {
      gk[i] = round_bf16(static_cast<float>(g[i]));
      uk[i] = round_bf16(static_cast<float>(u[i]));
      h[i] = round_bf16(gk[i] / (1.0f + std::exp(-gk[i])) * uk[i]);
    }
    // dhp = Q(dy) Q(W_down) (K = H), w applied after; d w = <dhp, h>.
    dhp.assign(I, 0.0);
    fp8_matvec_transposed(experts.down[e], dyv, dys, &dhp);
    const double w = topk_weights_row[k];
    double d_w = 0.0;
    for (int64_t i = 0; i < I; ++i) d_w += dhp[i] * h[i];
    d_topk_weights_row[k] = static_cast<float>(d_w);
    for (int64_t i = 0; i < I; ++i) {
      detail::swiglu_backward(w * dhp[i], gk[i], uk[i], &dg[i], &du[i]);
      dgf[i] = round_bf16(static_cast<float>(dg[i]));
      duf[i] = round_bf16(static_cast<float>(du[i]));
    }
    // dx += Q([dg | du]) Q([W_gate; W_up]) (K = 2I: the gate blocks, then the up blocks), dg and
    // du quantized from their bf16 values (which the weight gradients read).
    quantize_row(dgf.data(), I, pow2, &dgv, &dgs);
    quantize_row(duf.data(), I, pow2, &duv, &dus);
    fp8_matvec_transposed(experts.gate[e], dgv, dgs, &dx);
    fp8_matvec_transposed(experts.up[e], duv, dus, &dx);
    if (rows != nullptr) {  // FP8 weight gradients: the operands, summed later per pull table
      WgradRow& row = rows[k];
      row.dy.resize(H);
      row.x.resize(H);
      row.wh.resize(I);
      for (int64_t j = 0; j < H; ++j) {
        row.dy[j] = round_bf16(dy_q[j]);
        row.x[j] = round_bf16(x_q[j]);
      }
      row.dg = dequantized(dgv, dgs);
      row.du = dequantized(duv, dus);
      for (int64_t i = 0; i < I; ++i) {
        row.wh[i] = round_bf16(static_cast<float>(w) * h[i]);
        row.dg[i] = round_bf16(row.dg[i]);
        row.du[i] = round_bf16(row.du[i]);
      }
    }
    if (sums == nullptr) continue;
    // The weight gradients: (w Q(dy))^T h, with dy as pulled (e4m3), and [dg | du]^T Q(x) (x
    // as the forward's gate/up GEMM read it, [dg | du] in bf16).
    double* d_down = sums->down.data() + e * H * I;
    for (int64_t j = 0; j < H; ++j)
      for (int64_t i = 0; i < I; ++i) d_down[j * I + i] += w * dy_q[j] * h[i];
    double* d_gate = sums->gate.data() + e * I * H;
    double* d_up = sums->up.data() + e * I * H;
    for (int64_t i = 0; i < I; ++i)
      for (int64_t j = 0; j < H; ++j) {
        d_gate[i * H + j] += dgf[i] * x_q[j];
        d_up[i * H + j] += duf[i] * x_q[j];
      }
  }
  for (int64_t j = 0; j < H; ++j) dx_row[j] = static_cast<float>(dx[j]);
}

// m [n, cols] (n a multiple of 128) quantized along its rows and dequantized in place: by 128 x 1
// blocks (a scale per column per 128 rows) or 128 x 128 blocks.
void quantize_along_rows(std::vector<float>* m, int64_t n, int64_t cols, bool per_column,
                         bool pow2) {
  std::vector<uint8_t> q(m->size());
  const int64_t width = per_column ? 1 : fp8::kBlock;
  for (int64_t r0 = 0; r0 < n; r0 += fp8::kBlock)
    for (int64_t c0 = 0; c0 < cols; c0 += width) {
      float* block = m->data() + r0 * cols + c0;
      float scale;
      const int64_t w = std::min<int64_t>(width, cols - c0);
      quantize_block(block, cols, fp8::kBlock, w, pow2, q.data() + r0 * cols + c0, &scale);
      for (int64_t r = 0; r < fp8::kBlock; ++r)
        for (int64_t c = 0; c < w; ++c)
          block[r * cols + c] = fp8::to_float(q[(r0 + r) * cols + c0 + c]) * scale;
    }
}

// out[a_col, b_col] += sum over rows of a[row, a_col] b[row, b_col] (a [n, A], b [n, B]), in
// double, row after row.
void add_rows_product(const std::vector<float>& a, int64_t a_cols, const std::vector<float>& b,
                      int64_t b_cols, int64_t n, double* out) {
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < a_cols; ++i) {
      const double av = a[r * a_cols + i];
      if (av == 0.0) continue;
      for (int64_t j = 0; j < b_cols; ++j) out[i * b_cols + j] += av * b[r * b_cols + j];
    }
}

// The FP8 weight gradients from every routed row's operands (rows[src][slot]), expert by expert
// in each destination rank's pull table.
void fp8_weight_gradient_sums(const LayerConfig& config, const std::vector<RankInput>& inputs,
                              const std::vector<std::vector<WgradRow>>& rows, bool pow2,
                              Fp8WeightGradSums* sums) {
  const int64_t H = config.hidden, I = config.intermediate;
  const int32_t e_local = config.experts_per_rank();
  std::vector<const int32_t*> topk_idx;
  std::vector<int64_t> tokens;
  for (const RankInput& in : inputs) {
    topk_idx.push_back(in.topk_idx.data());
    tokens.push_back(in.num_tokens);
  }
  static_assert(kTileRows % fp8::kBlock == 0, "segments pad to whole quantization blocks");
  for (int32_t d = 0; d < config.ep_size; ++d) {
    const sched::ScheduleShape shape{config.ep_size, d, e_local, config.top_k, kTileRows};
    const sched::PullTable table = sched::build_pull_table(shape, topk_idx, tokens, 256);
    for (int32_t e = 0; e < e_local; ++e) {
      const int64_t first = table.seg_offset[e], n = table.seg_offset[e + 1] - first;
      if (n == 0) continue;
      std::vector<float> dy(n * H, 0.0f), x(n * H, 0.0f), wh(n * I, 0.0f), dg(n * I, 0.0f),
          du(n * I, 0.0f);
      for (int64_t r = 0; r < n; ++r) {
        const sched::PullRow p = table.rows[first + r];
        if (p.src_rank == sched::kPaddingRow) continue;
        const WgradRow& w = rows[p.src_rank][p.src_slot];
        std::copy(w.dy.begin(), w.dy.end(), dy.begin() + r * H);
        std::copy(w.x.begin(), w.x.end(), x.begin() + r * H);
        std::copy(w.wh.begin(), w.wh.end(), wh.begin() + r * I);
        std::copy(w.dg.begin(), w.dg.end(), dg.begin() + r * I);
        std::copy(w.du.begin(), w.du.end(), du.begin() + r * I);
      }
      quantize_along_rows(&dy, n, H, true, pow2);
      quantize_along_rows(&wh, n, I, false, pow2);
      quantize_along_rows(&dg, n, I, true, pow2);
      quantize_along_rows(&du, n, I, true, pow2);
      quantize_along_rows(&x, n, H, false, pow2);
      const int64_t g = int64_t{d} * e_local + e;
      add_rows_product(dy, H, wh, I, n, sums->down.data() + g * H * I);
      add_rows_product(dg, I, x, H, n, sums->gate.data() + g * I * H);
      add_rows_product(du, I, x, H, n, sums->up.data() + g * I * H);
    }
  }
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

void backward_token_fp8(const LayerConfig& config, const Fp8Experts& experts, const float* x_row,
                        const int32_t* topk_idx_row, const float* topk_weights_row,
                        const float* dy_row, float* dx_row, float* d_topk_weights_row) {
  token_backward_fp8(config, experts, x_row, topk_idx_row, topk_weights_row, dy_row, dx_row,
                     d_topk_weights_row, nullptr);
}

Status backward_fp8(const LayerConfig& config, const std::vector<RankInput>& inputs,
                    const std::vector<RankExperts>& experts,
                    const std::vector<std::vector<float>>& dy, bool pow2,
                    std::vector<RankGrads>* grads, bool fp8_weight_gradients) {
  if (Status s = detail::check_backward_inputs(config, inputs, experts, dy); !s.ok()) return s;
  if (grads == nullptr) return invalid_argument("grads is null");
  const int64_t H = config.hidden, I = config.intermediate, K = config.top_k;
  const Fp8Experts q = quantize_experts_fp8(config, experts, pow2);
  Fp8WeightGradSums sums;
  sums.gate.assign(config.num_experts * I * H, 0.0);
  sums.up.assign(config.num_experts * I * H, 0.0);
  sums.down.assign(config.num_experts * H * I, 0.0);
  grads->assign(config.ep_size, {});
  // FP8 weight gradients: every routed row's operands by (rank, slot), summed per pull table.
  std::vector<std::vector<WgradRow>> rows(fp8_weight_gradients ? config.ep_size : 0);
  for (int32_t r = 0; r < config.ep_size; ++r) {
    const RankInput& in = inputs[r];
    RankGrads& out = (*grads)[r];
    out.dx.assign(in.num_tokens * H, 0.0f);
    out.d_topk_weights.assign(in.num_tokens * K, 0.0f);
    if (fp8_weight_gradients) rows[r].resize(in.num_tokens * K);
    for (int64_t t = 0; t < in.num_tokens; ++t)
      token_backward_fp8(config, q, in.x.data() + t * H, in.topk_idx.data() + t * K,
                         in.topk_weights.data() + t * K, dy[r].data() + t * H,
                         out.dx.data() + t * H, out.d_topk_weights.data() + t * K,
                         fp8_weight_gradients ? nullptr : &sums,
                         fp8_weight_gradients ? rows[r].data() + t * K : nullptr);
  }
  if (fp8_weight_gradients) fp8_weight_gradient_sums(config, inputs, rows, pow2, &sums);
  const int64_t rank_size = config.experts_per_rank() * I * H;
  for (int32_t r = 0; r < config.ep_size; ++r) {
    RankGrads& out = (*grads)[r];
    const auto slice = [&](const std::vector<double>& all) {
      return std::vector<float>(all.begin() + r * rank_size, all.begin() + (r + 1) * rank_size);
    };
    out.d_gate = slice(sums.gate);
    out.d_up = slice(sums.up);
    out.d_down = slice(sums.down);
  }
  return Status::ok_status();
}

}  // namespace epflow::reference
