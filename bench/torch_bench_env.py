"""What the PyTorch bench scripts share. Import it before torch: NVLink multicast stays off (set
before NCCL, PyTorch or NVSHMEM load), the repository's python/ (epflow) and bench/baselines/
(the shared inputs) become importable, and git_commit() names the commit a result file records."""
import os
import subprocess
import sys
from pathlib import Path

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO / "bench" / "baselines", REPO / "python"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))


def git_commit() -> str:
    """$EPFLOW_COMMIT (a device run's copy has no .git), else HEAD's short hash, else unknown."""
    try:
        return os.environ.get("EPFLOW_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
            check=False).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def init_torchrun():
    """This process's GPU (torchrun's LOCAL_RANK) and the NCCL process group over all of them:
    (rank, world size, device)."""
    import torch
    import torch.distributed as dist
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local)


def settle(fn, settle_ms: float) -> None:
    """Untimed calls of fn for settle_ms of GPU time (bench/settle.h says why): one call timed
    after an untimed one; under torch.distributed every rank makes the slowest rank's count (the
    calls are collective)."""
    if settle_ms <= 0:
        return
    import math

    import torch
    import torch.distributed as dist
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    ms = torch.tensor([start.elapsed_time(end)], device="cuda")
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    for _ in range(min(int(math.ceil(settle_ms / max(float(ms.item()), 1e-3))), 1_000_000)):
        fn()


def median_step_ms(step, params, warmup: int, iters: int, settle_ms: float) -> float:
    """Median GPU time (CUDA events) of step() over `iters` calls after settle_ms of untimed calls
    (settle()) and `warmup` more, the parameters' .grad set to None before each (as an
    optimizer's zero_grad)."""
    import statistics

    import torch

    def fresh_step():
        for p in params:
            p.grad = None
        step()

    settle(fresh_step, settle_ms)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(warmup + iters)]
    for start, end in events:
        for p in params:
            p.grad = None
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events[warmup:])


def step_arguments(doc: str, warmup: int):
    """The training-step benchmarks' shared flags (preset, tokens, warmup, settle-ms, iters,
    repeats, seed, json); a script adds its own before parse_args()."""
    import argparse

    import inputs
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v3", choices=sorted(inputs.PRESETS))
    ap.add_argument("--tokens", default="2048,8192", help="tokens per rank per step")
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--settle-ms", type=float, default=2000.0,
                    help="untimed steps for this many ms of GPU time before each system's "
                    "warm-up (bench/settle.h)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path)
    return ap
