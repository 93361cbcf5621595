#!/usr/bin/env python3
"""Renders the result tables of README.md and docs/benchmarks.md from the committed JSON.

A generated block is the lines between

    <!-- generated: bench/report.py [--summary] docs/results/FILE.json [...] -->
    <!-- end generated -->

and holds exactly what that command prints (run from the repository root). Without arguments
every block is rewritten in place; with --check nothing is written, and the exit status is 1
(with a diff) where a block differs from what its command prints: a figure typed or edited by
hand, or a result file changed under it. CTest runs --check (docs_tables_match_results).

Usage: scripts/render_docs.py [--check]"""
from __future__ import annotations

import difflib
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "docs/benchmarks.md"]
BLOCK = re.compile(r"^<!-- generated: (?P<cmd>.+?) -->\n(?P<body>.*?)^<!-- end generated -->$",
                   re.M | re.S)


def render(cmd: str, where: str) -> str:
    """What one block's command prints; only bench/report.py runs."""
    args = shlex.split(cmd)
    if not args or args[0] != "bench/report.py":
        sys.exit(f"render_docs.py: {where}: a block runs bench/report.py, not {cmd!r}")
    out = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                         check=False)
    if out.returncode != 0:
        sys.exit(f"render_docs.py: {where}: {cmd} failed:\n{out.stderr}")
    return out.stdout


def main() -> int:
    check = sys.argv[1:] == ["--check"]
    if sys.argv[1:] and not check:
        sys.exit(__doc__)
    stale = 0
    for doc in DOCS:
        path = REPO / doc
        text = path.read_text()
        blocks = 0

        def replace(m: re.Match) -> str:
            nonlocal stale, blocks
            blocks += 1
            line = text.count("\n", 0, m.start()) + 1
            body = render(m.group("cmd"), f"{doc}:{line}")
            if body != m.group("body"):
                stale += 1
                if check:
                    sys.stdout.writelines(difflib.unified_diff(
                        m.group("body").splitlines(True), body.splitlines(True),
                        f"{doc}:{line} (as committed)", f"{m.group('cmd')} (prints)"))
            return f"<!-- generated: {m.group('cmd')} -->\n{body}<!-- end generated -->"

        new = BLOCK.sub(replace, text)
        if not check and new != text:
            path.write_text(new)
        print(f"{doc}: {blocks} generated block(s)")
    if check and stale:
        print(f"render_docs.py: {stale} block(s) differ from their results: run "
              "scripts/render_docs.py and commit")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
