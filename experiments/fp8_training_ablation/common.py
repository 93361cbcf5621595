"""What ablate.py and horizons.py share: the seeds they draw and the final loss at a horizon.
Both put examples/ on sys.path before importing it."""
import sys

from train_moe import TAIL  # the example's final-loss rule: the mean of the last TAIL steps


def experts_seed(seed: int) -> int:
    """The torch seed of the experts' initial weights for run seed `seed` (0: train_moe.py's)."""
    return 100 + 7919 * seed


def parse_horizons(text: str, steps: int, prog: str) -> list:
    """--horizons ("600,1200,...": step counts within [TAIL, steps]); empty: none."""
    horizons = [int(h) for h in text.split(",")] if text else []
    if any(h < TAIL or h > steps for h in horizons):
        sys.exit(f"{prog}: every horizon must be within [{TAIL}, --steps]")
    return horizons


def final_loss_at(per_step: list, step: int) -> float:
    """The final-loss rule applied to the first `step` steps of per-step losses: with a constant
    learning rate, what a run of that length ends with."""
    return sum(per_step[step - TAIL:step]) / TAIL
