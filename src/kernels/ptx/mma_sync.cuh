// Thin inline-PTX wrappers for the warp-level tensor-core path (sm_80+): ldmatrix and
// mma.sync m16n8k16 with bf16 inputs and fp32 accumulation.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), with
// g = lane / 4 (groupID) and t = lane % 4 (threadID_in_group); each .b32 register holds two
// bf16, the lower column (or k) in the low half:
//   A (16x16, row-major, [m][k]):  a[0] = (m g,   k 2t..2t+1)    a[1] = (m g+8, k 2t..2t+1)
//                                   a[2] = (m g,   k 2t+8..2t+9)  a[3] = (m g+8, k 2t+8..2t+9)
//   B (16x8, "col", [k][n]):        b[0] = (k 2t..2t+1, n g)      b[1] = (k 2t+8..2t+9, n g)
//   C/D (16x8 fp32):                c[0], c[1] = (m g, n 2t, 2t+1)  c[2], c[3] = (m g+8, same n)
// ldmatrix .m8n8 (no .trans): lanes 8i..8i+7 give the row addresses of matrix i (16 contiguous
// bytes each); register i of every lane then receives row lane / 4, columns 2 (lane % 4) + {0, 1}
// of matrix i, which is exactly the layout of a[*] (rows = m) and of b[*] when the 8x8 matrix
// is stored with n as its row and k contiguous (a K-major B operand).
#pragma once

#include <cstdint>

namespace epflow::ptx {

// Four 8x8 b16 matrices from shared memory; this lane supplies the row address of matrix
// lane / 8, row lane % 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_row_addr));
}

// d += a * b for one 16x8x16 tile: bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4],
                                                  const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

}  // namespace epflow::ptx
