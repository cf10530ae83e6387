"""The house's structure, checked: no environment named outside the environments, no import cycle between
top-level packages, the layering of the packages below the activities (``turns`` holds a turn's logic with
no Temporal in it), every activity called by reference with its declared options."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

from activities.calls import options_of
from config.paths import REPO_ROOT
from envs import registry

PACKAGES: list[str] = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
    "packages"
]
OUTSIDE_ENVS = [p for p in PACKAGES if p != "envs"] + ["bench"]


def _sources(packages: list[str]) -> list[Path]:
    return [f for p in packages for f in sorted((REPO_ROOT / p).rglob("*.py"))]


def test_no_environment_name_is_compared_outside_the_environments() -> None:
    names = sorted(registry.installed())
    assert {"math", "coding"} <= set(names)
    alt = "|".join(map(re.escape, names))
    compared = re.compile(
        rf"""(==|!=|\bin\b|\bis\b)\s*[\(\[{{]?\s*['"]({alt})['"]|['"]({alt})['"]\s*(==|!=|\bin\b)"""
    )
    hits = [
        f"{f.relative_to(REPO_ROOT)}:{n}: {line.strip()}"
        for f in _sources(OUTSIDE_ENVS)
        for n, line in enumerate(f.read_text().splitlines(), start=1)
        if compared.search(line)
    ]
    assert not hits, "environment names compared outside envs/:\n" + "\n".join(hits)


def _package_imports() -> dict[str, dict[str, str]]:
    """package -> {imported package: first place}, module-level and lazy imports alike."""
    graph: dict[str, dict[str, str]] = {p: {} for p in PACKAGES}
    for p in PACKAGES:
        for f in _sources([p]):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    mods = [node.module]
                else:
                    continue
                for m in mods:
                    top = m.split(".")[0]
                    if top in graph and top != p:
                        graph[p].setdefault(top, f"{f.relative_to(REPO_ROOT)}:{node.lineno}")
    return graph


def test_no_import_cycle_between_top_level_packages() -> None:
    graph = _package_imports()

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    cycles = [f"{a} -> {b} ({where})" for a in graph for b, where in graph[a].items() if reaches(b, a)]
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
    assert not graph["errors"] and set(graph["contracts"]) <= {"config", "sandboxes", "errors"}


TURNS_BELOW = {"contracts", "errors", "config", "sandboxes", "store", "envs"}
"""What ``turns`` may import: the data, the store and the environments. Not ``engines`` (it declares the
engine it needs, ``turns.engine``; the engine client computes its window through ``turns.budget``), nor
anything that runs on Temporal (``activities``, ``workflows``, ``workers``)."""


def test_turns_sit_below_engines_activities_and_workflows_and_import_no_temporal() -> None:
    graph = _package_imports()
    upward = {p: where for p, where in graph["turns"].items() if p not in TURNS_BELOW}
    assert not upward, f"turns imports above its layer: {upward}"
    assert "turns" in graph["activities"] and "turns" in graph["workflows"] and "turns" in graph["engines"]
    temporal = [
        f"{f.relative_to(REPO_ROOT)}:{node.lineno}"
        for f in _sources(["turns"])
        for node in ast.walk(ast.parse(f.read_text()))
        if isinstance(node, ast.Import | ast.ImportFrom)
        and any(
            (m or "").split(".")[0] == "temporalio"
            for m in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module])
        )
    ]
    assert not temporal, f"turns imports temporalio: {temporal}"


def test_workflows_name_no_activity_by_string_and_every_activity_declares_its_options() -> None:
    from workers.worker import build_worker  # noqa: F401  (imports every activity module)

    by_string = re.compile(r"execute_(local_)?activity\(\s*['\"]|\.signal\(\s*['\"]")
    hits = [
        f"{f.relative_to(REPO_ROOT)}:{n}"
        for f in _sources(["workflows"])
        for n, line in enumerate(f.read_text().splitlines(), start=1)
        if by_string.search(line)
    ]
    assert not hits, hits
    from activities.dispatch import DispatchActivities
    from activities.environment import EnvironmentActivities
    from activities.rollout import RolloutActivities
    from activities.sandbox import SandboxActivities

    for cls in (RolloutActivities, EnvironmentActivities, SandboxActivities, DispatchActivities):
        for name, fn in vars(cls).items():
            if hasattr(fn, "__temporal_activity_definition"):
                assert options_of(fn).start_to_close.total_seconds() > 0, f"{cls.__name__}.{name}"
