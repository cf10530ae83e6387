"""The model gateway for agent harnesses: a harness (mini-swe-agent, terminus-2, OpenHands, ...) runs
unchanged in its rollout's sandbox and calls an OpenAI-compatible API (chat completions, or Responses as
Codex CLI does); each call is a durable, token-exact model call of that rollout.

- ``chat``: the OpenAI shapes, tool-call parsing, and how a conversation maps onto stored tokens (pure).
- ``responses``, ``response_items``: the Responses API as chat calls: its input items converted to the
  conversation a chat call records, its answer read back as output items and stream events (pure).
- ``turn``: one call as a model turn (render, check, sample, store, answer), Temporal-free.
- ``server``: the per-rollout Unix-socket HTTP endpoint in the sandbox host's worker.
- ``harness``: starting, watching and stopping the harness process inside the sandbox.
- ``shim.py``: the loopback TCP shim copied into the sandbox (stdlib only).

The flow of one call: harness -> shim (TCP, loopback) -> the rollout's socket -> ``server`` records the
request (store, ``gateway_calls``) and signals the rollout's workflow -> the workflow runs the
``gateway_call`` activity (``turn``) -> the answer is stored -> ``server`` returns it.
"""
