// Property tests of the routing schedule (src/common/routing_schedule.h and the host driver
// build_pull_table). Every generated routing is checked against an oracle written here from the
// layout spec alone, the slow obvious way, so a mistake shared by the portable helpers and the
// driver cannot vouch for itself. The device kernels run the same helpers, so these tests also
// pin the GPU layout.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/routing_schedule.h"
#include "common/routing_schedule_host.h"

namespace epflow::sched {
namespace {

constexpr int32_t kMinId = std::numeric_limits<int32_t>::min();
constexpr int32_t kMaxId = std::numeric_limits<int32_t>::max();

// One routing: every source rank's topk_idx, plus the shape it is scheduled with.
struct Case {
  std::string name;
  int32_t world = 1;
  int32_t experts_per_rank = 1;
  int32_t top_k = 1;
  int32_t tile_m = 1;
  std::vector<std::vector<int32_t>> topk;  // [world][tokens(src) * top_k]

  int32_t num_experts() const { return world * experts_per_rank; }
  int64_t tokens(int32_t src) const { return static_cast<int64_t>(topk[src].size()) / top_k; }
  int64_t slots(int32_t src) const { return static_cast<int64_t>(topk[src].size()); }
  int64_t max_tokens() const {
    int64_t m = 0;
    for (int32_t src = 0; src < world; ++src) m = std::max(m, tokens(src));
    return m;
  }
  ScheduleShape shape(int32_t rank) const {
    return ScheduleShape{world, rank, experts_per_rank, top_k, tile_m};
  }
};

// id_of(src, token, k) gives the expert id of each slot.
template <class IdOf>
Case make_case(std::string name, int32_t world, int32_t experts_per_rank, int32_t top_k,
               int32_t tile_m, const std::vector<int64_t>& tokens, IdOf&& id_of) {
  Case c{std::move(name), world, experts_per_rank, top_k, tile_m, {}};
  c.topk.resize(world);
  for (int32_t src = 0; src < world; ++src)
    for (int64_t t = 0; t < tokens[src]; ++t)
      for (int32_t k = 0; k < top_k; ++k) c.topk[src].push_back(id_of(src, t, k));
  return c;
}

PullTable build(const Case& c, int32_t rank, int64_t chunk_slots) {
  std::vector<const int32_t*> ptrs;
  std::vector<int64_t> tokens;
  for (int32_t src = 0; src < c.world; ++src) {
    ptrs.push_back(c.topk[src].data());
    tokens.push_back(c.tokens(src));
  }
  return build_pull_table(c.shape(rank), ptrs, tokens, chunk_slots);
}

bool is_padding(PullRow r) { return r.src_rank == kPaddingRow && r.src_slot == -1; }
bool same_row(PullRow a, PullRow b) { return a.src_rank == b.src_rank && a.src_slot == b.src_slot; }
std::string str(PullRow r) {
  return "{" + std::to_string(r.src_rank) + ", " + std::to_string(r.src_slot) + "}";
}

// What the spec says one destination's table must be.
struct Oracle {
  std::vector<std::vector<std::vector<int32_t>>> slots;  // [e][src]: slots routed to e, in order
  std::vector<std::vector<PullRow>> segments;            // [e]: the padded segment, row by row
  std::vector<int64_t> seg_offset;                       // [E + 1]
  std::vector<int32_t> expert_of_row;                    // [total rows]
  int64_t routed_rows = 0;                               // rows that are not padding
  int64_t invalid_slots = 0;

  int64_t total_rows() const { return seg_offset.back(); }
};

Oracle make_oracle(const Case& c, int32_t dest) {
  const int32_t E = c.experts_per_rank;
  Oracle o;
  o.slots.assign(E, std::vector<std::vector<int32_t>>(c.world));
  for (int32_t src = 0; src < c.world; ++src) {
    for (int32_t slot = 0; slot < c.slots(src); ++slot) {
      const int32_t id = c.topk[src][slot];
      if (id == -1) continue;
      if (id < -1 || id >= c.num_experts()) {
        ++o.invalid_slots;
        continue;
      }
      if (id / E == dest) o.slots[id % E][src].push_back(slot);
    }
  }
  o.segments.resize(E);
  o.seg_offset.push_back(0);
  for (int32_t e = 0; e < E; ++e) {
    std::vector<PullRow>& seg = o.segments[e];
    for (size_t j = 0;; ++j) {  // round j: the j-th row of every source that has one
      const size_t before = seg.size();
      for (int32_t src = 0; src < c.world; ++src)
        if (j < o.slots[e][src].size()) seg.push_back(PullRow{src, o.slots[e][src][j]});
      if (seg.size() == before) break;
    }
    o.routed_rows += static_cast<int64_t>(seg.size());
    while (seg.size() % c.tile_m != 0) seg.push_back(PullRow{kPaddingRow, -1});
    o.seg_offset.push_back(o.seg_offset.back() + static_cast<int64_t>(seg.size()));
    o.expert_of_row.insert(o.expert_of_row.end(), seg.size(), e);
  }
  return o;
}

// --- the cases ---------------------------------------------------------------------------------

// A random routing. Each slot is empty with p_empty, an out-of-range id with p_invalid, else an
// expert drawn from a few hot ones with p_hot (skew leaves segments empty and makes interleaving
// rounds uneven) or uniformly. Token counts differ per rank, are rarely tile multiples, and are
// zero for about one rank in eight.
Case random_case(uint64_t seed, int32_t world, int32_t experts_per_rank, int32_t top_k,
                 int32_t tile_m, int64_t max_tokens) {
  std::mt19937_64 rng(seed);
  auto uniform = [&rng](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  const int32_t num_experts = world * experts_per_rank;
  const double p_empty = uniform(0, 3) * 0.05;
  const double p_invalid = uniform(0, 1) * 0.03;
  const double p_hot = uniform(0, 2) * 0.4;
  std::vector<int32_t> hot;
  for (int i = 0; i < 3; ++i) hot.push_back(static_cast<int32_t>(uniform(0, num_experts - 1)));
  const std::vector<int32_t> invalid = {-2, -7, kMinId, num_experts, num_experts + 3, kMaxId};
  std::vector<int64_t> tokens;
  for (int32_t src = 0; src < world; ++src)
    tokens.push_back(uniform(0, 7) == 0 ? 0 : uniform(1, max_tokens));
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  auto id_of = [&](int32_t, int64_t, int32_t) -> int32_t {
    const double u = coin(rng);
    if (u < p_empty) return -1;
    if (u < p_empty + p_invalid) return invalid[uniform(0, invalid.size() - 1)];
    if (coin(rng) < p_hot) return hot[uniform(0, hot.size() - 1)];
    return static_cast<int32_t>(uniform(0, num_experts - 1));
  };
  return make_case("random_seed" + std::to_string(seed) + "_w" + std::to_string(world) + "_e" +
                       std::to_string(experts_per_rank) + "_k" + std::to_string(top_k) + "_t" +
                       std::to_string(tile_m),
                   world, experts_per_rank, top_k, tile_m, tokens, id_of);
}

std::vector<Case> make_cases() {
  std::vector<Case> cases;
  const int32_t worlds[] = {1, 2, 3, 4, 8};
  const int32_t experts[] = {1, 2, 3, 5, 8, 16};
  const int32_t top_ks[] = {1, 2, 3, 4, 8, 16};
  const int32_t tiles[] = {1, 64, 128, 256};
  // EPFLOW_FUZZ_CASES (scripts/sanitize.sh sets it) draws more random shapes than the default.
  const char* fuzz = std::getenv("EPFLOW_FUZZ_CASES");
  const uint64_t random_cases = fuzz ? std::strtoull(fuzz, nullptr, 10) : 40;
  for (uint64_t seed = 0; seed < random_cases; ++seed) {
    // The shape is a function of the seed so each case reproduces from its name alone.
    std::mt19937_64 pick(seed * 7919 + 1);
    auto any = [&pick](const auto& options) {
      return options[pick() % std::size(options)];
    };
    cases.push_back(random_case(seed, any(worlds), any(experts), any(top_ks), any(tiles), 300));
  }

  // The two big ones: 1024 experts over 8 ranks, and on a single rank.
  cases.push_back(random_case(1001, 8, 128, 16, 128, 250));
  cases.push_back(random_case(1002, 1, 1024, 8, 256, 300));

  // Every token of every rank to the first expert: three empty experts after it on rank 0,
  // whole ranks with nothing to pull, and the longest possible interleaving tail.
  cases.push_back(make_case("all_to_first_expert_k1", 4, 8, 1, 128, {300, 1, 0, 129},
                            [](int32_t, int64_t, int32_t) { return 0; }));
  // Same with K > 1: one slot per token to the very last expert, the others empty.
  cases.push_back(make_case("all_to_last_expert_k6_rest_empty", 4, 8, 6, 64, {77, 200, 5, 0},
                            [](int32_t, int64_t t, int32_t k) { return k == t % 6 ? 31 : -1; }));
  // One busy expert in the middle; every slot of a token names it (duplicates in the top-k).
  cases.push_back(make_case("one_busy_middle_expert_duplicate_topk", 2, 16, 4, 64, {150, 33},
                            [](int32_t, int64_t, int32_t) { return 7; }));
  // Only local experts 1 and 4 of each rank are used: empty segments at both ends and between.
  {
    std::mt19937_64 rng(2024);
    cases.push_back(make_case("empty_experts_at_ends_and_middle", 3, 6, 4, 64, {100, 0, 61},
                              [&rng](int32_t, int64_t, int32_t) {
                                return static_cast<int32_t>(rng() % 3 * 6 + (rng() % 2 ? 1 : 4));
                              }));
  }
  cases.push_back(make_case("all_ranks_without_tokens", 4, 4, 2, 64, {0, 0, 0, 0},
                            [](int32_t, int64_t, int32_t) { return 0; }));
  // Two experts only, drawn at random per slot: most tokens name one expert several times.
  {
    std::mt19937_64 rng(77);
    cases.push_back(make_case("duplicate_ids_in_topk", 2, 4, 8, 64, {123, 45},
                              [&rng](int32_t, int64_t, int32_t) { return rng() % 2 ? 2 : 5; }));
  }
  {
    std::mt19937_64 rng(5);
    cases.push_back(make_case("k16_tile256_uneven_tokens", 4, 2, 16, 256, {299, 3, 0, 64},
                              [&rng](int32_t, int64_t, int32_t) {
                                return static_cast<int32_t>(rng() % 9) - 1;
                              }));
  }
  return cases;
}

const std::vector<Case>& all_cases() {
  static const std::vector<Case> cases = make_cases();
  return cases;
}

// Chunk size of the tables most tests look at; TableDoesNotDependOnChunkSize covers the others.
constexpr int64_t kChunk = 64;

// Every destination's table and oracle for one case, built once for all tests.
struct CaseTables {
  const Case* c;
  std::vector<PullTable> tables;  // [dest]
  std::vector<Oracle> oracles;    // [dest]
};

const std::vector<CaseTables>& all_tables() {
  static const std::vector<CaseTables> built = [] {
    std::vector<CaseTables> out;
    for (const Case& c : all_cases()) {
      CaseTables ct{&c, {}, {}};
      for (int32_t dest = 0; dest < c.world; ++dest) {
        ct.tables.push_back(build(c, dest, kChunk));
        ct.oracles.push_back(make_oracle(c, dest));
      }
      out.push_back(std::move(ct));
    }
    return out;
  }();
  return built;
}

// Calls check(case, dest, table, oracle) for every destination of every case; failures name
// the case and destination.
template <class Check>
void for_each_table(Check&& check) {
  for (const CaseTables& ct : all_tables()) {
    for (int32_t dest = 0; dest < ct.c->world; ++dest) {
      EXPECT_TRUE(check(*ct.c, dest, ct.tables[dest], ct.oracles[dest]))
          << "case " << ct.c->name << ", destination rank " << dest;
    }
  }
}

using ::testing::AssertionFailure;
using ::testing::AssertionResult;
using ::testing::AssertionSuccess;

// --- hand-computed tables ----------------------------------------------------------------------

TEST(RoutingSchedule, SmallRoutingGivesTheDocumentedTable) {
  // world 2, 2 experts per rank, K 2, tile 4. Slot = token * 2 + k.
  const std::vector<std::vector<int32_t>> topk = {{0, 2, 0, 1, 0, -1}, {1, 0, 3, 0}};
  const PullTable t = build_pull_table(ScheduleShape{2, 0, 2, 2, 4},
                                       {topk[0].data(), topk[1].data()}, {3, 2}, 1);
  // Expert 0 gets src0 slots {0, 2, 4} and src1 slots {1, 3}, interleaved round by round;
  // expert 1 gets src0 slot 3 and src1 slot 0.
  const std::vector<PullRow> want = {{0, 0}, {1, 1}, {0, 2}, {1, 3}, {0, 4}, {-1, -1}, {-1, -1},
                                     {-1, -1}, {0, 3}, {1, 0}, {-1, -1}, {-1, -1}};
  EXPECT_EQ(t.counts, (std::vector<int32_t>{3, 2, 1, 1}));
  EXPECT_EQ(t.seg_offset, (std::vector<int64_t>{0, 8, 12}));
  EXPECT_EQ(t.invalid_slots, 0);
  ASSERT_EQ(t.rows.size(), want.size());
  for (size_t r = 0; r < want.size(); ++r)
    EXPECT_TRUE(same_row(t.rows[r], want[r])) << "row " << r << ": " << str(t.rows[r]);
}

TEST(RoutingSchedule, InvalidIdsAreCountedAndSkippedByEveryDestination) {
  // 6 experts in all; -2, 6, INT32_MIN, INT32_MAX and 7 are invalid, -1 is just empty.
  const std::vector<std::vector<int32_t>> topk = {{-2, 0, 6, kMinId, kMaxId, 5}, {-1, 7, 1}};
  const std::vector<const int32_t*> ptrs = {topk[0].data(), topk[1].data()};
  const PullTable t0 = build_pull_table(ScheduleShape{2, 0, 3, 3, 4}, ptrs, {2, 1}, 2);
  const PullTable t1 = build_pull_table(ScheduleShape{2, 1, 3, 3, 4}, ptrs, {2, 1}, 2);
  EXPECT_EQ(t0.invalid_slots, 5);
  EXPECT_EQ(t1.invalid_slots, 5);

  const PullRow pad{kPaddingRow, -1};
  EXPECT_EQ(t0.seg_offset, (std::vector<int64_t>{0, 4, 8, 8}));
  const std::vector<PullRow> want0 = {{0, 1}, pad, pad, pad, {1, 2}, pad, pad, pad};
  ASSERT_EQ(t0.rows.size(), want0.size());
  for (size_t r = 0; r < want0.size(); ++r)
    EXPECT_TRUE(same_row(t0.rows[r], want0[r])) << "rank 0 row " << r << ": " << str(t0.rows[r]);

  EXPECT_EQ(t1.seg_offset, (std::vector<int64_t>{0, 0, 0, 4}));
  const std::vector<PullRow> want1 = {{0, 5}, pad, pad, pad};
  ASSERT_EQ(t1.rows.size(), want1.size());
  for (size_t r = 0; r < want1.size(); ++r)
    EXPECT_TRUE(same_row(t1.rows[r], want1[r])) << "rank 1 row " << r << ": " << str(t1.rows[r]);
}

TEST(RoutingSchedule, ExpertOfRowSkipsEmptySegmentsAtStartMiddleAndEnd) {
  // Experts 0, 2, 3 and 5 are empty; 1 owns [0, 64), 4 owns [64, 128).
  const std::vector<int64_t> seg_offset = {0, 0, 64, 64, 64, 128, 128};
  for (int64_t row = 0; row < 128; ++row)
    EXPECT_EQ(expert_of_row(seg_offset.data(), 6, row), row < 64 ? 1 : 4) << "row " << row;
}

TEST(RoutingSchedule, CapacityIsReachedWhenEveryExpertIsOneRowPastATile) {
  // All slots land here and each expert's segment is one real row plus tile_m - 1 padding rows,
  // so the bound must be exact, not just an upper bound.
  const std::vector<int32_t> topk = {0, 1, 2};
  const ScheduleShape s{1, 0, 3, 1, 64};
  const PullTable t = build_pull_table(s, {topk.data()}, {3}, kChunk);
  EXPECT_EQ(t.total_rows(), 3 * 64);
  EXPECT_EQ(pull_table_capacity(s, 3), t.total_rows());
}

TEST(RoutingSchedule, BuildRejectsWrongRankCountOrNonPositiveChunk) {
  const std::vector<int32_t> topk = {0, 1};
  const ScheduleShape s{2, 0, 1, 1, 1};
  EXPECT_THROW(build_pull_table(s, {topk.data()}, {2}, 1), std::invalid_argument);
  EXPECT_THROW(build_pull_table(s, {topk.data(), topk.data()}, {2}, 1), std::invalid_argument);
  EXPECT_THROW(build_pull_table(s, {topk.data(), topk.data()}, {2, 2}, 0), std::invalid_argument);
}

// --- properties over all generated routings ----------------------------------------------------

// (a) Segment bounds come from the oracle so a wrong seg_offset cannot vouch for itself.
TEST(RoutingSchedule, EveryOwnedSlotAppearsExactlyOnceInItsExpertSegment) {
  for_each_table([](const Case& c, int32_t dest, const PullTable& t,
                    const Oracle& o) -> AssertionResult {
    if (static_cast<int64_t>(t.rows.size()) != o.total_rows())
      return AssertionFailure() << t.rows.size() << " rows, want " << o.total_rows();
    std::vector<std::vector<int32_t>> seen(c.world);
    for (int32_t src = 0; src < c.world; ++src) seen[src].assign(c.slots(src), 0);
    for (int64_t r = 0; r < o.total_rows(); ++r) {
      const PullRow p = t.rows[r];
      if (p.src_rank == kPaddingRow) continue;
      if (p.src_rank < 0 || p.src_rank >= c.world || p.src_slot < 0 ||
          p.src_slot >= c.slots(p.src_rank))
        return AssertionFailure() << "row " << r << " " << str(p) << " is out of range";
      const int32_t want = dest * c.experts_per_rank + o.expert_of_row[r];
      const int32_t id = c.topk[p.src_rank][p.src_slot];
      if (id != want)
        return AssertionFailure() << "row " << r << " " << str(p) << " routes to expert " << id
                                  << " but sits in the segment of expert " << want;
      if (++seen[p.src_rank][p.src_slot] > 1)
        return AssertionFailure() << "row " << r << " " << str(p) << " appears twice";
    }
    for (int32_t src = 0; src < c.world; ++src) {
      for (int32_t slot = 0; slot < c.slots(src); ++slot) {
        const int32_t id = c.topk[src][slot];
        const bool owned = id >= 0 && id < c.num_experts() && id / c.experts_per_rank == dest;
        if (owned && seen[src][slot] == 0)
          return AssertionFailure() << "{" << src << ", " << slot << "} (expert " << id
                                    << ") is missing";
      }
    }
    return AssertionSuccess();
  });
}

// (b)
TEST(RoutingSchedule, CountsMatchRowsPerSourceAndExpert) {
  for_each_table([](const Case& c, int32_t, const PullTable& t,
                    const Oracle& o) -> AssertionResult {
    if (t.counts.size() != static_cast<size_t>(c.experts_per_rank) * c.world)
      return AssertionFailure() << "counts has " << t.counts.size() << " entries";
    for (int32_t e = 0; e < c.experts_per_rank; ++e)
      for (int32_t src = 0; src < c.world; ++src)
        if (t.counts[e * c.world + src] != static_cast<int32_t>(o.slots[e][src].size()))
          return AssertionFailure() << "counts[expert " << e << ", src " << src
                                    << "] = " << t.counts[e * c.world + src] << ", want "
                                    << o.slots[e][src].size();
    int64_t real_rows = 0;
    for (const PullRow& p : t.rows) real_rows += p.src_rank != kPaddingRow;
    if (real_rows != o.routed_rows)
      return AssertionFailure() << real_rows << " non-padding rows, want " << o.routed_rows;
    return AssertionSuccess();
  });
}

// (c)
TEST(RoutingSchedule, SegmentsAreTilePaddedPrefixSumsWithPaddingOnlyAtTheTail) {
  for_each_table([](const Case& c, int32_t, const PullTable& t,
                    const Oracle& o) -> AssertionResult {
    const int32_t E = c.experts_per_rank;
    if (t.seg_offset.size() != static_cast<size_t>(E) + 1 || t.seg_offset[0] != 0)
      return AssertionFailure() << "seg_offset must have E + 1 entries starting at 0";
    if (t.total_rows() != t.seg_offset[E] || static_cast<int64_t>(t.rows.size()) != t.total_rows())
      return AssertionFailure() << "rows.size() " << t.rows.size() << ", total_rows() "
                                << t.total_rows() << ", seg_offset[E] " << t.seg_offset[E];
    for (int32_t e = 0; e < E; ++e) {
      int64_t routed = 0;
      for (int32_t src = 0; src < c.world; ++src) routed += o.slots[e][src].size();
      int64_t padded = routed;
      while (padded % c.tile_m != 0) ++padded;
      const int64_t begin = t.seg_offset[e];
      const int64_t len = t.seg_offset[e + 1] - begin;
      if (len != padded || len % c.tile_m != 0 || (routed == 0 && len != 0))
        return AssertionFailure() << "expert " << e << " has " << routed << " rows, segment of "
                                  << len << ", want " << padded;
      for (int64_t r = begin; r < begin + len; ++r) {
        const bool tail = r >= begin + routed;
        if (tail != is_padding(t.rows[r]))
          return AssertionFailure() << "expert " << e << " row " << r << " " << str(t.rows[r])
                                    << (tail ? " must be padding" : " must not be padding");
      }
    }
    return AssertionSuccess();
  });
}

// (d) The expected segment order is built directly in make_oracle: rounds j = 0.., sources
// ascending, then padding.
TEST(RoutingSchedule, SegmentsInterleaveSourcesRoundByRound) {
  for_each_table([](const Case& c, int32_t, const PullTable& t,
                    const Oracle& o) -> AssertionResult {
    if (static_cast<int64_t>(t.rows.size()) != o.total_rows())
      return AssertionFailure() << t.rows.size() << " rows, want " << o.total_rows();
    for (int32_t e = 0; e < c.experts_per_rank; ++e) {
      const std::vector<PullRow>& want = o.segments[e];
      for (size_t i = 0; i < want.size(); ++i) {
        const PullRow got = t.rows[o.seg_offset[e] + i];
        if (!same_row(got, want[i]))
          return AssertionFailure() << "expert " << e << " position " << i << ": " << str(got)
                                    << ", want " << str(want[i]);
      }
    }
    return AssertionSuccess();
  });
}

// (e)
TEST(RoutingSchedule, RowsFromOneSourceToOneExpertKeepIncreasingSlotOrder) {
  for_each_table([](const Case& c, int32_t, const PullTable& t,
                    const Oracle& o) -> AssertionResult {
    if (static_cast<int64_t>(t.rows.size()) != o.total_rows())
      return AssertionFailure() << t.rows.size() << " rows, want " << o.total_rows();
    for (int32_t e = 0; e < c.experts_per_rank; ++e) {
      std::vector<int64_t> last(c.world, -1);
      for (int64_t r = o.seg_offset[e]; r < o.seg_offset[e + 1]; ++r) {
        const PullRow p = t.rows[r];
        if (p.src_rank < 0 || p.src_rank >= c.world) continue;
        if (p.src_slot <= last[p.src_rank])
          return AssertionFailure() << "expert " << e << " row " << r << " " << str(p)
                                    << " follows slot " << last[p.src_rank] << " of that source";
        last[p.src_rank] = p.src_slot;
      }
    }
    return AssertionSuccess();
  });
}

// (f)
TEST(RoutingSchedule, TableDoesNotDependOnChunkSize) {
  for (const CaseTables& ct : all_tables()) {
    const Case& c = *ct.c;
    int64_t all_slots = 1;
    for (int32_t src = 0; src < c.world; ++src) all_slots = std::max(all_slots, c.slots(src));
    for (const int64_t chunk : {int64_t{1}, int64_t{3}, int64_t{7}, int64_t{64}, all_slots}) {
      for (int32_t dest = 0; dest < c.world; ++dest) {
        const PullTable& ref = ct.tables[dest];
        const PullTable t = build(c, dest, chunk);
        SCOPED_TRACE("case " + c.name + ", destination rank " + std::to_string(dest) +
                     ", chunk " + std::to_string(chunk));
        EXPECT_EQ(t.counts, ref.counts);
        EXPECT_EQ(t.seg_offset, ref.seg_offset);
        EXPECT_EQ(t.invalid_slots, ref.invalid_slots);
        ASSERT_EQ(t.rows.size(), ref.rows.size());
        for (size_t r = 0; r < t.rows.size(); ++r) {
          if (!same_row(t.rows[r], ref.rows[r])) {
            ADD_FAILURE() << "row " << r << ": " << str(t.rows[r]) << ", with chunk " << kChunk
                          << ": " << str(ref.rows[r]);
            break;
          }
        }
      }
    }
  }
}

// (g)
TEST(RoutingSchedule, ExpertOfRowIsTheSegmentOfEveryRowIncludingPadding) {
  int64_t tables_with_empty_segment_before_a_busy_one = 0;
  for_each_table([&](const Case& c, int32_t, const PullTable& t,
                     const Oracle& o) -> AssertionResult {
    if (t.seg_offset.size() != o.seg_offset.size())
      return AssertionFailure() << "seg_offset has " << t.seg_offset.size() << " entries";
    bool seen_empty = false, empty_before_busy = false;
    for (int32_t e = 0; e < c.experts_per_rank; ++e) {
      const bool empty = o.seg_offset[e + 1] == o.seg_offset[e];
      empty_before_busy |= seen_empty && !empty;
      seen_empty |= empty;
    }
    tables_with_empty_segment_before_a_busy_one += empty_before_busy;
    for (int64_t r = 0; r < o.total_rows(); ++r) {
      const int32_t got = expert_of_row(t.seg_offset.data(), c.experts_per_rank, r);
      if (got != o.expert_of_row[r])
        return AssertionFailure() << "row " << r << ": expert " << got << ", want "
                                  << o.expert_of_row[r];
    }
    return AssertionSuccess();
  });
  // The binary search only has something to skip past when an empty segment precedes a busy one.
  EXPECT_GT(tables_with_empty_segment_before_a_busy_one, 0);
}


// (h)
TEST(RoutingSchedule, InvalidSlotCountMatchesEveryGeneratedRouting) {
  int64_t invalid_seen = 0;
  for_each_table([&](const Case&, int32_t, const PullTable& t,
                     const Oracle& o) -> AssertionResult {
    invalid_seen += o.invalid_slots;
    if (t.invalid_slots != o.invalid_slots)
      return AssertionFailure() << t.invalid_slots << " invalid slots, want " << o.invalid_slots;
    return AssertionSuccess();
  });
  EXPECT_GT(invalid_seen, 0);  // so the generator did produce invalid ids
}

// (i)
TEST(RoutingSchedule, CapacityBoundsTotalRows) {
  for_each_table([](const Case& c, int32_t dest, const PullTable& t,
                    const Oracle&) -> AssertionResult {
    const int64_t cap = pull_table_capacity(c.shape(dest), c.max_tokens());
    if (t.total_rows() > cap)
      return AssertionFailure() << t.total_rows() << " rows exceed capacity " << cap;
    return AssertionSuccess();
  });
}

// (j)
TEST(RoutingSchedule, DestinationsTogetherPullEveryValidSlotExactlyOnce) {
  for (const CaseTables& ct : all_tables()) {
    const Case& c = *ct.c;
    std::vector<std::vector<int32_t>> pulled(c.world);
    for (int32_t src = 0; src < c.world; ++src) pulled[src].assign(c.slots(src), 0);
    for (const PullTable& t : ct.tables)
      for (const PullRow& p : t.rows)
        if (p.src_rank >= 0 && p.src_rank < c.world && p.src_slot >= 0 &&
            p.src_slot < c.slots(p.src_rank))
          ++pulled[p.src_rank][p.src_slot];
    int64_t wrong = 0;
    std::string first;
    for (int32_t src = 0; src < c.world; ++src) {
      for (int32_t slot = 0; slot < c.slots(src); ++slot) {
        const int32_t id = c.topk[src][slot];
        const int32_t want = id >= 0 && id < c.num_experts() ? 1 : 0;
        if (pulled[src][slot] != want && wrong++ == 0)
          first = "{" + std::to_string(src) + ", " + std::to_string(slot) + "} (expert " +
                  std::to_string(id) + ") pulled " + std::to_string(pulled[src][slot]) + " times";
      }
    }
    EXPECT_EQ(wrong, 0) << "case " << c.name << ": first " << first;
  }
}

// (k) The device marks a segment's padding with a warp: lanes [0, lanes) of fill_padding must
// mark exactly the rows one thread does, and nothing else.
TEST(RoutingSchedule, PaddingSplitOverLanesMarksTheSameRows) {
  for_each_table([](const Case& c, int32_t dest, const PullTable& t,
                    const Oracle&) -> AssertionResult {
    for (const int32_t lanes : {2, 32}) {
      std::vector<PullRow> rows = t.rows;
      for (PullRow& r : rows)
        if (is_padding(r)) r = PullRow{c.world, 0};  // not a row any table holds
      for (int32_t e = 0; e < c.experts_per_rank; ++e)
        for (int32_t lane = 0; lane < lanes; ++lane)
          fill_padding(c.shape(dest), t.counts.data(), t.seg_offset.data(), e, rows.data(), lane,
                       lanes);
      for (size_t r = 0; r < rows.size(); ++r)
        if (!same_row(rows[r], t.rows[r]))
          return AssertionFailure() << lanes << " lanes, row " << r << ": " << str(rows[r])
                                    << ", want " << str(t.rows[r]);
    }
    return AssertionSuccess();
  });
}

}  // namespace
}  // namespace epflow::sched
