"""`stack up` asks the engine its logprobs mode once it is healthy (`procs.check_logprob_mode`): that
answers vLLM's slow first ``/server_info`` before a run's first rollouts ask it, and refuses an engine that
serves another mode than the stack declares; an engine without dev mode (404) answers nothing."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from durable_rollouts.stack.procs import StackError, check_logprob_mode

REPLY: dict[str, tuple[int, bytes]] = {}
ASKED: list[str] = []


class Engine(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        ASKED.append(self.path)
        status, body = REPLY["server_info"]
        self.send_response(status)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def engine_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    ASKED.clear()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def config(mode: str) -> bytes:
    return json.dumps({"vllm_config": {"model_config": {"logprobs_mode": mode}}}).encode()


def test_the_declared_mode_passes_and_is_asked_with_the_workers_query(engine_url: str) -> None:
    REPLY["server_info"] = (200, config("processed_logprobs"))
    assert check_logprob_mode(engine_url, "processed_logprobs") == "processed_logprobs"
    assert ASKED == ["/server_info?config_format=json"]


def test_another_mode_is_refused_in_one_line(engine_url: str) -> None:
    REPLY["server_info"] = (200, config("raw_logprobs"))
    with pytest.raises(StackError, match="serves logprobs mode 'raw_logprobs'; the stack declares"):
        check_logprob_mode(engine_url, "processed_logprobs")


def test_an_engine_without_dev_mode_answers_nothing_and_a_broken_reply_is_an_error(engine_url: str) -> None:
    REPLY["server_info"] = (404, b"")
    assert check_logprob_mode(engine_url, "processed_logprobs") is None
    REPLY["server_info"] = (200, b"<html>")
    with pytest.raises(StackError, match="server_info: not JSON"):
        check_logprob_mode(engine_url, "processed_logprobs")
    REPLY["server_info"] = (500, b"")
    with pytest.raises(StackError, match="server_info: HTTP 500"):
        check_logprob_mode(engine_url, "processed_logprobs")
