"""bench/h200/pick_parts.py: which parts-stage variants a device call goes on to confirm in the worker."""

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("pick_parts", Path(__file__).resolve().parents[1] / "bench" / "h200" / "pick_parts.py")
pick = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pick)

PASSED = "....\n12 passed, 3 skipped in 30.1s\n"



def _v(flow=(10.0, 10.2), hift=(3.0, 3.1)):
    return {"reps_flow_s": list(flow), "reps_hift_s": list(hift)}


def test_a_variant_counts_only_when_both_timings_beat_every_shipped_one():
    parts = {"variants": {"shipped": _v(), "resid=1": _v(flow=(9.0, 9.9)), "temb=1": _v(flow=(9.0, 10.1)),
                          "snake_epi=1": _v(hift=(2.8, 2.9)), "hift_cl=1": _v(flow=(5.0, 5.0), hift=(3.2, 3.0))}}
    # temb: one timing above the shipped best; hift_cl: judged on HiFT, not on the flow it does not change
    assert pick.winners(parts, PASSED) == {"resid": "1", "snake_epi": "1"}


def test_failed_gpu_tests_rule_out_what_they_check():
    parts = {"variants": {"shipped": _v(), "resid=1": _v(flow=(9.0, 9.1)), "snake_epi=1": _v(hift=(2.0, 2.0))}}
    tests = "FAILED tests/test_cosyvoice2_norm.py::test_kernel_on_gpu - AssertionError\n1 failed, 11 passed in 9s\n"
    assert pick.winners(parts, tests) == {"snake_epi": "1"}
    assert pick.winners(parts, "collection error, no summary") == {}  # tests that did not run prove nothing
    # failures the summary counts but no FAILED line names (pytest without -rf) clear no file
    unnamed = "SKIPPED [1] tests/test_cosyvoice2_flow.py:385: no flow.pt\n6 failed, 54 passed, 6 skipped in 65.55s (0:01:05)\n"
    assert pick.winners(parts, unnamed) == {}


def test_a_losing_combination_keeps_the_best_single():
    parts = {"variants": {"shipped": _v(), "resid=1": _v(flow=(9.0, 9.1)), "temb=1": _v(flow=(9.5, 9.6)),
                          "resid=1,temb=1": _v(flow=(10.5, 10.6))}}
    assert pick.winners(parts, PASSED) == {"resid": "1"}
    parts["variants"]["resid=1,temb=1"] = _v(flow=(8.0, 8.1))
    assert pick.winners(parts, PASSED) == {"resid": "1", "temb": "1"}


def test_main_prints_the_spec_and_refuses_a_missing_result(tmp_path, capsys):
    (tmp_path / "run.json").write_text(json.dumps({"stages": {"parts": {"variants": {"shipped": _v(), "enc_sdpa=1": _v(flow=(9.0, 9.0))}}}}))
    (tmp_path / "gpu_tests.txt").write_text(PASSED)
    assert pick.main([str(tmp_path), "run"]) == 0
    assert capsys.readouterr().out.strip() == "enc_sdpa=1"
    assert pick.main([str(tmp_path), "other"]) == 2
    assert "no parts result" in capsys.readouterr().err


@pytest.mark.parametrize("spec", ["fa3_q=1", "fa3_splits=1"])
def test_every_flow_switch_has_tests_that_check_it(spec):
    parts = {"variants": {"shipped": _v(), spec: _v(flow=(1.0, 1.0))}}
    assert pick.winners(parts, PASSED) == pick.keys_of(spec)
