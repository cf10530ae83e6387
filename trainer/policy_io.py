"""Load the policy a version was published from, and save new weights as a complete HF checkpoint.

Invariants:
- A saved version directory is complete and self-describing: ``model.safetensors`` holds every tensor of
  the source checkpoint (same names, shapes and dtypes; vLLM's in-place reload keeps old values for missing
  tensors, so a partial file would silently mix versions), and every other file of the source directory
  (config, generation config, tokenizer, chat template) is copied beside it.
- A directory is written under a temporary name and renamed into place, so a crash never leaves a
  half-written version directory under its final name; an existing directory is never overwritten.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS = "model.safetensors"


class PolicyIOError(RuntimeError):
    """A checkpoint cannot be loaded or saved (one line naming the directory)."""


def load_policy(weights_dir: Path) -> torch.nn.Module:
    """The HF causal LM in ``weights_dir`` in float32, in training mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if not (Path(weights_dir) / "config.json").is_file() or not (Path(weights_dir) / WEIGHTS).is_file():
        raise PolicyIOError(f"{weights_dir}: needs config.json and {WEIGHTS}")
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(weights_dir), dtype=torch.float32)
    model.train()
    return model


def save_policy(model: torch.nn.Module, source_dir: Path, out_dir: Path) -> Path:
    """Write ``model``'s weights plus ``source_dir``'s other files to ``out_dir`` (which must not exist).

    Returns:
        ``out_dir``.

    Raises:
        PolicyIOError: ``out_dir`` exists, or the model's tensors do not match the source checkpoint's names.
    """
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    if out_dir.exists():
        raise PolicyIOError(f"{out_dir}: already exists; a version directory is written once")
    reference = load_file(source_dir / WEIGHTS)
    state = model.state_dict()
    missing = sorted(set(reference) - set(state))
    if missing:
        raise PolicyIOError(f"{source_dir}/{WEIGHTS}: model has no tensor {missing[0]}")
    tensors = {k: state[k].detach().to(reference[k].dtype).contiguous().clone() for k in reference}
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in sorted(source_dir.iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name != "BUILD_INFO.json":
            shutil.copy2(f, tmp / f.name)
    save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
    tmp.rename(out_dir)
    return out_dir
