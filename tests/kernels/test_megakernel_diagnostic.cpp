// The message a timed-out wait inside the forward megakernel leaves for the next forward() call
// (the kernel records the fields in host-mapped memory and traps; describe() words them on the
// host). No GPU needed: the record is plain data.
#include <gtest/gtest.h>

#include <string>

#include "common/megakernel_tasks.h"
#include "kernels/moe_megakernel.cuh"

namespace epflow::kernels {
namespace {

TEST(MegakernelDiagnostic, EmptyRecordSaysNothing) {
  EXPECT_EQ(describe(MegakernelDiagnostic{}), "");
}

TEST(MegakernelDiagnostic, NamesWhoWaitedForWhat) {
  MegakernelDiagnostic d{};
  d.set = 1;
  d.rank = 1;
  d.cta = 37;
  d.compute = 1;
  d.task_kind = static_cast<int32_t>(mega::TaskKind::kGateUp);
  d.m_tile = 12;
  d.n_tile = 5;
  d.counter = static_cast<int32_t>(mega::Counter::kXReady);
  d.slot = 4;
  d.m_tiles = 40;
  d.ring_tiles = 8;
  d.want = 2;
  d.have = 1;
  d.seconds = 5.0;
  const std::string m = describe(d);
  for (const char* part : {"rank 1", "CTA 37", "compute partition", "5.000 s", "gate/up GEMM",
                           "row tile 12", "n tile 5", "x_ready", "ring slot 4", "reach 2",
                           "it was 1", "40 row tiles", "ring of 8"})
    EXPECT_NE(m.find(part), std::string::npos) << "missing \"" << part << "\" in: " << m;
}

TEST(MegakernelDiagnostic, NamesTheCtasInsideAComputeTask) {
  MegakernelDiagnostic d{};
  d.set = 1;
  d.m_tiles = 4;
  d.ring_tiles = 4;
  d.minibatch_tiles = 4;
  d.n_gate_up = 2;
  d.n_down = 3;
  d.comm_ctas = 1;
  d.ctas = 3;
  d.progress[0][kProducerLoaded] = 3;  // a communication CTA that joined the compute tasks
  d.progress[0][kConsumerTaken] = 3;   // task 2: gate/up of row tile 2, n tile 0
  d.progress[0][kConsumerDone] = 3;    // done: not listed
  d.progress[2][kProducerLoaded] = 2;  // task 1: gate/up of row tile 1, n tile 0
  d.progress[2][kConsumerTaken] = 2;
  d.progress[2][kConsumerDone] = 1;
  const std::string m = describe(d);
  EXPECT_NE(m.find("CTA 2: loads issued to task 1 (gate/up m 1 n 0)"), std::string::npos) << m;
  EXPECT_NE(m.find("warpgroup 0 in 1 (gate/up m 1 n 0) after 0 (gate/up m 0 n 0)"),
            std::string::npos) << m;
  EXPECT_EQ(m.find("CTA 0:"), std::string::npos) << m;
  EXPECT_EQ(m.find("CTA 1:"), std::string::npos) << m;
  EXPECT_NE(m.find("1 CTAs were inside a compute task"), std::string::npos) << m;
}

TEST(MegakernelDiagnostic, CommunicationPartitionWaitingToOverwriteX) {
  MegakernelDiagnostic d{};
  d.set = 1;
  d.compute = 0;
  d.task_kind = static_cast<int32_t>(mega::TaskKind::kDispatch);
  d.counter = static_cast<int32_t>(mega::Counter::kHDone);
  const std::string m = describe(d);
  EXPECT_NE(m.find("communication partition"), std::string::npos) << m;
  EXPECT_NE(m.find("dispatch"), std::string::npos) << m;
  EXPECT_NE(m.find("h_done"), std::string::npos) << m;
}

}  // namespace
}  // namespace epflow::kernels
