// The backward's dhp epilogue sink (grouped_gemm.cuh's direct sink interface): the SwiGLU and
// router-weight backward applied to the dhp accumulators, writing w·h, [dg | du] and the rows'
// <dhp, h> partial sums. Its own file: one file per epilogue sink.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cuda/ptx>

#include "common/fp8_blocks.h"
#include "common/routing_schedule.h"
#include "common/tile.h"
#include "kernels/grouped_gemm.cuh"
#include "kernels/megakernel/smem.cuh"
#include "kernels/moe_megakernel.cuh"
#include "kernels/ptx/cp_async.cuh"
#include "kernels/ptx/timed_wait.cuh"
#include "kernels/ptx/tma.cuh"

namespace epflow::kernels::megakernel {

// Backward dhp tiles (dhp = dy W_down): the SwiGLU and router-weight backward in the epilogue,
// straight from the accumulators. Per routed row (its table row is its ring row: the backward's
// ring does not wrap) and column i of the tile, from the forward's kept g | u (the recomputed
// overflow for rows past what the context keeps) and the row's
// router weight w (read from its owner's window before the mainloop): h = silu(g) u rounded as
// the forward stored it, w·h (the down weight gradient's rhs), dg = w dhp u silu'(g) and
// du = w dhp silu(g) (the dx GEMM's rows), 16 bytes per lane (quad_gather_block); and the row's
// <dhp, h> over the tile's columns into dw_partial (router_weight_grad sums the n tiles in order:
// d w is deterministic). Padding rows get zeros: the weight-gradient GEMMs sum over whole tiles.
// The counter says the tile's [dg | du] rows are written, so each warpgroup signals after all
// its threads stored (and fenced them for the dx GEMM's TMA loads).
// g | u reach the epilogue through the warpgroup's staging buffer (the down tiles' push staging,
// taken for the tile): four passes of 64 columns, two slots, cp.async by all 128 threads; the
// first two passes' loads are issued before the mainloop, each later one as soon as its slot's
// previous pass is read. The passes run as a loop, not unrolled (kRolledPasses: consume_tile
// hands each pass's accumulators over in the same registers). NOTES: with g | u read from
// global memory one or two n8 blocks at a time, and the whole epilogue unrolled (tens of
// thousands of instructions, far beyond the instruction cache, fetched again for every tile),
// the epilogue took longer than the tile's MMAs: its warps stalled on loads and on instruction
// fetches.
// kFp8 (the FP8 backward): [dg | du] rounded to bf16 and quantized 1 x 128 from those values
// into the ring's packed rows the dx GEMM reads (which the FP8 weight gradients requantize
// too); in bf16 to dgu_out only when the weight gradients run in bf16 (dgu_out not null). A
// row's 128-column block is held by a quad over two passes; each thread keeps the running amax
// of its rows' dg and du and stores its bf16 chunks over the g | u it has read in the staging
// (the same bytes: dg over g, du over u), and once the block is complete (quantized_block) reads
// them back and writes their e4m3 bytes with the quad's scale; only then are the two slots
// refilled, with the next block's passes. NOTES: keeping the block's bf16 pairs in registers
// (64 per thread) is what left no registers for a pass loop; storing them to global memory and
// reading them back from there moved five bytes of [dg | du] per value through L2 instead of
// one (the FP8 weight gradients read the packed rows).
template <bool kFp8>
struct DhSink {
  static constexpr bool kDirect = true;
  static constexpr int kWritePasses = 4;
  static constexpr bool kRolledPasses = true;
  static constexpr int kPassCols = kTileCols / kWritePasses;
  // A staged row: two slots of [g | u] (kPassCols each, bf16), then 16 bytes of padding, so the
  // 8 rows a warp reads at once start in 8 different bank groups.
  static constexpr int kSlotBytes = 2 * kPassCols * 2;
  static constexpr int kStagedRowBytes = 2 * kSlotBytes + 16;
  static_assert(kStagedRowBytes % 128 == 16 && 64 * kStagedRowBytes <= kStaging,
                "g | u's two slots of a warpgroup's 64 rows fit its staging");
  static_assert(!kFp8 || fp8::kBlock == 2 * kPassCols, "an FP8 block is two passes");
  const MegakernelArgs* a;
  StagingHandshake* staging;
  uint32_t* counter = nullptr;
  gemm::TileCoord c;  // the current tile (skip() needs it too)
  uint8_t* gu_smem;   // the warpgroup's staging, holding g | u
  uint8_t* staged_row[2];    // the thread's rows in this pass's slot (g, then u at + kPassCols * 2)
  const uint8_t* staged[2];  // the thread's rows' g in this pass's slot (u: + kPassCols * 2)
  bool live[2];              // the thread's rows are routed rows (not padding)
  __nv_bfloat16* wh[2];      // the thread's rows of w·h at this n tile
  __nv_bfloat16* dgu[2];     // ... and of [dg | du]
  uint8_t* packed[2];        // kFp8: the thread's rows of packed [dg | du] at this n tile
  int64_t row[2];            // the thread's two ring rows
  float w[2], dot[2];
  float amax[2][2];          // kFp8: the thread's running amax of [row][dg, du] in the block
  int32_t cols = 0, q = 0, wg = 0, tid = 0, pass = 0;
  uint32_t wh_pairs[2][4], dg_pairs[2][4], du_pairs[2][4];

  // Ring row `r`'s g at this n tile (u: + I): kept by the forward or recomputed past it.
  __device__ __forceinline__ const __nv_bfloat16* gate_up_row(int64_t r, int64_t col0) const {
    return (r < a->gate_up_rows ? a->gate_up_in + r * 2 * a->intermediate
                                : a->gate_up_overflow + (r - a->gate_up_rows) * 2 * a->intermediate) +
           col0;
  }
  // Pass p's g | u (columns p * kPassCols of the tile) of the warpgroup's routed rows into slot
  // p % 2: each thread copies one 16-byte chunk of every eighth row; one cp.async group.
  __device__ __forceinline__ void load_pass(int p) {
    const int chunk = tid % 16, part = chunk / 8, col = p * kPassCols + chunk % 8 * 8;
    const int64_t col0 = int64_t{c.n_tile} * kTileCols;
    if (col < cols)
#pragma unroll
      for (int r = tid / 16; r < 64; r += 8)
        if (wg * 64 + r < c.rows)
          ptx::cp_async_16(ptx::smem_addr(gu_smem + r * kStagedRowBytes + p % 2 * kSlotBytes +
                                          part * kPassCols * 2 + chunk % 8 * 16),
                           gate_up_row(int64_t{c.a_row} + wg * 64 + r, col0) +
                               part * a->intermediate + col);
    ptx::cp_async_commit();
  }

  __device__ __forceinline__ void prepare(const gemm::TileCoord& tile, int warpgroup, int thread) {
    c = tile;
    wg = warpgroup;
    tid = thread;
    pass = 0;
    const int64_t I = a->intermediate, col0 = int64_t{tile.n_tile} * kTileCols;
    q = tid % 4;
    cols = static_cast<int32_t>(I - col0);
    gu_smem = staging->s->gemm.out[wg];
    staging->acquire(wg);  // the previous down tile's rows have left it
    load_pass(0);
    load_pass(1);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      row[half] = int64_t{tile.a_row} + wg * 64 + tid / 32 * 16 + tid % 32 / 4 + 8 * half;
      wh[half] = a->wh_out + row[half] * I + col0;
      dgu[half] = kFp8 ? (a->dgu_out ? a->dgu_out + row[half] * 2 * I + col0 : nullptr)
                       : a->ring_h + row[half] * 2 * I + col0;
      packed[half] = reinterpret_cast<uint8_t*>(a->ring_h) +
                     row[half] * fp8::packed_row_bytes(2 * I) + col0;
      dot[half] = 0.0f;
      w[half] = 0.0f;
      live[half] = row[half] - tile.a_row < tile.rows;
      if (live[half]) {
        const sched::PullRow r = a->table[row[half]];
        w[half] = *reinterpret_cast<const float*>(a->peers.base[r.src_rank] + a->weights_offset +
                                                  int64_t{r.src_slot} * sizeof(float));
        // The last two passes' g and u into L2 while the MMAs run (lane q: pass q's 128 bytes).
        const int64_t line = int64_t{q} * kPassCols;
        if (q >= 2 && line < cols) {
          const __nv_bfloat16* gu = gate_up_row(row[half], col0);
          ptx::prefetch_l2(gu + line);
          ptx::prefetch_l2(gu + I + line);
        }
      }
    }
  }
  // The thread's row `half` (rows g, g + 8 of its warp's 16) in the warpgroup's staging.
  __device__ __forceinline__ uint8_t* staged_row_of(int half) const {
    return gu_smem + (tid / 32 * 16 + tid % 32 / 4 + 8 * half) * kStagedRowBytes;
  }
  // Pass `pass`'s slot has landed (every thread's copies: hence the barrier). Outstanding: the
  // next pass's group, except before a pass that ends a refill (the last pass; in FP8, which
  // refills both slots after each block, every second pass).
  __device__ __forceinline__ void begin(int, int) {
    if (kFp8 ? pass % 2 == 0 : pass < kWritePasses - 1)
      ptx::cp_async_wait<1>();
    else
      ptx::cp_async_wait<0>();
    ptx::named_barrier_sync(1 + wg, 128);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      staged_row[half] = staged_row_of(half) + pass % 2 * kSlotBytes;
      staged[half] = staged_row[half] + q * 4;
      if (kFp8 && pass % 2 == 0) amax[half][0] = amax[half][1] = 0.0f;
    }
  }
  // n8 block jj of this pass (jj = 0 .. kPassCols / 8 - 1, unrolled: a compile-time constant).
  __device__ __forceinline__ void write(int jj, int half, float d0, float d1) {
    const int col = pass * kPassCols + 8 * jj + 2 * q;  // in the tile
    float wh0 = 0.0f, wh1 = 0.0f, dg0 = 0.0f, dg1 = 0.0f, du0 = 0.0f, du1 = 0.0f;
    if (live[half] && col < cols) {
      const float2 g =
          __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(staged[half] + 16 * jj));
      const float2 u = __bfloat1622float2(
          *reinterpret_cast<const __nv_bfloat162*>(staged[half] + 16 * jj + kPassCols * 2));
      auto one = [&](float gv, float uv, float dhp, float* whv, float* dgv, float* duv) {
        const float sig = gemm::sigmoid(gv);
        const float silu = gv * sig;
        const float h = __bfloat162float(__float2bfloat16(silu * uv));
        dot[half] = fmaf(dhp, h, dot[half]);
        const float dh = w[half] * dhp;
        *whv = w[half] * h;
        *duv = dh * silu;
        *dgv = dh * uv * sig * (1.0f + gv * (1.0f - sig));
      };
      one(g.x, u.x, d0, &wh0, &dg0, &du0);
      one(g.y, u.y, d1, &wh1, &dg1, &du1);
    }
    wh_pairs[half][jj % 4] = gemm::bf16_pair(wh0, wh1);
    dg_pairs[half][jj % 4] = gemm::bf16_pair(dg0, dg1);
    du_pairs[half][jj % 4] = gemm::bf16_pair(du0, du1);
    if constexpr (kFp8) {
      // Of the unrounded values: rounding to bf16 keeps their order (and NaN, infinity), so the
      // block's amax rounded once is the amax of the bf16 values the block quantizes.
      amax[half][0] = fp8::amax_nan(amax[half][0], fp8::amax_nan(fabsf(dg0), fabsf(dg1)));
      amax[half][1] = fp8::amax_nan(amax[half][1], fp8::amax_nan(fabsf(du0), fabsf(du1)));
    }
    if (jj % 4 != 3 || half != 1) return;
    const int block = pass * kPassCols + 8 * (jj - 3 + q);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 vwh = gemm::quad_gather_block(wh_pairs[h], q);
      const uint4 vdg = gemm::quad_gather_block(dg_pairs[h], q);
      const uint4 vdu = gemm::quad_gather_block(du_pairs[h], q);
      // NOTES: explicit 16-byte stores (__stwb: st.global.wb.v4, the default write-back
      // policy): written as plain uint4 assignments, the compiler split each into four 4-byte
      // stores here, four times the instructions and about 2.5x the L2 sector requests.
      if (block < cols) {
        __stwb(reinterpret_cast<uint4*>(wh[h] + block), vwh);
        if (!kFp8 || dgu[h]) {
          __stwb(reinterpret_cast<uint4*>(dgu[h] + block), vdg);
          __stwb(reinterpret_cast<uint4*>(dgu[h] + a->intermediate + block), vdu);
        }
      }
      if constexpr (kFp8) {  // over the g | u the quad has read (its own rows and columns)
        const int chunk = 16 * (jj - 3 + q);
        *reinterpret_cast<uint4*>(staged_row[h] + chunk) = vdg;
        *reinterpret_cast<uint4*>(staged_row[h] + kPassCols * 2 + chunk) = vdu;
      }
    }
  }
  // After pass `pass`: the slot just read refilled with pass + 2's columns (once every thread
  // has read it); in FP8, after a block's second pass, the block quantized and then both slots
  // refilled with the next block's passes. After the last pass, the rows' <dhp, h>.
  __device__ __forceinline__ void end(int, int) {
    if constexpr (kFp8) {
      if (pass % 2 == 1) {
        quantized_block(pass / 2);
        if (pass + 1 < kWritePasses) {
          ptx::named_barrier_sync(1 + wg, 128);
          load_pass(pass + 1);
          load_pass(pass + 2);
        }
      }
    } else if (pass + 2 < kWritePasses) {
      ptx::named_barrier_sync(1 + wg, 128);
      load_pass(pass + 2);
    }
    if (++pass < kWritePasses) return;
    // The quad's four partial sums of each row, in a fixed order.
    const int32_t n_dh = backward_dh_tiles(a->intermediate);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float v = dot[h];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      if (q == 0 && live[h]) a->dw_partial[row[h] * n_dh + c.n_tile] = v;
    }
    finish(true);
  }
  // kFp8: block b (of the tile's two 128-column blocks) of both rows' dg and du: the quad's amax
  // by two shuffles, then the bf16 chunks this lane stored in the staging (n8 blocks 4i + q of
  // the block, i < 2 in slot 0 and the rest in slot 1: its own writes, read back) as e4m3, 8
  // bytes per chunk, and the scale by lane 0. Padding rows hold zeros (scale 1).
  __device__ __forceinline__ void quantized_block(int b) {
    const int64_t I = a->intermediate;
    const int32_t col = b * fp8::kBlock;  // in the tile
    if (col >= cols) return;              // past I (the same for the whole tile)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint8_t* row_smem = staged_row_of(h);
      uint4 chunk[2][4];
#pragma unroll
      for (int part = 0; part < 2; ++part)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          chunk[part][i] = *reinterpret_cast<const uint4*>(
              row_smem + i / 2 * kSlotBytes + part * kPassCols * 2 + 16 * (4 * (i % 2) + q));
#pragma unroll
      for (int part = 0; part < 2; ++part) {  // dg, then du (I columns later)
        float m = amax[h][part];
        m = fp8::amax_nan(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fp8::amax_nan(m, __shfl_xor_sync(0xffffffffu, m, 2));
        const float scale =
            fp8::block_scale(__bfloat162float(__float2bfloat16(m)), a->fp8_pow2_scales);
        uint8_t* dst = packed[h] + part * I + col;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint4 v = chunk[part][i];
          const float2 v0 = gemm::bf16_pair_to_float2(v.x), v1 = gemm::bf16_pair_to_float2(v.y);
          const float2 v2 = gemm::bf16_pair_to_float2(v.z), v3 = gemm::bf16_pair_to_float2(v.w);
          *reinterpret_cast<uint2*>(dst + 8 * (4 * i + q)) = make_uint2(
              uint32_t{fp8::quantize_pair(v0.x, v0.y, scale)} |
                  uint32_t{fp8::quantize_pair(v1.x, v1.y, scale)} << 16,
              uint32_t{fp8::quantize_pair(v2.x, v2.y, scale)} |
                  uint32_t{fp8::quantize_pair(v3.x, v3.y, scale)} << 16);
        }
        if (q == 0)
          reinterpret_cast<float*>(packed[h] - (int64_t{c.n_tile} * kTileCols) + 2 * I)
              [(part * I + int64_t{c.n_tile} * kTileCols + col) / fp8::kBlock] = scale;
      }
    }
  }
  // After the epilogue (every thread of the warpgroup): the tile's rows are written; signal,
  // and free the staging if the tile held it.
  __device__ __forceinline__ void finish(bool held_staging) {
    cuda::ptx::fence_proxy_async(cuda::ptx::space_global);  // the dx GEMM reads them by TMA
    ptx::named_barrier_sync(1 + wg, 128);
    if (tid == 0) {
      ptx::signal_counter(counter);
      if (held_staging) staging->release(wg);
    }
  }
  // A warpgroup whose 64 rows are all padding: zeros for them (w·h and [dg | du] at this n tile).
  __device__ __forceinline__ void skip(int warpgroup, int thread) {
    wg = warpgroup;
    tid = thread;
    const int64_t I = a->intermediate, col0 = int64_t{c.n_tile} * kTileCols;
    const int32_t chunks = static_cast<int32_t>((I - col0 < kTileCols ? I - col0 : kTileCols) / 8);
    for (int32_t i = tid; i < 64 * 3 * chunks; i += 128) {
      const int64_t row = int64_t{c.a_row} + wg * 64 + i / (3 * chunks);
      const int32_t part = i % (3 * chunks) / chunks, col = i % chunks * 8;
      __nv_bfloat16* dgu_rows = kFp8 ? a->dgu_out : a->ring_h;
      if (part > 0 && !dgu_rows) continue;
      __nv_bfloat16* dst = part == 0 ? a->wh_out + row * I + col0 + col
                                     : dgu_rows + row * 2 * I + (part - 1) * I + col0 + col;
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
    if constexpr (kFp8) {
      // The packed rows too: e4m3 zeros (16-byte chunks of dg's and du's columns) and scale 1
      // for the tile's blocks.
      const int64_t row_bytes = fp8::packed_row_bytes(2 * I);
      for (int32_t i = tid; i < 64 * 2 * chunks / 2; i += 128) {
        const int64_t row = int64_t{c.a_row} + wg * 64 + i / chunks;
        const int32_t part = i % chunks / (chunks / 2), col = i % (chunks / 2) * 16;
        *reinterpret_cast<uint4*>(reinterpret_cast<uint8_t*>(a->ring_h) + row * row_bytes +
                                  part * I + col0 + col) = make_uint4(0, 0, 0, 0);
      }
      const int32_t blocks = chunks * 8 / fp8::kBlock;
      for (int32_t i = tid; i < 64 * 2 * blocks; i += 128) {
        const int64_t row = int64_t{c.a_row} + wg * 64 + i / (2 * blocks);
        const int32_t part = i % (2 * blocks) / blocks, b = i % blocks;
        reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(a->ring_h) + row * row_bytes +
                                 2 * I)[(part * I + col0) / fp8::kBlock + b] = 1.0f;
      }
    }
    finish(false);
  }
};

}  // namespace epflow::kernels::megakernel
