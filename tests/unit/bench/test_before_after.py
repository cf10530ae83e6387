"""The before/after runner's ratios (bench/before_after.py): new / old for the numbers both results hold,
one level of nesting deep, never for flags, zeros or values only one side has. The runner itself (two code
versions in one sitting) is not run here."""

from __future__ import annotations

import pytest

from bench.before_after import main, ratios


def test_ratios_are_new_over_old_for_shared_numbers_one_level_deep() -> None:
    old = {"pipeline_rollouts_per_s": 10.0, "rounds": 2, "bare": {"rollouts_per_s": 40.0, "deep": {"x": 1}}}
    new = {"pipeline_rollouts_per_s": 15.0, "rounds": 2, "bare": {"rollouts_per_s": 38.0, "deep": {"x": 2}}}
    assert ratios(old, new) == {"pipeline_rollouts_per_s": 1.5, "rounds": 1.0, "bare.rollouts_per_s": 0.95}


def test_ratios_skip_flags_zeros_strings_and_one_sided_keys() -> None:
    old = {"ok": True, "zero": 0.0, "name": "a", "only_old": 3.0, "list": [1, 2]}
    new = {"ok": True, "zero": 5.0, "name": "b", "only_new": 4.0, "list": [2, 4]}
    assert ratios(old, new) == {}


def test_a_script_this_checkout_lacks_is_refused_with_its_name(tmp_path) -> None:
    with pytest.raises(SystemExit, match=r"bench/no_such_bench\.py: no such benchmark"):
        main(["--old", "HEAD", "--out", str(tmp_path / "r.json"), "bench/no_such_bench.py"])
