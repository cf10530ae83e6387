"""Write the trainer's named tensors as a complete HF checkpoint directory that the engines can reload.

The checkpoint is written by the core's ``durable_rollouts.trainer.policy_io.save_policy`` (its invariants
hold: every tensor of the source checkpoint, same names and dtypes, its other files copied beside it,
written under a temporary name and renamed into place, an existing directory never overwritten). This
module only adapts TRL's ``(name, tensor)`` stream to it, and checks each tensor's shape against the source
checkpoint first (a mis-shaped tensor is refused, naming it).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from durable_rollouts.trainer.policy_io import WEIGHTS, PolicyIOError, save_policy

WeightsError = PolicyIOError
"""A checkpoint cannot be written (one line naming the directory or tensor): the core's ``PolicyIOError``."""


class _Tensors(torch.nn.Module):
    """Named tensors seen as the module ``save_policy`` reads (only its ``state_dict``)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._tensors = tensors

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return self._tensors


def save_weights(named: Iterable[tuple[str, torch.Tensor]], source_dir: Path, out_dir: Path) -> Path:
    """Write ``named`` plus ``source_dir``'s other files to ``out_dir`` (which must not exist).

    Raises:
        WeightsError: ``out_dir`` exists, a tensor of the source checkpoint is missing, or one has
            another shape.
    """
    from safetensors import safe_open

    source_dir, out_dir = Path(source_dir), Path(out_dir)
    given = {name: t.detach().to("cpu") for name, t in named}
    with safe_open(str(source_dir / WEIGHTS), framework="pt") as ref:
        for key in ref.keys():  # noqa: SIM118 (safe_open has no __iter__)
            want = list(ref.get_slice(key).get_shape())
            if key in given and list(given[key].shape) != want:
                raise WeightsError(f"tensor {key}: shape {list(given[key].shape)}, checkpoint has {want}")
    return save_policy(_Tensors(given), source_dir, out_dir)
