#!/usr/bin/env python3
"""Torch mirror of bench/bench_inputs.h (and of the preset table in bench/presets.h): the
counter-based benchmark inputs every system of a comparison must see bit for bit.

  key(seed, stream, rank) = mix(seed ^ mix(stream << 32 | rank))
  unit(key, i)            = (2v + 1) / 2^24, v = ((mix(key + i) >> 40) & 0xFFFFFF) - 2^23
  x[t, h]                 = bf16(unit(key(seed, X, r), t * H + h))
  dy[t, h]                = bf16(unit(key(seed, DY, r), t * H + h))  (the backward's dL/dy)
  gate/up[e, i, h]        = bf16(unit(key(seed, GATE|UP, r), (e * I + i) * H + h) * H^-1/2)
  down[e, h, i]           = bf16(unit(key(seed, DOWN, r), (e * H + h) * I + i) * I^-1/2)
  topk_idx[t, :]          = the K experts e with the largest score(t, e), largest first (ties:
                            smaller e first), by the routing kind (ROUTINGS, --routing), with
                            h(t, e) = mix(key(seed, ROUTE, r) + t * E + e):
    uniform: h(t, e) >> 1, an integer
    zipf:    lp_e - ln(-ln(u(t, e))) in float64: Gumbel-top-k, so the K experts of a token are a
             sample without replacement with probabilities p_e proportional to 1 / (1 + r_e)
             r_e     = e's place, from 0, among the E experts sorted by
                       mix(key(seed, ZIPF_RANK, 0) + e) ascending (ties: smaller e first): rank 0's
                       key, so every rank ranks the experts alike
             lp_e    = -ln(1 + r_e)
             u(t, e) = (2 * (h(t, e) >> 12) + 1) * 2^-53: odd multiples of 2^-53 in (0, 1), exact
                       in float64
             ln is torch's float64 log here and the C library's in C++: they may differ in the
             last ulp, which reorders only scores within an ulp of each other (the selftest
             compares every topk_idx)
  topk_weights[t, k]      = 0.05f + 0.95f * ((mix(key(seed, ROUTE_WEIGHT, r) + t * K + k) >> 40)
                            * 2^-24), for every routing kind

e is local to rank r for weights, global for routing; bf16 rounding is round-to-nearest-even
(as __float2bfloat16 and torch's float32 -> bfloat16 cast both do).

splitmix64 runs on int64 tensors: torch's integer add and multiply wrap in two's complement, which
is uint64 arithmetic on the same bits; >> on int64 is arithmetic, so logical shifts mask the
sign-extended bits off. 64-bit constants are Python ints turned into their signed int64 value.

Usage: inputs.py --selftest PATH/epflow-inputs-dump [--device cuda]
  runs the C++ dump for a few small configs and asserts this module reproduces every value
  (exact checksums over all elements, plus sampled values), for both routing kinds; and for a
  few large routings alone, compares every topk_idx."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass

import torch

# InputStream of bench_inputs.h.
STREAM_X, STREAM_GATE, STREAM_UP, STREAM_DOWN, STREAM_ROUTE, STREAM_ROUTE_WEIGHT = 1, 2, 3, 4, 5, 6
STREAM_ZIPF_RANK = 7
STREAM_DY = 8

# RoutingKind of bench/routing_kind.h, by name: the default first.
ROUTINGS = ("uniform", "zipf")

_U64 = 1 << 64


def _signed(u: int) -> int:
    """The int64 holding the same bits as the uint64 u."""
    u %= _U64
    return u - _U64 if u >= 1 << 63 else u


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (>> alone copies the sign bit in)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors holding uint64 bits."""
    z = z + _GOLDEN
    z = (z ^ _srl(z, 30)) * _MUL1
    z = (z ^ _srl(z, 27)) * _MUL2
    return z ^ _srl(z, 31)


def _mix64_scalar(u: int) -> int:
    return int(mix64(torch.tensor(_signed(u), dtype=torch.int64))) % _U64


def stream_key(seed: int, stream: int, rank: int) -> int:
    """key(seed, stream, rank) as an unsigned Python int."""
    return _mix64_scalar(seed ^ _mix64_scalar((stream << 32) | rank))


def unit_value(key: int, i: torch.Tensor) -> torch.Tensor:
    """unit(key, i) for int64 indices i, in float32 (exact: odd multiples of 2^-24)."""
    v = (_srl(mix64(i + _signed(key)), 40) & 0xFFFFFF) - 0x800000
    return (2 * v + 1).to(torch.float32) * 2.0**-24


def fan_in_scale(fan_in: int) -> float:
    """1.0f / sqrtf(float(fan_in)), computed in float32 as the C++ does."""
    n = torch.tensor(float(fan_in), dtype=torch.float32)
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.sqrt(n))


def fill_bf16(count: int, scale: float, key: int, device: torch.device | str,
              chunk: int = 1 << 24) -> torch.Tensor:
    """bf16(unit(key, i) * scale) for i < count, flat. Chunked so that the int64 temporaries stay
    small next to expert weights of hundreds of millions of elements."""
    out = torch.empty(count, dtype=torch.bfloat16, device=device)
    # A float32 tensor, not a Python float, so the product is float32 * float32 as in C++.
    s = torch.tensor(scale, dtype=torch.float32, device=device)
    for start in range(0, count, chunk):
        i = torch.arange(start, min(start + chunk, count), dtype=torch.int64, device=device)
        out[start:start + i.numel()] = (unit_value(key, i) * s).to(torch.bfloat16)
    return out


@dataclass(frozen=True)
class Preset:
    """A row of bench/presets.h."""
    hidden: int
    intermediate: int
    model_experts: int
    top_k: int
    experts_per_rank: int  # of an 8-way split, kept at any EP size


PRESETS: dict[str, Preset] = {
    "deepseek-v3": Preset(7168, 2048, 256, 8, 32),
    "kimi-k2": Preset(7168, 2048, 384, 8, 48),
    "deepseek-v4-flash": Preset(4096, 2048, 256, 6, 32),
    "deepseek-v4-pro": Preset(7168, 3072, 384, 6, 48),
    "qwen3-235b-a22b": Preset(4096, 1536, 128, 8, 16),
    "qwen3-30b-a3b": Preset(2048, 768, 128, 8, 16),
    "gpt-oss-120b": Preset(2880, 2880, 128, 4, 16),
    "mixtral-8x7b": Preset(4096, 14336, 8, 2, 1),
    "tiny": Preset(256, 128, 16, 4, 8),
}


@dataclass
class ExpertWeights:
    """One rank's local experts, in bench_inputs.h's layouts."""
    gate: torch.Tensor  # [E_local, I, H] bf16
    up: torch.Tensor    # [E_local, I, H] bf16
    down: torch.Tensor  # [E_local, H, I] bf16


def make_x(seed: int, rank: int, tokens: int, hidden: int,
           device: torch.device | str) -> torch.Tensor:
    """Rank `rank`'s tokens, [T, H] bf16."""
    return fill_bf16(tokens * hidden, 1.0, stream_key(seed, STREAM_X, rank),
                     device).view(tokens, hidden)


def make_dy(seed: int, rank: int, tokens: int, hidden: int,
            device: torch.device | str) -> torch.Tensor:
    """Rank `rank`'s dL/dy for the backward, [T, H] bf16 (every system's backward gets this)."""
    return fill_bf16(tokens * hidden, 1.0, stream_key(seed, STREAM_DY, rank),
                     device).view(tokens, hidden)


def make_weights(seed: int, rank: int, p: Preset, device: torch.device | str) -> ExpertWeights:
    """Rank `rank`'s experts (local indices 0 .. experts_per_rank - 1)."""
    e, i, h = p.experts_per_rank, p.intermediate, p.hidden
    return ExpertWeights(
        gate=fill_bf16(e * i * h, fan_in_scale(h), stream_key(seed, STREAM_GATE, rank),
                       device).view(e, i, h),
        up=fill_bf16(e * i * h, fan_in_scale(h), stream_key(seed, STREAM_UP, rank),
                     device).view(e, i, h),
        down=fill_bf16(e * h * i, fan_in_scale(i), stream_key(seed, STREAM_DOWN, rank),
                       device).view(e, h, i))


def zipf_log_popularity(seed: int, num_experts: int) -> torch.Tensor:
    """zipf's lp_e = -ln(1 + r_e) of every global expert e, float64 on the CPU."""
    e = torch.arange(num_experts, dtype=torch.int64)
    expert_hash = mix64(e + _signed(stream_key(seed, STREAM_ZIPF_RANK, 0)))
    # Flipping the top bit makes signed order the C++'s unsigned order; the stable sort keeps
    # equal hashes in expert order.
    by_hash = torch.sort(expert_hash ^ _signed(1 << 63), stable=True).indices
    place = torch.empty_like(by_hash)
    place[by_hash] = e
    return -torch.log(1.0 + place.to(torch.float64))


def make_routing(seed: int, rank: int, tokens: int, num_experts: int, top_k: int,
                 device: torch.device | str,
                 routing: str = "uniform") -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s (topk_idx [T, K] int64 global expert ids, topk_weights [T, K] float32) for
    the routing kind `routing` (one of ROUTINGS).

    Order within a token: largest score first. uniform: the C++ breaks score ties by the smaller
    expert id and torch.topk's tie order is unspecified, but a tie needs two equal 63-bit hashes in
    one token's row: it does not happen at benchmark sizes (the selftest would see it). zipf:
    scored in float64 on the CPU whatever the device (the C++ scores on the host: the same
    operations in the same order), ranked by a stable sort, so ties go to the smaller id."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing {routing!r} is not one of {', '.join(ROUTINGS)}")
    route_key = _signed(stream_key(seed, STREAM_ROUTE, rank))
    if routing == "zipf":
        t = torch.arange(tokens, dtype=torch.int64).unsqueeze(1)
        e = torch.arange(num_experts, dtype=torch.int64).unsqueeze(0)
        h = mix64(t * num_experts + e + route_key)
        u = (2 * _srl(h, 12) + 1).to(torch.float64) * 2.0**-53
        score = zipf_log_popularity(seed, num_experts) - torch.log(-torch.log(u))
        idx = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :top_k]
        idx = idx.contiguous().to(device)
    else:
        t = torch.arange(tokens, dtype=torch.int64, device=device).unsqueeze(1)
        e = torch.arange(num_experts, dtype=torch.int64, device=device).unsqueeze(0)
        # >> 1 keeps 63 bits: non-negative int64, so signed order is the C++'s unsigned order.
        score = _srl(mix64(t * num_experts + e + route_key), 1)
        idx = torch.topk(score, top_k, dim=1, largest=True, sorted=True).indices
    slot = torch.arange(tokens * top_k, dtype=torch.int64, device=device).view(tokens, top_k)
    u = _srl(mix64(slot + _signed(stream_key(seed, STREAM_ROUTE_WEIGHT, rank))), 40)
    # 0.05f + 0.95f * (float(u) * 2^-24), each step rounded to float32 as in C++.
    f32 = {"dtype": torch.float32, "device": device}
    w = torch.tensor(0.05, **f32) + torch.tensor(0.95, **f32) * (u.to(torch.float32) * 2.0**-24)
    return idx, w


# --- selftest against the C++ (epflow-inputs-dump) -------------------------------------------

# (preset, tokens, ep, rank, seed), each under every routing kind: both ranks of a 2-way split,
# a seed above 2^63 (unsigned handling), a non-power-of-two token count, and 128 experts for
# routing.
_SELFTEST_CONFIGS = [
    ("tiny", 64, 2, 0, 1),
    ("tiny", 64, 2, 1, 1),
    ("tiny", 5, 1, 0, 18446744073709551557),
    ("qwen3-30b-a3b", 37, 8, 5, 42),
]
# Routings alone (no fills: gigabytes of expert weights), every topk_idx compared: DeepSeek-V3's
# 256 experts at 4096 tokens on the first and last of 8 ranks, Kimi-K2's 384 at 8192 tokens.
_ROUTING_SELFTEST_CONFIGS = [
    ("deepseek-v3", 4096, 8, 0, 1),
    ("deepseek-v3", 4096, 8, 7, 1),
    ("kimi-k2", 8192, 8, 3, 42),
]


def _bits_checksums(bits: torch.Tensor) -> tuple[int, int]:
    """(sum of bits, sum of bits * (index + 1)), both modulo 2^64 as in the C++."""
    bits = bits.to(torch.int64).cpu()
    weight = torch.arange(1, bits.numel() + 1, dtype=torch.int64)
    return int(bits.sum()) % _U64, int((bits * weight).sum()) % _U64


def _check_fill(name: str, want: dict, got: torch.Tensor, key: int, scale: float,
                device: str) -> list[str]:
    errors = []
    flat = got.reshape(-1)
    bits = flat.view(torch.int16).to(torch.int64) & 0xFFFF
    bits_sum, bits_weighted_sum = _bits_checksums(bits)
    if want["count"] != flat.numel():
        errors.append(f"{name}: count {flat.numel()} != {want['count']}")
    if want["key"] != key:
        errors.append(f"{name}: key {key} != {want['key']}")
    if torch.tensor(want["scale"], dtype=torch.float32).item() != scale:
        errors.append(f"{name}: scale {scale!r} != {want['scale']!r}")
    if (bits_sum, bits_weighted_sum) != (want["bits_sum"], want["bits_weighted_sum"]):
        errors.append(f"{name}: bf16 bit checksums {bits_sum}, {bits_weighted_sum} != "
                      f"{want['bits_sum']}, {want['bits_weighted_sum']}")
    value_sum = float(flat.to(torch.float64).sum())
    if abs(value_sum - want["sum"]) > 1e-9 * max(1.0, abs(want["sum"])):
        errors.append(f"{name}: value sum {value_sum!r} != {want['sum']!r}")
    for s in want["samples"]:
        i = torch.tensor([s["i"]], dtype=torch.int64, device=device)
        unit = float(unit_value(key, i)[0])
        if unit != torch.tensor(s["unit"], dtype=torch.float32).item():
            errors.append(f"{name}[{s['i']}]: unit {unit!r} != {s['unit']!r}")
        if int(bits[s["i"]]) != s["bf16"]:
            errors.append(f"{name}[{s['i']}]: bf16 bits {int(bits[s['i']]):#06x} != "
                          f"{s['bf16']:#06x}")
    return errors


def _check_routing(want: dict, seed: int, rank: int, tokens: int, num_experts: int,
                   top_k: int, routing: str, device: str) -> list[str]:
    """This module's routing against the dump's: keys, checksums, samples and every topk_idx
    (a differing token is named with both rows)."""
    errors = []
    if want["kind"] != routing:
        errors.append(f"routing: the dump's kind {want['kind']} != {routing}")
    for name, key in (("route_key", stream_key(seed, STREAM_ROUTE, rank)),
                      ("weight_key", stream_key(seed, STREAM_ROUTE_WEIGHT, rank)),
                      ("zipf_rank_key", stream_key(seed, STREAM_ZIPF_RANK, 0))):
        if want[name] != key:
            errors.append(f"routing: {name} {key} != {want[name]}")
    idx, tw = make_routing(seed, rank, tokens, num_experts, top_k, device, routing)
    idx, tw = idx.reshape(-1).cpu(), tw.reshape(-1).cpu()
    if _bits_checksums(idx) != (want["idx_sum"], want["idx_weighted_sum"]):
        errors.append(f"routing: expert id checksums {_bits_checksums(idx)} != "
                      f"{(want['idx_sum'], want['idx_weighted_sum'])}")
    w_bits = tw.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if _bits_checksums(w_bits) != (want["weight_bits_sum"], want["weight_bits_weighted_sum"]):
        errors.append("routing: weight bit checksums differ")
    for s in want["samples"]:
        k = s["slot"]
        want_w = torch.tensor(s["weight"], dtype=torch.float32).item()
        if int(idx[k]) != s["idx"] or float(tw[k]) != want_w:
            errors.append(f"routing slot {k}: ({int(idx[k])}, {float(tw[k])!r}) != "
                          f"({s['idx']}, {want_w!r})")
    want_idx = torch.tensor(want["topk_idx"], dtype=torch.int64)
    if want_idx.numel() != idx.numel():
        errors.append(f"routing: {idx.numel()} topk_idx != the dump's {want_idx.numel()}")
        return errors
    got_rows, want_rows = idx.view(tokens, top_k), want_idx.view(tokens, top_k)
    differ = (got_rows != want_rows).any(dim=1).nonzero().flatten().tolist()
    if differ:
        errors.append(f"routing: topk_idx of {len(differ)} of {tokens} tokens differ")
    for t in differ[:5]:
        errors.append(f"    token {t}: {got_rows[t].tolist()} != {want_rows[t].tolist()}")
    return errors


def _check_config(dump: str, preset: str, tokens: int, ep: int, rank: int, seed: int,
                  routing: str, routing_only: bool, device: str) -> list[str]:
    out = subprocess.run([dump, "--preset", preset, "--tokens", str(tokens), "--ep", str(ep),
                          "--rank", str(rank), "--seed", str(seed), "--routing", routing,
                          *(["--routing-only"] if routing_only else [])],
                         check=True, capture_output=True, text=True).stdout
    want = json.loads(out)
    p = PRESETS[preset]
    errors = []
    shape = (p.hidden, p.intermediate, p.experts_per_rank, p.top_k)
    want_shape = (want["hidden"], want["intermediate"], want["experts_per_rank"], want["top_k"])
    if shape != want_shape:
        errors.append(f"preset {preset}: (H, I, E_local, K) {shape} != presets.h {want_shape}")
        return errors
    if not routing_only:
        x = make_x(seed, rank, tokens, p.hidden, device)
        errors += _check_fill("x", want["x"], x, stream_key(seed, STREAM_X, rank), 1.0, device)
        w = make_weights(seed, rank, p, device)
        for name, t, stream, fan_in in (("gate", w.gate, STREAM_GATE, p.hidden),
                                        ("up", w.up, STREAM_UP, p.hidden),
                                        ("down", w.down, STREAM_DOWN, p.intermediate)):
            errors += _check_fill(name, want[name], t, stream_key(seed, stream, rank),
                                  fan_in_scale(fan_in), device)
    return errors + _check_routing(want["routing"], seed, rank, tokens,
                                   p.experts_per_rank * ep, p.top_k, routing, device)


def selftest(dump: str, device: str) -> int:
    failed = False
    runs = [(cfg, routing, False) for routing in ROUTINGS for cfg in _SELFTEST_CONFIGS]
    runs += [(cfg, routing, True) for routing in ROUTINGS for cfg in _ROUTING_SELFTEST_CONFIGS]
    for cfg, routing, routing_only in runs:
        errors = _check_config(dump, *cfg, routing=routing, routing_only=routing_only,
                               device=device)
        what = "routing only" if routing_only else "all inputs"
        print(f"{'OK' if not errors else 'MISMATCH':8} {routing:7} preset {cfg[0]} tokens {cfg[1]} "
              f"ep {cfg[2]} rank {cfg[3]} seed {cfg[4]} ({what}, {device})")
        for e in errors:
            print(f"    {e}")
        failed |= bool(errors)
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--selftest", metavar="EPFLOW_INPUTS_DUMP", required=True,
                    help="path of the epflow-inputs-dump executable to compare with")
    ap.add_argument("--device", default="cpu", help="torch device for this side (cpu, cuda)")
    args = ap.parse_args()
    return selftest(args.selftest, args.device)


if __name__ == "__main__":
    sys.exit(main())
