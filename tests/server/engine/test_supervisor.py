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
