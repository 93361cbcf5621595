// The block-scaled FP8 formats (src/common/fp8_blocks.h) and the FP8 CPU reference
// (reference.h: quantize_rows_1x128, quantize_blocks_128x128, forward_fp8, backward_fp8): e4m3
// rounding and saturation, block scales (plain and power-of-two), a NaN or infinity kept in its
// block, and the quantized forward and backward against the exact ones.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#include "common/fp8_blocks.h"
#include "epflow/reference.h"
#include "reference/synthetic.h"

namespace epflow {
namespace {

TEST(Fp8Blocks, E4m3RoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(fp8::quantize(1.0f, 1.0f), 0x38);
  EXPECT_EQ(fp8::quantize(-2.0f, 1.0f), 0xC0);
  EXPECT_EQ(fp8::quantize(448.0f, 1.0f), 0x7E);
  EXPECT_EQ(fp8::quantize(1e6f, 1.0f), 0x7E);  // saturated, never NaN
  EXPECT_EQ(fp8::quantize(-1e6f, 1.0f), 0xFE);
  EXPECT_EQ(fp8::quantize(1.0625f, 1.0f), 0x38);  // halfway between 1 and 1.125: to even
  EXPECT_EQ(fp8::quantize(1.1875f, 1.0f), 0x3A);  // halfway between 1.125 and 1.25: to even
  EXPECT_EQ(fp8::quantize(2.0f, 2.0f), 0x38);     // v * (1 / scale)
  // Every finite byte survives a round trip through its float.
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(fp8::to_float(static_cast<uint8_t>(b)))) << b;
      continue;
    }
    EXPECT_EQ(fp8::quantize(fp8::to_float(static_cast<uint8_t>(b)), 1.0f), b) << b;
  }
  EXPECT_EQ(fp8::to_float(0x7E), 448.0f);
  EXPECT_TRUE(std::isnan(fp8::to_float(fp8::quantize(NAN, 1.0f))));
}

TEST(Fp8Blocks, BlockScales) {
  EXPECT_EQ(fp8::block_scale(448.0f, false), 1.0f);
  EXPECT_EQ(fp8::block_scale(0.0f, false), 1.0f);
  EXPECT_EQ(fp8::block_scale(0.0f, true), 1.0f);
  EXPECT_FLOAT_EQ(fp8::block_scale(448.0f * 3, false), 3.0f);
  EXPECT_EQ(fp8::block_scale(448.0f * 3, true), 4.0f);
  EXPECT_EQ(fp8::block_scale(448.0f * 4, true), 4.0f);  // exact powers stay
  EXPECT_EQ(fp8::block_scale(448.0f * 0.3f, true), 0.5f);
  EXPECT_EQ(fp8::block_scale(448.0f * std::ldexp(1.0f, -20), true), std::ldexp(1.0f, -20));
  // Tiny blocks: the scale stops at the smallest normal float, so its reciprocal stays finite and
  // zeros stay zeros.
  const float tiny = std::numeric_limits<float>::denorm_min() * 100;
  for (bool pow2 : {false, true}) {
    const float s = fp8::block_scale(tiny, pow2);
    EXPECT_EQ(s, std::numeric_limits<float>::min()) << pow2;
    EXPECT_EQ(fp8::quantize(0.0f, s), 0x00) << pow2;
    EXPECT_EQ(fp8::quantize(-tiny, s), 0x80) << pow2;  // rounds to -0
  }
  EXPECT_TRUE(std::isnan(fp8::block_scale(INFINITY, false)));
  EXPECT_TRUE(std::isnan(fp8::block_scale(NAN, true)));
}

// Rows of 300 columns: blocks of 128, 128 and 44.
TEST(Fp8Blocks, RowsIn1x128Blocks) {
  const int64_t rows = 3, cols = 300, nb = 3;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  std::vector<float> x(rows * cols);
  for (float& v : x) v = u(rng);
  x[1 * cols + 200] = INFINITY;  // row 1, block 1
  x[2 * cols + 5] = NAN;         // row 2, block 0
  for (bool pow2 : {false, true}) {
    SCOPED_TRACE(pow2 ? "power-of-two scales" : "plain scales");
    std::vector<uint8_t> q(rows * cols);
    std::vector<float> s(rows * nb);
    reference::quantize_rows_1x128(x.data(), rows, cols, pow2, q.data(), s.data());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const bool lost = (r == 1 && b == 1) || (r == 2 && b == 0);
        const float scale = s[r * nb + b];
        EXPECT_EQ(std::isnan(scale), lost) << "row " << r << " block " << b;
        float amax = 0.0f;
        for (int64_t c = b * 128; c < std::min<int64_t>(cols, (b + 1) * 128); ++c) {
          const float v = x[r * cols + c], back = fp8::to_float(q[r * cols + c]) * scale;
          if (lost) {
            EXPECT_TRUE(std::isnan(back));
            continue;
          }
          amax = std::max(amax, std::fabs(v));
          // e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of the value, or of the smallest
          // normal (2^-6) times the scale below it.
          EXPECT_LE(std::fabs(back - v), std::max(std::fabs(v) / 16, scale * 0.0078125f))
              << r << ", " << c;
        }
        if (!lost && !pow2) {
          EXPECT_FLOAT_EQ(scale, amax / 448.0f);
        }
        if (!lost && pow2) {
          EXPECT_GE(scale * 448.0f, amax);
          EXPECT_LT(scale * 224.0f, amax);
        }
      }
  }
}

TEST(Fp8Blocks, MatricesIn128x128Blocks) {
  const int64_t rows = 200, cols = 130;  // 2 x 2 blocks, partial on both edges
  std::vector<float> w(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) w[i] = std::sin(0.37f * i) * (1 + i / 1000);
  std::vector<uint8_t> q(rows * cols);
  std::vector<float> s(4);
  reference::quantize_blocks_128x128(w.data(), rows, cols, false, q.data(), s.data());
  for (int rb = 0; rb < 2; ++rb)
    for (int cb = 0; cb < 2; ++cb) {
      float amax = 0.0f;
      for (int64_t r = rb * 128; r < std::min<int64_t>(rows, rb * 128 + 128); ++r)
        for (int64_t c = cb * 128; c < std::min<int64_t>(cols, cb * 128 + 128); ++c)
          amax = std::max(amax, std::fabs(w[r * cols + c]));
      EXPECT_FLOAT_EQ(s[rb * 2 + cb], amax / 448.0f) << rb << ", " << cb;
    }
}

// The FP8 tests' layer: two ranks with different token counts, empty slots, random dy.
struct Fp8Case {
  LayerConfig config;
  std::vector<reference::RankInput> inputs;
  std::vector<reference::RankExperts> experts;
  std::vector<std::vector<float>> dy;
};

Fp8Case fp8_case() {
  Fp8Case b;
  LayerConfig& c = b.config;
  c.hidden = 384;
  c.intermediate = 256;
  c.num_experts = 8;
  c.top_k = 3;
  c.ep_size = 2;
  c.max_tokens_per_rank = 64;
  synthetic::InputSpec spec;
  spec.tokens_per_rank = {37, 64};
  spec.routing = synthetic::Routing::kWithEmptySlots;
  b.inputs = synthetic::make_inputs(c, spec);
  b.experts = synthetic::make_experts(c, 3);
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (const auto& in : b.inputs) {
    b.dy.emplace_back(in.num_tokens * c.hidden);
    for (float& v : b.dy.back()) v = u(rng);
  }
  return b;
}

// The quantized forward stays close to the exact one, on both scale kinds, with empty slots.
// e4m3 keeps 3 mantissa bits: each element's rounding error is up to 1/16 (about 3.6% rms), and
// a dot product of random-sign terms keeps that relative error (its sum grows like its error),
// so each GEMM with both operands quantized costs about 5% and the layer's two (x and W_gate /
// W_up, then h and W_down) about 6%: the tolerance against the exact forward is 8%.
TEST(ReferenceFp8, ForwardCloseToTheExactForward) {
  const Fp8Case b = fp8_case();
  const LayerConfig& c = b.config;
  const auto& inputs = b.inputs;
  const auto& experts = b.experts;
  std::vector<std::vector<float>> exact;
  ASSERT_TRUE(reference::forward(c, inputs, experts, &exact).ok());
  for (bool pow2 : {false, true}) {
    std::vector<std::vector<float>> y;
    ASSERT_TRUE(reference::forward_fp8(c, inputs, experts, pow2, &y).ok());
    for (int r = 0; r < c.ep_size; ++r) {
      double err = 0, norm = 0;
      for (size_t i = 0; i < y[r].size(); ++i) {
        ASSERT_TRUE(std::isfinite(y[r][i]));
        err += (y[r][i] - exact[r][i]) * double(y[r][i] - exact[r][i]);
        norm += exact[r][i] * double(exact[r][i]);
      }
      EXPECT_LT(std::sqrt(err / norm), 0.08) << "rank " << r << (pow2 ? ", pow2" : "");
      EXPECT_GT(std::sqrt(err / norm), 1e-4) << "no quantization happened?";
    }
  }
}

// Relative L2 error of got against want; every element of got finite.
double rel_l2(const std::vector<float>& got, const std::vector<float>& want) {
  double err = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(std::isfinite(got[i])) << i;
    err += (got[i] - want[i]) * double(got[i] - want[i]);
    norm += want[i] * double(want[i]);
  }
  return std::sqrt(err / norm);
}

// The quantized backward stays close to the exact one, for every gradient, on both scale kinds.
// Every gradient has one or two GEMMs with both operands quantized behind it (about 5% each, as in
// the forward) and a quantized factor (Q(x), Q(h), Q(dy)); they land at 5-7% on these inputs, as
// the forward's 6%: the tolerance is 10%.
TEST(ReferenceFp8, BackwardCloseToTheExactBackward) {
  const Fp8Case b = fp8_case();
  std::vector<reference::RankGrads> exact;
  ASSERT_TRUE(reference::backward(b.config, b.inputs, b.experts, b.dy, &exact).ok());
  for (bool pow2 : {false, true}) {
    std::vector<reference::RankGrads> got;
    ASSERT_TRUE(reference::backward_fp8(b.config, b.inputs, b.experts, b.dy, pow2, &got).ok());
    for (int r = 0; r < b.config.ep_size; ++r) {
      SCOPED_TRACE(testing::Message() << "rank " << r << (pow2 ? ", pow2" : ""));
      const std::pair<const char*, double> errs[] = {
          {"dx", rel_l2(got[r].dx, exact[r].dx)},
          {"d topk_weights", rel_l2(got[r].d_topk_weights, exact[r].d_topk_weights)},
          {"d W_gate", rel_l2(got[r].d_gate, exact[r].d_gate)},
          {"d W_up", rel_l2(got[r].d_up, exact[r].d_up)},
          {"d W_down", rel_l2(got[r].d_down, exact[r].d_down)}};
      for (const auto& [what, err] : errs) {
        EXPECT_LT(err, 0.10) << what;
        EXPECT_GT(err, 1e-4) << what << ": no quantization happened?";
      }
    }
  }
}

// With FP8 weight gradients (operands quantized once more along the tokens, per expert in the
// pull table's row order): dx and d topk_weights bit for bit the same, the weight gradients
// within e4m3's rounding of the bf16-operand ones (each product has two 3-bit-mantissa factors
// more: a few percent), different from them, and still close to the exact backward.
TEST(ReferenceFp8, Fp8WeightGradientsQuantizeAlongTheTokens) {
  const Fp8Case b = fp8_case();
  std::vector<reference::RankGrads> exact, bf16_wgrad, fp8_wgrad;
  ASSERT_TRUE(reference::backward(b.config, b.inputs, b.experts, b.dy, &exact).ok());
  ASSERT_TRUE(
      reference::backward_fp8(b.config, b.inputs, b.experts, b.dy, false, &bf16_wgrad).ok());
  ASSERT_TRUE(reference::backward_fp8(b.config, b.inputs, b.experts, b.dy, false, &fp8_wgrad,
                                      /*fp8_weight_gradients=*/true)
                  .ok());
  for (int r = 0; r < b.config.ep_size; ++r) {
    SCOPED_TRACE(testing::Message() << "rank " << r);
    EXPECT_EQ(fp8_wgrad[r].dx, bf16_wgrad[r].dx);
    EXPECT_EQ(fp8_wgrad[r].d_topk_weights, bf16_wgrad[r].d_topk_weights);
    for (auto [name, got, bf16, ex] :
         {std::tuple{"d W_gate", &fp8_wgrad[r].d_gate, &bf16_wgrad[r].d_gate, &exact[r].d_gate},
          {"d W_up", &fp8_wgrad[r].d_up, &bf16_wgrad[r].d_up, &exact[r].d_up},
          {"d W_down", &fp8_wgrad[r].d_down, &bf16_wgrad[r].d_down, &exact[r].d_down}}) {
      const double vs_bf16 = rel_l2(*got, *bf16);
      EXPECT_LT(vs_bf16, 0.05) << name;
      EXPECT_GT(vs_bf16, 1e-4) << name << ": no second quantization happened?";
      EXPECT_LT(rel_l2(*got, *ex), 0.10) << name;
    }
  }
}

// backward_token_fp8 is backward_fp8's arithmetic: bit for bit its rows.
TEST(ReferenceFp8, TokenBackwardIsTheWholeBackwardsRow) {
  const Fp8Case b = fp8_case();
  std::vector<reference::RankGrads> whole;
  ASSERT_TRUE(reference::backward_fp8(b.config, b.inputs, b.experts, b.dy, false, &whole).ok());
  const reference::Fp8Experts q = reference::quantize_experts_fp8(b.config, b.experts, false);
  const int64_t H = b.config.hidden, K = b.config.top_k;
  for (int r = 0; r < b.config.ep_size; ++r)
    for (int64_t t : {int64_t{0}, b.inputs[r].num_tokens - 1}) {
      std::vector<float> dx(H), dw(K);
      reference::backward_token_fp8(
          b.config, q, b.inputs[r].x.data() + t * H, b.inputs[r].topk_idx.data() + t * K,
          b.inputs[r].topk_weights.data() + t * K, b.dy[r].data() + t * H, dx.data(), dw.data());
      for (int64_t j = 0; j < H; ++j) ASSERT_EQ(dx[j], whole[r].dx[t * H + j]) << r << " " << t;
      for (int64_t k = 0; k < K; ++k)
        ASSERT_EQ(dw[k], whole[r].d_topk_weights[t * K + k]) << r << " " << t;
    }
}

// Empty slots contribute nothing (a token without experts gets dx = 0), and an infinity in one
// token's dy stays in that token's dx: each token's dy has its own 1 x 128 scales.
TEST(ReferenceFp8, BackwardEmptySlotsAndAnInfinityStayInTheirToken) {
  Fp8Case b = fp8_case();
  const int64_t H = b.config.hidden, K = b.config.top_k;
  for (int64_t k = 0; k < K; ++k) b.inputs[0].topk_idx[3 * K + k] = -1;  // rank 0, token 3
  b.dy[1][5 * H + 17] = INFINITY;                                        // rank 1, token 5
  std::vector<reference::RankGrads> got;
  ASSERT_TRUE(reference::backward_fp8(b.config, b.inputs, b.experts, b.dy, false, &got).ok());
  for (int64_t j = 0; j < H; ++j) EXPECT_EQ(got[0].dx[3 * H + j], 0.0f) << j;
  for (int64_t k = 0; k < K; ++k) EXPECT_EQ(got[0].d_topk_weights[3 * K + k], 0.0f) << k;
  bool poisoned = false;
  for (int64_t j = 0; j < H; ++j) poisoned |= !std::isfinite(got[1].dx[5 * H + j]);
  EXPECT_TRUE(poisoned) << "the infinity vanished";
  for (int r = 0; r < b.config.ep_size; ++r)
    for (int64_t t = 0; t < b.inputs[r].num_tokens; ++t) {
      if (r == 1 && t == 5) continue;
      for (int64_t j = 0; j < H; ++j)
        ASSERT_TRUE(std::isfinite(got[r].dx[t * H + j])) << "rank " << r << " token " << t;
    }
}

}  // namespace
}  // namespace epflow
