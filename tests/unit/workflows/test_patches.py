"""The patch policy (workflows/patches.py): every ``workflow.patched`` / ``deprecate_patch`` call in the
workflows names a registered patch, and each call is the one the policy prescribes for `SUPPORTED_FROM`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from durable_rollouts.workflows import patches
from durable_rollouts.workflows.patches import PATCHES, SUPPORTED_FROM, Patch, stage

WORKFLOWS = Path(patches.__file__).parent


def patch_calls() -> list[tuple[str, str, str]]:
    """(file, call name, patch constant) for every ``workflow.patched(X.id)`` and
    ``workflow.deprecate_patch(X.id)`` (or ``patches.X.id``) in workflows/."""
    out = []
    for path in sorted(WORKFLOWS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr not in ("patched", "deprecate_patch"):
                continue
            arg = node.args[0] if node.args else None
            target = arg.value if isinstance(arg, ast.Attribute) and arg.attr == "id" else None
            if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "patches":
                target = ast.Name(target.attr)  # patches.X.id
            if isinstance(target, ast.Name):
                out.append((path.name, node.func.attr, target.id))
            else:
                out.append((path.name, node.func.attr, ast.unparse(arg) if arg is not None else ""))
    return out


def by_constant() -> dict[str, Patch]:
    return {name: value for name, value in vars(patches).items() if isinstance(value, Patch)}


def test_every_call_names_a_registered_patch_by_its_constant() -> None:
    constants = by_constant()
    calls = patch_calls()
    assert calls, "no patch call found: the scan is broken"
    for file, call, name in calls:
        assert name in constants, f"{file}: workflow.{call}({name}): not a Patch of workflows/patches.py"
        assert constants[name] in PATCHES, f"{name} is not listed in PATCHES"
    ids = [p.id for p in PATCHES]
    assert len(ids) == len(set(ids)), "a patch id is registered twice"


def test_each_patch_is_called_as_the_policy_says() -> None:
    constants = by_constant()
    calls: dict[str, set[str]] = {}
    for _, call, name in patch_calls():
        calls.setdefault(constants[name].id, set()).add(call)
    for p in PATCHES:
        wanted = stage(p)
        found = calls.get(p.id, set())
        if wanted == "removed":
            assert not found, f"{p.id} (introduced {p.introduced}) must be removed: {SUPPORTED_FROM=}"
        else:
            assert found == {wanted}, f"{p.id} (introduced {p.introduced}): expected {wanted}, found {found}"


@pytest.mark.parametrize(
    ("introduced", "supported_from", "expected"),
    [
        ("0.3.0", "0.2.0", "patched"),  # some supported history predates it: the old branch stays
        ("0.2.0", "0.2.0", "deprecate_patch"),  # every supported history has it: old branch gone
        ("0.2.0", "0.3.0", "removed"),
        ("0.10.0", "0.9.0", "patched"),  # versions compare as numbers, not text
    ],
)
def test_the_policy(introduced: str, supported_from: str, expected: str) -> None:
    assert stage(Patch("x", introduced, ""), supported_from) == expected


def test_bumping_the_supported_release_retires_this_releases_patches() -> None:
    """At the next release (SUPPORTED_FROM becomes CURRENT) every patch introduced now is to be deprecated,
    and the ones deprecated now are to be removed: the table tells exactly which branches go."""
    after = {p.id: stage(p, patches.CURRENT) for p in PATCHES}
    for p in PATCHES:
        if p.introduced == patches.CURRENT:
            assert after[p.id] == "deprecate_patch"
        elif stage(p) == "deprecate_patch":
            assert after[p.id] == "removed"
