// epflow-inputs-dump: prints, as JSON, sample values and exact checksums of one rank's benchmark
// inputs (bench/bench_inputs.h) so that bench/baselines/inputs.py --selftest can prove its torch
// mirror reproduces them bit for bit. CPU only: it runs the host side of the same functions the
// GPU fill kernel runs (unit_value, fan_in_scale, __float2bfloat16 round-to-nearest-even) and
// the very make_routing epflow-bench calls, for the routing kind of --routing. The routing lists
// every topk_idx, so that a difference names its token; --routing-only leaves the fills out (a
// routing of a large preset without gigabytes of expert weights).
//
// Checksums are sums modulo 2^64 of bit patterns (bf16 bits, fp32 bits, expert ids), plain and
// weighted by (index + 1): exact, independent of summation order, and sensitive to permutations.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_inputs.h"
#include "presets.h"

namespace {

using namespace epflow;
using bench::InputStream;

struct Options {
  std::string preset;
  int64_t tokens = 64;
  int32_t ep = 1;
  int32_t rank = 0;
  uint64_t seed = 1;
  bench::RoutingKind routing = bench::RoutingKind::kUniform;
  bool routing_only = false;
};

void usage() {
  std::fprintf(stderr,
               "usage: epflow-inputs-dump --preset NAME [--tokens T] [--ep N] [--rank R] "
               "[--seed S] [--routing uniform|zipf] [--routing-only]\n");
}

bool parse(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--routing-only") {
      o->routing_only = true;
      continue;
    }
    if (i + 1 == argc) return false;
    const std::string v = argv[++i];
    if (a == "--preset")
      o->preset = v;
    else if (a == "--tokens")
      o->tokens = std::atoll(v.c_str());
    else if (a == "--ep")
      o->ep = std::atoi(v.c_str());
    else if (a == "--rank")
      o->rank = std::atoi(v.c_str());
    else if (a == "--seed")
      o->seed = std::strtoull(v.c_str(), nullptr, 10);
    else if (a == "--routing" && v == bench::routing_name(bench::RoutingKind::kUniform))
      o->routing = bench::RoutingKind::kUniform;
    else if (a == "--routing" && v == bench::routing_name(bench::RoutingKind::kZipf))
      o->routing = bench::RoutingKind::kZipf;
    else
      return false;
  }
  return !o->preset.empty() && o->tokens > 0 && o->ep > 0 && o->rank >= 0 &&
         o->rank < o->ep;
}

// A spread of indices in [0, count): both ends and a few interior points.
std::vector<int64_t> sample_indices(int64_t count) {
  std::vector<int64_t> out;
  for (int64_t i : {int64_t{0}, int64_t{1}, count / 7, count / 3, count / 2, 2 * count / 3,
                    count - 2, count - 1})
    if (i >= 0 && i < count && (out.empty() || i > out.back())) out.push_back(i);
  return out;
}

uint16_t bf16_bits(__nv_bfloat16 v) {
  uint16_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits;
}

uint32_t f32_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits;
}

// One filled tensor: dst[i] = bf16(unit_value(key, i) * scale), as fill_uniform_bf16 does.
void print_fill(const char* name, int64_t count, float scale, uint64_t key) {
  uint64_t bits_sum = 0, bits_weighted_sum = 0;
  double value_sum = 0;
  for (int64_t i = 0; i < count; ++i) {
    const __nv_bfloat16 v = __float2bfloat16(bench::unit_value(key, uint64_t(i)) * scale);
    const uint64_t bits = bf16_bits(v);
    bits_sum += bits;
    bits_weighted_sum += bits * uint64_t(i + 1);
    value_sum += double(__bfloat162float(v));
  }
  std::printf(
      "  \"%s\": {\"count\": %lld, \"key\": %llu, \"scale\": %.9g, \"bits_sum\": %llu, "
      "\"bits_weighted_sum\": %llu, \"sum\": %.17g, \"samples\": [",
      name, (long long)count, (unsigned long long)key, scale, (unsigned long long)bits_sum,
      (unsigned long long)bits_weighted_sum, value_sum);
  const auto idx = sample_indices(count);
  for (size_t j = 0; j < idx.size(); ++j) {
    const float unit = bench::unit_value(key, uint64_t(idx[j]));
    std::printf("%s{\"i\": %lld, \"unit\": %.9g, \"bf16\": %u}", j ? ", " : "", (long long)idx[j],
                unit, unsigned(bf16_bits(__float2bfloat16(unit * scale))));
  }
  std::printf("]},\n");
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse(argc, argv, &o)) {
    usage();
    return 2;
  }
  const bench::Preset* p = bench::find_preset(o.preset);
  if (!p) {
    std::fprintf(stderr, "epflow-inputs-dump: unknown preset %s\n", o.preset.c_str());
    return 2;
  }
  const int64_t T = o.tokens, H = p->hidden, I = p->intermediate;
  const int64_t E = p->experts_per_rank;
  const int32_t K = p->top_k, num_experts = p->experts_per_rank * o.ep;
  const uint32_t rank = uint32_t(o.rank);

  std::printf(
      "{\n  \"preset\": \"%s\", \"hidden\": %lld, \"intermediate\": %lld, "
      "\"experts_per_rank\": %lld, \"num_experts\": %d, \"top_k\": %d,\n"
      "  \"tokens\": %lld, \"ep\": %d, \"rank\": %d, \"seed\": %llu,\n",
      p->name.c_str(), (long long)H, (long long)I, (long long)E, num_experts, K, (long long)T, o.ep,
      o.rank, (unsigned long long)o.seed);
  if (!o.routing_only) {
    print_fill("x", T * H, 1.0f, bench::stream_key(o.seed, InputStream::kX, rank));
    print_fill("gate", E * I * H, bench::fan_in_scale(H),
               bench::stream_key(o.seed, InputStream::kGate, rank));
    print_fill("up", E * I * H, bench::fan_in_scale(H),
               bench::stream_key(o.seed, InputStream::kUp, rank));
    print_fill("down", E * H * I, bench::fan_in_scale(I),
               bench::stream_key(o.seed, InputStream::kDown, rank));
  }

  const bench::Routing r = bench::make_routing(o.seed, rank, T, num_experts, K, o.routing);
  uint64_t idx_sum = 0, idx_weighted_sum = 0, w_bits_sum = 0, w_bits_weighted_sum = 0;
  for (size_t s = 0; s < r.topk_idx.size(); ++s) {
    idx_sum += uint64_t(int64_t(r.topk_idx[s]));
    idx_weighted_sum += uint64_t(int64_t(r.topk_idx[s])) * (s + 1);
    w_bits_sum += f32_bits(r.topk_weights[s]);
    w_bits_weighted_sum += uint64_t(f32_bits(r.topk_weights[s])) * (s + 1);
  }
  std::printf(
      "  \"routing\": {\"kind\": \"%s\", \"route_key\": %llu, \"weight_key\": %llu, "
      "\"zipf_rank_key\": %llu, \"idx_sum\": %llu, \"idx_weighted_sum\": %llu, "
      "\"weight_bits_sum\": %llu, \"weight_bits_weighted_sum\": %llu, \"samples\": [",
      bench::routing_name(o.routing),
      (unsigned long long)bench::stream_key(o.seed, InputStream::kRoute, rank),
      (unsigned long long)bench::stream_key(o.seed, InputStream::kRouteWeight, rank),
      (unsigned long long)bench::stream_key(o.seed, InputStream::kZipfRank, 0),
      (unsigned long long)idx_sum, (unsigned long long)idx_weighted_sum,
      (unsigned long long)w_bits_sum, (unsigned long long)w_bits_weighted_sum);
  const auto slots = sample_indices(T * K);
  for (size_t j = 0; j < slots.size(); ++j)
    std::printf("%s{\"slot\": %lld, \"idx\": %d, \"weight\": %.9g}", j ? ", " : "",
                (long long)slots[j], r.topk_idx[slots[j]], r.topk_weights[slots[j]]);
  std::printf("],\n    \"topk_idx\": [");
  for (size_t s = 0; s < r.topk_idx.size(); ++s)
    std::printf("%s%d", s ? "," : "", r.topk_idx[s]);
  std::printf("]}\n}\n");
  return 0;
}
