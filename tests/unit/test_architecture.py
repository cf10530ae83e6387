"""The house's structure, checked: no environment named outside the environments, no plug-in package
imported by the core, no import cycle between top-level packages, every package in its layer and importing
only from the layers below (`LAYERS`: the command line on top, then the worker processes, ...; ``turns``
holds a turn's logic and ``admission`` the run's admission policy, neither with Temporal in it), every
activity called by reference with its declared options. The checks are functions of the import graph, and
tests below feed them graphs with a cycle and with an upward import, so a check that stopped seeing either
would fail."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

from durable_rollouts.activities.calls import options_of
from durable_rollouts.environments import registry
from tests import REPO_ROOT

NAMESPACE = "durable_rollouts"
SETUPTOOLS = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
DOTTED: list[str] = SETUPTOOLS["packages"]
"""Every package the core installs, by its import name (``durable_rollouts.records.report``, ...)."""
PACKAGES: list[str] = sorted({d.split(".")[1] for d in DOTTED if d.count(".") >= 1})
"""The core's top-level packages (``records``, ...), each a folder at the repository's top level."""
OUTSIDE_ENVS = [p for p in PACKAGES if p != "environments"] + ["bench"]
PLUGINS: dict[str, list[str]] = {
    str(f.parent.relative_to(REPO_ROOT)): tomllib.loads(f.read_text())["tool"]["setuptools"]["packages"]
    for f in sorted((REPO_ROOT / "environments").glob("*/pyproject.toml"))
}
"""The environment plug-ins (environments/NAME/, each its own distribution) and their packages."""


def _folders(package: str) -> list[Path]:
    """The folders of a top-level package and its subpackages (not the plug-in distributions that sit
    under ``environments/``, which are not packages of the core)."""
    if package == "bench":
        return [REPO_ROOT / "bench"]
    names = [d for d in DOTTED if d == f"{NAMESPACE}.{package}" or d.startswith(f"{NAMESPACE}.{package}.")]
    return [REPO_ROOT.joinpath(*d.split(".")[1:]) for d in names]


def _sources(packages: list[str]) -> list[Path]:
    return [f for p in packages for folder in _folders(p) for f in sorted(folder.glob("*.py"))]


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
    assert not hits, "environment names compared outside environments/:\n" + "\n".join(hits)


def test_the_core_imports_no_plug_in_package() -> None:
    assert {"math_env", "coding_env", "swe_env"} <= {m for pkgs in PLUGINS.values() for m in pkgs}
    assert not {"math_env", "coding_env"} & set(PACKAGES)  # the bundled environments are plug-ins too
    plugins = {m for pkgs in PLUGINS.values() for m in pkgs}
    hits = [
        f"{f.relative_to(REPO_ROOT)}:{node.lineno}: {m}"
        for f in _sources([*PACKAGES, "bench"])
        for node in ast.walk(ast.parse(f.read_text()))
        for m in _imported(node)
        if m.split(".")[0] in plugins
    ]
    assert not hits, "plug-in packages imported by the core (use environments.registry):\n" + "\n".join(hits)


def _imported(node: ast.AST) -> list[str]:
    """The modules an import statement names (none for any other node, or a relative import)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [node.module]
    return []


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
                    parts = m.split(".")
                    top = parts[1] if parts[0] == NAMESPACE and len(parts) > 1 else parts[0]
                    if top in graph and top != p:
                        graph[p].setdefault(top, f"{f.relative_to(REPO_ROOT)}:{node.lineno}")
    return graph


def _cycles(graph: dict[str, dict[str, str]]) -> list[str]:
    """Every import ``a -> b`` from which ``a`` is reached again (each edge on a cycle, with its place)."""

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

    return [f"{a} -> {b} ({where})" for a in graph for b, where in graph[a].items() if reaches(b, a)]


def test_no_import_cycle_between_top_level_packages() -> None:
    graph = _package_imports()
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
    assert not graph["errors"] and set(graph["contracts"]) <= {"config", "sandboxes", "errors"}


LAYERS: list[tuple[str, set[str]]] = [
    ("the command line", {"cli"}),
    ("the worker processes; the fault kit", {"workers", "faults"}),
    ("the embedded stack; the example trainer", {"stack", "trainer"}),
    ("the workflows (deterministic orchestration)", {"workflows"}),
    ("the activities", {"activities"}),
    ("the engine client; the model gateway", {"engines", "gateway"}),
    ("a turn; records and run reports; the simulated engine", {"turns", "records", "simengine"}),
    ("admission; environments; metrics; the run store", {"admission", "environments", "metrics", "store"}),
    ("the data crossing Temporal", {"contracts"}),
    ("configuration", {"config"}),
    ("sandboxes", {"sandboxes"}),
    ("the error model", {"errors"}),
]
"""The top-level packages, top layer first. A package imports only packages of the layers below its own
(module-level and lazy imports alike): never one of its own layer, never one above. A new package, or an
import a change means to add upward, takes a deliberate edit here."""


def _upward(graph: dict[str, dict[str, str]], layers: list[tuple[str, set[str]]]) -> list[str]:
    """Every import ``a -> b`` where ``b`` is not in a layer below ``a``'s, with its place."""
    depth = {p: i for i, (_, members) in enumerate(layers) for p in members}
    return [
        f"{a} -> {b} ({where}): {layers[depth[a]][0]!r} may not import {layers[depth[b]][0]!r}"
        for a in graph
        for b, where in graph[a].items()
        if depth[b] <= depth[a]
    ]


def test_every_package_has_one_layer() -> None:
    placed = [p for _, members in LAYERS for p in members]
    assert sorted(placed) == sorted(PACKAGES), "LAYERS and [tool.setuptools] packages differ"
    assert len(placed) == len(set(placed)), "a package in two layers"


def test_every_package_imports_only_the_layers_below_its_own() -> None:
    upward = _upward(_package_imports(), LAYERS)
    assert not upward, "imports that are not downward:\n" + "\n".join(upward)
    graph = _package_imports()
    assert not any("cli" in graph[p] for p in graph)  # the command line is a view; nothing calls it
    assert "stack" in graph["workers"] and "workers" in graph["cli"]


def test_the_checks_see_a_cycle_and_an_upward_import() -> None:
    layers = [("top", {"a"}), ("middle", {"b"}), ("bottom", {"c"})]
    clean = {"a": {"b": "a.py:1", "c": "a.py:2"}, "b": {"c": "b.py:1"}, "c": {}}
    assert _cycles(clean) == [] and _upward(clean, layers) == []
    cycle = {"a": {"b": "a.py:1"}, "b": {"c": "b.py:1"}, "c": {"a": "c.py:1"}}
    assert sorted(_cycles(cycle)) == ["a -> b (a.py:1)", "b -> c (b.py:1)", "c -> a (c.py:1)"]
    assert _upward(cycle, layers) == ["c -> a (c.py:1): 'bottom' may not import 'top'"]
    sideways = {"a": {}, "b": {}, "c": {}, "d": {"c": "d.py:1"}}
    assert _upward(sideways, [*layers[:2], ("bottom", {"c", "d"})]) == [
        "d -> c (d.py:1): 'bottom' may not import 'bottom'"
    ]
    real = _package_imports()
    assert _upward({**real, "errors": {"cli": "errors/x.py:1"}}, LAYERS) == [
        "errors -> cli (errors/x.py:1): 'the error model' may not import 'the command line'"
    ]
    assert _cycles({**real, "errors": {"cli": "errors/x.py:1"}})  # cli imports errors: now a cycle


def _temporal_imports(package: str) -> list[str]:
    """Where ``package`` imports temporalio (file:line), module-level and lazy imports alike."""
    return [
        f"{f.relative_to(REPO_ROOT)}:{node.lineno}"
        for f in _sources([package])
        for node in ast.walk(ast.parse(f.read_text()))
        if isinstance(node, ast.Import | ast.ImportFrom)
        and any(
            (m or "").split(".")[0] == "temporalio"
            for m in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module])
        )
    ]


ADMISSION_BELOW = {"config", "contracts"}
"""What ``admission`` may import: the config models and the data it decides on. It is the run's admission
policy as pure functions and state machines, called inside the workflows' sandbox and replayed."""


def test_admission_is_pure_policy_below_the_workflows_and_imports_no_temporal() -> None:
    graph = _package_imports()
    assert set(graph["admission"]) <= ADMISSION_BELOW, graph["admission"]
    assert "admission" in graph["workflows"]
    temporal = _temporal_imports("admission")
    assert not temporal, f"admission imports temporalio: {temporal}"


TURNS_BELOW = {"contracts", "errors", "config", "sandboxes", "store", "environments"}
"""What ``turns`` may import: the data, the store and the environments. Not ``engines`` (it declares the
engine it needs, ``turns.engine``; the engine client computes its window through ``turns.budget``), nor
anything that runs on Temporal (``activities``, ``workflows``, ``workers``)."""


def test_turns_sit_below_engines_activities_and_workflows_and_import_no_temporal() -> None:
    graph = _package_imports()
    upward = {p: where for p, where in graph["turns"].items() if p not in TURNS_BELOW}
    assert not upward, f"turns imports above its layer: {upward}"
    assert "turns" in graph["activities"] and "turns" in graph["workflows"] and "turns" in graph["engines"]
    temporal = _temporal_imports("turns")
    assert not temporal, f"turns imports temporalio: {temporal}"


def test_workflows_name_no_activity_by_string_and_every_activity_declares_its_options() -> None:
    from durable_rollouts.workers.worker import build_worker  # noqa: F401  (imports every activity module)

    by_string = re.compile(r"execute_(local_)?activity\(\s*['\"]|\.signal\(\s*['\"]")
    hits = [
        f"{f.relative_to(REPO_ROOT)}:{n}"
        for f in _sources(["workflows"])
        for n, line in enumerate(f.read_text().splitlines(), start=1)
        if by_string.search(line)
    ]
    assert not hits, hits
    from durable_rollouts.activities.dispatch import DispatchActivities
    from durable_rollouts.activities.environment import EnvironmentActivities
    from durable_rollouts.activities.rollout import RolloutActivities
    from durable_rollouts.activities.sandbox import SandboxActivities

    for cls in (RolloutActivities, EnvironmentActivities, SandboxActivities, DispatchActivities):
        for name, fn in vars(cls).items():
            if hasattr(fn, "__temporal_activity_definition"):
                assert options_of(fn).start_to_close.total_seconds() > 0, f"{cls.__name__}.{name}"
