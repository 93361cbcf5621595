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
