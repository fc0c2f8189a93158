"""Faults: the vLLM engine killed mid-stream (clean client error, engine restarted, log intact) and
the agentkv server killed with SIGKILL mid-write (a restart recovers the log, nothing duplicated)."""

from __future__ import annotations

import os
import signal
import sqlite3
import threading
import time

import httpx
import openai
import psutil
import pytest

from conftest import start_server, stop_server

MODEL = "agentkv-tiny"


def _engine(server) -> psutil.Process:
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline()):
            return p
    raise AssertionError("no vLLM engine under the server")


def _wait_health(server, want: int, timeout: float = 600) -> dict:
    deadline, seen = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{server.base_url}/health", timeout=5)
            seen = r.json()
            if r.status_code == want:
                return seen
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"/health never answered {want}; last: {seen}\n{server.log_tail()}")


def _log(server, sid, **kw) -> list[dict]:
    r = server.http(**kw).get(f"/v1/sessions/{sid}/messages", params={"limit": 10_000})
    assert r.status_code == 200, r.text
    return r.json()["data"]


def _kill_during_stream(server, engine, sid, msgs):
    """Stream a long generation; SIGKILL the engine's process group at the 5th chunk."""
    stream = server.client(timeout=120).chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=8000, stream=True, extra_headers={"X-Session-Id": sid},
        extra_body={"ignore_eos": True})
    got, t0, t_kill = [], time.monotonic(), None
    try:
        for chunk in stream:
            got.append((round(time.monotonic() - t0, 3), chunk.choices[0].finish_reason if chunk.choices else None))
            if len(got) == 5:
                os.killpg(engine.pid, signal.SIGKILL)  # the engine and its workers, mid-stream
                t_kill = time.monotonic()
    except openai.APIError as exc:
        return exc, got, t_kill
    return None, (len(got), got[:6], got[-2:]), t_kill


@pytest.mark.last  # the shared server (a 32k window: the stream outlasts the kill), before its shutdown test
def test_engine_killed_mid_stream(server):
    sid = "fault-engine"
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "count to a thousand"}]
    kills = 0
    for _ in range(3):  # a stream that ended before the kill landed proves nothing: kill again
        _wait_health(server, 200)
        engine = _engine(server)
        error, got, t_kill = _kill_during_stream(server, engine, sid, msgs)
        kills += t_kill is not None
        if error is not None:
            break
        if t_kill is not None:
            _wait_health(server, 503, 30)
    assert error is not None, got                                   # the client saw an error...
    assert time.monotonic() - t_kill < 60                         # ...within seconds, not a hang
    assert "engine" in str(error)
    assert _log(server, sid) == msgs                                  # logged before the engine ran
    assert _wait_health(server, 503, 30)["status"] in ("restarting", "starting")
    assert httpx.get(f"{server.base_url}/health/live").status_code == 200
    with pytest.raises(openai.APIStatusError) as during:            # while restarting: a clean 503
        server.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert during.value.status_code == 503
    _wait_health(server, 200)
    assert _engine(server).pid != engine.pid
    ok = server.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                                 extra_headers={"X-Session-Id": sid})
    assert ok.choices and _log(server, sid) == msgs                   # the same session, no duplicate
    metrics = server.http().get("/metrics").text
    assert f"agentkv_engine_restarts_total {kills:.1f}" in metrics


@pytest.mark.last
def test_server_killed_mid_write_recovers_the_log(tmp_path):
    server = start_server(tmp_path)
    sessions = {f"crash-{i}": [{"role": "system", "content": f"agent {i}"}] for i in range(4)}
    acked: dict[str, int] = dict.fromkeys(sessions, 0)   # messages of a request the server answered
    stop = threading.Event()

    def writer(sid: str) -> None:
        http, n = server.http(), 0
        while not stop.is_set():
            conv = sessions[sid] + [{"role": "user", "content": f"message {n} " + "word " * 3000}]
            try:
                r = http.post("/v1/chat/completions", headers={"X-Session-Id": sid},
                              json={"model": MODEL, "messages": conv, "max_tokens": 1})
            except httpx.TransportError:
                return
            if r.status_code in (200, 400):  # answered: its messages were logged first
                sessions[sid], acked[sid], n = conv, len(conv), n + 1

    threads = [threading.Thread(target=writer, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while min(acked.values()) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    engine = _engine(server)
    server.proc.send_signal(signal.SIGKILL)               # no shutdown, writes in flight
    server.proc.wait()
    stop.set()
    for t in threads:
        t.join(60)
    assert min(acked.values()) >= 3
    engine.wait(120)                                       # the orphaned engine exits with its parent
    db = tmp_path / "sessions.db"
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"

    server = start_server(tmp_path)
    try:
        for sid, conv in sessions.items():
            log = _log(server, sid)
            assert log[:acked[sid]] == conv[:acked[sid]]      # everything acknowledged survived
            in_flight = log[acked[sid]:]                      # received, never answered: kept, once
            assert len(in_flight) <= 1 and all(m["content"].startswith("message ") for m in in_flight)
            again = conv + [{"role": "user", "content": "after the crash"}]
            r = server.http().post("/v1/chat/completions", headers={"X-Session-Id": sid},
                                   json={"model": MODEL, "messages": again, "max_tokens": 1})
            assert r.status_code == 200, r.text
            # resumed: the log is append-only, so it holds what it had, then the new message, once
            assert _log(server, sid) == conv[:acked[sid]] + in_flight + again[acked[sid]:]
    finally:
        stop_server(server)
