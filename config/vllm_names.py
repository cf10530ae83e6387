"""The parser names of the vLLM release the project is tested with (vLLM 0.32), stated here so that a run
config naming one is checked where vLLM is not installed (the machine that submits a run); a unit test
(tests/unit/gateway/test_formats.py) keeps them equal to vLLM's own registries."""

from __future__ import annotations

VLLM_TOOL_CALL_PARSERS = (
    "apertus", "cohere_command3", "cohere_command4", "deepseek_v3", "deepseek_v31", "deepseek_v32",
    "deepseek_v4", "deepseek_v41", "dots", "ernie45", "functiongemma", "gemma4", "gigachat3", "glm45",
    "glm47", "granite", "granite-20b-fc", "granite4", "hermes", "hf", "hunyuan_a13b", "hy_v3", "hy_v4",
    "inkling", "internlm", "jamba", "k2_horizon", "kimi_k2", "kimi_k3", "lfm2", "ling3", "llama3_json",
    "llama4_json", "llama4_pythonic", "longcat", "mimo", "minicpm5", "minimax_m2", "minimax_m3", "mistral",
    "muse_glimmer", "olmo3", "openai", "phi4_mini_json", "plamo3", "poolside_v1", "pythonic", "qwen3_coder",
    "qwen3_json", "qwen3_xml", "seed_oss", "step3", "step3p5", "xlam",
)  # fmt: skip
"""The names ``vllm serve --tool-call-parser`` takes in the vLLM release the project is tested with
(vLLM's ``ToolParserManager``; a test checks the two agree). Stated here so a config is checked where vLLM
is not installed (the machine that submits a run)."""
VLLM_REASONING_PARSERS = (
    "cohere_command3", "cohere_command4", "deepseek_r1", "deepseek_v3", "deepseek_v4", "deepseek_v41",
    "ernie45", "gemma4", "glm45", "glm47", "granite", "granite_thinking_parser", "hf", "holo2",
    "hunyuan_a13b", "hy_v3", "hy_v4", "inkling", "k2_horizon", "kimi_k2", "kimi_k3", "ling3", "mimo",
    "minicpmv", "minimax_m2", "minimax_m2_append_think", "minimax_m3", "mistral", "muse_glimmer",
    "nemotron_v3", "olmo3", "openai_gptoss", "plamo3", "poolside_v1", "qwen3", "seed_oss", "step3",
    "step3p5",
)  # fmt: skip
"""The names ``vllm serve --reasoning-parser`` takes (vLLM's ``ReasoningParserManager``), as above."""
