"""Build the bundled tiny policy and its addition task file, reproducibly, on CPU.

The project's tests and demos need a policy that vLLM can serve fully offline, that is small enough
to commit, and whose sampled answers are right only part of the time, so that a group of rollouts of
one task has reward variance. This script builds all of that from scratch in a few minutes:

* ``environments/math/math_env/data/addition.jsonl``: 200 two-digit + two-digit addition tasks
  (``{"id", "prompt", "answer"}``; the math plug-in's bundled task file).
* ``engines/tiny-policy/``: a Hugging Face model directory holding

  - a byte-level tokenizer (every byte is one token, its id equal to the byte's value) with seven
    special tokens and a minimal chat template ``<|role|>content<|end|>`` ... ``<|assistant|>``;
  - a 2-layer ``LlamaForCausalLM`` (hidden size 128, 4 heads of dimension 32, float32);
  - weights trained briefly on the same addition distribution, stopped as soon as the accuracy of
    sampled answers (temperature 1.0) on the bundled tasks lands near 50 %;
  - ``BUILD_INFO.json`` recording the seed, the number of steps, the parameter count and the accuracy.

Everything is seeded and runs single-threaded with deterministic algorithms, so two runs on the same
machine produce the same files. Usage::

    python engines/build_tiny_policy.py [--out engines/tiny-policy] \
        [--tasks-out environments/math/math_env/data/addition.jsonl]
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, BatchEncoding, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path(__file__).resolve().parent / "tiny-policy"
DEFAULT_TASKS_OUT = REPO_ROOT / "environments" / "math" / "math_env" / "data" / "addition.jsonl"

PAD, BOS, END = "<|pad|>", "<|bos|>", "<|end|>"
SPECIAL_TOKENS = [PAD, BOS, END, "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

NUM_TASKS = 200
OPERAND_RANGE = (10, 99)  # two-digit operands, inclusive
MAX_NEW_TOKENS = 8
SAMPLES_PER_TASK = 4  # answers sampled per task at each evaluation (the accuracy is their mean)
TARGET_BAND = (0.45, 0.55)  # stop training at the first evaluation inside this band ...
ACCEPT_BAND = (0.25, 0.75)  # ... and never ship a model outside this one


@dataclass
class TrainConfig:
    """Hyper-parameters of the short supervised training run.

    Attributes:
        seed: Seed for the task list, the initial weights, the batches and the evaluation sampling.
        batch_size: Problems per optimiser step.
        lr: Peak AdamW learning rate (after a linear warm-up).
        warmup_steps: Steps of linear learning-rate warm-up.
        weight_decay: AdamW weight decay.
        eval_every: Steps between two sampled evaluations on the bundled tasks.
        max_steps: Give up (and fail) after this many steps.
    """

    seed: int = 1234
    batch_size: int = 128
    lr: float = 1e-3
    warmup_steps: int = 100
    weight_decay: float = 0.01
    eval_every: int = 10
    max_steps: int = 20_000


@dataclass
class TrainResult:
    """Outcome of :func:`train`.

    Attributes:
        steps: Optimiser steps taken by the shipped weights.
        accuracy: Sampled accuracy of the shipped weights on the bundled tasks.
        history: ``(step, accuracy)`` of every evaluation.
    """

    steps: int
    accuracy: float
    history: list[tuple[int, float]] = field(default_factory=list)


def byte_symbols() -> list[str]:
    """Return GPT-2's printable stand-in character for each byte value 0..255, in byte order.

    Returns:
        A list of 256 single-character strings; ``byte_symbols()[b]`` is the symbol of byte ``b``.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    symbols: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def make_tasks(seed: int, count: int = NUM_TASKS) -> list[dict[str, str]]:
    """Draw distinct ``a+b=`` problems with two-digit operands.

    Args:
        seed: Seed of the draw.
        count: Number of tasks.

    Returns:
        Task dicts with exactly the keys ``id``, ``prompt`` and ``answer``.
    """
    low, high = OPERAND_RANGE
    pairs = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    chosen = random.Random(seed).sample(pairs, count)
    return [
        {"id": f"add-{i:04d}", "prompt": f"{a}+{b}=", "answer": str(a + b)} for i, (a, b) in enumerate(chosen)
    ]


def write_tasks(tasks: list[dict[str, str]], path: Path) -> None:
    """Write tasks as JSONL, one compact object per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(json.dumps(task, separators=(",", ":")) + "\n" for task in tasks), encoding="utf-8"
    )


def write_tokenizer(out: Path) -> PreTrainedTokenizerBase:
    """Write the byte-level tokenizer files into ``out`` and load them back.

    Byte ``b`` gets token id ``b``; the special tokens follow from id 256 on. No bos is prepended and
    there are no merges, so the ids of a rendered chat are exactly its bytes and special tokens.

    Args:
        out: The model directory.

    Returns:
        The tokenizer as ``AutoTokenizer`` loads it from ``out``.
    """
    vocab = {symbol: i for i, symbol in enumerate(byte_symbols())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.save(str(out / "tokenizer.json"))

    special_map = {"bos_token": BOS, "eos_token": END, "pad_token": PAD}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "additional_special_tokens": SPECIAL_TOKENS[3:],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out / "tokenizer_config.json", config)
    _write_json(
        out / "special_tokens_map.json", {**special_map, "additional_special_tokens": SPECIAL_TOKENS[3:]}
    )
    return AutoTokenizer.from_pretrained(str(out))


def check_tokenizer(tok: PreTrainedTokenizerBase) -> None:
    """Fail loudly unless the tokenizer round-trips text and renders chats byte for byte.

    Args:
        tok: The loaded tokenizer.

    Raises:
        AssertionError: If a property the rollout code relies on does not hold.
    """
    ids = {token: tok.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    assert list(ids.values()) == list(range(256, 256 + len(SPECIAL_TOKENS))), ids
    for text in [
        "37+45=",
        "def f(x):\n    return x  # ok\n\n",
        "tabs\tand \r\n crlf",
        "emoji 🙂🚀 ünï 中文",
        " a  b ",
    ]:
        encoded = tok.encode(text, add_special_tokens=False)
        assert encoded == list(text.encode("utf-8")), (text, encoded)
        assert tok.decode(encoded) == text, (text, tok.decode(encoded))
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "37+45="}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(chat, BatchEncoding):  # transformers >= 5 returns a dict by default
        chat = chat["input_ids"]
    assert list(chat) == [ids["<|user|>"], *b"37+45=", ids[END], ids["<|assistant|>"]], chat


def build_model(tok: PreTrainedTokenizerBase, seed: int) -> LlamaForCausalLM:
    """Create the randomly initialised 2-layer Llama policy.

    Args:
        tok: The tokenizer, for the vocabulary size and the special token ids.
        seed: Seed of the initial weights.

    Returns:
        The untrained model, in float32.
    """
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=-(-len(tok) // 64) * 64,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        hidden_act="silu",
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        dtype="float32",
    )
    return LlamaForCausalLM(config).float()


def encode_all_problems(tok: PreTrainedTokenizerBase) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenise every problem of the distribution as a padded training sequence.

    A sequence is the rendered chat prompt, the answer and ``<|end|>``; labels are ``-100`` everywhere
    except on the answer and the final ``<|end|>`` (already shifted by the model's loss).

    Args:
        tok: The tokenizer.

    Returns:
        ``(input_ids, labels)``, both of shape ``(num_problems, max_len)``.
    """
    low, high = OPERAND_RANGE
    rows: list[tuple[list[int], list[int]]] = []
    for a in range(low, high + 1):
        for b in range(low, high + 1):
            prompt = prompt_ids(tok, f"{a}+{b}=")
            answer = [*tok.encode(str(a + b), add_special_tokens=False), tok.eos_token_id]
            rows.append((prompt + answer, [-100] * len(prompt) + answer))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.tensor([ids + [tok.pad_token_id] * (width - len(ids)) for ids, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    return input_ids, labels


def prompt_ids(tok: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Return the token ids of the one-turn chat asking ``prompt``, ending with ``<|assistant|>``."""
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    assert isinstance(rendered, str)
    return tok.encode(rendered, add_special_tokens=False)


@torch.no_grad()
def sampled_accuracy(
    model: LlamaForCausalLM, tok: PreTrainedTokenizerBase, tasks: list[dict[str, str]], seed: int
) -> float:
    """Sample answers (temperature 1.0, full vocabulary) and score exact matches.

    Each task is answered ``SAMPLES_PER_TASK`` times. An answer is the decoded text before the first
    ``<|end|>`` (all of it if there is none), stripped.

    Args:
        model: The policy.
        tok: The tokenizer.
        tasks: Tasks to answer; their prompts must all have the same token length.
        seed: Seed of the sampling generator.

    Returns:
        The fraction of sampled answers that are exactly right.
    """
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    tasks = [task for task in tasks for _ in range(SAMPLES_PER_TASK)]
    ids = torch.tensor([prompt_ids(tok, task["prompt"]) for task in tasks])
    prompt_len = ids.shape[1]
    for _ in range(MAX_NEW_TOKENS):
        logits = model(input_ids=ids).logits[:, -1, :].float()
        next_ids = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        ids = torch.cat([ids, next_ids], dim=1)
    correct = 0
    for task, row in zip(tasks, ids[:, prompt_len:].tolist(), strict=True):
        if tok.eos_token_id in row:
            row = row[: row.index(tok.eos_token_id)]
        answer = tok.decode(row)
        assert isinstance(answer, str)
        correct += answer.strip() == task["answer"]
    model.train(was_training)
    return correct / len(tasks)


def train(
    model: LlamaForCausalLM, tok: PreTrainedTokenizerBase, tasks: list[dict[str, str]], cfg: TrainConfig
) -> TrainResult:
    """Train on random problems until the sampled accuracy on ``tasks`` lands in ``TARGET_BAND``.

    Every ``cfg.eval_every`` steps the model answers every task a few times by sampling. Training stops at
    the first evaluation inside ``TARGET_BAND``. Should one evaluation jump over the band, the weights
    of the evaluation closest to 50 % are restored, provided that one lies in ``ACCEPT_BAND``.

    Args:
        model: The policy, trained in place.
        tok: The tokenizer.
        tasks: The bundled tasks used for evaluation.
        cfg: Hyper-parameters.

    Returns:
        The steps and accuracy of the weights left in ``model``, and the evaluation history.

    Raises:
        RuntimeError: If no evaluation reaches ``ACCEPT_BAND`` within ``cfg.max_steps`` steps.
    """
    inputs, labels = encode_all_problems(tok)
    batches = torch.Generator().manual_seed(cfg.seed + 1)
    optimiser = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimiser, lambda step: min(1.0, (step + 1) / cfg.warmup_steps)
    )
    result, best_state = TrainResult(steps=0, accuracy=0.0), None
    model.train()
    for step in range(1, cfg.max_steps + 1):
        rows = torch.randint(0, inputs.shape[0], (cfg.batch_size,), generator=batches)
        batch = inputs[rows]
        loss = model(input_ids=batch, attention_mask=batch != tok.pad_token_id, labels=labels[rows]).loss
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        schedule.step()
        if step % cfg.eval_every:
            continue
        accuracy = sampled_accuracy(model, tok, tasks, seed=cfg.seed + 2)
        result.history.append((step, accuracy))
        print(f"step {step:5d}  loss {loss.item():.4f}  sampled accuracy {accuracy:.3f}", flush=True)
        if abs(accuracy - 0.5) < abs(result.accuracy - 0.5) and ACCEPT_BAND[0] <= accuracy <= ACCEPT_BAND[1]:
            result.steps, result.accuracy = step, accuracy
            best_state = copy.deepcopy(model.state_dict())
        if TARGET_BAND[0] <= accuracy <= TARGET_BAND[1] or (accuracy > TARGET_BAND[1] and best_state):
            break
    if best_state is None:
        raise RuntimeError(f"sampled accuracy never reached {ACCEPT_BAND}: {result.history}")
    model.load_state_dict(best_state)
    return result


def save_model(model: LlamaForCausalLM, tok: PreTrainedTokenizerBase, out: Path) -> None:
    """Save the weights, the model config and a generation config that stops at ``<|end|>``.

    Args:
        model: The trained policy.
        tok: The tokenizer (already written to ``out``).
        out: The model directory.
    """
    model.save_pretrained(str(out), safe_serialization=True)
    ids = {
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    _write_json(out / "generation_config.json", {**ids, "_from_model_config": False})
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    # Older loaders (transformers 4, older vLLM) read these keys; transformers 5 writes "dtype" and
    # "rope_parameters" and still accepts the old names.
    config.update(torch_dtype="float32", rope_theta=config["rope_parameters"]["rope_theta"])
    _write_json(out / "config.json", config)
    (out / "model.safetensors").chmod(0o644)


def _write_json(path: Path, obj: object) -> None:
    """Write ``obj`` as indented, key-sorted JSON with a trailing newline."""
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="model directory to (re)create")
    parser.add_argument("--tasks-out", type=Path, default=DEFAULT_TASKS_OUT, help="task JSONL file to write")
    parser.add_argument("--seed", type=int, default=TrainConfig.seed, help="seed of everything")
    return parser.parse_args()


def main() -> None:
    """Build the task file and the model directory, then record how they were built."""
    args = parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    started = time.monotonic()
    cfg = TrainConfig(seed=args.seed)

    tasks = make_tasks(cfg.seed)
    write_tasks(tasks, args.tasks_out)
    args.out.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer(args.out)
    check_tokenizer(tok)

    model = build_model(tok, cfg.seed)
    result = train(model, tok, tasks, cfg)
    save_model(model, tok, args.out)
    info = {
        "seed": cfg.seed,
        "steps": result.steps,
        "sampled_accuracy": result.accuracy,
        "sampling": {
            "samples_per_task": SAMPLES_PER_TASK,
            "temperature": 1.0,
            "top_k": None,
            "top_p": None,
            "max_new_tokens": MAX_NEW_TOKENS,
        },
        "num_tasks": len(tasks),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "train_config": vars(cfg),
        "eval_history": {str(step): accuracy for step, accuracy in result.history},
        "torch_version": torch.__version__,
    }
    _write_json(args.out / "BUILD_INFO.json", info)
    print(json.dumps({k: v for k, v in info.items() if k != "eval_history"}, indent=2))
    print(f"built in {time.monotonic() - started:.0f} s: {args.out}, {args.tasks_out}")


if __name__ == "__main__":
    main()
