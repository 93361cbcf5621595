// epflow-bench's command line (bench/bench_options.h): a bad flag or value is an error naming the
// flag and the value, --help is help, and a full command line sets every option.
#include <gtest/gtest.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "bench_options.h"
#include "settle.h"

namespace epflow::bench {
namespace {

using Outcome = ParseResult::Outcome;

ParseResult parse(const std::vector<std::string>& args) {
  std::vector<const char*> argv = {"epflow-bench"};
  for (const auto& a : args) argv.push_back(a.c_str());
  return parse_options(static_cast<int>(argv.size()), argv.data());
}

std::string temp_dir() {
  const std::string dir = ::testing::TempDir() + "test_bench_options";
  std::filesystem::create_directories(dir);
  return dir;
}

TEST(BenchOptions, NoFlagsGiveTheDefaults) {
  const ParseResult r = parse({});
  ASSERT_EQ(r.outcome, Outcome::kOk) << r.error;
  const Options& o = r.options;
  EXPECT_TRUE(o.presets.empty());
  EXPECT_TRUE(o.tokens.empty());
  EXPECT_EQ(o.ep, 0);
  EXPECT_EQ(o.warmup, 100);
  EXPECT_EQ(o.settle_ms, 2000);
  EXPECT_EQ(o.iters, 20);
  EXPECT_EQ(o.repeats, 1);
  EXPECT_EQ(o.seed, 1u);
  EXPECT_EQ(o.routing, RoutingKind::kUniform);
  EXPECT_EQ(o.baselines, (std::vector<std::string>{kNcclCublas, kUnfused}));
  EXPECT_FALSE(o.check || o.backward || o.backward_unfused || o.fp32_grads);
  EXPECT_EQ(o.yardstick, Options::Yardstick::kAtOnce);
  EXPECT_TRUE(o.json.empty() && o.trace.empty());
}

TEST(BenchOptions, FullCommandLine) {
  const std::string dir = temp_dir();
  const ParseResult r = parse(
      {"--preset", "tiny,deepseek-v3", "--tokens", "64,128", "--tokens", "256", "--ep", "2",
       "--iters", "5", "--warmup", "0", "--settle-ms", "0", "--repeats", "3",
       "--seed", "18446744073709551615",
       "--routing", "zipf", "--json", dir + "/results.json", "--baselines", "epflow-unfused", "--check", "--comm-sms",
       "0,8", "--minibatch-rows", "1024", "--ring-rows", "0,16384", "--trace", dir + "/trace",
       "--yardstick", "interleaved", "--backward", "--grad-dtype", "fp32", "--accumulate-grads",
       "--saved-gate-up-rows", "1000", "--backward-unfused",
       "--backward-side-sms", "0,4", "--backward-comm-sms", "6,20"});
  ASSERT_EQ(r.outcome, Outcome::kOk) << r.error;
  const Options& o = r.options;
  EXPECT_EQ(o.presets, (std::vector<std::string>{"tiny", "deepseek-v3"}));
  EXPECT_EQ(o.tokens, (std::vector<int64_t>{64, 128, 256}));
  EXPECT_EQ(o.ep, 2);
  EXPECT_EQ(o.iters, 5);
  EXPECT_EQ(o.warmup, 0);
  EXPECT_EQ(o.settle_ms, 0);
  EXPECT_EQ(o.repeats, 3);
  EXPECT_EQ(o.seed, UINT64_MAX);
  EXPECT_EQ(o.routing, RoutingKind::kZipf);
  EXPECT_EQ(o.json, dir + "/results.json");
  EXPECT_EQ(o.baselines, (std::vector<std::string>{kUnfused}));
  EXPECT_TRUE(o.check);
  EXPECT_EQ(o.sweep_comm_sms, (std::vector<int64_t>{0, 8}));
  EXPECT_EQ(o.sweep_minibatch_rows, (std::vector<int64_t>{1024}));
  EXPECT_EQ(o.sweep_ring_rows, (std::vector<int64_t>{0, 16384}));
  EXPECT_EQ(o.trace, dir + "/trace");
  EXPECT_EQ(o.yardstick, Options::Yardstick::kInterleaved);
  EXPECT_TRUE(o.backward);
  EXPECT_TRUE(o.fp32_grads);
  EXPECT_TRUE(o.accumulate_grads);
  EXPECT_EQ(o.saved_gate_up_rows, 1000);
  EXPECT_TRUE(o.backward_unfused);
  EXPECT_EQ(o.backward_side_sms, (std::vector<int64_t>{0, 4}));
  EXPECT_EQ(o.backward_comm_sms, (std::vector<int64_t>{6, 20}));
  // The check only looks: the file is written at the end of a GPU run.
  EXPECT_FALSE(std::filesystem::exists(dir + "/results.json"));
}

TEST(BenchOptions, NoBaselinesAndEveryYardstickAndRouting) {
  EXPECT_TRUE(parse({"--baselines", "none"}).options.baselines.empty());
  EXPECT_EQ(parse({"--yardstick", "one-by-one"}).options.yardstick,
            Options::Yardstick::kOneByOne);
  EXPECT_EQ(parse({"--yardstick", "at-once"}).options.yardstick, Options::Yardstick::kAtOnce);
  EXPECT_FALSE(parse({"--backward", "--grad-dtype", "bf16"}).options.fp32_grads);
  EXPECT_EQ(parse({"--routing", "uniform"}).options.routing, RoutingKind::kUniform);
  EXPECT_EQ(parse({"--routing", "zipf", "--routing", "uniform"}).options.routing,
            RoutingKind::kUniform);
}

TEST(BenchOptions, HelpAnywhere) {
  for (const auto& args : {std::vector<std::string>{"--help"}, std::vector<std::string>{"-h"},
                           std::vector<std::string>{"--ep", "2", "--help"}})
    EXPECT_EQ(parse(args).outcome, Outcome::kHelp) << args.back();
  EXPECT_NE(usage_text().find("--backward-comm-sms"), std::string::npos);
  EXPECT_NE(usage_text().find("--routing uniform|zipf"), std::string::npos);
  EXPECT_NE(usage_text().find("deepseek-v3"), std::string::npos);
  EXPECT_NE(short_usage_text().find("--help"), std::string::npos);
}

struct BadCase {
  std::vector<std::string> args;
  std::string message;  // parse_options's error, exactly
};

class BenchOptionsRejects : public ::testing::TestWithParam<BadCase> {};

TEST_P(BenchOptionsRejects, NamingTheFlagAndTheValue) {
  const ParseResult r = parse(GetParam().args);
  ASSERT_EQ(r.outcome, Outcome::kError);
  EXPECT_EQ(r.error, GetParam().message);
  EXPECT_EQ(r.error.find('\n'), std::string::npos) << "one line";
}

const std::string kPresets =
    "deepseek-v3, kimi-k2, deepseek-v4-flash, deepseek-v4-pro, qwen3-235b-a22b, qwen3-30b-a3b, "
    "gpt-oss-120b, mixtral-8x7b, tiny";

INSTANTIATE_TEST_SUITE_P(
    BadArguments, BenchOptionsRejects,
    ::testing::Values(
        BadCase{{"--ep", "0"}, "--ep: 0 must be at least 1"},
        BadCase{{"--ep", "-1"}, "--ep: -1 must be at least 1"},
        BadCase{{"--ep", "2x"}, "--ep: \"2x\" is not a whole number"},
        BadCase{{"--ep", ""}, "--ep: \"\" is not a whole number"},
        BadCase{{"--ep", "99999999999"}, "--ep: 99999999999 must be at most 2147483647"},
        BadCase{{"--tokens", "1.5"}, "--tokens: \"1.5\" is not a whole number"},
        BadCase{{"--tokens", "64,abc"}, "--tokens: \"abc\" in \"64,abc\" is not a whole number"},
        BadCase{{"--tokens", "abc"}, "--tokens: \"abc\" is not a whole number"},
        BadCase{{"--tokens", "0"}, "--tokens: 0 must be at least 1"},
        BadCase{{"--tokens", "64,,128"}, "--tokens: \"\" in \"64,,128\" is not a whole number"},
        BadCase{{"--tokens", "99999999999999999999"},
                "--tokens: \"99999999999999999999\" is out of range"},
        BadCase{{"--iters", "0"}, "--iters: 0 must be at least 1"},
        BadCase{{"--warmup", "-1"}, "--warmup: -1 must be at least 0"},
        BadCase{{"--settle-ms", "600001"}, "--settle-ms: 600001 must be at most 600000"},
        BadCase{{"--repeats", "10"}, "--repeats: 10 must be at most 9"},
        BadCase{{"--repeats", "0"}, "--repeats: 0 must be at least 1"},
        BadCase{{"--seed", "-1"}, "--seed: -1 must be at least 0"},
        BadCase{{"--seed", "-"}, "--seed: \"-\" is not a whole number"},
        BadCase{{"--seed", "0x10"}, "--seed: \"0x10\" is not a whole number"},
        BadCase{{"--comm-sms", "8,-1"}, "--comm-sms: -1 in \"8,-1\" must be at least 0"},
        BadCase{{"--minibatch-rows", "1k"}, "--minibatch-rows: \"1k\" is not a whole number"},
        BadCase{{"--ring-rows", "-5"}, "--ring-rows: -5 must be at least 0"},
        BadCase{{"--backward", "--backward-comm-sms", "0"},
                "--backward-comm-sms: 0 must be at least 1"},
        BadCase{{"--backward", "--backward-side-sms", "4,x"},
                "--backward-side-sms: \"x\" in \"4,x\" is not a whole number"},
        BadCase{{"--preset", "deepseek"}, "--preset: \"deepseek\" is not one of " + kPresets},
        BadCase{{"--preset", "tiny,foo"},
                "--preset: \"foo\" in \"tiny,foo\" is not one of " + kPresets},
        BadCase{{"--baselines", "pytorch"},
                "--baselines: \"pytorch\" is not one of nccl-cublas, epflow-unfused, none"},
        BadCase{{"--baselines", "none,nccl-cublas"},
                "--baselines: \"none,nccl-cublas\" lists none beside baselines"},
        BadCase{{"--backward", "--grad-dtype", "fp16"},
                "--grad-dtype: \"fp16\" is not one of bf16, fp32"},
        BadCase{{"--routing", "skewed"}, "--routing: \"skewed\" is not one of uniform, zipf"},
        BadCase{{"--routing", "uniform,zipf"},
                "--routing: \"uniform,zipf\" is not one of uniform, zipf"},
        BadCase{{"--routing", "Zipf"}, "--routing: \"Zipf\" is not one of uniform, zipf"},
        BadCase{{"--routing"}, "--routing needs a value"},
        BadCase{{"--yardstick", "sometimes"},
                "--yardstick: \"sometimes\" is not one of at-once, one-by-one, interleaved"},
        BadCase{{"--foo"}, "unknown flag --foo"},
        BadCase{{"--ep=2"}, "unknown flag --ep=2"},
        BadCase{{"2"}, "unexpected argument \"2\""},
        BadCase{{"--ep"}, "--ep needs a value"},
        BadCase{{"--json", "--check"}, "--json needs a value before --check"},
        BadCase{{"--json", ""}, "--json: the path is empty"},
        BadCase{{"--trace", ""}, "--trace: the path is empty"},
        BadCase{{"--backward-unfused"}, "--backward-unfused needs --backward"},
        BadCase{{"--backward-side-sms", "4"}, "--backward-side-sms needs --backward"},
        BadCase{{"--backward-comm-sms", "6"}, "--backward-comm-sms needs --backward"},
        BadCase{{"--grad-dtype", "fp32"}, "--grad-dtype needs --backward"},
        BadCase{{"--accumulate-grads"}, "--accumulate-grads needs --backward"},
        BadCase{{"--saved-gate-up-rows", "256"}, "--saved-gate-up-rows needs --backward"},
        BadCase{{"--json", "/nonexistent-epflow-folder/r.json"},
                std::string("--json: cannot write \"/nonexistent-epflow-folder/r.json\": folder "
                            "\"/nonexistent-epflow-folder\": ") +
                    std::strerror(ENOENT)},
        BadCase{{"--trace", "/nonexistent-epflow-folder/t"},
                std::string("--trace: cannot write "
                            "\"/nonexistent-epflow-folder/t-<preset>-<tokens>-rank<r>.csv\": "
                            "folder \"/nonexistent-epflow-folder\": ") +
                    std::strerror(ENOENT)}));

TEST(BenchOptions, JsonPathThatIsAFolder) {
  const std::string dir = temp_dir();
  const ParseResult r = parse({"--json", dir});
  ASSERT_EQ(r.outcome, Outcome::kError);
  EXPECT_EQ(r.error, "--json: cannot write \"" + dir + "\": " + std::strerror(EISDIR));
}

TEST(BenchOptions, JsonPathUnderAFile) {
  const std::string file = temp_dir() + "/a-file";
  std::FILE* f = std::fopen(file.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  const ParseResult r = parse({"--json", file + "/r.json"});
  ASSERT_EQ(r.outcome, Outcome::kError);
  EXPECT_EQ(r.error, "--json: cannot write \"" + file + "/r.json\": folder \"" + file +
                         "\": " + std::strerror(ENOTDIR));
}

}  // namespace
}  // namespace epflow::bench

// bench/settle.h: how many calls fill the settling time.
TEST(Settle, CallsFillTheSettlingTime) {
  EXPECT_EQ(epflow::bench::settle_calls(0, 1.0), 0);
  EXPECT_EQ(epflow::bench::settle_calls(2000, 1.0), 2000);
  EXPECT_EQ(epflow::bench::settle_calls(2000, 6.0), 334);  // rounded up: at least 2000 ms
  EXPECT_EQ(epflow::bench::settle_calls(2000, 0.0), 1000000);  // a call too short to time: capped
  EXPECT_EQ(epflow::bench::settle_calls(2000, -1.0), 1000000);
}

