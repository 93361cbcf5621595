// epflow-bench's command line: its options, their parsing and the usage text. Apart from the
// benchmark so that a CPU test (tests/bench/test_bench_options.cpp) runs the parser: no CUDA here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "routing_kind.h"

namespace epflow::bench {

inline constexpr const char* kNcclCublas = "nccl-cublas";
inline constexpr const char* kUnfused = "epflow-unfused";  // bench/unfused: separate kernels

struct Options {
  std::vector<std::string> presets;  // empty: deepseek-v3 on GPUs, tiny on the CPU reference
  std::vector<int64_t> tokens;       // per rank; empty: 4096 on GPUs, 64 on the CPU reference
  int32_t ep = 0;                    // ranks; 0: every GPU present (2 simulated on the CPU)
  // NOTES: every system and yardstick first runs untimed for settle_ms of GPU time, then
  // `warmup` more calls, then its timed ones: each is timed in the sustained power state a
  // training loop keeps it in. With a few warm-up calls a short yardstick ran in the burst above
  // the sustained clock while the layer did not; with 100 calls and no settling, the system timed
  // second at a large point ran slower than the same system timed first (settle.h;
  // docs/benchmarks.md, "How we measure").
  int32_t settle_ms = 2000;
  int32_t warmup = 100;
  int32_t iters = 20;
  // Each point's whole sequence (EPFlow and its variants, baselines, yardsticks) runs this many
  // times; every reported time and rate is the median over the repeats (each the median of its
  // iterations), so one run's power history moves the figures less.
  int32_t repeats = 1;
  uint64_t seed = 1;
  // The routing distribution of every system's inputs (bench_inputs.h): uniform, or zipf (skewed
  // expert popularity, the same on every rank).
  RoutingKind routing = RoutingKind::kUniform;
  std::string json;                                    // write results here as JSON
  std::vector<std::string> baselines = {kNcclCublas, kUnfused};  // timed after EPFlow
  bool check = false;  // compare with the CPU reference (small shape) instead of benchmarking
  // --dtype fp8: EPFlow's FP8 (block-scaled e4m3) forward first, then its bf16 forward and the
  // baselines in the same run, each ratio against the FP8 layer. Forward only.
  bool fp8 = false;
  // Also time EPFlow's backward (default knobs): after one forward that saves its context, the
  // backward alone, with dy = x and the weight gradients written in bf16 (what the NCCL+PyTorch
  // baseline's autograd writes for bf16 weights), or fp32 with --grad-dtype fp32.
  bool backward = false;
  bool fp32_grads = false;
  // --accumulate-grads: the backward adds into the weight gradients (accumulate_weight_grads, as
  // gradient accumulation over micro-batches runs it) instead of writing them.
  bool accumulate_grads = false;
  // --saved-gate-up-rows: LayerConfig::saved_gate_up_rows (0: the default; rows past it are
  // recomputed by the backward).
  int64_t saved_gate_up_rows = 0;
  // --backward-unfused: the unfused backward too (separate kernels; its stages).
  bool backward_unfused = false;
  // --backward-side-sms: the unfused backward again with each of these side-stream SM counts.
  std::vector<int64_t> backward_side_sms;
  // --backward-comm-sms: the backward megakernel again with each of these communication SMs.
  std::vector<int64_t> backward_comm_sms;
  // Knob sweep: EPFlow also runs with every (comm SMs, minibatch rows) pair of these lists.
  std::vector<int64_t> sweep_comm_sms, sweep_minibatch_rows, sweep_ring_rows;
  std::string trace;  // prefix of per-task megakernel traces (CSV), empty: none
  // How the yardsticks run: on every GPU at once after the systems, one GPU after the other, or
  // (dense GEMMs) between the layer's own calls.
  enum class Yardstick { kAtOnce, kOneByOne, kInterleaved } yardstick = Yardstick::kAtOnce;
};

// A yardstick mode's name (JSON, --yardstick) and how the printout words it.
struct YardstickMode {
  const char* name;
  const char* words;
};
YardstickMode yardstick_mode(Options::Yardstick y);

struct ParseResult {
  enum class Outcome { kOk, kHelp, kError } outcome = Outcome::kOk;
  Options options;    // kOk: what the command line asked for
  std::string error;  // kError: one line naming the flag and its value, without the program name
};

// The command line argv[1..argc). Besides the values themselves, checks that the --json file and
// the --trace folder can be written, so that a bad path fails before minutes of GPU work.
ParseResult parse_options(int argc, const char* const* argv);

// The whole usage (--help), and the two lines printed after an error.
std::string usage_text();
std::string short_usage_text();

}  // namespace epflow::bench
