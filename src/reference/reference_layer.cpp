#include "epflow/reference.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "common/status_util.h"

namespace epflow::reference {
namespace {

// exp() only ever sees a non-positive argument, so it cannot overflow for large |g|.
double sigmoid(double g) {
  if (g >= 0.0) return 1.0 / (1.0 + std::exp(-g));
  const double e = std::exp(g);
  return e / (1.0 + e);
}

// One global expert's weights, inside the rank that owns it.
struct ExpertWeights {
  const float* gate;  // [I, H]
  const float* up;    // [I, H]
  const float* down;  // [H, I]
};

ExpertWeights expert_weights(const LayerConfig& config, const std::vector<RankExperts>& experts,
                             int32_t expert) {
  const int32_t experts_per_rank = config.experts_per_rank();
  const RankExperts& owner = experts[expert / experts_per_rank];
  const int64_t offset = (expert % experts_per_rank) * config.intermediate * config.hidden;
  return {owner.gate.data() + offset, owner.up.data() + offset, owner.down.data() + offset};
}

// One expert applied to one token; the backward needs every intermediate.
struct ExpertActivations {
  std::vector<double> gate;  // g, [I]
  std::vector<double> up;    // u, [I]
  std::vector<double> h;     // silu(g) * u, [I]
  std::vector<double> y;     // W_down h, [H]
};

// out[row] = sum_j matrix[row, j] * v[j] for a row-major [rows, cols] matrix. kRows rows run
// side by side only so that their independent sums hide the add latency: each is still taken
// in increasing j, bit-identical to one row at a time.
template <typename Vector>
void matvec(const float* matrix, int64_t rows, int64_t cols, const Vector* v, double* out) {
  constexpr int64_t kRows = 4;
  static_assert(Limits::kHiddenMultiple % kRows == 0 && Limits::kIntermediateMultiple % kRows == 0,
                "validate() must guarantee that kRows divides H and I");
  for (int64_t row = 0; row < rows; row += kRows) {
    double sum[kRows] = {};
    for (int64_t j = 0; j < cols; ++j) {
      for (int64_t b = 0; b < kRows; ++b)
        sum[b] += static_cast<double>(matrix[(row + b) * cols + j]) * v[j];
    }
    for (int64_t b = 0; b < kRows; ++b) out[row + b] = sum[b];
  }
}

void expert_forward(const LayerConfig& config, const ExpertWeights& weights, const float* x,
                    ExpertActivations* act) {
  const int64_t hidden = config.hidden;
  const int64_t intermediate = config.intermediate;
  act->gate.resize(intermediate);
  act->up.resize(intermediate);
  act->h.resize(intermediate);
  act->y.resize(hidden);
  matvec(weights.gate, intermediate, hidden, x, act->gate.data());
  matvec(weights.up, intermediate, hidden, x, act->up.data());
  for (int64_t i = 0; i < intermediate; ++i) {
    const double g = act->gate[i];
    act->h[i] = g * sigmoid(g) * act->up[i];
  }
  matvec(weights.down, hidden, intermediate, act->h.data(), act->y.data());
}

// Buffers reused from token to token by forward().
struct TokenWorkspace {
  ExpertActivations act;
  std::vector<double> y;  // [H]
};

// The single implementation of a token's forward, behind both forward() and forward_token().
void token_forward(const LayerConfig& config, const std::vector<RankExperts>& experts,
                   const float* x_row, const int32_t* topk_idx_row, const float* topk_weights_row,
                   TokenWorkspace* ws, float* y_row) {
  ws->y.assign(config.hidden, 0.0);
  for (int32_t k = 0; k < config.top_k; ++k) {
    const int32_t expert = topk_idx_row[k];
    if (expert == -1) continue;
    if (expert < -1 || expert >= config.num_experts) {
      throw std::out_of_range(concat("forward_token: k ", k, ": expert id ", expert,
                                     " is outside [-1, num_experts=", config.num_experts, ")"));
    }
    expert_forward(config, expert_weights(config, experts, expert), x_row, &ws->act);
    const double weight = topk_weights_row[k];
    for (int64_t j = 0; j < config.hidden; ++j) ws->y[j] += weight * ws->act.y[j];
  }
  for (int64_t j = 0; j < config.hidden; ++j) y_row[j] = static_cast<float>(ws->y[j]);
}

Status check_size(int64_t actual, int64_t expected, const std::string& what,
                  const std::string& expected_formula) {
  if (actual == expected) return Status::ok_status();
  return invalid_argument(what, " has ", actual, " elements, expected ", expected_formula, " = ",
                          expected);
}

}  // namespace

Status check_inputs(const LayerConfig& config, const std::vector<RankInput>& inputs,
                    const std::vector<RankExperts>& experts) {
  if (Status status = validate(config); !status.ok()) return status;
  const int64_t ep_size = config.ep_size;
  if (static_cast<int64_t>(inputs.size()) != ep_size)
    return invalid_argument("inputs has ", inputs.size(), " ranks, expected ep_size (", ep_size,
                            ")");
  if (static_cast<int64_t>(experts.size()) != ep_size)
    return invalid_argument("experts has ", experts.size(), " ranks, expected ep_size (", ep_size,
                            ")");

  const int64_t hidden = config.hidden;
  const int64_t intermediate = config.intermediate;
  const int64_t top_k = config.top_k;
  const int64_t experts_per_rank = config.experts_per_rank();
  for (int64_t r = 0; r < ep_size; ++r) {
    const RankInput& in = inputs[r];
    const std::string rank = concat("rank ", r, ": ");
    if (in.num_tokens < 0 || in.num_tokens > config.max_tokens_per_rank) {
      return invalid_argument(rank, "num_tokens (", in.num_tokens,
                              ") must be in [0, max_tokens_per_rank=", config.max_tokens_per_rank,
                              "]");
    }
    const std::string tokens_by = concat("num_tokens (", in.num_tokens, ") * ");
    Status status = check_size(in.x.size(), in.num_tokens * hidden, rank + "x",
                               concat(tokens_by, "hidden (", hidden, ")"));
    if (status.ok()) {
      status = check_size(in.topk_idx.size(), in.num_tokens * top_k, rank + "topk_idx",
                          concat(tokens_by, "top_k (", top_k, ")"));
    }
    if (status.ok()) {
      status = check_size(in.topk_weights.size(), in.num_tokens * top_k, rank + "topk_weights",
                          concat(tokens_by, "top_k (", top_k, ")"));
    }
    if (!status.ok()) return status;
  }
  const int64_t expert_weights_size = experts_per_rank * intermediate * hidden;
  const std::string weights_formula =
      concat("experts_per_rank (", experts_per_rank, ") * intermediate (", intermediate,
             ") * hidden (", hidden, ")");
  for (int64_t r = 0; r < ep_size; ++r) {
    const RankExperts& ex = experts[r];
    const std::string rank = concat("rank ", r, ": ");
    Status status =
        check_size(ex.gate.size(), expert_weights_size, rank + "experts.gate", weights_formula);
    if (status.ok()) {
      status = check_size(ex.up.size(), expert_weights_size, rank + "experts.up", weights_formula);
    }
    if (status.ok()) {
      status =
          check_size(ex.down.size(), expert_weights_size, rank + "experts.down", weights_formula);
    }
    if (!status.ok()) return status;
  }
  for (int64_t r = 0; r < ep_size; ++r) {
    const RankInput& in = inputs[r];
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      for (int64_t k = 0; k < top_k; ++k) {
        const int32_t expert = in.topk_idx[t * top_k + k];
        if (expert < -1 || expert >= config.num_experts) {
          return invalid_argument("rank ", r, " token ", t, " k ", k, ": expert id ", expert,
                                  " is outside [-1, num_experts=", config.num_experts, ")");
        }
      }
    }
  }
  return Status::ok_status();
}

Status forward(const LayerConfig& config, const std::vector<RankInput>& inputs,
               const std::vector<RankExperts>& experts, std::vector<std::vector<float>>* y) {
  if (Status status = check_inputs(config, inputs, experts); !status.ok()) return status;
  if (y == nullptr) return invalid_argument("y is null");
  const int64_t hidden = config.hidden;
  const int64_t top_k = config.top_k;
  y->assign(config.ep_size, {});
  TokenWorkspace ws;
  for (int32_t r = 0; r < config.ep_size; ++r) {
    const RankInput& in = inputs[r];
    std::vector<float>& y_rank = (*y)[r];
    y_rank.assign(in.num_tokens * hidden, 0.0f);
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      token_forward(config, experts, in.x.data() + t * hidden, in.topk_idx.data() + t * top_k,
                    in.topk_weights.data() + t * top_k, &ws, y_rank.data() + t * hidden);
    }
  }
  return Status::ok_status();
}

void forward_token(const LayerConfig& config, const std::vector<RankExperts>& experts,
                   const float* x_row, const int32_t* topk_idx_row, const float* topk_weights_row,
                   float* y_row) {
  // There is no Status to return, and a bad config or expert shape would read out of bounds.
  Status status = validate(config);
  if (status.ok()) status = check_inputs(config, std::vector<RankInput>(config.ep_size), experts);
  if (!status.ok()) throw std::invalid_argument("forward_token: " + status.to_string());
  TokenWorkspace ws;
  token_forward(config, experts, x_row, topk_idx_row, topk_weights_row, &ws, y_row);
}

Status backward(const LayerConfig& config, const std::vector<RankInput>& inputs,
                const std::vector<RankExperts>& experts, const std::vector<std::vector<float>>& dy,
                std::vector<RankGrads>* grads) {
  if (Status status = check_inputs(config, inputs, experts); !status.ok()) return status;
  if (grads == nullptr) return invalid_argument("grads is null");
  const int64_t ep_size = config.ep_size;
  const int64_t hidden = config.hidden;
  const int64_t intermediate = config.intermediate;
  const int64_t top_k = config.top_k;
  if (static_cast<int64_t>(dy.size()) != ep_size)
    return invalid_argument("dy has ", dy.size(), " ranks, expected ep_size (", ep_size, ")");
  for (int64_t r = 0; r < ep_size; ++r) {
    Status status =
        check_size(dy[r].size(), inputs[r].num_tokens * hidden, concat("rank ", r, ": dy"),
                   concat("num_tokens (", inputs[r].num_tokens, ") * hidden (", hidden, ")"));
    if (!status.ok()) return status;
  }

  // Weight gradients of all experts, indexed by global expert id, summed in double over every
  // rank's tokens (ranks, tokens, slots in increasing order) and rounded once at the end.
  const int64_t expert_size = intermediate * hidden;
  std::vector<double> d_gate(config.num_experts * expert_size, 0.0);
  std::vector<double> d_up(config.num_experts * expert_size, 0.0);
  std::vector<double> d_down(config.num_experts * expert_size, 0.0);

  grads->assign(ep_size, {});
  ExpertActivations act;
  std::vector<double> dx(hidden);
  std::vector<double> dh(intermediate);
  std::vector<double> dg(intermediate);
  std::vector<double> du(intermediate);
  for (int64_t r = 0; r < ep_size; ++r) {
    const RankInput& in = inputs[r];
    RankGrads& out = (*grads)[r];
    out.dx.assign(in.num_tokens * hidden, 0.0f);
    out.d_topk_weights.assign(in.num_tokens * top_k, 0.0f);
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      const float* x = in.x.data() + t * hidden;
      const float* dy_row = dy[r].data() + t * hidden;
      std::fill(dx.begin(), dx.end(), 0.0);
      for (int64_t k = 0; k < top_k; ++k) {
        const int32_t expert = in.topk_idx[t * top_k + k];
        if (expert == -1) continue;
        const ExpertWeights weights = expert_weights(config, experts, expert);
        expert_forward(config, weights, x, &act);

        double d_weight = 0.0;
        for (int64_t j = 0; j < hidden; ++j) d_weight += dy_row[j] * act.y[j];
        out.d_topk_weights[t * top_k + k] = static_cast<float>(d_weight);

        const double weight = in.topk_weights[t * top_k + k];
        double* d_down_expert = d_down.data() + expert * expert_size;
        std::fill(dh.begin(), dh.end(), 0.0);
        for (int64_t row = 0; row < hidden; ++row) {
          const double dz = weight * dy_row[row];
          const float* down_row = weights.down + row * intermediate;
          double* d_down_row = d_down_expert + row * intermediate;
          for (int64_t i = 0; i < intermediate; ++i) {
            d_down_row[i] += dz * act.h[i];
            dh[i] += static_cast<double>(down_row[i]) * dz;
          }
        }
        for (int64_t i = 0; i < intermediate; ++i) {
          const double g = act.gate[i];
          const double s = sigmoid(g);
          dg[i] = dh[i] * act.up[i] * s * (1.0 + g * (1.0 - s));
          du[i] = dh[i] * g * s;
        }
        double* d_gate_expert = d_gate.data() + expert * expert_size;
        double* d_up_expert = d_up.data() + expert * expert_size;
        for (int64_t i = 0; i < intermediate; ++i) {
          const float* gate_row = weights.gate + i * hidden;
          const float* up_row = weights.up + i * hidden;
          double* d_gate_row = d_gate_expert + i * hidden;
          double* d_up_row = d_up_expert + i * hidden;
          for (int64_t j = 0; j < hidden; ++j) {
            d_gate_row[j] += dg[i] * x[j];
            d_up_row[j] += du[i] * x[j];
            dx[j] +=
                static_cast<double>(gate_row[j]) * dg[i] + static_cast<double>(up_row[j]) * du[i];
          }
        }
      }
      float* dx_out = out.dx.data() + t * hidden;
      for (int64_t j = 0; j < hidden; ++j) dx_out[j] = static_cast<float>(dx[j]);
    }
  }

  const int64_t rank_weights_size = config.experts_per_rank() * expert_size;
  const auto rank_slice = [&](const std::vector<double>& all, int64_t r) {
    const auto first = all.begin() + r * rank_weights_size;
    return std::vector<float>(first, first + rank_weights_size);
  };
  for (int64_t r = 0; r < ep_size; ++r) {
    RankGrads& out = (*grads)[r];
    out.d_gate = rank_slice(d_gate, r);
    out.d_up = rank_slice(d_up, r);
    out.d_down = rank_slice(d_down, r);
  }
  return Status::ok_status();
}

}  // namespace epflow::reference
