// Tests of the CPU reference layer and the synthetic data generators. The reference is the
// ground truth of every GPU test, so it is checked here against independent arithmetic: values
// computed by hand, finite differences and invariances of the math.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <set>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "epflow/config.h"
#include "epflow/status.h"
#include "epflow/reference.h"
#include "reference/synthetic.h"

namespace epflow {
namespace {

using reference::RankExperts;
using reference::RankGrads;
using reference::RankInput;
using Outputs = std::vector<std::vector<float>>;

LayerConfig make_config(int64_t hidden, int64_t intermediate, int32_t num_experts, int32_t top_k,
                        int32_t ep_size, int64_t max_tokens_per_rank) {
  LayerConfig config;
  config.hidden = hidden;
  config.intermediate = intermediate;
  config.num_experts = num_experts;
  config.top_k = top_k;
  config.ep_size = ep_size;
  config.max_tokens_per_rank = max_tokens_per_rank;
  return config;
}

std::vector<RankInput> make_inputs(const LayerConfig& config, std::vector<int64_t> tokens,
                                   synthetic::Routing routing, uint64_t seed) {
  synthetic::InputSpec spec;
  spec.tokens_per_rank = std::move(tokens);
  spec.routing = routing;
  spec.seed = seed;
  return synthetic::make_inputs(config, spec);
}

// An upstream gradient shaped like the outputs of `inputs`, with values in (-1, 1).
Outputs make_dy(const LayerConfig& config, const std::vector<RankInput>& inputs, uint64_t seed) {
  std::vector<int64_t> tokens;
  for (const RankInput& in : inputs) tokens.push_back(in.num_tokens);
  Outputs dy;
  for (RankInput& in : make_inputs(config, tokens, synthetic::Routing::kUniform, seed))
    dy.push_back(std::move(in.x));
  return dy;
}

Outputs run_forward(const LayerConfig& config, const std::vector<RankInput>& inputs,
                    const std::vector<RankExperts>& experts) {
  Outputs y;
  const Status status = reference::forward(config, inputs, experts, &y);
  EXPECT_TRUE(status.ok()) << status.to_string();
  return y;
}

std::vector<RankGrads> run_backward(const LayerConfig& config,
                                    const std::vector<RankInput>& inputs,
                                    const std::vector<RankExperts>& experts, const Outputs& dy) {
  std::vector<RankGrads> grads;
  const Status status = reference::backward(config, inputs, experts, dy, &grads);
  EXPECT_TRUE(status.ok()) << status.to_string();
  return grads;
}

template <typename T>
std::vector<T> concat_ranks(const std::vector<std::vector<T>>& per_rank) {
  std::vector<T> all;
  for (const std::vector<T>& part : per_rank) all.insert(all.end(), part.begin(), part.end());
  return all;
}

// Concatenates one field of every rank's grads, in rank order.
template <typename Field>
std::vector<float> concat_grads(const std::vector<RankGrads>& grads, Field field) {
  std::vector<std::vector<float>> parts;
  for (const RankGrads& g : grads) parts.push_back(g.*field);
  return concat_ranks(parts);
}

// Relative to each expected value, so an expected 0 must be exactly 0.
void expect_rel_near(const std::vector<float>& actual, const std::vector<double>& expected,
                     double rel, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_NEAR(actual[i], expected[i], rel * std::abs(expected[i])) << what << "[" << i << "]";
  }
}

// For results summed in a different order: each element within `rel` of the larger of itself
// and a thousandth of the vector's largest element (cancellation can leave tiny values).
void expect_all_near(const std::vector<float>& actual, const std::vector<float>& expected,
                     double rel, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  double largest = 0.0;
  for (float value : expected) largest = std::max(largest, std::abs(static_cast<double>(value)));
  for (size_t i = 0; i < actual.size(); ++i) {
    const double scale = std::max(std::abs(static_cast<double>(expected[i])), 1e-3 * largest);
    EXPECT_NEAR(actual[i], expected[i], rel * scale) << what << "[" << i << "]";
  }
}

double silu(double g) { return g / (1.0 + std::exp(-g)); }

double silu_derivative(double g) {
  const double s = 1.0 / (1.0 + std::exp(-g));
  return s + g * s * (1.0 - s);
}

// Two ranks of one expert each and one token on rank 0 routed to both. Each expert has only a
// few nonzero weights, so every output and gradient has a closed form written out below.
TEST(ReferenceLayer, HandComputedTinyLayer) {
  const LayerConfig config = make_config(64, 64, 2, 2, 2, 1);
  const int64_t H = 64;
  const int64_t I = 64;
  std::vector<RankInput> inputs(2);
  inputs[0].num_tokens = 1;
  inputs[0].x.assign(H, 0.0f);
  inputs[0].x[0] = 0.5f;
  inputs[0].x[1] = -1.25f;
  inputs[0].topk_idx = {0, 1};
  inputs[0].topk_weights = {0.625f, 0.25f};
  std::vector<RankExperts> experts(2);
  for (RankExperts& ex : experts) {
    ex.gate.assign(I * H, 0.0f);
    ex.up.assign(I * H, 0.0f);
    ex.down.assign(H * I, 0.0f);
  }
  // Expert 0 uses intermediate row 0 only, expert 1 row 2 only.
  experts[0].gate[0 * H + 0] = 2.0f;
  experts[0].gate[0 * H + 1] = 0.375f;
  experts[0].up[0 * H + 0] = 1.5f;
  experts[0].down[0 * I + 0] = 1.0f;
  experts[0].down[3 * I + 0] = -2.0f;
  experts[1].gate[2 * H + 1] = -0.75f;
  experts[1].up[2 * H + 0] = -1.0f;
  experts[1].up[2 * H + 1] = 0.25f;
  experts[1].down[1 * I + 2] = 0.625f;
  experts[1].down[3 * I + 2] = 0.5f;

  const double a = 0.5, b = -1.25, w0 = 0.625, w1 = 0.25;
  const double g0 = 2.0 * a + 0.375 * b, u0 = 1.5 * a, h0 = silu(g0) * u0;
  const double g1 = -0.75 * b, u1 = -1.0 * a + 0.25 * b, h1 = silu(g1) * u1;

  std::vector<double> y(H, 0.0);
  y[0] = w0 * h0;
  y[1] = w1 * 0.625 * h1;
  y[3] = w0 * -2.0 * h0 + w1 * 0.5 * h1;
  const Outputs out = run_forward(config, inputs, experts);
  ASSERT_EQ(out.size(), 2u);
  expect_rel_near(out[0], y, 1e-6, "y");
  EXPECT_TRUE(out[1].empty());

  Outputs dy = {std::vector<float>(H, 0.0f), {}};
  dy[0][0] = 1.0f;
  dy[0][1] = -2.0f;
  dy[0][3] = 0.25f;
  dy[0][5] = 3.0f;  // y[5] is 0, but row 5 of dW_down still sees dz[5] * h
  const std::vector<RankGrads> grads = run_backward(config, inputs, experts, dy);
  ASSERT_EQ(grads.size(), 2u);

  // <dy, y_0> with y_0 = (h0, 0, 0, -2 h0, ...); <dy, y_1> with y_1 = (0, 0.625 h1, 0, 0.5 h1).
  expect_rel_near(grads[0].d_topk_weights, {h0 - 0.5 * h0, -2.0 * 0.625 * h1 + 0.25 * 0.5 * h1},
                  1e-6, "d_topk_weights");

  // dh = W_down^T (w dy) is nonzero only in the intermediate row each expert uses.
  const double dh0 = w0 * (1.0 * 1.0 + -2.0 * 0.25);
  const double dh1 = w1 * (0.625 * -2.0 + 0.5 * 0.25);
  const double dg0 = dh0 * u0 * silu_derivative(g0), du0 = dh0 * silu(g0);
  const double dg1 = dh1 * u1 * silu_derivative(g1), du1 = dh1 * silu(g1);

  std::vector<double> dx(H, 0.0);
  dx[0] = 2.0 * dg0 + 1.5 * du0 + -1.0 * du1;
  dx[1] = 0.375 * dg0 + -0.75 * dg1 + 0.25 * du1;
  expect_rel_near(grads[0].dx, dx, 1e-6, "dx");
  EXPECT_TRUE(grads[1].dx.empty());
  EXPECT_TRUE(grads[1].d_topk_weights.empty());

  const std::vector<double> dy_values = {1.0, -2.0, 0.0, 0.25, 0.0, 3.0};
  std::vector<double> d_down0(H * I, 0.0), d_down1(H * I, 0.0);
  for (int64_t row = 0; row < 6; ++row) {
    d_down0[row * I + 0] = w0 * dy_values[row] * h0;
    d_down1[row * I + 2] = w1 * dy_values[row] * h1;
  }
  std::vector<double> d_gate0(I * H, 0.0), d_up0(I * H, 0.0);
  std::vector<double> d_gate1(I * H, 0.0), d_up1(I * H, 0.0);
  d_gate0[0 * H + 0] = dg0 * a;
  d_gate0[0 * H + 1] = dg0 * b;
  d_up0[0 * H + 0] = du0 * a;
  d_up0[0 * H + 1] = du0 * b;
  d_gate1[2 * H + 0] = dg1 * a;
  d_gate1[2 * H + 1] = dg1 * b;
  d_up1[2 * H + 0] = du1 * a;
  d_up1[2 * H + 1] = du1 * b;
  expect_rel_near(grads[0].d_gate, d_gate0, 1e-6, "d_gate of expert 0");
  expect_rel_near(grads[0].d_up, d_up0, 1e-6, "d_up of expert 0");
  expect_rel_near(grads[0].d_down, d_down0, 1e-6, "d_down of expert 0");
  expect_rel_near(grads[1].d_gate, d_gate1, 1e-6, "d_gate of expert 1");
  expect_rel_near(grads[1].d_up, d_up1, 1e-6, "d_up of expert 1");
  expect_rel_near(grads[1].d_down, d_down1, 1e-6, "d_down of expert 1");
}

// L = sum(y * dy) has gradient `backward(dy)`; checked against central differences of L.
TEST(ReferenceLayer, BackwardMatchesFiniteDifferences) {
  const LayerConfig config = make_config(64, 64, 4, 2, 2, 4);
  std::vector<RankInput> inputs =
      make_inputs(config, {3, 2}, synthetic::Routing::kUniform, /*seed=*/7);
  std::vector<RankExperts> experts = synthetic::make_experts(config, /*seed=*/11);
  const Outputs dy = make_dy(config, inputs, /*seed=*/13);
  const std::vector<RankGrads> grads = run_backward(config, inputs, experts, dy);

  const auto loss = [&] {
    const Outputs y = run_forward(config, inputs, experts);
    double sum = 0.0;
    for (size_t r = 0; r < y.size(); ++r) {
      for (size_t i = 0; i < y[r].size(); ++i) sum += static_cast<double>(y[r][i]) * dy[r][i];
    }
    return sum;
  };
  // Fourth-order central difference, so the step can be large next to the fp32 rounding of y
  // (the only noise in L) while truncation stays far below the tolerance.
  const auto central_difference = [&](float* value, float step) {
    const float original = *value;
    const auto loss_at = [&](float offset) {
      *value = original + offset;
      return loss();
    };
    const double derivative = (8.0 * (loss_at(step) - loss_at(-step)) -
                               (loss_at(2.0f * step) - loss_at(-2.0f * step))) / (12.0 * step);
    *value = original;
    return derivative;
  };
  // The differences carry the fp32 rounding of y, an absolute error; a floor of 1% of the
  // family's largest gradient keeps near-zero gradients from turning it into a large ratio.
  struct Check {
    std::string what;
    double analytic;
    double numeric;
  };
  const auto expect_matches = [](const std::vector<Check>& checks) {
    double largest = 0.0;
    for (const Check& c : checks) largest = std::max(largest, std::abs(c.analytic));
    ASSERT_GT(largest, 0.0);
    for (const Check& c : checks) {
      const double scale = std::max(std::abs(c.analytic), 1e-2 * largest);
      EXPECT_LE(std::abs(c.numeric - c.analytic), 1e-3 * scale)
          << c.what << ": analytic " << c.analytic << ", numeric " << c.numeric;
    }
  };

  std::vector<Check> dx_checks, d_weight_checks;
  for (int r = 0; r < 2; ++r) {
    for (int64_t t = 0; t < inputs[r].num_tokens; ++t) {
      for (int64_t j : {0, 17, 63}) {
        const int64_t at = t * config.hidden + j;
        dx_checks.push_back({"dx rank " + std::to_string(r) + " [" + std::to_string(at) + "]",
                             grads[r].dx[at], central_difference(&inputs[r].x[at], 0.1f)});
      }
      for (int64_t k = 0; k < config.top_k; ++k) {
        const int64_t at = t * config.top_k + k;
        d_weight_checks.push_back(
            {"d_topk_weights rank " + std::to_string(r) + " [" + std::to_string(at) + "]",
             grads[r].d_topk_weights[at], central_difference(&inputs[r].topk_weights[at], 1e-2f)});
      }
    }
  }
  expect_matches(dx_checks);
  expect_matches(d_weight_checks);

  // About a sixth of the weights' scale, 1/sqrt(64); x above steps by a tenth of its scale.
  const float weight_step = 2e-2f;
  std::vector<Check> d_gate_checks, d_up_checks, d_down_checks;
  const int64_t expert_size = config.intermediate * config.hidden;
  for (int r = 0; r < 2; ++r) {
    for (int64_t local = 0; local < config.experts_per_rank(); ++local) {
      for (const auto& [row, col] :
           std::vector<std::pair<int64_t, int64_t>>{{0, 0}, {5, 17}, {31, 2}, {63, 63}}) {
        const int64_t at = local * expert_size + row * 64 + col;  // H = I = 64: [I,H] or [H,I]
        const std::string where = " rank " + std::to_string(r) + " [" + std::to_string(at) + "]";
        d_gate_checks.push_back({"d_gate" + where, grads[r].d_gate[at],
                                 central_difference(&experts[r].gate[at], weight_step)});
        d_up_checks.push_back({"d_up" + where, grads[r].d_up[at],
                               central_difference(&experts[r].up[at], weight_step)});
        d_down_checks.push_back({"d_down" + where, grads[r].d_down[at],
                                 central_difference(&experts[r].down[at], weight_step)});
      }
    }
  }
  expect_matches(d_gate_checks);
  expect_matches(d_up_checks);
  expect_matches(d_down_checks);
}

TEST(ReferenceLayer, ForwardTokenMatchesForward) {
  const LayerConfig config = make_config(128, 64, 8, 3, 2, 6);
  const std::vector<RankInput> inputs =
      make_inputs(config, {6, 4}, synthetic::Routing::kWithEmptySlots, 21);
  const std::vector<RankExperts> experts = synthetic::make_experts(config, 22);
  const Outputs y = run_forward(config, inputs, experts);
  for (int r = 0; r < 2; ++r) {
    for (int64_t t = 0; t < inputs[r].num_tokens; ++t) {
      std::vector<float> row(config.hidden);
      reference::forward_token(config, experts, inputs[r].x.data() + t * config.hidden,
                               inputs[r].topk_idx.data() + t * config.top_k,
                               inputs[r].topk_weights.data() + t * config.top_k, row.data());
      EXPECT_EQ(row, std::vector<float>(y[r].begin() + t * config.hidden,
                                        y[r].begin() + (t + 1) * config.hidden))
          << "rank " << r << " token " << t;
    }
  }

  // forward_token has no Status to return: it throws rather than read out of bounds.
  std::vector<float> row(config.hidden);
  const std::vector<int32_t> bad_idx = {1, 8, 2};
  EXPECT_THROW(reference::forward_token(config, experts, inputs[0].x.data(), bad_idx.data(),
                                        inputs[0].topk_weights.data(), row.data()),
               std::out_of_range);
  std::vector<RankExperts> short_experts = experts;
  short_experts[1].up.pop_back();
  EXPECT_THROW(reference::forward_token(config, short_experts, inputs[0].x.data(),
                                        inputs[0].topk_idx.data(), inputs[0].topk_weights.data(),
                                        row.data()),
               std::invalid_argument);
}

// backward_token is backward()'s own per-token code: every token's dx row and d topk_weights
// (zeros for its empty slots) bit for bit, on both ranks.
TEST(ReferenceLayer, BackwardTokenMatchesBackward) {
  const LayerConfig config = make_config(128, 64, 8, 3, 2, 6);
  const std::vector<RankInput> inputs =
      make_inputs(config, {6, 4}, synthetic::Routing::kWithEmptySlots, 23);
  const std::vector<RankExperts> experts = synthetic::make_experts(config, 24);
  const Outputs dy = make_dy(config, inputs, 25);
  const std::vector<RankGrads> grads = run_backward(config, inputs, experts, dy);
  const int64_t H = config.hidden, K = config.top_k;
  for (int r = 0; r < 2; ++r) {
    for (int64_t t = 0; t < inputs[r].num_tokens; ++t) {
      std::vector<float> dx(H), d_weights(K);
      reference::backward_token(
          config, experts, inputs[r].x.data() + t * H, inputs[r].topk_idx.data() + t * K,
          inputs[r].topk_weights.data() + t * K, dy[r].data() + t * H, dx.data(), d_weights.data());
      EXPECT_EQ(dx,
                std::vector<float>(grads[r].dx.begin() + t * H, grads[r].dx.begin() + (t + 1) * H))
          << "rank " << r << " token " << t;
      EXPECT_EQ(d_weights, std::vector<float>(grads[r].d_topk_weights.begin() + t * K,
                                              grads[r].d_topk_weights.begin() + (t + 1) * K))
          << "rank " << r << " token " << t;
    }
  }

  // Like forward_token, it throws rather than read out of bounds.
  std::vector<float> dx(H), d_weights(K);
  const std::vector<int32_t> bad_idx = {1, -2, 2};
  EXPECT_THROW(reference::backward_token(config, experts, inputs[0].x.data(), bad_idx.data(),
                                         inputs[0].topk_weights.data(), dy[0].data(), dx.data(),
                                         d_weights.data()),
               std::out_of_range);
  std::vector<RankExperts> short_experts = experts;
  short_experts[0].gate.pop_back();
  EXPECT_THROW(reference::backward_token(config, short_experts, inputs[0].x.data(),
                                         inputs[0].topk_idx.data(), inputs[0].topk_weights.data(),
                                         dy[0].data(), dx.data(), d_weights.data()),
               std::invalid_argument);
}

// weight_grad_elements sums backward()'s terms in backward()'s order: every element of every
// rank's three weight gradients agrees to one float rounding (exactly 0 for an expert without
// rows), whatever order the elements are asked in. Imbalanced routing over both ranks, one
// expert's slots emptied.
TEST(ReferenceLayer, WeightGradElementsMatchBackward) {
  const LayerConfig config = make_config(64, 128, 8, 3, 2, 9);
  std::vector<RankInput> inputs = make_inputs(config, {9, 7}, synthetic::Routing::kImbalanced, 26);
  const int32_t emptied = 5;  // rank 1's local expert 1
  for (RankInput& in : inputs) std::replace(in.topk_idx.begin(), in.topk_idx.end(), emptied, -1);
  const std::vector<RankExperts> experts = synthetic::make_experts(config, 27);
  const Outputs dy = make_dy(config, inputs, 28);
  const std::vector<RankGrads> grads = run_backward(config, inputs, experts, dy);

  using reference::WeightGradElement;
  using reference::WeightGradMatrix;
  const int64_t H = config.hidden, I = config.intermediate;
  const int32_t experts_per_rank = config.experts_per_rank();
  for (int32_t r = 0; r < 2; ++r) {
    // Every element of the three matrices, interleaved: expert by expert, the gate and up
    // elements of each index pair, then the down one (the function groups them itself).
    std::vector<WeightGradElement> elements;
    std::vector<double> expected;
    for (int32_t e = 0; e < experts_per_rank; ++e) {
      for (int64_t i = 0; i < I; ++i) {
        for (int64_t h = 0; h < H; ++h) {
          const int64_t gate_up_at = (e * I + i) * H + h;
          const int64_t down_at = (e * H + h) * I + i;
          elements.push_back({WeightGradMatrix::kGate, e, i, h});
          expected.push_back(grads[r].d_gate[gate_up_at]);
          elements.push_back({WeightGradMatrix::kUp, e, i, h});
          expected.push_back(grads[r].d_up[gate_up_at]);
          elements.push_back({WeightGradMatrix::kDown, e, h, i});
          expected.push_back(grads[r].d_down[down_at]);
        }
      }
    }
    std::vector<float> values;
    const Status status =
        reference::weight_grad_elements(config, inputs, experts, dy, r, elements, &values);
    ASSERT_TRUE(status.ok()) << status.to_string();
    expect_rel_near(values, expected, 0x1p-23, "rank " + std::to_string(r));
  }
  // Not a comparison of zeros: exactly the experts without rows (the emptied one among them)
  // have all-zero gradients.
  std::vector<int64_t> rows(config.num_experts, 0);
  for (const RankInput& in : inputs)
    for (int32_t expert : in.topk_idx) rows[expert] += expert >= 0;
  EXPECT_EQ(rows[emptied], 0);
  for (int32_t expert = 0; expert < config.num_experts; ++expert) {
    const RankGrads& g = grads[expert / experts_per_rank];
    const int64_t first = (expert % experts_per_rank) * H * I;
    for (const std::vector<float>* matrix : {&g.d_gate, &g.d_up, &g.d_down}) {
      EXPECT_EQ(std::all_of(matrix->begin() + first, matrix->begin() + first + H * I,
                            [](float v) { return v == 0.0f; }),
                rows[expert] == 0)
          << "expert " << expert << " with " << rows[expert] << " rows";
    }
  }

  std::vector<float> values;
  EXPECT_EQ(reference::weight_grad_elements(config, inputs, experts, dy, 2,
                                            {{WeightGradMatrix::kUp, 0, 0, 0}}, &values)
                .code(),
            StatusCode::kInvalidArgument);
  const Status outside = reference::weight_grad_elements(
      config, inputs, experts, dy, 0, {{WeightGradMatrix::kDown, 1, 0, I}}, &values);
  EXPECT_EQ(outside.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(outside.message().find("elements[0]"), std::string::npos) << outside.message();
  Outputs short_dy = dy;
  short_dy[0].pop_back();
  EXPECT_EQ(reference::weight_grad_elements(config, inputs, experts, short_dy, 0,
                                            {{WeightGradMatrix::kGate, 0, 0, 0}}, &values)
                .code(),
            StatusCode::kInvalidArgument);
}

// Tokens are independent: permuting one rank's tokens (and their dy) permutes that rank's y, dx
// and d_topk_weights bit for bit. Weight gradients only change by summation order.
TEST(ReferenceLayer, PermutingTokensPermutesOutputs) {
  const LayerConfig config = make_config(64, 128, 8, 2, 2, 7);
  const std::vector<RankInput> inputs =
      make_inputs(config, {6, 7}, synthetic::Routing::kUniform, 31);
  const std::vector<RankExperts> experts = synthetic::make_experts(config, 32);
  const Outputs dy = make_dy(config, inputs, 33);

  const std::vector<int64_t> permutation = {3, 6, 0, 5, 1, 4, 2};  // new token t = old token p[t]
  const auto permute_rows = [&](const auto& rows, int64_t width) {
    std::remove_cvref_t<decltype(rows)> permuted(rows.size());
    for (size_t t = 0; t < permutation.size(); ++t) {
      std::copy_n(rows.begin() + permutation[t] * width, width, permuted.begin() + t * width);
    }
    return permuted;
  };
  std::vector<RankInput> permuted_inputs = inputs;
  permuted_inputs[1].x = permute_rows(inputs[1].x, config.hidden);
  permuted_inputs[1].topk_idx = permute_rows(inputs[1].topk_idx, config.top_k);
  permuted_inputs[1].topk_weights = permute_rows(inputs[1].topk_weights, config.top_k);
  Outputs permuted_dy = dy;
  permuted_dy[1] = permute_rows(dy[1], config.hidden);

  const Outputs y = run_forward(config, inputs, experts);
  const Outputs permuted_y = run_forward(config, permuted_inputs, experts);
  EXPECT_EQ(permuted_y[0], y[0]);
  EXPECT_EQ(permuted_y[1], permute_rows(y[1], config.hidden));

  const std::vector<RankGrads> grads = run_backward(config, inputs, experts, dy);
  const std::vector<RankGrads> permuted_grads =
      run_backward(config, permuted_inputs, experts, permuted_dy);
  EXPECT_EQ(permuted_grads[0].dx, grads[0].dx);
  EXPECT_EQ(permuted_grads[1].dx, permute_rows(grads[1].dx, config.hidden));
  EXPECT_EQ(permuted_grads[1].d_topk_weights,
            permute_rows(grads[1].d_topk_weights, config.top_k));
  for (int r = 0; r < 2; ++r) {
    expect_all_near(permuted_grads[r].d_gate, grads[r].d_gate, 1e-6, "d_gate");
    expect_all_near(permuted_grads[r].d_up, grads[r].d_up, 1e-6, "d_up");
    expect_all_near(permuted_grads[r].d_down, grads[r].d_down, 1e-6, "d_down");
  }
}

// A slot with router weight 0 adds w * y_e = 0 and w * dy = 0 everywhere, exactly like an empty
// slot; only its own d_topk_weights differs (the gradient of w does not depend on w).
TEST(ReferenceLayer, ZeroRouterWeightEqualsEmptySlot) {
  const LayerConfig config = make_config(64, 64, 4, 2, 1, 5);
  std::vector<RankInput> zero_weight = make_inputs(config, {5}, synthetic::Routing::kUniform, 41);
  const std::vector<RankExperts> experts = synthetic::make_experts(config, 42);
  const Outputs dy = make_dy(config, zero_weight, 43);
  const std::vector<int64_t> zeroed_slots = {1, 4, 7};
  std::vector<RankInput> empty_slot = zero_weight;
  for (int64_t slot : zeroed_slots) {
    zero_weight[0].topk_weights[slot] = 0.0f;
    empty_slot[0].topk_idx[slot] = -1;
  }

  EXPECT_EQ(run_forward(config, zero_weight, experts), run_forward(config, empty_slot, experts));
  const std::vector<RankGrads> zero_weight_grads = run_backward(config, zero_weight, experts, dy);
  const std::vector<RankGrads> empty_slot_grads = run_backward(config, empty_slot, experts, dy);
  EXPECT_EQ(zero_weight_grads[0].dx, empty_slot_grads[0].dx);
  EXPECT_EQ(zero_weight_grads[0].d_gate, empty_slot_grads[0].d_gate);
  EXPECT_EQ(zero_weight_grads[0].d_up, empty_slot_grads[0].d_up);
  EXPECT_EQ(zero_weight_grads[0].d_down, empty_slot_grads[0].d_down);
  for (int64_t slot = 0; slot < 5 * config.top_k; ++slot) {
    const bool zeroed =
        std::find(zeroed_slots.begin(), zeroed_slots.end(), slot) != zeroed_slots.end();
    if (zeroed) {
      EXPECT_EQ(empty_slot_grads[0].d_topk_weights[slot], 0.0f) << slot;
      EXPECT_NE(zero_weight_grads[0].d_topk_weights[slot], 0.0f) << slot;
    } else {
      EXPECT_EQ(zero_weight_grads[0].d_topk_weights[slot],
                empty_slot_grads[0].d_topk_weights[slot])
          << slot;
    }
  }
}

// Inserting an empty slot into every token (at a varying position) changes nothing but the
// shape of d_topk_weights, whose new slot is 0; a token whose slots are all empty gives zeros.
TEST(ReferenceLayer, EmptySlotsContributeNothing) {
  const LayerConfig config = make_config(64, 64, 6, 2, 2, 5);
  const LayerConfig padded_config = make_config(64, 64, 6, 3, 2, 5);
  std::vector<RankInput> inputs = make_inputs(config, {5, 3}, synthetic::Routing::kUniform, 51);
  inputs[1].topk_idx[2] = -1;  // rank 1 token 1: no expert at all
  inputs[1].topk_idx[3] = -1;
  const std::vector<RankExperts> experts = synthetic::make_experts(config, 52);
  const Outputs dy = make_dy(config, inputs, 53);

  std::vector<RankInput> padded = inputs;
  for (int r = 0; r < 2; ++r) {
    RankInput& in = padded[r];
    in.topk_idx.clear();
    in.topk_weights.clear();
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      const int64_t empty_at = t % 3;
      for (int64_t k = 0, source = 0; k < 3; ++k) {
        const bool empty = k == empty_at;
        in.topk_idx.push_back(empty ? -1 : inputs[r].topk_idx[t * 2 + source]);
        in.topk_weights.push_back(empty ? 0.75f : inputs[r].topk_weights[t * 2 + source]);
        source += empty ? 0 : 1;
      }
    }
  }

  const Outputs y = run_forward(config, inputs, experts);
  EXPECT_EQ(run_forward(padded_config, padded, experts), y);
  const std::vector<float> token_without_experts(y[1].begin() + config.hidden,
                                                 y[1].begin() + 2 * config.hidden);
  EXPECT_EQ(token_without_experts, std::vector<float>(config.hidden, 0.0f));

  const std::vector<RankGrads> grads = run_backward(config, inputs, experts, dy);
  const std::vector<RankGrads> padded_grads = run_backward(padded_config, padded, experts, dy);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(padded_grads[r].dx, grads[r].dx);
    EXPECT_EQ(padded_grads[r].d_gate, grads[r].d_gate);
    EXPECT_EQ(padded_grads[r].d_up, grads[r].d_up);
    EXPECT_EQ(padded_grads[r].d_down, grads[r].d_down);
    for (int64_t t = 0; t < inputs[r].num_tokens; ++t) {
      for (int64_t k = 0, source = 0; k < 3; ++k) {
        const float d_weight = padded_grads[r].d_topk_weights[t * 3 + k];
        if (k == t % 3) {
          EXPECT_EQ(d_weight, 0.0f);
        } else {
          EXPECT_EQ(d_weight, grads[r].d_topk_weights[t * 2 + source++]);
        }
      }
    }
  }
  const std::vector<float> dx_without_experts(grads[1].dx.begin() + config.hidden,
                                              grads[1].dx.begin() + 2 * config.hidden);
  EXPECT_EQ(dx_without_experts, std::vector<float>(config.hidden, 0.0f));
}

// Splits rows [0, total) of `all` (each `width` wide) into consecutive runs of the given sizes.
template <typename T>
std::vector<std::vector<T>> split_rows(const std::vector<T>& all, int64_t width,
                                       const std::vector<int64_t>& rows_per_rank) {
  std::vector<std::vector<T>> parts;
  auto first = all.begin();
  for (int64_t rows : rows_per_rank) {
    parts.emplace_back(first, first + rows * width);
    first += rows * width;
  }
  return parts;
}

std::vector<RankInput> split_tokens(const LayerConfig& config, const RankInput& all,
                                    const std::vector<int64_t>& tokens_per_rank) {
  const auto x = split_rows(all.x, config.hidden, tokens_per_rank);
  const auto topk_idx = split_rows(all.topk_idx, config.top_k, tokens_per_rank);
  const auto topk_weights = split_rows(all.topk_weights, config.top_k, tokens_per_rank);
  std::vector<RankInput> inputs;
  for (size_t r = 0; r < tokens_per_rank.size(); ++r)
    inputs.push_back({tokens_per_rank[r], x[r], topk_idx[r], topk_weights[r]});
  return inputs;
}

// Rank r of ep_size gets global experts [r * E_local, (r + 1) * E_local) of `all`.
std::vector<RankExperts> split_experts(const LayerConfig& config, const RankExperts& all) {
  const int64_t rank_size =
      int64_t{config.experts_per_rank()} * config.intermediate * config.hidden;
  std::vector<RankExperts> experts(config.ep_size);
  for (int64_t r = 0; r < config.ep_size; ++r) {
    const auto slice = [&](const std::vector<float>& v) {
      return std::vector<float>(v.begin() + r * rank_size, v.begin() + (r + 1) * rank_size);
    };
    experts[r] = {slice(all.gate), slice(all.up), slice(all.down)};
  }
  return experts;
}

// Spreading the same global experts and tokens over 1, 2, 4 or 8 ranks changes nothing. Every
// token and every weight gradient sees its terms in the same order (ranks are walked in order,
// and the token runs are consecutive), so the results are bit-identical.
TEST(ReferenceLayer, SameResultsForAnyExpertSplit) {
  const int64_t total_tokens = 37;
  const LayerConfig one_rank = make_config(64, 128, 8, 3, 1, total_tokens);
  const std::vector<RankInput> all_tokens =
      make_inputs(one_rank, {total_tokens}, synthetic::Routing::kWithEmptySlots, 61);
  const std::vector<RankExperts> all_experts = synthetic::make_experts(one_rank, 62);
  const Outputs all_dy = make_dy(one_rank, all_tokens, 63);
  const Outputs expected_y = run_forward(one_rank, all_tokens, all_experts);
  const std::vector<RankGrads> expected = run_backward(one_rank, all_tokens, all_experts, all_dy);

  const std::vector<std::vector<int64_t>> layouts = {
      {37, 0},          {0, 37},          {20, 17},
      {37, 0, 0, 0},    {9, 0, 25, 3},
      {37, 0, 0, 0, 0, 0, 0, 0},          {5, 5, 0, 9, 1, 7, 10, 0},
  };
  for (const std::vector<int64_t>& tokens_per_rank : layouts) {
    const int32_t ep_size = static_cast<int32_t>(tokens_per_rank.size());
    SCOPED_TRACE("ep_size " + std::to_string(ep_size) + ", rank 1 has " +
                 std::to_string(tokens_per_rank[1]) + " tokens");
    const LayerConfig config = make_config(64, 128, 8, 3, ep_size, total_tokens);
    const std::vector<RankInput> inputs = split_tokens(config, all_tokens[0], tokens_per_rank);
    const std::vector<RankExperts> experts = split_experts(config, all_experts[0]);
    const Outputs dy = split_rows(all_dy[0], config.hidden, tokens_per_rank);

    EXPECT_EQ(concat_ranks(run_forward(config, inputs, experts)), expected_y[0]);
    const std::vector<RankGrads> grads = run_backward(config, inputs, experts, dy);
    EXPECT_EQ(concat_grads(grads, &RankGrads::dx), expected[0].dx);
    EXPECT_EQ(concat_grads(grads, &RankGrads::d_topk_weights), expected[0].d_topk_weights);
    EXPECT_EQ(concat_grads(grads, &RankGrads::d_gate), expected[0].d_gate);
    EXPECT_EQ(concat_grads(grads, &RankGrads::d_up), expected[0].d_up);
    EXPECT_EQ(concat_grads(grads, &RankGrads::d_down), expected[0].d_down);
  }
}

// Rank 0 has no tokens but owns experts that rank 1's tokens use: it returns empty y and dx and
// still receives the gradients of its experts.
TEST(ReferenceLayer, RankWithoutTokens) {
  const LayerConfig config = make_config(64, 64, 4, 2, 2, 6);
  const std::vector<RankInput> inputs =
      make_inputs(config, {0, 6}, synthetic::Routing::kUniform, 71);
  const std::vector<RankExperts> experts = synthetic::make_experts(config, 72);
  const Outputs y = run_forward(config, inputs, experts);
  ASSERT_EQ(y.size(), 2u);
  EXPECT_TRUE(y[0].empty());
  EXPECT_EQ(y[1].size(), 6u * config.hidden);

  const std::vector<RankGrads> grads = run_backward(config, inputs, experts, make_dy(config,
                                                                                     inputs, 73));
  EXPECT_TRUE(grads[0].dx.empty());
  EXPECT_TRUE(grads[0].d_topk_weights.empty());
  const bool uses_rank0_experts = std::any_of(
      inputs[1].topk_idx.begin(), inputs[1].topk_idx.end(), [](int32_t e) { return e < 2; });
  ASSERT_TRUE(uses_rank0_experts);
  const auto nonzero = [](const std::vector<float>& v) {
    return std::any_of(v.begin(), v.end(), [](float value) { return value != 0.0f; });
  };
  EXPECT_TRUE(nonzero(grads[0].d_gate));
  EXPECT_TRUE(nonzero(grads[0].d_up));
  EXPECT_TRUE(nonzero(grads[0].d_down));
}

// --- check_inputs --------------------------------------------------------------------------------

class CheckInputs : public ::testing::Test {
 protected:
  CheckInputs()
      : inputs_(make_inputs(config_, {3, 4}, synthetic::Routing::kUniform, 81)),
        experts_(synthetic::make_experts(config_, 82)) {}

  // Expects kInvalidArgument with every one of `fragments` in the message, from check_inputs
  // and from forward and backward, which run it first.
  void expect_rejected(const std::vector<std::string>& fragments) {
    const Status status = reference::check_inputs(config_, inputs_, experts_);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.to_string();
    for (const std::string& fragment : fragments)
      EXPECT_NE(status.message().find(fragment), std::string::npos) << status.message();
    Outputs y;
    EXPECT_EQ(reference::forward(config_, inputs_, experts_, &y).message(), status.message());
    std::vector<RankGrads> grads;
    EXPECT_EQ(reference::backward(config_, inputs_, experts_, {}, &grads).message(),
              status.message());
  }

  LayerConfig config_ = make_config(64, 64, 8, 2, 2, 4);
  std::vector<RankInput> inputs_;
  std::vector<RankExperts> experts_;
};

TEST_F(CheckInputs, AcceptsValidInputs) {
  EXPECT_TRUE(reference::check_inputs(config_, inputs_, experts_).ok());
}

TEST_F(CheckInputs, RejectsExpertIdPastLastExpert) {
  inputs_[1].topk_idx[2 * 2 + 1] = 8;
  expect_rejected({"rank 1", "token 2", "k 1", "expert id 8"});
}

TEST_F(CheckInputs, RejectsExpertIdBelowMinusOne) {
  inputs_[0].topk_idx[0] = -2;
  expect_rejected({"rank 0", "token 0", "k 0", "expert id -2"});
}

TEST_F(CheckInputs, RejectsWrongXSize) {
  inputs_[1].x.pop_back();
  expect_rejected({"rank 1", "x has 255 elements", "256"});
}

TEST_F(CheckInputs, RejectsWrongRoutingSizes) {
  inputs_[0].topk_weights.push_back(0.5f);
  expect_rejected({"rank 0", "topk_weights has 7 elements", "6"});
}

TEST_F(CheckInputs, RejectsWrongWeightSize) {
  experts_[1].down.resize(3 * 64 * 64);
  expect_rejected({"rank 1", "experts.down", "12288", "16384"});
}

TEST_F(CheckInputs, RejectsWrongRankCount) {
  inputs_.push_back(inputs_[0]);
  expect_rejected({"inputs has 3 ranks", "ep_size (2)"});
  inputs_.resize(2);
  experts_.pop_back();
  expect_rejected({"experts has 1 ranks", "ep_size (2)"});
}

TEST_F(CheckInputs, RejectsMoreTokensThanTheConfigAllows) {
  inputs_ = make_inputs(config_, {3, 5}, synthetic::Routing::kUniform, 83);
  expect_rejected({"rank 1", "num_tokens (5)", "max_tokens_per_rank=4"});
}

TEST_F(CheckInputs, RejectsInvalidConfig) {
  config_.hidden = 96;
  expect_rejected({"hidden (96)"});
}

TEST_F(CheckInputs, BackwardRejectsWrongDySize) {
  Outputs dy = make_dy(config_, inputs_, 84);
  dy[1].resize(5);
  std::vector<RankGrads> grads;
  Status status = reference::backward(config_, inputs_, experts_, dy, &grads);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("rank 1: dy has 5 elements"), std::string::npos)
      << status.message();
  dy.pop_back();
  status = reference::backward(config_, inputs_, experts_, dy, &grads);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("dy has 1 ranks"), std::string::npos) << status.message();
}

// --- synthetic -----------------------------------------------------------------------------------

TEST(Synthetic, InputsAreDeterministicPerSeed) {
  const LayerConfig config = make_config(64, 64, 16, 4, 2, 32);
  for (synthetic::Routing routing :
       {synthetic::Routing::kUniform, synthetic::Routing::kImbalanced,
        synthetic::Routing::kSingleExpert, synthetic::Routing::kWithEmptySlots}) {
    const std::vector<RankInput> first = make_inputs(config, {32, 5}, routing, 5);
    const std::vector<RankInput> again = make_inputs(config, {32, 5}, routing, 5);
    const std::vector<RankInput> other = make_inputs(config, {32, 5}, routing, 6);
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(first[r].num_tokens, again[r].num_tokens);
      EXPECT_EQ(first[r].x, again[r].x);
      EXPECT_EQ(first[r].topk_idx, again[r].topk_idx);
      EXPECT_EQ(first[r].topk_weights, again[r].topk_weights);
      EXPECT_NE(first[r].x, other[r].x);
      EXPECT_NE(first[r].topk_weights, other[r].topk_weights);
    }
    if (routing != synthetic::Routing::kSingleExpert) {
      EXPECT_NE(first[0].topk_idx, other[0].topk_idx);
    }
  }
}

TEST(Synthetic, InputValuesAreInRangeAndNeverZero) {
  const LayerConfig config = make_config(128, 64, 16, 4, 2, 64);
  synthetic::InputSpec spec;
  spec.tokens_per_rank = {64, 17};
  spec.x_scale = 3.0f;
  for (const RankInput& in : synthetic::make_inputs(config, spec)) {
    ASSERT_EQ(in.x.size(), static_cast<size_t>(in.num_tokens * config.hidden));
    for (float value : in.x) {
      EXPECT_NE(value, 0.0f);
      EXPECT_LT(std::abs(value), 3.0f);
    }
    for (float weight : in.topk_weights) {
      EXPECT_GT(weight, 0.05f);
      EXPECT_LE(weight, 1.0f);
    }
  }
}

TEST(Synthetic, UniformRoutingPicksDistinctExperts) {
  const LayerConfig config = make_config(64, 64, 8, 8, 2, 200);  // K = E: all 8 every token
  const std::vector<RankInput> inputs =
      make_inputs(config, {200, 3}, synthetic::Routing::kUniform, 9);
  std::vector<int64_t> first_slot_count(8, 0);
  for (const RankInput& in : inputs) {
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      const auto row = in.topk_idx.begin() + t * config.top_k;
      const std::set<int32_t> distinct(row, row + config.top_k);
      EXPECT_EQ(distinct.size(), 8u) << "token " << t;
      EXPECT_GE(*distinct.begin(), 0);
      EXPECT_LT(*distinct.rbegin(), 8);
      ++first_slot_count[*row];
    }
  }
  // Slot order is random too: every expert lands in slot 0 now and then.
  for (int64_t count : first_slot_count) EXPECT_GT(count, 5);
}

TEST(Synthetic, ImbalancedRoutingLeavesExpertsEmpty) {
  const LayerConfig config = make_config(64, 64, 32, 4, 2, 8);
  for (uint64_t seed = 1; seed <= 5; ++seed) {
    const std::vector<RankInput> inputs =
        make_inputs(config, {8, 8}, synthetic::Routing::kImbalanced, seed);
    std::vector<int64_t> count(32, 0);
    for (const RankInput& in : inputs) {
      for (int64_t t = 0; t < in.num_tokens; ++t) {
        const auto row = in.topk_idx.begin() + t * config.top_k;
        EXPECT_EQ(std::set<int32_t>(row, row + config.top_k).size(), 4u);
        for (int64_t k = 0; k < config.top_k; ++k) ++count[row[k]];
      }
    }
    // 64 slots over 32 experts: uniform routing would give 2 each on average.
    const int64_t empty_experts = std::count(count.begin(), count.end(), 0);
    EXPECT_GE(empty_experts, 8) << "seed " << seed;
    EXPECT_GE(*std::max_element(count.begin(), count.end()), 8) << "seed " << seed;
  }
}

TEST(Synthetic, SingleExpertRouting) {
  const LayerConfig config = make_config(64, 64, 4, 3, 2, 5);
  for (const RankInput& in : make_inputs(config, {5, 2}, synthetic::Routing::kSingleExpert, 3)) {
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      EXPECT_EQ(in.topk_idx[t * 3 + 0], 0);
      EXPECT_EQ(in.topk_idx[t * 3 + 1], -1);
      EXPECT_EQ(in.topk_idx[t * 3 + 2], -1);
    }
  }
}

TEST(Synthetic, EmptySlotsRoutingEmptiesAboutAQuarter) {
  const LayerConfig config = make_config(64, 64, 16, 4, 1, 500);
  const std::vector<RankInput> uniform =
      make_inputs(config, {500}, synthetic::Routing::kUniform, 4);
  const std::vector<RankInput> with_empty =
      make_inputs(config, {500}, synthetic::Routing::kWithEmptySlots, 4);
  int64_t empty = 0;
  for (size_t slot = 0; slot < with_empty[0].topk_idx.size(); ++slot) {
    const int32_t expert = with_empty[0].topk_idx[slot];
    if (expert == -1) {
      ++empty;
    } else {
      EXPECT_EQ(expert, uniform[0].topk_idx[slot]);
    }
  }
  EXPECT_GT(empty, 400);  // 2000 slots, 500 expected
  EXPECT_LT(empty, 600);
}

TEST(Synthetic, RejectsBadSpec) {
  const LayerConfig config = make_config(64, 64, 4, 2, 2, 4);
  synthetic::InputSpec spec;
  spec.tokens_per_rank = {4};
  EXPECT_THROW(synthetic::make_inputs(config, spec), std::invalid_argument);
  spec.tokens_per_rank = {4, -1};
  EXPECT_THROW(synthetic::make_inputs(config, spec), std::invalid_argument);
  spec.tokens_per_rank = {4, 0};
  spec.x_scale = 0.0f;
  EXPECT_THROW(synthetic::make_inputs(config, spec), std::invalid_argument);
}

TEST(Synthetic, ExpertsAreDeterministicNonzeroAndIndependentOfEpSize) {
  const LayerConfig one_rank = make_config(64, 128, 8, 2, 1, 1);
  const std::vector<RankExperts> all = synthetic::make_experts(one_rank, 17);
  EXPECT_EQ(synthetic::make_experts(one_rank, 17)[0].gate, all[0].gate);
  EXPECT_NE(synthetic::make_experts(one_rank, 18)[0].gate, all[0].gate);
  const double gate_bound = 1.0 / std::sqrt(64.0);
  const double down_bound = 1.0 / std::sqrt(128.0);
  for (size_t i = 0; i < all[0].gate.size(); ++i) {
    ASSERT_NE(all[0].gate[i], 0.0f);
    ASSERT_NE(all[0].up[i], 0.0f);
    ASSERT_NE(all[0].down[i], 0.0f);
    ASSERT_LE(std::abs(all[0].gate[i]), gate_bound);
    ASSERT_LE(std::abs(all[0].up[i]), gate_bound);
    ASSERT_LE(std::abs(all[0].down[i]), down_bound);
  }
  EXPECT_NE(all[0].gate, all[0].up);
  for (int32_t ep_size : {2, 4, 8}) {
    const LayerConfig config = make_config(64, 128, 8, 2, ep_size, 1);
    const std::vector<RankExperts> split = synthetic::make_experts(config, 17);
    const std::vector<RankExperts> expected = split_experts(config, all[0]);
    for (int32_t r = 0; r < ep_size; ++r) {
      EXPECT_EQ(split[r].gate, expected[r].gate) << "ep " << ep_size << " rank " << r;
      EXPECT_EQ(split[r].up, expected[r].up) << "ep " << ep_size << " rank " << r;
      EXPECT_EQ(split[r].down, expected[r].down) << "ep " << ep_size << " rank " << r;
    }
  }
}

}  // namespace
}  // namespace epflow
