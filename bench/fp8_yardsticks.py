#!/usr/bin/env python3
"""The FP8 yardsticks: what the vendor and PyTorch kernels reach on one GPU on the GEMMs and the
weight stream an FP8 MoE layer is made of, measured in one run, so that an FP8 layer's figures
(EPFlow's, torch_moe.py --dtype fp8's) can be read against them on the same GPU:
1. dense GEMM TFLOP/s at M = N = K = 8192 (--dense-shape M,N,K): cuBLAS BF16 (torch.mm), and e4m3
   by torch._scaled_mm with a per-tensor scale, row-wise scales (scale_a [M, 1], scale_b [1, N]),
   and block-wise scales, 1x128 on the activations x 128x128 on the weights: DeepSeek-V3's recipe,
   the one EPFlow's FP8 layer uses (cuBLASLt, sm_90, CUDA >= 12.9). Block-wise scales as the op
   wants them: scale_a [M, K/128] outer-dim-major (strides (1, M)), scale_b [K/128, N/128] the
   transposed view of a contiguous [N/128, K/128]; by torch._scaled_mm (it infers the recipe from
   the scale shapes), else torch.nn.functional.scaled_mm with ScalingType.BlockWise1x128 /
   BlockWise128x128. A variant this torch or GPU cannot run records its error, not a figure.
2. grouped GEMMs, 32 experts, DeepSeek-V3's gate|up (K 7168 -> N 4096) and down (K 2048 -> N
   7168), 128 / 512 / 2048 rows per expert: torch._scaled_grouped_mm with row-wise scales (what it
   offers on sm_90) and torch._grouped_mm in BF16, both with the weights [E, N, K] contiguous
   passed as the column-major [E, K, N] view.
3. the FP8 weight stream: a device-to-device Tensor.copy_ of the e4m3 weights of 32 DeepSeek-V3
   experts (3 x 7168 x 2048 bytes each, ~1.41 GB): the time to read them once, the floor under a
   layer that streams its experts' weights, and its GB/s counting read + write.
Timing: CUDA events around every call; per measurement --warmup untimed calls (100; optionally
--settle-ms of GPU time before them, bench/settle.h; default 0, as DeepGEMM's figures), then --iters
timed ones (50), their median; the whole set runs --repeats times (3) in turn, each measurement
reporting the median of its repeats' medians and every repeat's. Random inputs (torch.randn,
scaled, cast or quantized with amax / 448 scales), never zeros; FP8 accumulation is the accurate
one unless --fast-accum.

Usage: python3 bench/fp8_yardsticks.py [--json out.json] [--dense-shape M,N,K] [--iters 50]
         [--warmup 100] [--settle-ms 0] [--repeats 3] [--fast-accum]"""
from __future__ import annotations

# NVLink multicast (NVLS) can take the shared host down (BRIEF §2): forced off, not merely
# defaulted, before torch loads NCCL or NVSHMEM.
from torch_bench_env import git_commit, settle  # noqa: E402  (first: before torch loads)

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

FP8 = getattr(torch, "float8_e4m3fn", None)  # None: main() stops, naming it
FP8_MAX = 448.0
EXPERTS, HIDDEN, INTER = 32, 7168, 2048  # DeepSeek-V3: 32 experts per GPU at EP 8
ROWS_PER_EXPERT = (128, 512, 2048)
BF16 = torch.bfloat16


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    return amax.float().clamp(min=1e-12) / FP8_MAX


def quantize(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """v / scale (broadcast) in e4m3, computed in fp32 and cast as it is stored."""
    return torch.div(v, scale, out=torch.empty(v.shape, dtype=FP8, device=v.device))


def rowwise(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 of v [..., K] with one fp32 scale per row (scale [..., 1])."""
    s = scale_of(v.abs().amax(-1, keepdim=True))
    return quantize(v, s), s


def dense_cases(m: int, n: int, k: int, fast: bool, dev: torch.device) -> list[dict]:
    """torch.mm and torch._scaled_mm at [m, k] x [k, n]; b is the weight w [n, k] as its
    column-major transpose, as the FP8 ops require."""
    a = torch.randn(m, k, device=dev, dtype=BF16)
    w = torch.randn(n, k, device=dev, dtype=BF16) * k ** -0.5
    shape = {"m": m, "n": n, "k": k}
    ref = torch.mm(a, w.t()).float()
    cases = [dict(name="dense", shape=shape, dtype="bf16", scaling="none", api="torch.mm",
                  flops=2 * m * n * k, fn=lambda: torch.mm(a, w.t()))]

    def scaled_mm(aq, bq, sa, sb) -> Callable[[], torch.Tensor]:
        return lambda: torch._scaled_mm(aq, bq, sa, sb, out_dtype=BF16, use_fast_accum=fast)

    sa_t, sw_t = scale_of(a.abs().amax()), scale_of(w.abs().amax())
    (aq_r, sa_r), (wq_r, sw_r) = rowwise(a), rowwise(w)
    variants = [("tensorwise", "torch._scaled_mm",
                 scaled_mm(quantize(a, sa_t), quantize(w, sw_t).t(), sa_t, sw_t)),
                ("rowwise", "torch._scaled_mm",
                 scaled_mm(aq_r, wq_r.t(), sa_r, sw_r.view(1, n)))]
    block = "blockwise 1x128 x 128x128"
    if k % 128 or n % 128:
        variants.append((block, None, "block-wise needs N and K multiples of 128"))
    else:
        kb, nb = k // 128, n // 128
        sa_b = scale_of(a.view(m, kb, 128).abs().amax(2))  # [M, K/128]
        aq_b = quantize(a.view(m, kb, 128), sa_b.unsqueeze(2)).view(m, k)
        sw_b = scale_of(w.view(nb, 128, kb, 128).abs().amax((1, 3)))  # [N/128, K/128]
        wq_b = quantize(w.view(nb, 128, kb, 128), sw_b[:, None, :, None]).view(n, k)
        sa_b = sa_b.t().contiguous().t()  # outer-dim-major: strides (1, M)
        # scale_b [K/128, N/128], strides (1, K/128); the v2 API wants K/128 padded to 4s.
        tries = [("torch._scaled_mm", scaled_mm(aq_b, wq_b.t(), sa_b, sw_b.t()))]
        if hasattr(F, "ScalingType") and hasattr(F, "scaled_mm"):
            sw_pad = torch.zeros(nb, -(-kb // 4) * 4, device=dev)
            sw_pad[:, :kb] = sw_b
            tries.append(("torch.nn.functional.scaled_mm", lambda: F.scaled_mm(
                aq_b, wq_b.t(), sa_b, F.ScalingType.BlockWise1x128, sw_pad.t(),
                F.ScalingType.BlockWise128x128, output_dtype=BF16, use_fast_accum=fast)))
        errors = []
        for api, fn in tries:
            if (err := probe(fn)) is None:
                variants.append((block, api, fn))
                break
            errors.append(f"{api}: {err}")
        else:
            variants.append((block, None, "; ".join(errors)))
    for scaling, api, fn in variants:
        case = dict(name="dense", shape=shape, dtype="e4m3", scaling=scaling, api=api,
                    use_fast_accum=fast, flops=2 * m * n * k)
        if api is None:
            case["error"] = fn
        elif (err := probe(fn)) is None:
            case["fn"] = fn  # a wrong scale layout would show here, far above e4m3's ~5%
            case["rel_err_vs_bf16"] = float((fn().float() - ref).norm() / ref.norm())
        else:
            case["error"] = err
        cases.append(case)
    return cases


def grouped_cases(fast: bool, dev: torch.device) -> list[dict]:
    cases = []
    for name, k, n in (("grouped gate|up", HIDDEN, 2 * INTER), ("grouped down", INTER, HIDDEN)):
        w = torch.randn(EXPERTS, n, k, device=dev, dtype=BF16) * k ** -0.5
        wq, ws = rowwise(w)
        for rows in ROWS_PER_EXPERT:
            m = EXPERTS * rows
            a = torch.randn(m, k, device=dev, dtype=BF16)
            offs = torch.arange(1, EXPERTS + 1, device=dev, dtype=torch.int32) * rows
            shape = {"experts": EXPERTS, "rows_per_expert": rows, "m": m, "n": n, "k": k}
            base = dict(name=name, shape=shape, flops=2 * m * n * k)
            cases.append(dict(base, dtype="bf16", scaling="none", api="torch._grouped_mm",
                              fn=lambda a=a, w=w, offs=offs: torch._grouped_mm(
                                  a, w.transpose(1, 2), offs=offs)))
            aq, as_ = rowwise(a)
            cases.append(dict(base, dtype="e4m3", scaling="rowwise",
                              api="torch._scaled_grouped_mm", use_fast_accum=fast,
                              fn=grouped_fp8(aq, as_.view(m), wq, ws.view(EXPERTS, n), offs,
                                             fast)))
    return cases


def grouped_fp8(aq, as_, wq, ws, offs, fast) -> Callable[[], torch.Tensor]:
    return lambda: torch._scaled_grouped_mm(aq, wq.transpose(1, 2), as_, ws, offs=offs,
                                            out_dtype=BF16, use_fast_accum=fast)


def stream_case(dev: torch.device) -> dict:
    nbytes = EXPERTS * 3 * HIDDEN * INTER
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return dict(name="fp8 weight stream", dtype="e4m3 (as uint8)", scaling="none",
                api="Tensor.copy_", bytes=nbytes,
                shape={"experts": EXPERTS, "matrices": 3, "rows": HIDDEN, "cols": INTER},
                fn=lambda: dst.copy_(src))


def probe(fn: Callable[[], object]) -> str | None:
    """Runs fn once: None, or the error it raised (the op's message, which says what it needs)."""
    try:
        fn()
        torch.cuda.synchronize()
        return None
    except (RuntimeError, ValueError, TypeError, AttributeError) as e:  # torch's own, or a
        # missing op (AttributeError names it); NotImplementedError is a RuntimeError
        return f"{type(e).__name__}: {str(e).strip()[:1500]}"


def median_us(fn: Callable[[], object], warmup: int, iters: int, settle_ms: float) -> float:
    settle(fn, settle_ms)
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--dense-shape", default="8192,8192,8192", help="M,N,K of the dense GEMMs")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--settle-ms", type=float, default=0.0,
                    help="untimed calls for this many ms of GPU time before each warm-up")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fast-accum", action="store_true",
                    help="use_fast_accum=True in every FP8 GEMM (default: accurate accumulation)")
    args = ap.parse_args()
    m, n, k = (int(v) for v in args.dense_shape.split(","))
    if args.iters < 1 or args.warmup < 0 or args.repeats < 1:
        ap.error("--iters and --repeats must be >= 1 and --warmup >= 0")
    if not torch.cuda.is_available():
        print("fp8_yardsticks.py: the yardsticks need a CUDA GPU; none here, nothing measured")
        return 0
    if FP8 is None:
        sys.exit(f"fp8_yardsticks.py: this torch ({torch.__version__}) has no torch.float8_e4m3fn")
    dev = torch.device("cuda", torch.cuda.current_device())
    cases = (dense_cases(m, n, k, args.fast_accum, dev) + grouped_cases(args.fast_accum, dev)
             + [stream_case(dev)])
    for c in cases:  # one call each first: a variant that raises records its error instead
        if "fn" in c and "error" not in c and (err := probe(c["fn"])) is not None:
            c["error"] = err
    timed = [c for c in cases if "fn" in c and "error" not in c]
    for c in timed:
        c["repeat_us"] = []
    for _ in range(args.repeats):  # the whole set, in turn, --repeats times
        for c in timed:
            c["repeat_us"].append(median_us(c["fn"], args.warmup, args.iters, args.settle_ms))
    print(f"{'measurement':18} {'shape':34} {'dtype, scaling':34} {'median us':>10} "
          f"{'rate':>14}  repeats us")
    for c in cases:
        c.pop("fn", None)
        flops, nbytes = c.pop("flops", None), c.get("bytes")
        if "repeat_us" in c:
            c["median_us"] = us = statistics.median(c["repeat_us"])
            if flops:
                c["tflops"] = flops / us * 1e-6
                rate = f"{c['tflops']:.1f} TFLOP/s"
            else:
                c["gbps"] = 2 * nbytes / us * 1e-3  # read + write
                c["gbps_read"] = nbytes / us * 1e-3
                rate = f"{c['gbps']:.0f} GB/s r+w"
            each = " / ".join(f"{u:.1f}" for u in c["repeat_us"])
            c["repeat_us"] = [round(u, 2) for u in c["repeat_us"]]
        else:
            us, rate, each = float("nan"), "n/a", "ERROR " + c["error"][:200]
        shape = "x".join(str(v) for v in c["shape"].values())
        print(f"{c['name']:18} {shape:34} {c['dtype'] + ', ' + c['scaling']:34} {us:10.1f} "
              f"{rate:>14}  {each}")
    if args.json:
        doc = {"kind": "fp8-yardsticks", "device": torch.cuda.get_device_name(dev),
               "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
               "commit": git_commit(), "torch": torch.__version__, "cuda": torch.version.cuda,
               "warmup": args.warmup, "settle_ms": args.settle_ms, "iters": args.iters, "repeats": args.repeats, "runs": cases}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
