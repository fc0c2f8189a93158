"""The supervisor's watch does not end silently: an engine that answers /health and then drops the
connection (a transport error where vLLM's model list should come) leaves the state visible.

A vLLM that dies between /health and /v1/models is a race the real engine cannot be made to hit
on demand, so the child here is a small HTTP server at the process boundary; the supervisor,
process handling and HTTP client are the real ones."""

from __future__ import annotations

import asyncio
import sys
import time

from agentkv.server.config import ServeConfig
from agentkv.server.engine.process import EngineProcess
from agentkv.server.engine.supervisor import EngineState, Supervisor

DROPS_AFTER_HEALTH = r"""
import http.server, socket, socketserver, sys

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/health":
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:  # no answer: the connection is cut
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

    def log_message(self, *args):
        pass

socketserver.UnixStreamServer(sys.argv[1], Handler).serve_forever()   # where vLLM's --uds would listen
"""


class DropsAfterHealth(EngineProcess):
    def argv(self) -> list[str]:
        return [sys.executable, "-c", DROPS_AFTER_HEALTH, self.socket_path]


def test_a_transport_error_at_launch_is_a_visible_failure(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTKV_HOME", str(tmp_path))

    async def run() -> Supervisor:
        sup = Supervisor(ServeConfig(model=str(tmp_path), device="cpu", engine_startup_timeout_s=60),
                         engine_factory=DropsAfterHealth)
        sup.start()
        deadline = time.monotonic() + 90
        while sup.state is EngineState.STARTING and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        return sup

    sup = asyncio.run(run())
    assert sup.state is EngineState.FAILED and not sup.alive()   # /health/live turns 503, no hang
    assert sup.error.startswith("ServerDisconnectedError: "), sup.error
    assert sup.engine.proc.returncode is not None and sup.client is None   # the child was stopped


FINISHED_ANSWER = r"""
import http.server, json, socketserver, sys

# an engine that has finished every request: nothing running or waiting, counters still
METRICS = ('vllm:num_requests_running{engine="0"} 0.0\nvllm:num_requests_waiting{engine="0"} 0.0\n'
           'vllm:generation_tokens_total{engine="0"} 4000.0\nvllm:prompt_tokens_total{engine="0"} 90.0\n').encode()

class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _send(self, body, kind):
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(json.dumps({"data": [{"id": "m", "max_model_len": 4096}]}).encode(), "application/json")
        elif self.path == "/metrics":
            self._send(METRICS, "text/plain")
        else:
            self._send(b"", "text/plain")

    def do_POST(self):   # the whole answer written at once, as vLLM writes what it generated: 8 MB
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        try:
            for _ in range(2000):
                self.wfile.write(b"data: " + b"x" * 4000 + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")
        except OSError:
            pass

    def log_message(self, *args):
        pass

class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

Server(sys.argv[1], Handler).serve_forever()   # where vLLM's --uds would listen
"""


class FinishedAnswer(EngineProcess):
    def argv(self) -> list[str]:
        return [sys.executable, "-c", FINISHED_ANSWER, self.socket_path]


def test_a_client_that_stops_reading_does_not_get_a_healthy_engine_killed(tmp_path, monkeypatch):
    """Issue 51, W1: the engine wrote its whole answer and reports nothing running; the front's
    relay took the first chunk and its client reads no more (a laptop that slept). Before, the
    request counted as in flight until the client read it all, the counters stood still, and the
    watchdog killed the engine after the bound (and each relaunch after it). Now nothing awaits
    the engine, so nothing is stuck: the same engine serves after four bounds."""
    monkeypatch.setenv("AGENTKV_HOME", str(tmp_path))

    async def run() -> tuple[Supervisor, object, float]:
        sup = Supervisor(ServeConfig(model=str(tmp_path), device="cpu", engine_startup_timeout_s=60,
                                     engine_stall_s=2), engine_factory=FinishedAnswer)
        sup.start()
        deadline = time.monotonic() + 90
        while sup.state is not EngineState.READY and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert sup.state is EngineState.READY, sup.error
        engine = sup.engine
        resp = await sup.client.post_stream("/v1/chat/completions", {"model": "m", "stream": True})
        first = await resp.chunks().__anext__()           # the relay's first chunk, then no more reads
        assert first.startswith(b"data: ")
        awaiting = sup.client.awaiting.n
        await asyncio.sleep(8)                             # four stall bounds with the answer unread
        state, same = sup.state, sup.engine is engine
        resp.close()
        await sup.stop()
        return state, same, awaiting

    state, same, awaiting = asyncio.run(run())
    assert awaiting == 0                                  # answered: no longer awaiting the engine
    assert state is EngineState.READY and same            # not declared stuck, not relaunched


def test_a_request_of_a_relaunched_engine_is_its_503_not_a_500(tmp_path):
    """Issue 51, W4: a route holds the client of the engine it started with; the engine is
    relaunched meanwhile (its client closed): its request is ``EngineUnavailable`` (the routes'
    503 ``engine_unavailable`` with Retry-After), not aiohttp's RuntimeError (a 500)."""
    import pytest

    from agentkv.server.engine.client import EngineClient, EngineUnavailable
    from agentkv.server.pipeline.engine_call import unreachable

    async def run():
        client = EngineClient(str(tmp_path / "engine.sock"), "secret")
        await client.aclose()
        with pytest.raises(EngineUnavailable) as exc:
            await client.post_json("/v1/chat/completions", {"model": "m"})
        return exc.value

    refusal = unreachable(asyncio.run(run()))
    assert refusal.status == 503 and refusal.body["error"]["code"] == "engine_unavailable"
    assert refusal.headers == {"Retry-After": "10"}
