"""The math environment: a prompt, a sampled answer, and a verifier reward of 1 or 0.

Multi-turn when the run allows more than one turn: a wrong answer gets the observation RETRY_PROMPT and
another attempt, until the answer is right or the attempts run out. The reward is the last attempt's.
"""

from __future__ import annotations

ENV_VERSION = "math-v1"
"""Version of the environment's behaviour (prompt rendering, RETRY_PROMPT, turn rules); every record carries
it (``lineage.env_version``). Bump it whenever that behaviour changes."""
VERIFIER_VERSION = "math-exact-v1"
"""Version of the reward function (``normalize``/``verify``); recorded as ``lineage.verifier_version``.
Bump it whenever a reward could change."""
RETRY_PROMPT = "Wrong, try again."


def normalize(text: str) -> str:
    """Compare answers without surrounding whitespace or a trailing period."""
    return text.strip().rstrip(".").strip()


def verify(output: str, answer: str) -> float:
    """1.0 if the model's output is exactly the answer (after normalization), else 0.0."""
    return 1.0 if normalize(output) == normalize(answer) else 0.0
