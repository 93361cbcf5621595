// The layout of the megakernel's counters region (MegakernelArgs::counters), which the kernel
// addresses (counters.cuh) and the host sizes (megakernel_counter_bytes, diagnostic.cpp).
// Separate so that the host side sees it without the device code.
#pragma once

namespace epflow::kernels::megakernel {

// The region: mega::kCounters words per ring slot, then kClaimWords words (the compute task
// claim counter, the timeout election, the head dispatch claim counter), then, 8-byte aligned,
// kProgressWords per CTA (moe_megakernel.cuh).
inline constexpr int kClaimWords = 3;

}  // namespace epflow::kernels::megakernel
