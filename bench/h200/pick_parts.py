"""Which `--parts-ab` variants of a device run to confirm in the worker: prints one spec ('' if none).

One device call may be all a session gets, so run.sh's parts stage and the worker A/B that confirms it
run back to back in that call, with this choosing between them by the rule BENCHMARKS.md keeps: a
variant counts when both of its timings of the part it changes (flow, or HiFT for HiFT's switches)
beat every timing of the shipped form, and the GPU tests of what it switches passed in the same call.
A combination that lost leaves only the best of its single switches.

Usage: python bench/h200/pick_parts.py OUT_DIR NAME   (reads OUT_DIR/NAME.json and OUT_DIR/gpu_tests.txt)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file on the device: the repo's bench package
from bench.switches import SWITCHES, parse_switches  # noqa: E402

# The GPU tests that check each switch's arithmetic (a FAILED or ERROR line in one of them rules it out).
TESTS = {
    "resid": ("test_cosyvoice2_flow.py", "test_cosyvoice2_norm.py"),
    "temb": ("test_cosyvoice2_flow.py", "test_cosyvoice2_norm.py"),
    "enc_sdpa": ("test_cosyvoice2_flow.py",),
    "hift_cl": ("test_cosyvoice2_channels_last.py", "test_cosyvoice2_hift.py"),
    "snake_epi": ("test_cosyvoice2_conv_epilogue.py", "test_cosyvoice2_hift.py"),
    "fa3_splits": ("test_cosyvoice2_flow.py",),
    "fa3_q": ("test_cosyvoice2_flow.py",),
}


def keys_of(spec: str) -> dict[str, str]:
    return parse_switches(spec)


def part_of(keys: dict[str, str]) -> str:
    """The part a variant changes: HiFT when every switch it sets lives in hift.py, else the flow."""
    return "hift" if all(SWITCHES[k][0].endswith(".hift") for k in keys) else "flow"


def failed_files(tests_txt: str) -> set[str] | None:
    """Test files with a failure or error; None when the tests did not run to their summary, or when
    it counts failures its FAILED/ERROR lines do not name (pytest without -rfE: 6 failed, none named,
    in the gpu_h100_parts35 run), so no file can be cleared."""
    if not re.search(r"\d+ passed", tests_txt):
        return None
    named = re.findall(r"^(?:FAILED|ERROR) (\S+?\.py)", tests_txt, re.M)
    counted = sum(int(n) for n in re.findall(r"(\d+) (?:failed|errors?)\b", tests_txt.strip().splitlines()[-1]))
    if counted > len(named):
        return None
    return {Path(m).name for m in named}


def winners(parts: dict, tests_txt: str) -> dict[str, str]:
    variants = parts["variants"]
    shipped = variants["shipped"]
    failed = failed_files(tests_txt)
    won: dict[str, float] = {}  # spec -> its best time of the part it changes
    lost: list[str] = []
    for spec, v in variants.items():
        if spec == "shipped":
            continue
        keys = keys_of(spec)
        part = part_of(keys)
        tested = failed is not None and all(k in TESTS and not failed & set(TESTS[k]) for k in keys)
        if tested and max(v[f"reps_{part}_s"]) < min(shipped[f"reps_{part}_s"]):
            won[spec] = min(v[f"reps_{part}_s"])
        else:
            lost.append(spec)
    chosen: dict[str, str] = {}
    for spec in won:
        chosen |= keys_of(spec)
    for spec in lost:  # a combination that lost, all of whose switches won alone: keep the best single
        keys = keys_of(spec)
        singles = [s for s in won if len(keys_of(s)) == 1 and set(keys_of(s)) <= set(keys)]
        if len(keys) > 1 and set(keys) <= set(chosen) and len(singles) == len(keys):
            best = min(singles, key=won.get)
            for k in keys:
                if k not in keys_of(best):
                    chosen.pop(k)
    return chosen


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    out, name = Path(argv[0]), argv[1]
    try:
        parts = json.loads((out / f"{name}.json").read_text())["stages"]["parts"]
        tests = (out / "gpu_tests.txt").read_text()
    except (OSError, KeyError, ValueError) as e:
        print(f"pick_parts: no parts result to choose from ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    if "variants" not in parts:
        print("pick_parts: the parts stage did not run", file=sys.stderr)
        return 2
    print(",".join(f"{k}={v}" for k, v in winners(parts, tests).items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
