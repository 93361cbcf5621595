#!/usr/bin/env python3
"""The patch's gemm::fp8_transpose_quarter, lane by lane on the CPU: its shared-memory addresses
in the 128B-swizzled stage, its 4 x 4 byte transposes (__byte_perm) and its shuffles among the
four lanes of one word, for each warpgroup's quarter of both halves of a stage of random bytes.
Checks that every byte of the 128 x 64 transposed quarter is written once, with the right value,
and prints the worst bank conflict of its 4-byte shared loads. No GPU needed."""
import random
from collections import defaultdict


def byte_perm(x, y, s):
    b = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    return sum(b[(s >> (4 * i)) & 0x7] << (8 * i) for i in range(4))


def smem_offset(n, w):  # word w (4 bytes) of stage row n: chunk w / 4 swizzled by the row
    return n * 128 + (((w // 4) ^ (n % 8)) * 16) + (w % 4) * 4


def quarter(half, wg, rng):
    stage = [[rng.randrange(256) for _ in range(128)] for _ in range(256)]
    smem = bytearray(256 * 128)
    for n in range(256):
        for k in range(128):
            smem[n * 128 + (((k // 16) ^ (n % 8)) * 16) + k % 16] = stage[n][k]
    base = half * 128 + wg * 64
    out = defaultdict(list)  # (output row k, byte n) -> values written
    for warp in range(4):
        for g in range(4):
            o = {}
            for lane in range(32):
                a, b = lane // 8, lane % 8
                w = 8 * warp + b
                x = [int.from_bytes(smem[(off := smem_offset(base + 16 * g + 4 * a + r, w)):off + 4],
                                    "little") for r in range(4)]
                ab01, ab23 = byte_perm(x[0], x[1], 0x5140), byte_perm(x[0], x[1], 0x7362)
                cd01, cd23 = byte_perm(x[2], x[3], 0x5140), byte_perm(x[2], x[3], 0x7362)
                o[lane] = [byte_perm(ab01, cd01, 0x5410), byte_perm(ab01, cd01, 0x7632),
                           byte_perm(ab23, cd23, 0x5410), byte_perm(ab23, cd23, 0x7632)]
            row = {lane: [o[lane][i] if i == lane // 8 else 0 for i in range(4)]
                   for lane in range(32)}
            for r in range(1, 4):  # __shfl_xor_sync(.., send, 8 r): lane (a, b) <-> (a ^ r, b)
                send = {lane: o[lane][(lane // 8) ^ r] for lane in range(32)}
                for lane in range(32):
                    row[lane][(lane // 8) ^ r] = send[lane ^ (8 * r)]
            for lane in range(32):
                a, b = lane // 8, lane % 8
                k = 4 * (8 * warp + b) + a
                for i in range(4):
                    for j in range(4):
                        out[(k, 16 * g + 4 * i + j)].append((row[lane][i] >> (8 * j)) & 0xFF)
    wrong = sum(out.get((k, n)) != [stage[base + n][k]] for k in range(128) for n in range(64))
    return wrong, len(out)


def worst_bank_conflict():
    worst = 0
    for warp in range(4):
        for g in range(4):
            for r in range(4):
                banks = defaultdict(set)
                for lane in range(32):
                    a, b = lane // 8, lane % 8
                    addr = smem_offset(16 * g + 4 * a + r, 8 * warp + b)
                    banks[(addr // 4) % 32].add(addr)
                worst = max(worst, max(len(v) for v in banks.values()))
    return worst


def main():
    rng = random.Random(0)
    for half in range(2):
        for wg in range(2):
            wrong, written = quarter(half, wg, rng)
            print(f"half {half}, warpgroup {wg}: {written} bytes written, {wrong} wrong or "
                  "written twice")
            assert wrong == 0 and written == 128 * 64
    print(f"4-byte shared loads: at most {worst_bank_conflict()}-way bank conflicts")


if __name__ == "__main__":
    main()
