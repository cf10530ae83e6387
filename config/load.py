"""Load a run config from TOML with command-line overrides.

Invariant: any problem with a config file or an override is a ``ConfigError`` whose message is one line
naming the file and the field (``file: section.field: problem``); callers print it and exit with code 2.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from durable_rollouts.config.models import Config
from durable_rollouts.config.paths import is_resource, resource_path
from durable_rollouts.errors import ConfigError


def _one_line(source: str, err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
    msg = first["msg"].replace("\n", " ")
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{source}: {loc}: {msg}{more}"


def parse_override(item: str) -> tuple[list[str], Any]:
    """``section.field=value``; the value is read as a TOML value, else taken as a string."""
    if "=" not in item:
        raise ConfigError(f"--set {item}: expected section.field=value")
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"--set {item}: empty field name")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return path, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item}: {part} is not a section")
            node = child
        node[path[-1]] = value
    return data


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read ``path`` (or the defaults when None), apply overrides, validate.

    Raises:
        ConfigError: one line naming the file (or override) and the field.
    """
    data, source = read_toml(path, overrides)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_one_line(source, e)) from e


def bundled_examples() -> list[str]:
    """The names of the example configs shipped with the package (``math``, ``coding``, ...)."""
    folder = importlib.resources.files("durable_rollouts.config").joinpath("examples")
    return sorted(f.name.removesuffix(".toml") for f in folder.iterdir() if f.name.endswith(".toml"))


def config_file(path: str | Path) -> Path:
    """The config file ``path`` names: a file (absolute, or relative to the working directory), a package
    resource (``PACKAGE:RELATIVE``), or the name of a bundled example (``math``) where no such file exists.

    Raises:
        ConfigError: a bare name that is neither a file nor a bundled example (one line, listing them).
    """
    text = str(path)
    if is_resource(text):
        return resource_path(text, "config")
    candidate = Path(text)
    if candidate.is_file() or "/" in text or text.endswith(".toml"):
        return candidate  # a folder of the same name (``stack/`` in a checkout) is not a config
    if text in bundled_examples():
        return resource_path(f"durable_rollouts.config:examples/{text}.toml", "config")
    raise ConfigError(
        f"{text}: no such config file, and no bundled example of that name "
        f"(bundled: {', '.join(bundled_examples())})"
    )


def read_toml(path: str | Path | None, overrides: list[str] | None = None) -> tuple[dict[str, Any], str]:
    """The TOML at ``path`` (empty when None) with overrides applied, and how errors should name it.

    Raises:
        ConfigError: the file cannot be read or parsed, or an override is malformed (one line).
    """
    source = str(path) if path is not None else "(defaults)"
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(config_file(path).read_text(encoding="utf-8"))
        except OSError as e:
            raise ConfigError(f"{source}: cannot read config: {e.strerror or e}") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{source}: invalid TOML: {e}") from e
    if overrides:
        data = apply_overrides(data, overrides)
        source = f"{source} (with overrides)"
    return data, source


def config_hash(cfg: Config | dict[str, Any]) -> str:
    """Stable hash of the resolved config (lineage: which config produced a record).

    Given the stored JSON object (a dict) it hashes that as stored: a later release whose config gained a
    field (with a default) still finds the hash the run was started with.
    """
    data = cfg if isinstance(cfg, dict) else cfg.model_dump(mode="json")
    canon = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:16]
