"""The run report: one self-contained HTML page of inline-SVG plots (``rollouts report RUN -o FILE``).

Invariants:
- Self-contained: the page holds its CSS, its SVG and one tiny inline script (it marks the page rendered
  for a headless check); nothing refers to a network or file resource, so it views offline anywhere.
- Polyglot: the page (after its doctype) is well-formed XML, every text escaped.
- Every plot of :data:`PLOTS` is present, each as ``<figure id=...>`` with an ``<svg>``; a plot with
  nothing to show (no trainer, fixed concurrency) says so inside its figure instead of disappearing.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from html import escape
from statistics import mean

from durable_rollouts.records.report import svg
from durable_rollouts.records.report.data import RunData
from durable_rollouts.records.timing import COMPONENTS, totals_by_env

PLOTS = {
    "time-by-env": "Time decomposition by environment",
    "length-by-outcome": "Rollout length by outcome",
    "end-reasons": "Truncation and failure rates by reason",
    "reward-distribution": "Reward distribution",
    "group-variance": "Within-group reward spread",
    "zero-variance": "Zero-variance groups",
    "trainer-tokens": "Tokens that reached the trainer",
    "offpolicy": "Behaviour logprobs against the trainer's",
    "admission": "Admission cap against KV usage",
    "timeline": "Rollouts across replicas",
}
"""Figure id -> title of every plot the report has, in page order."""

PART_COLORS = {
    "generation_s": "#4e79a7",
    "environment_s": "#f28e2b",
    "reward_s": "#59a14f",
    "transfer_s": "#b07aa1",
    "other_s": "#bab0ac",
}
"""One colour per time component (``other`` = wall time in none of them: orchestration)."""

_CSS = """
body { font-family: sans-serif; margin: 24px auto; max-width: 1320px; color: #222; background: #fff; }
h1 { font-size: 22px; margin-bottom: 4px; }
.sub { color: #666; margin-top: 0; }
.tiles { display: flex; flex-wrap: wrap; gap: 10px; margin: 16px 0; }
.tile { border: 1px solid #ddd; border-radius: 6px; padding: 8px 12px; min-width: 110px; }
.tile b { display: block; font-size: 18px; }
.tile span { color: #666; font-size: 12px; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(640px, 1fr)); gap: 18px; }
figure { margin: 0; border: 1px solid #e3e3e3; border-radius: 6px; padding: 10px; }
figure.wide { grid-column: 1 / -1; }
figcaption { font-weight: bold; margin-bottom: 4px; }
figure p { color: #555; font-size: 12px; margin: 2px 0 8px; }
svg { max-width: 100%; height: auto; }
table { border-collapse: collapse; font-size: 12px; margin-top: 8px; }
td, th { border-bottom: 1px solid #eee; padding: 3px 8px; text-align: right; }
td:first-child, th:first-child { text-align: left; }
"""

_SCRIPT = (
    'var figs = document.querySelectorAll("figure");'
    'var drawn = document.querySelectorAll("figure svg");'
    'if (figs.length === drawn.length) { document.documentElement.setAttribute("data-rendered", "ok"); }'
)
"""Marks the page rendered once every figure holds its SVG (a headless browser's check)."""


def _t(s: object) -> str:
    return escape(str(s), quote=True)


def reason_label(outcome: str, reason: str | None) -> str:
    """A short, groupable label of why a rollout ended (a failure's message is cut after its type)."""
    if not reason:
        return outcome
    parts = [p.strip() for p in reason.split(":")]
    short = ": ".join(parts[:2]) if outcome == "failed" else parts[0]
    return f"{outcome}: {short[:48]}"


def _figure(fid: str, chart: str, note: str = "", wide: bool = False, extra: str = "") -> str:
    cls = ' class="wide"' if wide else ""
    p = f"<p>{_t(note)}</p>" if note else ""
    return f'<figure id="{fid}"{cls}><figcaption>{_t(PLOTS[fid])}</figcaption>{p}{chart}{extra}</figure>'


def _time_by_env(d: RunData) -> str:
    totals = totals_by_env((r.env, r.time) for r in d.rollouts)
    rows = []
    for env, t in totals.items():
        shares = t.shares()
        parts = [(k.removesuffix("_s"), shares[k] or 0.0, PART_COLORS[k]) for k in (*COMPONENTS, "other_s")]
        rows.append((env, parts if t.wall_s else []))
    chart = svg.stacked_bars(
        rows, PLOTS["time-by-env"], "share of the rollouts' summed wall time", percent=True
    )
    head = "".join(f"<th>{_t(k.removesuffix('_s'))}</th>" for k in (*COMPONENTS, "other_s"))
    body = []
    for env, t in totals.items():
        vals = {**t.seconds, "other_s": t.other_s}
        cells = "".join(f"<td>{vals[k]:.1f}</td>" for k in (*COMPONENTS, "other_s"))
        wait = t.mean_trainer_wait_s
        body.append(
            f"<tr><td>{_t(env)}</td><td>{t.rollouts}</td><td>{t.wall_s:.1f}</td>{cells}"
            f"<td>{'-' if wait is None else f'{wait:.1f}'}</td></tr>"
        )
    table = (
        f"<table><tr><th>env (seconds)</th><th>rollouts</th><th>wall</th>{head}<th>trainer wait (mean)</th>"
        f"</tr>{''.join(body)}</table>"
    )
    note = (
        "generation = queue + model; environment = env steps (every sandbox command) + sandbox setup;"
        " reward = scoring; transfer = run-store reads and writes; other = orchestration"
    )
    return _figure("time-by-env", chart, note, extra=table)


def _length_by_outcome(d: RunData) -> str:
    by: dict[str, list[float]] = defaultdict(list)
    for r in d.rollouts:
        by[r.outcome].append(float(r.sampled_tokens))
    rows = [(k, v, svg.OUTCOME_COLORS.get(k, svg.PALETTE[0])) for k, v in sorted(by.items())]
    chart = svg.strips(rows, PLOTS["length-by-outcome"], "sampled tokens per rollout")
    return _figure("length-by-outcome", chart, "each dot a rollout; bar = median, band = quartiles")


def _end_reasons(d: RunData) -> str:
    n = len(d.rollouts)
    counts = Counter(reason_label(r.outcome, r.reason) for r in d.rollouts if r.outcome != "completed")
    rows = [
        (label, k / n, svg.OUTCOME_COLORS.get(label.split(":")[0], svg.PALETTE[0]))
        for label, k in counts.most_common(12)
    ]
    chart = svg.bars(rows, PLOTS["end-reasons"], "share of all rollouts", percent=True)
    note = (
        f"{sum(counts.values())} of {n} rollouts did not complete"
        if counts
        else f"all {n} rollouts completed"
    )
    return _figure("end-reasons", chart if rows else svg.empty(PLOTS["end-reasons"], "none"), note)


def _reward_distribution(d: RunData) -> str:
    rewards = [r.reward for r in d.rollouts if r.reward is not None]
    chart = svg.histogram(rewards, PLOTS["reward-distribution"], "reward of scorable rollouts", bins=20)
    note = f"{len(rewards)} scorable rollouts, mean {mean(rewards):.3f}" if rewards else "no scorable rollout"
    return _figure("reward-distribution", chart, note)


def _group_variance(d: RunData) -> str:
    stds = [float(g["reward_std"]) for g in d.groups if g.get("reward_std") is not None]
    chart = svg.histogram(stds, PLOTS["group-variance"], "reward standard deviation within a group", bins=20,
                          color=svg.PALETTE[6])  # fmt: skip
    return _figure("group-variance", chart, f"{len(stds)} groups with scorable members")


def _zero_variance(d: RunData) -> str:
    n = len(d.groups)
    zero = sum(1 for g in d.groups if g.get("zero_variance"))
    rows = (
        [("groups", [("zero variance", zero / n, "#e15759"), ("with signal", (n - zero) / n, "#59a14f")])]
        if n
        else []
    )
    chart = svg.stacked_bars(rows, PLOTS["zero-variance"], "share of closed groups", percent=True)
    note = (
        f"{zero} of {n} groups have equal rewards (advantages 0: no learning signal)"
        if n
        else "no closed group"
    )
    return _figure("zero-variance", chart, note)


def _trainer_tokens(d: RunData) -> str:
    t0 = d.created_at
    gen, acc = [(0.0, 0.0)], 0.0
    for r in sorted(d.rollouts, key=lambda r: r.finished_at):
        acc += r.sampled_tokens
        gen.append((r.finished_at - t0, acc))
    series = [svg.Series("generated", gen, svg.PALETTE[0])]
    consumed, discarded, c, x = [(0.0, 0.0)], [(0.0, 0.0)], 0.0, 0.0
    for m in d.feed:
        if m["state"] == "consumed":
            c += m["tokens"]
            consumed.append((m["at"] - t0, c))
        else:
            x += m["tokens"]
            discarded.append((m["at"] - t0, x))
    series.append(svg.Series("consumed by the trainer", consumed, svg.PALETTE[2]))
    if len(discarded) > 1:
        series.append(svg.Series("discarded (stale, zero variance)", discarded, svg.PALETTE[3]))
    chart = svg.lines(
        series, PLOTS["trainer-tokens"], "seconds since the run started", "sampled tokens (cumulative)"
    )
    total = gen[-1][1]
    note = (
        f"{c:.0f} of {total:.0f} sampled tokens reached a trainer ({c / total:.0%})"
        if d.feed and total
        else "no group has been taken by a trainer (rollouts feed / rollouts train)"
    )
    return _figure("trainer-tokens", chart, note)


def _offpolicy(d: RunData) -> str:
    """Per consumed batch: |Δ logprob| between the engine's behaviour logprobs and the trainer's
    recomputation (all tokens, and those sampled by the version the trainer held: ~0 when they agree)."""
    t0 = d.created_at
    ev = [e for e in d.evidence if e.get("tokens")]
    pts = {k: [(e["at"] - t0, float(e[k])) for e in ev if e.get(k) is not None]
           for k in ("mean_abs_dlogp", "max_abs_dlogp", "lag0_mean_abs_dlogp", "ratio_p99")}  # fmt: skip
    series = [
        svg.Series("mean |Δ logprob|", pts["mean_abs_dlogp"], svg.PALETTE[0], step=False),
        svg.Series("mean |Δ logprob|, lag 0", pts["lag0_mean_abs_dlogp"], svg.PALETTE[2], step=False),
        svg.Series("max |Δ logprob|", pts["max_abs_dlogp"], svg.PALETTE[3], step=False),
        svg.Series("importance ratio p99", pts["ratio_p99"], svg.PALETTE[4], right_axis=True, step=False),
    ]
    if not ev:
        chart = svg.empty(PLOTS["offpolicy"], "no trainer reported evidence (the TRL integration does)")
        return _figure("offpolicy", chart, "no off-policy evidence")
    chart = svg.lines(series, PLOTS["offpolicy"], "seconds since the run started", "nats",
                      y2_axis="importance ratio")  # fmt: skip
    flagged = [e for e in ev if e.get("flagged")]
    worst = max(float(e.get("ratio_max") or 0.0) for e in ev)
    note = (
        f"{len(ev)} batches, {sum(int(e['tokens']) for e in ev)} tokens recomputed by the trainer;"
        f" {len(flagged)} flagged (lag-0 mean |Δ| over the tolerance); largest importance ratio {worst:.3g}"
    )
    if flagged and flagged[-1].get("flag"):
        note += f"; last flag: {flagged[-1]['flag']}"
    return _figure("offpolicy", chart, note)


def _admission(d: RunData) -> str:
    t0 = d.created_at
    log = d.dispatch
    cap = [(e["at"] - t0, float(e["cap"])) for e in log]
    inflight = [(e["at"] - t0, float(e["inflight"])) for e in log]
    kv = [(e["at"] - t0, float(e["kv_usage"])) for e in log if e.get("kv_usage") is not None]
    series = [
        svg.Series("cap (rollouts)", cap, svg.PALETTE[0]),
        svg.Series("in flight (rollouts)", inflight, svg.PALETTE[4]),
        svg.Series("KV usage", kv, svg.PALETTE[3], right_axis=True, step=False),
    ]
    if not log:
        chart = svg.empty(PLOTS["admission"], "no dispatch log: the run used a fixed in-flight cap")
    else:
        axis = "KV cache usage (max over engines)"
        chart = svg.lines(series, PLOTS["admission"], "seconds since the run started", "rollouts",
                          y2_axis=axis, y2_max=1.0, width=svg.WIDE)  # fmt: skip
    note = f"{len(log)} dispatcher polls" if log else "admission.enabled = false"
    return _figure("admission", chart, note, wide=True)


def _timeline(d: RunData) -> str:
    t0 = d.created_at
    lanes: dict[str, list[svg.Span]] = defaultdict(list)
    for r in d.rollouts:
        s, e = r.time.get("started_at"), r.time.get("ended_at")
        if s is None or e is None:
            continue
        why = f" ({r.reason})" if r.reason else ""
        title = f"{r.rollout_id}: {r.outcome}{why}, {e - s:.1f}s, {r.turns} turns"
        lanes[r.replica or "no replica"].append(
            svg.Span(s - t0, e - t0, svg.OUTCOME_COLORS.get(r.outcome, svg.PALETTE[0]), title[:200])
        )
    keys = list(svg.OUTCOME_COLORS.items())
    chart = svg.timeline(sorted(lanes.items()), PLOTS["timeline"], "seconds since the run started", keys,
                         width=svg.WIDE)  # fmt: skip
    note = "one bar per rollout (from its start to its record), one band per engine replica"
    return _figure("timeline", chart, note, wide=True)


def _tiles(d: RunData) -> str:
    n = len(d.rollouts)
    outcomes = Counter(r.outcome for r in d.rollouts)
    rewards = [r.reward for r in d.rollouts if r.reward is not None]
    sampled = sum(r.sampled_tokens for r in d.rollouts)
    consumed = sum(m["tokens"] for m in d.feed if m["state"] == "consumed")
    zero = sum(1 for g in d.groups if g.get("zero_variance"))
    ends = [r.time["ended_at"] for r in d.rollouts if r.time.get("ended_at") is not None]
    tiles = [
        ("rollouts", f"{n}"),
        ("groups", f"{len(d.groups)}"),
        *((k, f"{v} ({v / n:.0%})") for k, v in sorted(outcomes.items())),
        ("mean reward", f"{mean(rewards):.3f}" if rewards else "-"),
        ("zero-variance groups", f"{zero / len(d.groups):.0%}" if d.groups else "-"),
        ("sampled tokens", svg.fmt(sampled)),
        ("to the trainer", svg.fmt(consumed)),
        ("run span", f"{max(ends) - d.created_at:.0f}s" if ends else "-"),
    ]
    return '<div class="tiles">' + "".join(f'<div class="tile"><b>{_t(v)}</b><span>{_t(k)}</span></div>'
                                           for k, v in tiles) + "</div>"  # fmt: skip


def render(d: RunData) -> str:
    """The report page of one run (see the module invariants)."""
    run_cfg = d.config.get("run", {}) if isinstance(d.config.get("run"), dict) else {}
    envs = ", ".join(d.envs)
    made = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(d.created_at))
    sub = (
        f"env {envs} · {run_cfg.get('num_groups', '?')} groups × {run_cfg.get('group_size', '?')} ·"
        f" started {started} · report made {made}"
    )
    figures = [
        _time_by_env(d),
        _length_by_outcome(d),
        _end_reasons(d),
        _reward_distribution(d),
        _group_variance(d),
        _zero_variance(d),
        _trainer_tokens(d),
        _offpolicy(d),
        _admission(d),
        _timeline(d),
    ]
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8"/>'
        '<meta name="viewport" content="width=device-width, initial-scale=1"/>'
        f"<title>{_t(f'rollouts report: {d.run_id}')}</title><style>{_CSS}</style></head><body>"
        f'<h1>{_t(f"Run {d.run_id}")}</h1><p class="sub">{_t(sub)}</p>'
        f'{_tiles(d)}<div class="grid">{"".join(figures)}</div>'
        f"<script>{_SCRIPT}</script></body></html>\n"
    )
