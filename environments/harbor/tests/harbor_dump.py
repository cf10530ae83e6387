"""Run by Harbor's own Python (the .venv-harbor venv, Python 3.12, ``harbor==0.25.0``): each task directory
given on the command line loaded with ``harbor.models.task.task.Task`` and its ``task.toml`` with
``TaskConfig.model_validate_toml``; one JSON line each (name, instruction, config dump, and how Harbor
resolves the verifier: its mode, whether its image bundles the tests, the folder its image is built from)
on stdout."""

import json
import sys
import warnings
from pathlib import Path

from harbor.models.task.config import TaskConfig
from harbor.models.task.task import Task
from harbor.models.task.verifier_mode import (
    resolve_task_verifier_mode,
    resolve_verifier_environment_definition,
)

warnings.simplefilter("ignore")
for arg in sys.argv[1:]:
    task = Task(arg)
    config = TaskConfig.model_validate_toml((Path(arg) / "task.toml").read_text())
    assert config.model_dump(mode="json") == task.config.model_dump(mode="json")
    definition = resolve_verifier_environment_definition(task.config, task.paths)
    verifier = {"mode": resolve_task_verifier_mode(task.config).value}
    if definition is not None:
        verifier["bundled"] = definition.bundled_tests
        verifier["directory"] = definition.directory.name
    print(
        json.dumps(
            {
                "dir": arg,
                "name": task.name,
                "instruction": task.instruction,
                "config": task.config.model_dump(mode="json"),
                "verifier": verifier,
            }
        )
    )
