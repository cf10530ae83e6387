"""The run report (records/report/): every required plot present with its SVG, self-contained (no external
resource of any kind), well-formed (the page parses as XML), honest when a plot has nothing to show, and
``rollouts report`` failing in one line on bad input.

Drives the real report on a temp RunStore written through its public methods.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from durable_rollouts.cli.rollouts import app
from durable_rollouts.records.report import PLOTS, ReportError, load, render, write_report
from durable_rollouts.records.report.render import reason_label
from durable_rollouts.records.report.svg import nice_ticks
from durable_rollouts.store.runstore import RunStore, Segment

RUN = "rep"
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 8, "seed": 1}
REQUIRED = (
    "time-by-env", "length-by-outcome", "end-reasons", "reward-distribution", "group-variance",
    "zero-variance", "trainer-tokens", "offpolicy", "admission", "timeline",
)  # fmt: skip
OUTCOMES = [
    ("completed", None, 1.0),
    ("completed", None, 0.0),
    ("truncated", "max_turns", None),
    ("failed", "infra: EngineUnavailable: engine e2 refused the connection", None),
    ("cancelled", "admission", None),
]


def fill(store: RunStore, run: str = RUN, groups: int = 3, feed: bool = True, dispatch: bool = True) -> None:
    store.register_run(run, json.dumps({"run": {"env": "math", "num_groups": groups, "group_size": 5}}), "h")
    t0 = store.get_run(run)["created_at"]  # type: ignore[index]
    for g in range(groups):
        gid = f"g{g:06d}"
        rewards = []
        for k, (outcome, reason, reward) in enumerate(OUTCOMES):
            rid = f"{run}/{gid}/{k}"
            engine = f"http://e{(g + k) % 2 + 1}:8000"
            prompt = Segment(name="prompt", kind="prompt", turn=None, start=0, token_ids=[1, 2])
            store.put_segment(rid, prompt)
            n = 2 + 3 * k
            meta = {"engine": engine, "finish_reason": "stop", "queue_s": 0.1, "model_s": 0.4 + k,
                    "env_s": 0.05, "reward_s": 0.01, "transfer_s": 0.002, "attempt": 1}  # fmt: skip
            store.put_segment(rid, Segment(name="t00000.model", kind="model", turn=0, start=2,
                                           token_ids=[5] * n, logprobs=[-1.0] * n,
                                           policy_versions=["v1"] * n, meta=meta))  # fmt: skip
            start = t0 + g * 2.0 + k * 0.3
            extra = {"started_at": start, "ended_at": start + 1.0 + k, "sandbox_s": 0.0,
                     "record_transfer_s": 0.001}  # fmt: skip
            scorable = reward is not None
            r = reward + g * 0.1 if reward is not None else None
            if r is not None:
                rewards.append(r)
            store.put_rollout({
                "rollout_id": rid, "run_id": run, "group_id": gid, "task_id": f"t{g}", "sample_index": k,
                "env": "math", "outcome": outcome, "reason": reason, "reward": r, "scorable": int(scorable),
                "advantage": 0.0 if scorable else None, "prompt_length": 2, "num_tokens": 2 + n,
                "sampling_json": json.dumps(SAMPLING), "extra_json": json.dumps(extra),
            })  # fmt: skip
        std = 0.0 if g == 0 else 0.5
        store.put_group(run, gid, f"t{g}", {
            "run_id": run, "group_id": gid, "task_id": f"t{g}", "size": 5, "scorable": len(rewards),
            "failed": 1, "reward_mean": sum(rewards) / len(rewards), "reward_std": std,
            "zero_variance": g == 0,
        })  # fmt: skip
    if feed:
        store.put_feed_marks(run, [{"group_id": "g000001", "state": "consumed", "records": 5, "tokens": 40,
                                    "lag": 0}])  # fmt: skip
        store.put_feed_marks(run, [{"group_id": "g000000", "state": "discarded", "reason": "zero_variance",
                                    "records": 5, "tokens": 40, "lag": 0}])  # fmt: skip
        for b, (mean, flag) in enumerate([(1e-7, None), (0.05, "logprob mismatch at equal weights: x")]):
            store.put_offpolicy_evidence(run, f"b{b + 1:06d}", {
                "tokens": 20, "mean_abs_dlogp": mean, "max_abs_dlogp": 10 * mean, "lag0_mean_abs_dlogp": mean,
                "ratio_p99": 1.01, "ratio_max": 1.3 + b, "flagged": flag is not None,
                **({"flag": flag} if flag else {}),
            })  # fmt: skip
    if dispatch:
        for seq in range(1, 6):
            store.put_dispatch_log(run, seq, t0 + seq, {
                "run_id": run, "seq": seq, "at": t0 + seq, "cap": 8 + seq, "inflight": 5, "admitted": 5,
                "cancelled": 0, "kv_usage": 0.1 * seq, "healthy": ["http://e1:8000"], "reasons": ["grow"],
            })  # fmt: skip


@pytest.fixture
def store(tmp_path: Path) -> RunStore:
    store = RunStore(tmp_path / "home")
    fill(store)
    return store


def parse(page: str) -> ET.Element:
    assert page.startswith("<!DOCTYPE html>\n")
    return ET.fromstring(page.removeprefix("<!DOCTYPE html>\n"))  # well-formed: polyglot HTML


def assert_self_contained(page: str) -> None:
    assert not re.search(r"\b(src|href|xlink:href|action|srcset)\s*=", page, re.I)
    assert "url(" not in page and "@import" not in page and "<link" not in page and "<iframe" not in page
    for m in re.finditer(r"<script([^>]*)>", page):
        assert m.group(1) == "", "only inline scripts"
    assert not re.search(r"https?://(?!e\d:8000)", page), "the only URLs are the run's engine labels"


def test_every_required_plot_is_present_with_its_svg(store: RunStore) -> None:
    assert tuple(PLOTS) == REQUIRED
    root = parse(render(load(store, RUN)))
    figures = {f.get("id"): f for f in root.iter("figure")}
    assert set(figures) == set(REQUIRED)
    for fid, fig in figures.items():
        assert fig.find("figcaption").text == PLOTS[str(fid)]  # type: ignore[union-attr]
        (chart,) = fig.iter("svg")
        marks = [e for e in chart.iter() if e.tag in ("rect", "circle", "polyline")]
        assert marks, f"{fid} draws nothing"
    assert root.find("head/title").text == f"rollouts report: {RUN}"  # type: ignore[union-attr]


def test_the_page_is_self_contained(store: RunStore) -> None:
    assert_self_contained(render(load(store, RUN)))


def test_plots_show_the_run(store: RunStore) -> None:
    page = render(load(store, RUN))
    assert "1 of 3 groups have equal rewards" in page
    assert "40 of " in page  # consumed tokens of the feed
    assert "failed: infra: EngineUnavailable" in page and "truncated: max_turns" in page
    assert "5 dispatcher polls" in page
    assert "2 batches, 40 tokens recomputed by the trainer; 1 flagged" in page
    assert "largest importance ratio 2.3" in page and "last flag: logprob mismatch at equal weights" in page
    assert page.count("<title>rep/g") == 15  # one timeline bar per rollout
    assert "http://e1:8000" in page and "http://e2:8000" in page  # one band per replica


def test_a_run_without_trainer_or_dispatcher_still_has_every_plot_and_says_why(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    fill(store, feed=False, dispatch=False)
    page = render(load(store, RUN))
    root = parse(page)
    assert {f.get("id") for f in root.iter("figure")} == set(REQUIRED)
    assert "no group has been taken by a trainer" in page
    assert "no trainer reported evidence" in page
    assert "fixed in-flight cap" in page
    assert_self_contained(page)


def test_text_from_the_store_is_escaped(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    fill(store, run="x<&>", groups=1)
    page = render(load(store, "x<&>"))
    parse(page)
    assert "x&lt;&amp;&gt;" in page and "x<&>" not in page


def test_unknown_run_and_empty_run_are_report_errors(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    with pytest.raises(ReportError, match="no run 'nope'"):
        load(store, "nope")
    store.register_run("empty", "{}", "h")
    with pytest.raises(ReportError, match="no rollout record"):
        write_report(store, "empty", tmp_path / "r.html")


def test_the_cli_writes_the_report_and_fails_in_one_line(store: RunStore, tmp_path: Path) -> None:
    env = {"ROLLOUTS_HOME": str(store.root)}
    out = tmp_path / "r.html"
    res = CliRunner().invoke(app, ["report", RUN, "-o", str(out)], env=env)
    assert res.exit_code == 0, res.output
    assert f"to {out}" in res.output and out.read_text().startswith("<!DOCTYPE html>")
    bad = CliRunner().invoke(app, ["report", "nope", "-o", str(out)], env=env)
    assert bad.exit_code == 2 and bad.output.strip().count("\n") == 0 and "no run 'nope'" in bad.output
    missing = CliRunner().invoke(app, ["report", RUN, "-o", str(tmp_path / "no" / "r.html")], env=env)
    assert missing.exit_code == 2 and missing.output.startswith("error:")


def test_reason_labels_group_failures_by_type() -> None:
    label = reason_label("failed", "infra: EngineUnavailable: refused: port 1")
    assert label == "failed: infra: EngineUnavailable"
    assert reason_label("truncated", "max_turns") == "truncated: max_turns"
    assert reason_label("completed", None) == "completed"


def test_ticks_are_round_and_span_the_range() -> None:
    assert nice_ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    ticks = nice_ticks(3, 997)
    assert ticks == [0, 200, 400, 600, 800]  # within the range, one step apart
    assert nice_ticks(5, 5)  # degenerate range: still ticks
