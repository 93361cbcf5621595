// Model presets of the benchmark (BRIEF §3): hidden / expert intermediate / experts / top-k.
// With fewer GPUs than the model's EP degree, the per-rank expert count of an 8-way split is kept
// (experts_per_rank below) and the total is that times the EP size used.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "epflow/config.h"

namespace epflow::bench {

struct Preset {
  std::string name;
  int64_t hidden;
  int64_t intermediate;
  int32_t model_experts;     // the model's expert count
  int32_t top_k;
  int32_t experts_per_rank;  // of an 8-way split (the "tiny" CPU preset: its own)
};

inline const std::vector<Preset>& presets() {
  static const std::vector<Preset> all = {
      {"deepseek-v3", 7168, 2048, 256, 8, 32},
      {"kimi-k2", 7168, 2048, 384, 8, 48},
      {"deepseek-v4-flash", 4096, 2048, 256, 6, 32},
      {"deepseek-v4-pro", 7168, 3072, 384, 6, 48},
      {"qwen3-235b-a22b", 4096, 1536, 128, 8, 16},
      {"qwen3-30b-a3b", 2048, 768, 128, 8, 16},
      {"gpt-oss-120b", 2880, 2880, 128, 4, 16},
      {"mixtral-8x7b", 4096, 14336, 8, 2, 1},
      // Small enough for the CPU reference: the default without a GPU.
      {"tiny", 256, 128, 16, 4, 8},
  };
  return all;
}

// The layer config of a preset at EP size `ep`, keeping the preset's experts per rank.
inline LayerConfig layer_config(const Preset& p, int32_t ep, int64_t max_tokens_per_rank) {
  LayerConfig c;
  c.hidden = p.hidden;
  c.intermediate = p.intermediate;
  c.num_experts = p.experts_per_rank * ep;
  c.top_k = p.top_k;
  c.ep_size = ep;
  c.max_tokens_per_rank = max_tokens_per_rank;
  return c;
}

inline const Preset* find_preset(const std::string& name) {
  for (const auto& p : presets())
    if (p.name == name) return &p;
  return nullptr;
}

}  // namespace epflow::bench
