"""The bundled policy's tokenizer and chat template, as vLLM applies them.

Invariant: token ids produced here equal those of ``transformers.AutoTokenizer`` on the same model directory
(``apply_chat_template(..., tokenize=True)`` for messages, ``encode`` for text), so a rollout generated
against the simulated engine holds the same ids it would hold against real vLLM. The tokenizer itself is
the model's ``tokenizer.json`` loaded by the ``tokenizers`` library; only the chat template is rendered here,
in its one fixed shape: ``<|{role}|>{content}<|end|>`` per message, then ``<|assistant|>`` if asked.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

END = "<|end|>"
ASSISTANT = "<|assistant|>"


class SimTokenizer:
    """Encode, decode and render chats with one model's tokenizer."""

    def __init__(self, model_dir: Path) -> None:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{path}: no such tokenizer file (pass --model-dir, a model directory)")
        self._tok = Tokenizer.from_file(str(path))
        end_id = self._tok.token_to_id(END)
        if end_id is None:
            raise ValueError(f"{path}: no {END} token; the simulated engine needs the bundled chat tokens")
        self.eos_id: int = end_id
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)

    @staticmethod
    def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """The chat template: each message as ``<|role|>content<|end|>``, then ``<|assistant|>``."""
        text = "".join(f"<|{m['role']}|>{m['content']}{END}" for m in messages)
        return text + ASSISTANT if add_generation_prompt else text

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token markers in it become their ids (as in vLLM and HF)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD. vLLM's /detokenize keeps special tokens."""
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
