"""The README and the documentation site stay whole.

`mkdocs build --strict` (in `make lint`) checks the links inside docs/; these check what it cannot: the
README's own links into docs/ (files and headings), that the generated configuration reference covers
every field of every config section, and that no page points a reader at a ticket number.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

from pydantic import BaseModel

from durable_rollouts.config.models import Config
from durable_rollouts.trainer.settings import TrainerSettings

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """The anchor MkDocs' toc (and GitHub) gives a heading: lower case, punctuation dropped, dashes."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[-\s]+", "-", text)


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # '# comment' lines in code are no headings
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+)$", text, re.M)}


def test_readme_links_resolve() -> None:
    readme = ROOT / "README.md"
    local = [t for t in LINK.findall(readme.read_text()) if not re.match(r"[a-z]+://", t)]
    assert any(t.startswith("docs/") for t in local), "the README links into docs/"
    for target in local:
        path, _, anchor = target.partition("#")
        file = (ROOT / path) if path else readme
        assert file.exists(), f"README.md links to {target}: no such file"
        if anchor:
            assert anchor in _anchors(file), f"README.md links to {target}: no such heading in {path}"


def _render_config_reference() -> str:
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "docs/hooks/config_reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return str(module.render())


def _section(text: str, name: str) -> str:
    match = re.search(rf"^## `\[{name}\]`$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"configuration reference has no section [{name}]"
    return match.group(1)


def test_configuration_reference_covers_every_field() -> None:
    text = _render_config_reference()
    sections: dict[str, type[BaseModel]] = {"trainer": TrainerSettings}
    for name, info in Config.model_fields.items():
        assert isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)
        sections[name] = info.annotation
    for name, model in sections.items():
        body = _section(text, name)
        rows = set(re.findall(r"^\| `(\w+)` \|", body, re.M))
        assert rows == set(model.model_fields), f"[{name}]: reference lists {sorted(rows)}"
    assert '`["http://127.0.0.1:8000"]`' in _section(text, "engine")  # a default_factory's value
    assert '| `placement` | `"local"` | `"local"` or `"hosts"` |' in _section(text, "sandbox_pool")


def test_no_ticket_numbers_in_readme_or_docs() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for page in pages:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            where = f"{page.relative_to(ROOT)}:{number}"
            assert not re.search(r"\bissues?[- ]#?\d+", line, re.I), f"{where}: {line}"
