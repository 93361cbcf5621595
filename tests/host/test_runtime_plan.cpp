// Automatic knobs resolve to the rules they are documented by; explicit knobs are honoured or
// rejected with a message.
#include <gtest/gtest.h>

#include "host/runtime_plan.h"

namespace epflow::runtime {
namespace {

LayerConfig deepseek_v3_ep2() {
  LayerConfig c;
  c.hidden = 7168;
  c.intermediate = 2048;
  c.num_experts = 64;
  c.top_k = 8;
  c.ep_size = 2;
  c.max_tokens_per_rank = 8192;
  return c;
}

TEST(RuntimePlan, TwoWaveMinibatchRule) {
  // 2 * 116 SMs * 128 * 256 / min(4096, 7168) = 1856 rows -> 1920 in whole 128-row tiles.
  EXPECT_EQ(two_wave_minibatch_rows(deepseek_v3_ep2(), TileShape{}, 116), 1920);
  LayerConfig c = deepseek_v3_ep2();
  c.hidden = 2048;  // H narrower than 2I: the down GEMM sets the bound
  EXPECT_EQ(two_wave_minibatch_rows(c, TileShape{}, 116), 3712);
}

TEST(RuntimePlan, AutomaticDefaultsOnH200) {
  LayerPlan p;
  ASSERT_TRUE(make_plan(deepseek_v3_ep2(), 132, &p).ok());
  EXPECT_EQ(p.comm_sms, default_comm_sms(deepseek_v3_ep2(), 132));
  EXPECT_EQ(p.compute_sms, 132 - p.comm_sms);
  EXPECT_EQ(p.minibatch_rows % p.tile.m, 0);
  EXPECT_EQ(p.ring_rows, kDefaultRingMinibatches * p.minibatch_rows);
  EXPECT_EQ(p.ring_bytes, p.ring_rows * (7168 + 2048) * 2);
  EXPECT_EQ(p.max_routed_rows, 2 * 8192 * 8 + 32 * 127);
}

TEST(RuntimePlan, CommunicationSmsFollowTheBytesPerFlop) {
  // Rows cost 6·H·I FLOPs and bring 2·H bytes: a narrower expert (smaller I) needs more pulling.
  LayerConfig c = deepseek_v3_ep2();  // I = 2048
  EXPECT_EQ(default_comm_sms(c, 132), 6);
  c.intermediate = 1536;  // Qwen3-235B-A22B
  EXPECT_EQ(default_comm_sms(c, 132), 8);
  c.intermediate = 768;   // Qwen3-30B-A3B
  EXPECT_EQ(default_comm_sms(c, 132), 15);
  c.intermediate = 64;    // capped at a quarter of the SMs
  EXPECT_EQ(default_comm_sms(c, 132), 33);
  c.intermediate = 16384;  // at least kMinCommSms
  EXPECT_EQ(default_comm_sms(c, 132), kMinCommSms);
  EXPECT_EQ(default_comm_sms(c, 8), 2);  // tiny GPUs: a quarter
  EXPECT_EQ(default_comm_sms(c, 2), 1);  // and never none
}

TEST(RuntimePlan, DefaultRingNeverExceedsWhatCanBeRouted) {
  LayerConfig c = deepseek_v3_ep2();
  c.max_tokens_per_rank = 16;
  LayerPlan p;
  ASSERT_TRUE(make_plan(c, 132, &p).ok());
  EXPECT_LE(p.ring_rows, p.max_routed_rows + p.minibatch_rows);
  EXPECT_EQ(p.ring_rows % p.minibatch_rows, 0);
}

TEST(RuntimePlan, HonoursExplicitKnobs) {
  LayerConfig c = deepseek_v3_ep2();
  c.comm_sms = 24;
  c.minibatch_rows = 1024;
  c.ring_rows = 3000;  // rounded down to whole minibatches
  LayerPlan p;
  ASSERT_TRUE(make_plan(c, 132, &p).ok());
  EXPECT_EQ(p.comm_sms, 24);
  EXPECT_EQ(p.compute_sms, 108);
  EXPECT_EQ(p.minibatch_rows, 1024);
  EXPECT_EQ(p.ring_rows, 2048);
}

// Kept g | u rows: balanced routing plus the margin and a tile per expert (EP = 2: about
// 5/8 of the table), the whole table at EP = 1 (every routed row is this rank's), a knob
// rounded up to the tile and capped at the table.
TEST(RuntimePlan, SavedGateUpRows) {
  LayerConfig c = deepseek_v3_ep2();  // 8192 tokens, top-8, 32 experts per rank
  LayerPlan p;
  ASSERT_TRUE(make_plan(c, 132, &p).ok());
  const int64_t table = (p.max_routed_rows + 127) / 128 * 128;
  EXPECT_EQ(p.saved_gate_up_rows, (8192 * 8 * 5 / 4 + 32 * 128 + 127) / 128 * 128);
  EXPECT_LT(p.saved_gate_up_rows, table * 3 / 4);
  c.ep_size = 1;
  c.ep_rank = 0;
  c.num_experts = 32;
  ASSERT_TRUE(make_plan(c, 132, &p).ok());
  EXPECT_EQ(p.saved_gate_up_rows, (p.max_routed_rows + 127) / 128 * 128);
  c = deepseek_v3_ep2();
  c.saved_gate_up_rows = 1000;
  ASSERT_TRUE(make_plan(c, 132, &p).ok());
  EXPECT_EQ(p.saved_gate_up_rows, 1024);
  c.saved_gate_up_rows = int64_t{1} << 40;
  ASSERT_TRUE(make_plan(c, 132, &p).ok());
  EXPECT_EQ(p.saved_gate_up_rows, table);
  c.saved_gate_up_rows = -1;
  EXPECT_NE(make_plan(c, 132, &p).message().find("saved_gate_up_rows (-1)"), std::string::npos);
}

TEST(RuntimePlan, RejectsKnobsThatDoNotFit) {
  LayerPlan p;
  LayerConfig c = deepseek_v3_ep2();
  c.comm_sms = 132;
  Status s = make_plan(c, 132, &p);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("comm_sms (132)"), std::string::npos) << s.message();

  c = deepseek_v3_ep2();
  c.minibatch_rows = 1000;
  s = make_plan(c, 132, &p);
  EXPECT_NE(s.message().find("minibatch_rows (1000)"), std::string::npos) << s.message();

  c = deepseek_v3_ep2();
  c.minibatch_rows = 1024;
  c.ring_rows = 512;
  s = make_plan(c, 132, &p);
  EXPECT_NE(s.message().find("ring_rows (512)"), std::string::npos) << s.message();
}

// FP8 weight gradients from 256 routed rows per local expert on average (T·K / E_local): not at
// 512 DeepSeek-V3 tokens per rank (128 rows per expert), from 1024 (256) on.
TEST(RuntimePlan, Fp8WeightGradientsFromTwoKBlocksPerExpert) {
  LayerConfig c = deepseek_v3_ep2();  // 32 experts per rank, top-8
  EXPECT_FALSE(fp8_weight_gradients_pay(c, 0));
  EXPECT_FALSE(fp8_weight_gradients_pay(c, 512));
  EXPECT_FALSE(fp8_weight_gradients_pay(c, 1023));
  EXPECT_TRUE(fp8_weight_gradients_pay(c, 1024));
  EXPECT_TRUE(fp8_weight_gradients_pay(c, 8192));
}

}  // namespace
}  // namespace epflow::runtime
