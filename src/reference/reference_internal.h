// What the bf16 and the FP8 CPU references share (src/reference/): the SwiGLU backward and the
// backward's input checks.
#pragma once

#include <vector>

#include "epflow/reference.h"

namespace epflow::reference::detail {

// The SwiGLU backward of one intermediate element: dg = dh * u * silu'(g), du = dh * silu(g).
void swiglu_backward(double dh, double g, double u, double* dg, double* du);

// check_inputs, then dy's shape.
Status check_backward_inputs(const LayerConfig& config, const std::vector<RankInput>& inputs,
                             const std::vector<RankExperts>& experts,
                             const std::vector<std::vector<float>>& dy);

}  // namespace epflow::reference::detail
