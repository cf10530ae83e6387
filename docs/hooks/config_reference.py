"""MkDocs hook: renders the configuration reference from the config models' own source.

``docs/configuration.md`` holds the marker ``<!-- config-reference -->``; at build time it is replaced by
one table per TOML section of :class:`config.models.Config`, listing each field's type, default, bounds
and the docstring written under it. The models are read with ``ast`` (nothing is imported), so the page
can never disagree with the code and the docs build needs no installed project. A section whose model
cannot be found fails the build (an exception stops ``mkdocs build``).
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MARKER = "<!-- config-reference -->"
ROOT = Path(__file__).resolve().parents[2]
SOURCES = (
    "config/models.py", "sandboxes/base.py", "sandboxes/egress_policy.py", "sandboxes/pool.py",
    "trainer/settings.py",
)  # fmt: skip
# Sections read by one command only, beside those of config.models.Config: (section, model, note).
EXTRA = [("trainer", "TrainerSettings", "Read by `rollouts train` only, beside the run's sections.")]
BOUNDS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "length ≥", "max_length": "length ≤"}


@dataclass
class Model:
    name: str
    source: str
    bases: list[str]
    doc: str
    # (name, type, default, bounds, doc) per field, in source order
    fields: list[tuple[str, str, str, str, str]] = field(default_factory=list)


def _clean(text: str) -> str:
    """One table cell: docstring lines joined, reST literals as Markdown code, pipes escaped."""
    return " ".join(text.split()).replace("``", "`").replace("|", "\\|")


def _toml(text: str) -> str:
    """A Python default as it is written in TOML (true, "text", [..]); unset for None."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return f"`{text}`"
    if value is None:
        return "unset"
    return f"`{json.dumps(value)}`"


def _type(annotation: ast.expr) -> str:
    """A field's type; a Literal is shown as its TOML values."""
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) == "Literal":
        values = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
        return " or ".join(f"`{json.dumps(ast.literal_eval(v))}`" for v in values)
    return f"`{ast.unparse(annotation)}`"


def _default(value: ast.expr | None, constants: dict[str, str]) -> tuple[str, str]:
    """(default, bounds) of a field's right-hand side: a literal, or Field(default, ge=..., ...)."""
    if value is None:
        return "required", ""
    if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "Field":
        kwargs = {k.arg: k.value for k in value.keywords if k.arg}
        bounds = ", ".join(f"{BOUNDS[k]} {ast.unparse(v)}" for k, v in kwargs.items() if k in BOUNDS)
        if value.args:
            raw = value.args[0]
        elif "default" in kwargs:
            raw = kwargs["default"]
        elif "default_factory" in kwargs:
            factory = kwargs["default_factory"]
            if not isinstance(factory, ast.Lambda):
                return f"`{ast.unparse(factory)}()` (empty)", bounds
            raw = factory.body
        else:
            return "required", bounds
        text = ast.unparse(raw)
        return _toml(constants.get(text, text)), bounds
    text = ast.unparse(value)
    return _toml(constants.get(text, text)), ""


def _models() -> dict[str, Model]:
    models: dict[str, Model] = {}
    for source in SOURCES:
        tree = ast.parse((ROOT / source).read_text(), filename=source)
        constants = {
            t.id: repr(n.value.value)
            for n in tree.body
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [ast.unparse(b) for b in node.bases]
            model = Model(node.name, source, bases, ast.get_docstring(node) or "")
            body = node.body
            for i, stmt in enumerate(body):
                if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
                    continue
                name = stmt.target.id
                if name == "model_config":
                    continue
                nxt = body[i + 1] if i + 1 < len(body) else None
                doc = ""
                if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                    doc = str(nxt.value.value)
                default, bounds = _default(stmt.value, constants)
                model.fields.append((name, _type(stmt.annotation), default, bounds, doc))
            models[node.name] = model
    return models


def _fields(models: dict[str, Model], name: str) -> list[tuple[str, str, str, str, str]]:
    model = models[name]
    inherited = [f for base in model.bases if base in models for f in _fields(models, base)]
    return model.fields + inherited


def render() -> str:
    models = _models()
    out: list[str] = []
    sections = [(s, shown.strip("`"), doc) for s, shown, _d, _b, doc in models["Config"].fields]
    sections += [(s, model, "") for s, model, _note in EXTRA]
    notes = {s: note for s, _model, note in EXTRA}
    for section, type_, _doc in list(sections):  # a field that is a model of its own: a table of its own
        for name, ftype, _d, _b, fdoc in _fields(models, type_) if type_ in models else []:
            if ftype.strip("`") in models:
                sections.append((f"{section}.{name}", ftype.strip("`"), fdoc))
    for section, type_, doc in sections:
        if type_ not in models:
            raise RuntimeError(f"config reference: no model {type_!r} for section [{section}] in {SOURCES}")
        model = models[type_]
        out.append(f"## `[{section}]`\n")
        intro = _clean(doc or model.doc.split("\n\n")[0])
        if intro:
            out.append(f"{intro}\n")
        if section in notes:
            out.append(f"{notes[section]}\n")
        out.append(f"Model: `{type_}` in `{model.source}`.\n")
        out.append("| field | default | type, bounds | meaning |\n|---|---|---|---|")
        for name, ftype, default, bounds, fdoc in _fields(models, type_):
            kind = _clean(ftype) + (f", {bounds}" if bounds else "")
            out.append(f"| `{name}` | {_clean(default)} | {kind} | {_clean(fdoc)} |")
        out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, render())
    return markdown
