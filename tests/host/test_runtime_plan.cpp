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

}  // namespace
}  // namespace epflow::runtime
