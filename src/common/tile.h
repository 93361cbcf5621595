// The GEMM tile every part of the layer agrees on: the schedule pads each expert's rows to whole
// tiles of kTileRows, the megakernel's ring and counters count in such tiles, and the wgmma
// mainloop computes kTileRows x kTileCols per CTA (two consumer warpgroups of 64 rows).
#pragma once

namespace epflow {

inline constexpr int kTileRows = 128;
inline constexpr int kTileCols = 256;

}  // namespace epflow
