"""Reading the output of an A/B run (build_variants.sh's time_variants, or a run.sh that prints
the same "== VARIANT, round N" headers before each epflow-bench run): shared by the
experiments' summarize.py scripts."""
import re


def tagged_lines(path, stop_prefix):
    """(variant, tokens per rank, line) for each line after the first headers, up to the first line
    that starts with stop_prefix (what the run printed after its timings)."""
    variant = tokens = None
    for line in open(path):
        if line.startswith(stop_prefix):
            break
        if m := re.match(r"== (\w+), round", line):
            variant = m.group(1)
        elif m := re.match(r"\S+ \(H .*?\), (\d+) tokens/rank", line):
            tokens = int(m.group(1))
        else:
            yield variant, tokens, line
