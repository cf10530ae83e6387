"""The README and the documentation site stay whole.

`mkdocs build --strict` (in `make lint`) checks the links inside docs/; these check what it cannot: the
README's own links into docs/ (files and headings), that the generated configuration reference covers
every field of every config section, that no page points a reader at a ticket number, that the home page
lists every page of the nav, and that no user page (every page but docs/development.md, the READMEs) names
a commit: those pages speak to people running the project, not to whoever measured what when.
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


COMMIT = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
"""A commit id as people write one: 7 to 40 hex digits, at least one a digit and one a letter a-f (so
neither a number nor a word such as "defaced")."""


def user_pages() -> list[Path]:
    """The pages written for users: the READMEs and every page of docs/ but the development notes."""
    readmes = [
        ROOT / "README.md",
        *sorted(ROOT.glob("environments/*/README.md")),
        ROOT / "integrations/trl/README.md",
    ]
    docs = [p for p in sorted((ROOT / "docs").rglob("*.md")) if p != ROOT / "docs/development.md"]
    return [p for p in readmes if p.exists()] + docs


def commit_ids(text: str) -> list[str]:
    return COMMIT.findall(text)


def test_the_commit_pattern() -> None:
    assert commit_ids("against cb3230d, one run") == ["cb3230d"]
    assert commit_ids("(e48f5e6)") == ["e48f5e6"]
    assert commit_ids("commit 7c368284829c8633a638004e8db5e997334b9b14") == [
        "7c368284829c8633a638004e8db5e997334b9b14"
    ]
    for clean in (
        "1,032 tests in 2440 s",
        "deadbeef",
        "faced",
        "other_wait_cb3230d.json",
        "v0.2.0",
        "1234567",
    ):
        assert commit_ids(clean) == [], clean


def test_no_commit_ids_in_user_pages() -> None:
    pages = user_pages()
    assert ROOT / "docs/index.md" in pages and ROOT / "docs/development.md" not in pages
    for page in pages:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            found = commit_ids(line)
            assert not found, f"{page.relative_to(ROOT)}:{number}: commit id {found} (name the code instead: "
            "docs/development.md, 'User pages speak to users')"


def nav_pages() -> list[str]:
    """Every page of mkdocs.yml's nav, relative to docs/."""
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1]
    return re.findall(r"^\s*- (?:.*?: )?([\w./-]+\.md)\s*$", nav, re.M)


def unlisted(index_text: str, pages: list[str]) -> list[str]:
    """The pages (other than the index itself) that ``index_text`` does not link to."""
    linked = {t.partition("#")[0] for t in LINK.findall(index_text)}
    return [p for p in pages if p != "index.md" and p not in linked]


def test_the_home_page_lists_every_page_of_the_nav() -> None:
    pages = nav_pages()
    assert {"using.md", "glossary.md", "measurements/cost.md", "development.md"} <= set(pages)
    assert unlisted(
        "[a](using.md), [b](glossary.md#rollout)", ["index.md", "using.md", "glossary.md", "x.md"]
    ) == ["x.md"]
    assert unlisted((ROOT / "docs/index.md").read_text(), pages) == []
