// Bad configurations and call arguments are rejected before anything runs, with messages that
// name the offending field and value.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <memory>

#include <string>

#include "epflow/epflow.h"

namespace epflow {
namespace {

LayerConfig deepseek_v3_ep2() {
  LayerConfig c;
  c.hidden = 7168;
  c.intermediate = 2048;
  c.num_experts = 64;  // 32 per rank: the per-rank count of an 8-way split of 256
  c.top_k = 8;
  c.ep_size = 2;
  c.ep_rank = 1;
  c.max_tokens_per_rank = 8192;
  return c;
}

void expect_invalid(const Status& s, const std::string& needle) {
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
  EXPECT_NE(s.message().find(needle), std::string::npos)
      << "message '" << s.message() << "' should mention '" << needle << "'";
}

TEST(ConfigValidate, AcceptsModelPresets) {
  EXPECT_TRUE(validate(deepseek_v3_ep2()).ok());
  LayerConfig c = deepseek_v3_ep2();
  c.hidden = 2880;  // gpt-oss-120b: 45 x 64
  c.intermediate = 2880;
  EXPECT_TRUE(validate(c).ok()) << validate(c).to_string();
}

TEST(ConfigValidate, RejectsTopKLargerThanExpertCount) {
  LayerConfig c = deepseek_v3_ep2();
  c.num_experts = 4;
  c.ep_size = 1;
  c.ep_rank = 0;
  c.top_k = 6;
  expect_invalid(validate(c), "top_k (6) exceeds num_experts (4)");
}

TEST(ConfigValidate, RejectsTopKOutOfRange) {
  LayerConfig c = deepseek_v3_ep2();
  c.top_k = 0;
  expect_invalid(validate(c), "top_k (0)");
  c.top_k = Limits::kMaxTopK + 1;
  expect_invalid(validate(c), "top_k (17)");
}

TEST(ConfigValidate, RejectsHiddenBeyondTheDispatchRowBuffers) {
  LayerConfig c = deepseek_v3_ep2();
  c.hidden = Limits::kMaxHidden;
  EXPECT_TRUE(validate(c).ok()) << validate(c).to_string();
  c.hidden = Limits::kMaxHidden + 64;
  expect_invalid(validate(c), "hidden (32832) exceeds 32768");
}

TEST(ConfigValidate, RejectsExpertsNotDivisibleByEpSize) {
  LayerConfig c = deepseek_v3_ep2();
  c.num_experts = 63;
  expect_invalid(validate(c), "not divisible by ep_size (2)");
}

TEST(ConfigValidate, RejectsHiddenAndIntermediateNotKernelMultiples) {
  LayerConfig c = deepseek_v3_ep2();
  c.hidden = 7168 + 32;
  expect_invalid(validate(c), "hidden (7200)");
  c = deepseek_v3_ep2();
  c.intermediate = 2000;
  expect_invalid(validate(c), "intermediate (2000)");
  c.intermediate = 0;
  expect_invalid(validate(c), "intermediate (0)");
}

TEST(ConfigValidate, RejectsBadRanksAndKnobs) {
  LayerConfig c = deepseek_v3_ep2();
  c.ep_rank = 2;
  expect_invalid(validate(c), "ep_rank (2)");
  c = deepseek_v3_ep2();
  c.ep_size = 0;
  expect_invalid(validate(c), "ep_size (0)");
  c = deepseek_v3_ep2();
  c.max_tokens_per_rank = 0;
  expect_invalid(validate(c), "max_tokens_per_rank (0)");
  c = deepseek_v3_ep2();
  c.ring_rows = -1;
  expect_invalid(validate(c), "ring_rows (-1)");
  c = deepseek_v3_ep2();
  c.num_experts = 2 * (Limits::kMaxExpertsPerRank + 1);
  expect_invalid(validate(c), "experts per rank (1025)");
}

TEST(ForwardArgsValidate, RejectsTokensAboveMaximum) {
  const LayerConfig c = deepseek_v3_ep2();
  ForwardArgs a;
  auto* fake = reinterpret_cast<__nv_bfloat16*>(0x1000);  // never dereferenced by validate
  a.x = fake;
  a.y = fake;
  a.topk_idx = reinterpret_cast<const int32_t*>(0x1000);
  a.topk_weights = reinterpret_cast<const float*>(0x1000);
  a.weights = {fake, fake, fake};
  a.num_tokens = 8192;
  EXPECT_TRUE(validate(c, a).ok());
  a.num_tokens = 8193;
  expect_invalid(validate(c, a), "num_tokens (8193)");
  a.num_tokens = -1;
  expect_invalid(validate(c, a), "num_tokens (-1)");
}

TEST(ForwardArgsValidate, RejectsMissingPointersButAllowsZeroTokens) {
  const LayerConfig c = deepseek_v3_ep2();
  ForwardArgs a;
  auto* fake = reinterpret_cast<__nv_bfloat16*>(0x1000);
  a.weights = {fake, fake, fake};
  a.num_tokens = 0;  // T = 0 on this rank: no token buffers needed, experts still serve peers
  EXPECT_TRUE(validate(c, a).ok());
  a.num_tokens = 5;
  expect_invalid(validate(c, a), "x is null");
  a.num_tokens = 0;
  a.weights.down = nullptr;
  expect_invalid(validate(c, a), "expert weights");
}

TEST(ForwardArgsValidate, ChecksExpertStridesAndAlignment) {
  const LayerConfig c = deepseek_v3_ep2();
  const int64_t H = c.hidden, I = c.intermediate;
  auto* fc1 = reinterpret_cast<__nv_bfloat16*>(0x10000);
  ForwardArgs a;
  // Megatron-Core's fused linear_fc1 [E, 2I, H]: gate and up rows of each expert, read in place.
  a.weights = {fc1, fc1 + I * H, fc1};
  a.weights.gate_expert_stride = a.weights.up_expert_stride = 2 * I * H;
  a.weights.down_expert_stride = H * I + 64;  // padded between experts
  EXPECT_TRUE(validate(c, a).ok()) << validate(c, a).to_string();
  // Megatron-Core's DDP buffers: the experts from the last to the first, negative strides.
  a.weights.gate_expert_stride = a.weights.up_expert_stride = -3 * I * H;
  EXPECT_TRUE(validate(c, a).ok()) << validate(c, a).to_string();
  a.weights.gate_expert_stride = -(I * H - 8);
  expect_invalid(validate(c, a), "gate's expert stride (-14680056 elements)");
  a.weights.gate_expert_stride = 2 * I * H;
  a.weights.up_expert_stride = I * H - 8;  // experts would overlap
  expect_invalid(validate(c, a), "up's expert stride (14680056 elements)");
  a.weights.up_expert_stride = 2 * I * H + 4;  // 8 bytes: TMA strides are 16-byte multiples
  expect_invalid(validate(c, a), "multiple of 16 bytes");
  a.weights.up_expert_stride = 0;
  a.weights.down = fc1 + 3;  // 6 bytes past an aligned address
  expect_invalid(validate(c, a), "down must start at a 16-byte aligned address");
}

TEST(BackwardArgsValidate, RejectsUnfilledContext) {
  LayerConfig c = deepseek_v3_ep2();
  c.with_backward = true;
  expect_invalid(validate(c, SavedContext{}, BackwardArgs{}), "never filled");
}

TEST(BackwardArgsValidate, NeedsALayerCreatedForTheBackward) {
  const LayerConfig c = deepseek_v3_ep2();  // with_backward = false
  SavedContext saved;
  saved.layer_id = 1;
  saved.consumed = std::make_shared<bool>(false);
  expect_invalid(validate(c, saved, BackwardArgs{}), "with_backward");
}

TEST(BackwardArgsValidate, RejectsAContextWithoutItsBuffer) {
  LayerConfig c = deepseek_v3_ep2();
  c.with_backward = true;
  SavedContext saved;
  saved.layer_id = 1;
  saved.consumed = std::make_shared<bool>(false);
  expect_invalid(validate(c, saved, BackwardArgs{}), "no buffer");
}

TEST(BackwardArgsValidate, ChecksGradientStridesByGradDtype) {
  LayerConfig c = deepseek_v3_ep2();
  c.with_backward = true;
  const int64_t H = c.hidden, I = c.intermediate;
  SavedContext saved;
  saved.layer_id = 1;
  saved.consumed = std::make_shared<bool>(false);
  saved.buffer = reinterpret_cast<void*>(0x1000);
  saved.num_tokens = 0;  // no token gradients needed
  BackwardArgs a;
  auto* main_grad = reinterpret_cast<float*>(0x10000);
  a.d_gate = main_grad;
  a.d_up = main_grad + I * H;
  a.d_down = main_grad;
  a.d_gate_expert_stride = a.d_up_expert_stride = 2 * I * H + 4;  // 16 bytes of fp32
  a.grad_dtype = GradDType::kFP32;
  EXPECT_TRUE(validate(c, saved, a).ok()) << validate(c, saved, a).to_string();
  a.grad_dtype = GradDType::kBF16;  // the same stride is 8 bytes of bf16
  expect_invalid(validate(c, saved, a), "d_gate's expert stride");
  a.d_gate_expert_stride = a.d_up_expert_stride = 0;
  a.d_down_expert_stride = H * I - 8;
  expect_invalid(validate(c, saved, a), "d_down's expert stride");
}

TEST(NcclVersion, HeadersMatchLoadedLibrary) {
  const Status s = check_nccl_version();
  EXPECT_TRUE(s.ok()) << s.to_string();
}

TEST(LayerCreate, RejectsBadConfigBeforeTouchingTheDevice) {
  LayerConfig c = deepseek_v3_ep2();
  c.top_k = 0;
  std::unique_ptr<Layer> layer;
  expect_invalid(Layer::create(c, nullptr, &layer), "top_k");
  EXPECT_EQ(layer, nullptr);
}

TEST(LayerCreate, ReportsMissingDeviceOrCommunicator) {
  std::unique_ptr<Layer> layer;
  const Status s = Layer::create(deepseek_v3_ep2(), nullptr, &layer);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    EXPECT_EQ(s.code(), StatusCode::kNoDevice) << s.to_string();
  } else {
    expect_invalid(s, "communicator is null");
  }
  EXPECT_EQ(layer, nullptr);
}

TEST(LayerCreate, WorkspaceReportsMissingDeviceOrCommunicator) {
  std::shared_ptr<Workspace> workspace;
  const Status s = Workspace::create(nullptr, &workspace);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    EXPECT_EQ(s.code(), StatusCode::kNoDevice) << s.to_string();
  } else {
    expect_invalid(s, "communicator is null");
  }
  EXPECT_EQ(workspace, nullptr);
  std::unique_ptr<Layer> layer;
  expect_invalid(Layer::create(deepseek_v3_ep2(), workspace, &layer), "workspace is null");
}

TEST(LayerCreate, LowPrecisionModesSayNotImplemented) {
  LayerConfig c = deepseek_v3_ep2();
  c.dtype = DType::kMXFP8;
  std::unique_ptr<Layer> layer;
  const Status s = Layer::create(c, nullptr, &layer);
  EXPECT_EQ(s.code(), StatusCode::kNotImplemented) << s.to_string();
  EXPECT_NE(s.message().find("mxfp8"), std::string::npos);
}

TEST(LayerCreate, Fp8NeedsBlockMultiples) {
  LayerConfig c = deepseek_v3_ep2();
  c.dtype = DType::kFP8Blockwise;
  EXPECT_TRUE(validate(c).ok());
  c.with_backward = true;
  EXPECT_TRUE(validate(c).ok());
  c.intermediate = 128 * 127;  // the dx GEMM's K is 2I
  expect_invalid(validate(c), "up to 16128");
  c.with_backward = false;
  c.intermediate = 2048 + 64;
  expect_invalid(validate(c), "multiples of 128");
  c.intermediate = 128 * 254;  // a tile's weight scales must fit shared memory
  expect_invalid(validate(c), "up to 32384");
}

TEST(ForwardArgsValidate, Fp8LayerNeedsFp8WeightsAndQuantizationABuffer) {
  LayerConfig c = deepseek_v3_ep2();
  c.dtype = DType::kFP8Blockwise;
  ForwardArgs a;
  a.num_tokens = 0;
  a.weights.gate = a.weights.up = a.weights.down = reinterpret_cast<const __nv_bfloat16*>(64);
  expect_invalid(validate(c, a), "ExpertWeights::fp8");
  a.weights.fp8.gate = a.weights.fp8.up = a.weights.fp8.down = reinterpret_cast<const uint8_t*>(64);
  a.weights.fp8.gate_scales = a.weights.fp8.up_scales = reinterpret_cast<const float*>(64);
  a.weights.fp8.down_scales = reinterpret_cast<const float*>(68);
  expect_invalid(validate(c, a), "16-byte aligned");
  a.weights.fp8.down_scales = reinterpret_cast<const float*>(80);
  EXPECT_TRUE(validate(c, a).ok());
  // Each of the three: E_local x 2048 x 7168 bytes and E_local x 16 x 56 fp32 scales.
  const int64_t E = c.experts_per_rank();
  const int64_t matrix = E * 2048 * 7168, scales = E * 16 * 56 * 4;
  EXPECT_EQ(fp8_expert_weights_bytes(c), 3 * matrix + 3 * ((scales + 255) / 256 * 256));
  // A training config's weights also hold the three matrices transposed, with their scales.
  LayerConfig training = c;
  training.with_backward = true;
  EXPECT_EQ(fp8_expert_weights_bytes(training),
            fp8_expert_weights_bytes(c) + 3 * matrix + (2 * scales + 255) / 256 * 256 +
                (scales + 255) / 256 * 256);
  Fp8ExpertWeights out;
  expect_invalid(quantize_expert_weights(c, a.weights, false, nullptr, 0, &out, nullptr),
                 "fp8_expert_weights_bytes");
}

}  // namespace
}  // namespace epflow
