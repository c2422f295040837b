"""Summarise a py-spy raw capture of a device run (`PYSPY=1 [PYSPY_GIL=1] bash .gpu/run.sh ...`).

    python -m bench.pyspy_summary OUT/pyspy.txt --title "..." > bench/results/NAME_pyspy.txt

py-spy's raw format is one line per distinct stack, `frame;frame;... count`, where with
`--subprocesses` each stack starts with its process (`process PID:"command line"`, nested for a child's
child) and with `--threads` with its thread. This prints, per process: samples per thread (names with
their numbers folded, so `upload-3` and `upload-7` count together), then the functions that appear in
the most samples (inclusive) and the innermost frames (self). With `--gil` every sample is one in which
that thread held the GIL: the thread shares say who kept the others waiting.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path

PROCESS = re.compile(r'^process (\d+):"([^"]*)"$')


def _fold(name: str) -> str:
    """'thread (0x7f..): upload-3' -> 'upload-#'."""
    return re.sub(r"\d+", "#", re.sub(r"^thread \([^)]*\):\s*", "", name)).strip()


def _frame(f: str) -> str:
    return re.sub(r" \([^()]*:\d+\)$", "", f)


def summarise(lines: list[str], top: int = 25, thread: str | None = None) -> str:
    """The summary text; with `thread`, only the samples of threads whose raw name holds that string
    (e.g. "(890)": one thread of one run, where several share a name)."""
    procs: dict[str, dict[str, Counter]] = defaultdict(lambda: {"thread": Counter(), "incl": Counter(), "self": Counter()})
    commands: dict[str, str] = {}
    for line in lines:
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        pid = "?"
        while frames and (m := PROCESS.match(frames[0])):  # the innermost process is the one sampled
            pid, commands[m.group(1)] = m.group(1), m.group(2)
            frames = frames[1:]
        if not frames or (thread is not None and thread not in frames[0]):
            continue
        p = procs[pid]
        p["thread"][_fold(frames[0])] += int(n)
        for f in dict.fromkeys(_frame(f) for f in frames[1:]):
            p["incl"][f] += int(n)
        p["self"][frames[-1]] += int(n)
    out = []
    for pid, p in sorted(procs.items(), key=lambda kv: -sum(kv[1]["thread"].values())):
        total = sum(p["thread"].values())
        out.append(f"== process {pid} ({commands.get(pid, '?')[:100]}): {total} samples")
        for title, counter, k in (("threads", p["thread"], 12), ("inclusive", p["incl"], top), ("self", p["self"], top)):
            out.append(f"-- {title}")
            out += [f"{v:8d} {100 * v / total:5.1f}%  {name[:140]}" for name, v in counter.most_common(k)]
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", type=Path)
    ap.add_argument("--title", default="")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--thread", action="append", default=None,
                    help="only threads whose raw name holds this (e.g. '(890)'); repeat for one summary per thread")
    a = ap.parse_args()
    lines = a.raw.read_text(errors="replace").splitlines()
    text = "\n".join(summarise(lines, a.top, t) for t in (a.thread or [None]))
    sys.stdout.write((f"# {a.title}\n\n" if a.title else "") + text + "\n")


if __name__ == "__main__":
    main()
