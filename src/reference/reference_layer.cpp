#include "epflow/reference.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>

#include "common/status_util.h"
#include "reference/reference_internal.h"

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

using detail::swiglu_backward;

// Weight gradients of all experts, indexed by global expert id, summed in double.
struct WeightGradSums {
  std::vector<double> gate;  // [num_experts, I, H]
  std::vector<double> up;    // [num_experts, I, H]
  std::vector<double> down;  // [num_experts, H, I]
};

// Buffers reused from token to token by backward().
struct TokenBackwardWorkspace {
  ExpertActivations act;
  std::vector<double> dx;  // [H]
  std::vector<double> dh;  // [I]
  std::vector<double> dg;  // [I]
  std::vector<double> du;  // [I]
};

// The single implementation of a token's backward, behind both backward() and backward_token():
// its dx row and d topk_weights and, with `sums`, its routed rows' terms added to the weight
// gradients.
void token_backward(const LayerConfig& config, const std::vector<RankExperts>& experts,
                    const float* x, const int32_t* topk_idx_row, const float* topk_weights_row,
                    const float* dy_row, TokenBackwardWorkspace* ws, float* dx_row,
                    float* d_topk_weights_row, WeightGradSums* sums) {
  const int64_t hidden = config.hidden;
  const int64_t intermediate = config.intermediate;
  const int64_t expert_size = intermediate * hidden;
  ws->dx.assign(hidden, 0.0);
  ws->dh.resize(intermediate);
  ws->dg.resize(intermediate);
  ws->du.resize(intermediate);
  ExpertActivations& act = ws->act;
  for (int32_t k = 0; k < config.top_k; ++k) {
    const int32_t expert = topk_idx_row[k];
    d_topk_weights_row[k] = 0.0f;
    if (expert == -1) continue;
    if (expert < -1 || expert >= config.num_experts) {
      throw std::out_of_range(concat("backward_token: k ", k, ": expert id ", expert,
                                     " is outside [-1, num_experts=", config.num_experts, ")"));
    }
    const ExpertWeights weights = expert_weights(config, experts, expert);
    expert_forward(config, weights, x, &act);

    double d_weight = 0.0;
    for (int64_t j = 0; j < hidden; ++j) d_weight += dy_row[j] * act.y[j];
    d_topk_weights_row[k] = static_cast<float>(d_weight);

    const double weight = topk_weights_row[k];
    std::fill(ws->dh.begin(), ws->dh.end(), 0.0);
    for (int64_t row = 0; row < hidden; ++row) {
      const double dz = weight * dy_row[row];
      const float* down_row = weights.down + row * intermediate;
      for (int64_t i = 0; i < intermediate; ++i) ws->dh[i] += static_cast<double>(down_row[i]) * dz;
      if (sums == nullptr) continue;
      double* d_down_row = sums->down.data() + expert * expert_size + row * intermediate;
      for (int64_t i = 0; i < intermediate; ++i) d_down_row[i] += dz * act.h[i];
    }
    for (int64_t i = 0; i < intermediate; ++i)
      swiglu_backward(ws->dh[i], act.gate[i], act.up[i], &ws->dg[i], &ws->du[i]);
    for (int64_t i = 0; i < intermediate; ++i) {
      const double dg = ws->dg[i];
      const double du = ws->du[i];
      const float* gate_row = weights.gate + i * hidden;
      const float* up_row = weights.up + i * hidden;
      for (int64_t j = 0; j < hidden; ++j)
        ws->dx[j] += static_cast<double>(gate_row[j]) * dg + static_cast<double>(up_row[j]) * du;
      if (sums == nullptr) continue;
      double* d_gate_row = sums->gate.data() + expert * expert_size + i * hidden;
      double* d_up_row = sums->up.data() + expert * expert_size + i * hidden;
      for (int64_t j = 0; j < hidden; ++j) {
        d_gate_row[j] += dg * x[j];
        d_up_row[j] += du * x[j];
      }
    }
  }
  for (int64_t j = 0; j < hidden; ++j) dx_row[j] = static_cast<float>(ws->dx[j]);
}

// Throws (there is no Status to return) where a bad config or expert shape would make a
// per-token function read out of bounds.
void require_valid_experts(const LayerConfig& config, const std::vector<RankExperts>& experts,
                           const char* function) {
  Status status = validate(config);
  if (status.ok()) status = check_inputs(config, std::vector<RankInput>(config.ep_size), experts);
  if (!status.ok()) throw std::invalid_argument(std::string(function) + ": " + status.to_string());
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
  require_valid_experts(config, experts, "forward_token");
  TokenWorkspace ws;
  token_forward(config, experts, x_row, topk_idx_row, topk_weights_row, &ws, y_row);
}

namespace detail {

void swiglu_backward(double dh, double g, double u, double* dg, double* du) {
  const double s = sigmoid(g);
  *dg = dh * u * s * (1.0 + g * (1.0 - s));
  *du = dh * g * s;
}

Status check_backward_inputs(const LayerConfig& config, const std::vector<RankInput>& inputs,
                             const std::vector<RankExperts>& experts,
                             const std::vector<std::vector<float>>& dy) {
  if (Status status = check_inputs(config, inputs, experts); !status.ok()) return status;
  if (static_cast<int64_t>(dy.size()) != config.ep_size) {
    return invalid_argument("dy has ", dy.size(), " ranks, expected ep_size (", config.ep_size,
                            ")");
  }
  for (int64_t r = 0; r < config.ep_size; ++r) {
    Status status = check_size(
        dy[r].size(), inputs[r].num_tokens * config.hidden, concat("rank ", r, ": dy"),
        concat("num_tokens (", inputs[r].num_tokens, ") * hidden (", config.hidden, ")"));
    if (!status.ok()) return status;
  }
  return Status::ok_status();
}

}  // namespace detail

using detail::check_backward_inputs;

Status backward(const LayerConfig& config, const std::vector<RankInput>& inputs,
                const std::vector<RankExperts>& experts, const std::vector<std::vector<float>>& dy,
                std::vector<RankGrads>* grads) {
  if (Status status = check_backward_inputs(config, inputs, experts, dy); !status.ok())
    return status;
  if (grads == nullptr) return invalid_argument("grads is null");
  const int64_t ep_size = config.ep_size;
  const int64_t hidden = config.hidden;
  const int64_t intermediate = config.intermediate;
  const int64_t top_k = config.top_k;

  // Summed over every rank's tokens (ranks, tokens, slots in increasing order) and rounded once
  // at the end.
  const int64_t expert_size = intermediate * hidden;
  WeightGradSums sums;
  sums.gate.assign(config.num_experts * expert_size, 0.0);
  sums.up.assign(config.num_experts * expert_size, 0.0);
  sums.down.assign(config.num_experts * expert_size, 0.0);

  grads->assign(ep_size, {});
  TokenBackwardWorkspace ws;
  for (int64_t r = 0; r < ep_size; ++r) {
    const RankInput& in = inputs[r];
    RankGrads& out = (*grads)[r];
    out.dx.assign(in.num_tokens * hidden, 0.0f);
    out.d_topk_weights.assign(in.num_tokens * top_k, 0.0f);
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      token_backward(config, experts, in.x.data() + t * hidden, in.topk_idx.data() + t * top_k,
                     in.topk_weights.data() + t * top_k, dy[r].data() + t * hidden, &ws,
                     out.dx.data() + t * hidden, out.d_topk_weights.data() + t * top_k, &sums);
    }
  }

  const int64_t rank_weights_size = config.experts_per_rank() * expert_size;
  const auto rank_slice = [&](const std::vector<double>& all, int64_t r) {
    const auto first = all.begin() + r * rank_weights_size;
    return std::vector<float>(first, first + rank_weights_size);
  };
  for (int64_t r = 0; r < ep_size; ++r) {
    RankGrads& out = (*grads)[r];
    out.d_gate = rank_slice(sums.gate, r);
    out.d_up = rank_slice(sums.up, r);
    out.d_down = rank_slice(sums.down, r);
  }
  return Status::ok_status();
}

void backward_token(const LayerConfig& config, const std::vector<RankExperts>& experts,
                    const float* x_row, const int32_t* topk_idx_row, const float* topk_weights_row,
                    const float* dy_row, float* dx_row, float* d_topk_weights_row) {
  require_valid_experts(config, experts, "backward_token");
  TokenBackwardWorkspace ws;
  token_backward(config, experts, x_row, topk_idx_row, topk_weights_row, dy_row, &ws, dx_row,
                 d_topk_weights_row, nullptr);
}

Status weight_grad_elements(const LayerConfig& config, const std::vector<RankInput>& inputs,
                            const std::vector<RankExperts>& experts,
                            const std::vector<std::vector<float>>& dy, int32_t rank,
                            const std::vector<WeightGradElement>& elements,
                            std::vector<float>* values) {
  if (Status status = check_backward_inputs(config, inputs, experts, dy); !status.ok())
    return status;
  if (values == nullptr) return invalid_argument("values is null");
  if (rank < 0 || rank >= config.ep_size)
    return invalid_argument("rank ", rank, " is outside [0, ep_size=", config.ep_size, ")");
  const int64_t hidden = config.hidden;
  const int64_t intermediate = config.intermediate;
  const int64_t top_k = config.top_k;
  // Elements by (expert, intermediate index): one pass over the expert's rows computes that
  // index's g, u (and dg, du) for all of them.
  std::map<std::pair<int32_t, int64_t>, std::vector<size_t>> by_column;
  for (size_t n = 0; n < elements.size(); ++n) {
    const WeightGradElement& e = elements[n];
    const bool down = e.matrix == WeightGradMatrix::kDown;
    const int64_t rows = down ? hidden : intermediate;
    const int64_t cols = down ? intermediate : hidden;
    if (e.expert < 0 || e.expert >= config.experts_per_rank() || e.row < 0 || e.row >= rows ||
        e.col < 0 || e.col >= cols) {
      return invalid_argument("elements[", n, "] (expert ", e.expert, ", row ", e.row, ", col ",
                              e.col, ") is outside its gradient's [", config.experts_per_rank(),
                              ", ", rows, ", ", cols, "]");
    }
    by_column[{e.expert, down ? e.col : e.row}].push_back(n);
  }

  // What one routed row of the expert (token t of rank r, slot k) brings to its gradients.
  struct RoutedRow {
    const float* x;
    const float* dy;
    double weight;
  };
  std::vector<double> totals(elements.size(), 0.0);
  int32_t rows_of = -1;  // the local expert `routed` holds the rows of
  std::vector<RoutedRow> routed;
  std::vector<float> down_column(hidden);  // W_down[:, i], contiguous
  for (const auto& [column, members] : by_column) {
    const auto [local, i] = column;
    const int32_t expert = rank * config.experts_per_rank() + local;
    if (local != rows_of) {
      routed.clear();
      for (int64_t r = 0; r < config.ep_size; ++r) {
        const RankInput& in = inputs[r];
        for (int64_t t = 0; t < in.num_tokens; ++t) {
          for (int64_t k = 0; k < top_k; ++k) {
            if (in.topk_idx[t * top_k + k] != expert) continue;
            routed.push_back({in.x.data() + t * hidden, dy[r].data() + t * hidden,
                              in.topk_weights[t * top_k + k]});
          }
        }
      }
      rows_of = local;
    }
    const ExpertWeights weights = expert_weights(config, experts, expert);
    for (int64_t j = 0; j < hidden; ++j) down_column[j] = weights.down[j * intermediate + i];
    const bool needs_dh = std::any_of(members.begin(), members.end(), [&](size_t n) {
      return elements[n].matrix != WeightGradMatrix::kDown;
    });
    for (const RoutedRow& row : routed) {
      double g = 0.0, u = 0.0;
      for (int64_t j = 0; j < hidden; ++j) {
        g += static_cast<double>(weights.gate[i * hidden + j]) * row.x[j];
        u += static_cast<double>(weights.up[i * hidden + j]) * row.x[j];
      }
      const double h = g * sigmoid(g) * u;
      double dg = 0.0, du = 0.0;
      if (needs_dh) {
        double dh = 0.0;
        for (int64_t j = 0; j < hidden; ++j)
          dh += static_cast<double>(down_column[j]) * (row.weight * row.dy[j]);
        swiglu_backward(dh, g, u, &dg, &du);
      }
      for (size_t n : members) {
        const WeightGradElement& e = elements[n];
        switch (e.matrix) {
          case WeightGradMatrix::kGate:
            totals[n] += dg * row.x[e.col];
            break;
          case WeightGradMatrix::kUp:
            totals[n] += du * row.x[e.col];
            break;
          case WeightGradMatrix::kDown:
            totals[n] += (row.weight * row.dy[e.row]) * h;
            break;
        }
      }
    }
  }
  values->assign(totals.begin(), totals.end());
  return Status::ok_status();
}

}  // namespace epflow::reference
