"""Write the trainer's weights as a complete HF checkpoint directory that the engines can reload.

Invariants (the same as the core's ``trainer/policy_io.py``, restated here because this package never
imports the core in the trainer's process):
- ``model.safetensors`` holds every tensor of the source checkpoint, same names, shapes and dtypes (vLLM's
  in-place reload keeps old values for a missing tensor, which would silently mix versions); a missing
  tensor is an error naming it. Every other file of the source (config, tokenizer) is copied beside it.
- A directory is written under a temporary name and renamed into place; an existing one is never
  overwritten (a version directory is written once).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch

WEIGHTS = "model.safetensors"


class WeightsError(RuntimeError):
    """A checkpoint cannot be written (one line naming the directory or tensor)."""


def save_weights(named: Iterable[tuple[str, torch.Tensor]], source_dir: Path, out_dir: Path) -> Path:
    from safetensors import safe_open
    from safetensors.torch import save_file

    source_dir, out_dir = Path(source_dir), Path(out_dir)
    if out_dir.exists():
        raise WeightsError(f"{out_dir}: already exists; a version directory is written once")
    given = {name: t for name, t in named}
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(source_dir / WEIGHTS), framework="pt") as ref:
        for key in ref.keys():  # noqa: SIM118 (safe_open has no __iter__)
            if key not in given:
                raise WeightsError(f"{source_dir}/{WEIGHTS}: the trainer sent no tensor {key}")
            want = ref.get_slice(key)
            t = given[key].detach().to("cpu")
            if list(t.shape) != list(want.get_shape()):
                raise WeightsError(f"tensor {key}: shape {list(t.shape)}, checkpoint has {want.get_shape()}")
            tensors[key] = t.to(ref.get_tensor(key).dtype).contiguous().clone()
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in sorted(source_dir.iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name != "BUILD_INFO.json":
            shutil.copy2(f, tmp / f.name)
    save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
    tmp.rename(out_dir)
    return out_dir
