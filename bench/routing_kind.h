// The routing distributions of the benchmark inputs (bench_inputs.h states their formulas), in a
// header without CUDA so that epflow-bench's command line (bench_options.h) names them too.
#pragma once

namespace epflow::bench {

enum class RoutingKind {
  kUniform,  // every expert equally likely
  kZipf,     // expert popularity proportional to 1 / (1 + its place in a seeded ranking)
};

inline constexpr RoutingKind kRoutingKinds[] = {RoutingKind::kUniform, RoutingKind::kZipf};

// Its name on the command line (--routing), in the JSON runs and in the printouts.
inline constexpr const char* routing_name(RoutingKind kind) {
  return kind == RoutingKind::kZipf ? "zipf" : "uniform";
}

}  // namespace epflow::bench
