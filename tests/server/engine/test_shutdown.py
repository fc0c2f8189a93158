"""SIGTERM stops the server cleanly and reaps the vLLM engine and its workers. Runs last."""

from __future__ import annotations

import signal

import psutil
import pytest


@pytest.mark.last
def test_sigterm_exits_cleanly_and_reaps_engine(server):
    descendants = psutil.Process(server.proc.pid).children(recursive=True)
    assert descendants, "the vLLM engine should be running under the server"
    # uvicorn re-raises the signal it handled once shutdown is complete: -SIGTERM is a clean exit.
    assert server.stop(timeout=90) in (0, -signal.SIGTERM), server.log_tail()
    gone, alive = psutil.wait_procs(descendants, timeout=30)
    assert not alive, f"left running after SIGTERM: {[p.pid for p in alive]}"
    assert "Application shutdown complete" in server.log_tail(200)
