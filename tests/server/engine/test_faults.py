"""Faults: the vLLM engine killed mid-stream (an `engine_unavailable` error event, engine restarted,
log intact, summaries reach the new engine); a relaunch that fails (it uses the restart budget and
is tried again); the session log's database unreachable (503, then it reconnects); the agentkv
server killed with SIGKILL mid-write (a restart recovers the log, nothing duplicated)."""

from __future__ import annotations

import os
import signal
import sqlite3
import threading
import time
from pathlib import Path

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


def _wait_health(server, want: int, timeout: float = 600, status: str | None = None) -> dict:
    deadline, seen = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{server.base_url}/health", timeout=5)
            seen = r.json()
            if r.status_code == want and status in (None, seen["status"]):
                return seen
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"/health never answered {want}; last: {seen}\n{server.log_tail()}")


def _log(server, sid, **kw) -> list[dict]:
    r = server.http(**kw).get(f"/v1/sessions/{sid}/messages", params={"limit": 10_000})
    assert r.status_code == 200, r.text
    return r.json()["data"]


def _metric(server, name: str) -> float:
    """A metric of the server's ``/metrics`` (the front's and vLLM's), summed over its label sets."""
    lines = [x for x in server.http().get("/metrics").text.splitlines() if x.startswith((name + " ", name + "{"))]
    assert lines, f"no {name} in /metrics"
    return sum(float(x.split()[-1]) for x in lines)


COMPACT = {"edits": [{"type": "compact", "trigger": 0, "keep_recent_tokens": 200, "summary_max_tokens": 16}]}


def _compact(server, sid) -> dict:
    """A `compact` edit through the server: the summary is written by the engine it runs now."""
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "check the services"}]
    for i in range(4):
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": f"c{i}", "content": f"service {i} probe: ok\n" * 40}]
    r = server.http().post("/v1/chat/completions", headers={"X-Session-Id": sid}, json={
        "model": MODEL, "messages": msgs + [{"role": "user", "content": "next"}], "max_tokens": 2,
        "context_management": COMPACT})
    assert r.status_code == 200, r.text
    return r.json()["context_management"]


def _kill_during_stream(server, engine, sid, msgs):
    """Stream a long generation; SIGKILL the engine's process group at the 5th chunk. Returns
    (the error the client got or None, seconds from the kill to it, chunks received)."""
    stream = server.client(timeout=120).chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=8000, stream=True, extra_headers={"X-Session-Id": sid},
        extra_body={"ignore_eos": True})
    got, t_kill = 0, None
    try:
        for _ in stream:
            got += 1
            if got == 5:
                os.killpg(engine.pid, signal.SIGKILL)  # the engine and its workers, mid-stream
                t_kill = time.monotonic()
    except openai.APIError as exc:
        return exc, time.monotonic() - t_kill, got
    return None, None, got


@pytest.mark.last  # the shared server (a 32k window: the stream outlasts the kill), before its shutdown test
def test_engine_killed_mid_stream(server):
    sid = "fault-engine"
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "count to a thousand"}]
    _wait_health(server, 200)
    restarts = _metric(server, "agentkv_engine_restarts_total")
    before = _compact(server, "fault-compact-1")
    assert [e["type"] for e in before["applied_edits"]] == ["compact"] and "failed_edits" not in before
    engine = _engine(server)
    error, delay, got = _kill_during_stream(server, engine, sid, msgs)
    assert error is not None, f"the stream of {got} chunks ended without an error"
    assert error.code == "engine_unavailable", error.body                  # an error event, not a cut...
    assert delay < 10, delay                                              # ...within seconds, not a hang
    assert _log(server, sid) == msgs                                      # logged before the engine ran
    assert _wait_health(server, 503, 30)["status"] in ("restarting", "starting")
    assert httpx.get(f"{server.base_url}/health/live").status_code == 200
    with pytest.raises(openai.APIStatusError) as during:                # while restarting: a clean 503
        server.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert during.value.status_code == 503 and during.value.code == "engine_unavailable"
    assert during.value.response.headers["retry-after"] == "10"          # when to try again
    _wait_health(server, 200)
    assert _engine(server).pid != engine.pid
    ok = server.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=2,
                                                 extra_headers={"X-Session-Id": sid})
    assert ok.choices[0].finish_reason in ("length", "stop") and _log(server, sid) == msgs  # no duplicate
    assert _metric(server, "agentkv_engine_restarts_total") == restarts + 1
    after = _compact(server, "fault-compact-2")                  # the summarizer reaches the new engine
    assert after == {**before, "session_id": "fault-compact-2"}           # the same summary, greedy


@pytest.mark.last
def test_server_killed_mid_write_recovers_the_log(tmp_path):
    server = start_server(tmp_path)
    sessions = {f"crash-{i}": [{"role": "system", "content": f"agent {i}"}] for i in range(4)}
    acked: dict[str, int] = dict.fromkeys(sessions, 0)   # messages of a request the server answered
    unexpected: list[str] = []                           # any other answer fails the test
    stop = threading.Event()

    def writer(sid: str) -> None:
        http, n = server.http(), 0
        while not stop.is_set():
            conv = sessions[sid] + [{"role": "user", "content": f"message {n} " + "word " * 3000}]
            try:
                r = http.post("/v1/chat/completions", headers={"X-Session-Id": sid},
                              json={"model": MODEL, "messages": conv, "max_tokens": 1})
            except httpx.TransportError:                 # the kill: the server is gone
                return
            # answered (its messages were logged first): done, or the conversation outgrew the window
            if r.status_code == 200 or (r.status_code == 400 and "context length" in r.json()["error"]["message"]):
                sessions[sid], acked[sid], n = conv, len(conv), n + 1
            else:
                unexpected.append(f"{sid} message {n}: {r.status_code} {r.text[:300]}")
                return

    threads = [threading.Thread(target=writer, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while min(acked.values()) < 3 and not unexpected and time.monotonic() < deadline:
        time.sleep(0.2)
    engine = _engine(server)
    server.proc.send_signal(signal.SIGKILL)               # no shutdown, writes in flight
    server.proc.wait()
    stop.set()
    for t in threads:
        t.join(60)
    assert unexpected == []
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


def test_failed_relaunch_uses_the_restart_budget_and_tries_again(tmp_path):
    """The model's files are unreadable when the engine dies (a volume remounting): the relaunch
    fails, counts against --engine-restarts, and the next one, once the files are back, serves."""
    server = start_server(tmp_path, "--engine-restarts", "2")
    try:
        engine = _engine(server)
        cmd = engine.cmdline()
        config = Path(cmd[cmd.index("--model") + 1]) / "config.json"
        hidden = config.with_name("config.json.away")
        config.rename(hidden)
        try:
            os.killpg(engine.pid, signal.SIGKILL)
            deadline, seen = time.monotonic() + 600, {}
            while "failed to restart" not in seen.get("error", "") and seen.get("status") != "failed" \
                    and time.monotonic() < deadline:
                seen = httpx.get(f"{server.base_url}/health", timeout=5).json()
                time.sleep(0.1)
        finally:
            hidden.rename(config)
        assert seen["status"] == "restarting", seen
        assert seen["error"].startswith("the vLLM engine failed to restart: vLLM exited with code "), seen
        assert httpx.get(f"{server.base_url}/health/live").status_code == 200
        _wait_health(server, 200)
        assert _metric(server, "agentkv_engine_restarts_total") == 2      # the exit and the failed relaunch
        assert _metric(server, "agentkv_engine_starts_total") == 3
        r = server.http().post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "back?"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
        os.killpg(_engine(server).pid, signal.SIGKILL)                   # the third failure: budget spent
        failed = _wait_health(server, 503, 60, status="failed")
        assert "3 engine failures within an hour" in failed["error"], failed
        live = httpx.get(f"{server.base_url}/health/live")
        assert live.status_code == 503 and live.json()["engine"] == "failed"
    finally:
        stop_server(server)


def test_unreachable_session_log_is_503_then_reconnects(small_server, postgres_url):
    """The session log's PostgreSQL database refuses connections (its server's connections cut):
    requests that need the log get 503 `session_log_unavailable`; once it is back, they work."""
    import psycopg

    db = small_server.session_db
    assert db.startswith("postgresql://"), db
    name, sid = db.rsplit("/", 1)[1], f"pg-{os.getpid()}-{time.monotonic_ns()}"
    msgs = [{"role": "user", "content": "hello"}]
    chat = {"model": MODEL, "messages": msgs, "max_tokens": 1}
    http = small_server.http()
    assert http.post("/v1/chat/completions", headers={"X-Session-Id": sid}, json=chat).status_code == 200
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS false")
        try:
            admin.execute("SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity WHERE datname = %s",
                          (name,))
            more = {**chat, "messages": msgs + [{"role": "assistant", "content": "hi"},
                                                {"role": "user", "content": "are you there?"}]}
            down = [http.post("/v1/chat/completions", headers={"X-Session-Id": sid}, json=more),
                    http.get(f"/v1/sessions/{sid}/messages")]
        finally:
            admin.execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS true")
    for r in down:
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "session_log_unavailable"
        assert r.json()["error"]["type"] == "service_unavailable"
    r = http.post("/v1/chat/completions", headers={"X-Session-Id": sid}, json=more)
    assert r.status_code == 200, r.text
    assert _log(small_server, sid) == more["messages"]          # the refused request logged nothing


def _leaf(server) -> psutil.Process:
    """The engine's compute process: vLLM's worker (a leaf of its process tree named VLLM::...)."""
    engine = _engine(server)
    workers = [p for p in engine.children(recursive=True) if not p.children() and p.name().startswith("VLLM::")]
    assert workers, "no worker under the engine"
    return workers[0]


STALL_S = 8   # the stall bound of the server below (the default is 120 s)
HANG = "hang-the-engine"   # while this file is in the stall server's home, its engine core hangs at its next step


@pytest.fixture(scope="module")
def stall_server(tmp_path_factory):
    """A server whose engine is declared stuck after 8 s without progress: 24 layers of the tiny
    model, so a long prompt's prefill takes well over that on these CPUs. Its engine core blocks
    at a step while the file ``HANG`` is in its home (the connector's fault hook: a hung, not
    stopped, engine)."""
    home = tmp_path_factory.mktemp("agentkv-stall")
    srv = start_server(home, "--model", "agentkv-tiny-24l", "--served-model-name", MODEL,
                       "--engine-stall-s", str(STALL_S), env={"AGENTKV_FAULT_HANG_FILE": str(home / HANG)})
    yield srv
    stop_server(srv)


def _stalled(server, since: float, bound: float) -> dict:
    """/health once the watchdog noticed the stall: 503 ``restarting`` naming it, within ``bound``."""
    health = _wait_health(server, 503, bound + 60, status="restarting")
    assert time.monotonic() - since < bound + 60
    assert "stuck" in health["error"] and "restarting" in health["error"], health
    return health


def test_a_stopped_engine_is_noticed_mid_stream_and_relaunched(stall_server):
    """The engine's worker stopped (SIGSTOP: a hung GPU, a deadlock, a swapped-out host look alike
    from outside) in the middle of a stream: the stream ends with ``engine_unavailable`` within the
    stall bound, /health says 503 with the reason, new requests get 503, the engine is killed and
    relaunched (counted), the log keeps the message, and a request is served after."""
    server, sid = stall_server, "stall-stream"
    _wait_health(server, 200)
    stalls = _metric(server, "agentkv_engine_stalls_total")
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "count to a thousand"}]
    worker = _leaf(server)
    stream = server.client(timeout=300).chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=8000, stream=True, extra_headers={"X-Session-Id": sid},
        extra_body={"ignore_eos": True})
    got, t_stop, error = 0, None, None
    try:
        for _ in stream:
            got += 1
            if got == 5:
                os.kill(worker.pid, signal.SIGSTOP)
                t_stop = time.monotonic()
    except openai.APIError as exc:
        error = exc
    assert t_stop is not None and error is not None, f"the stream of {got} chunks ended without an error"
    assert error.code == "engine_unavailable", error.body
    assert time.monotonic() - t_stop < STALL_S + 60
    _stalled(server, t_stop, STALL_S)
    with pytest.raises(openai.APIStatusError) as during:
        server.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert during.value.status_code == 503 and during.value.code == "engine_unavailable"
    assert _metric(server, "agentkv_engine_stalls_total") == stalls + 1
    assert not psutil.pid_exists(worker.pid) or psutil.Process(worker.pid).status() == psutil.STATUS_ZOMBIE
    _wait_health(server, 200)
    assert _log(server, sid) == msgs
    ok = server.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_a_stopped_idle_engine_is_noticed_and_relaunched(stall_server):
    """Stopped with nothing in flight: /health turns 503 naming the stopped process within the
    bound (a router takes the replica out), and the relaunched engine serves."""
    server = stall_server
    _wait_health(server, 200)
    stalls = _metric(server, "agentkv_engine_stalls_total")
    worker = _leaf(server)
    os.kill(worker.pid, signal.SIGSTOP)
    t_stop = time.monotonic()
    health = _stalled(server, t_stop, STALL_S)
    assert "stopped" in health["error"], health
    assert _metric(server, "agentkv_engine_stalls_total") == stalls + 1
    _wait_health(server, 200)
    r = server.http().post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "back?"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_long_progressing_prefill_is_not_declared_stuck(stall_server):
    """A prompt whose prefill takes several stall bounds on these CPUs: vLLM's prompt counter
    moves only when it ends, but every chunk is a step the watchdog sees (issue 51, W2), so
    nothing is declared stuck and the request is answered."""
    server = stall_server
    _wait_health(server, 200)
    stalls = _metric(server, "agentkv_engine_stalls_total")
    words = " ".join(f"w{i}" for i in range(10_000))   # ~30k tokens of the tiny tokenizer
    t0 = time.monotonic()
    r = server.http().post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": 1, "temperature": 0,
        "context_management": {"edits": []}})          # the prompt itself, not a summary of it
    took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 25_000
    assert _metric(server, "agentkv_engine_stalls_total") == stalls
    assert took > 2 * STALL_S, f"the prefill took {took:.1f} s: too short to show anything"


def test_a_hung_engine_core_is_found_within_the_bound(stall_server):
    """Issue 51, W3: the engine core blocks in a step (a hook that never returns; its processes run,
    none is stopped, its API server answers ``/metrics`` and its idle workers poll). A request
    sent to it is answered ``engine_unavailable`` once the watchdog found the hang within the
    bound, and the relaunched engine serves."""
    server = stall_server
    _wait_health(server, 200)
    stalls = _metric(server, "agentkv_engine_stalls_total")
    hang = server.home / HANG
    hang.write_text("")
    try:
        t0 = time.monotonic()
        r = server.http().post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "are you there?"}], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
        assert time.monotonic() - t0 < STALL_S + 30
        assert all(p.status() != psutil.STATUS_STOPPED for p in psutil.Process(server.proc.pid).children(True)
                   if p.is_running())
        health = _stalled(server, t0, STALL_S)
        assert "no progress" in health["error"], health
    finally:
        hang.unlink()
    assert _metric(server, "agentkv_engine_stalls_total") == stalls + 1
    _wait_health(server, 200)
    r = server.http().post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "back?"}], "max_tokens": 2})
    assert r.status_code == 200, r.text


def _stream_never_read(server, body: dict):
    """A streamed request sent over a raw socket with a small receive buffer, whose answer this
    side never reads (a client whose laptop slept): the socket, to close later."""
    import json
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(server.base_url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((url.hostname, url.port))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: agentkv\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {server.api_key}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                 + payload)
    return sock


def test_a_client_that_never_reads_its_stream_gets_no_engine_killed(stall_server):
    """Issue 51, W1, through a real engine: a stream whose answer (megabytes of tokens with their
    logprobs) its client never reads. The engine generates it all and reports nothing running;
    the front's relay waits on the client. For four stall bounds after that the engine is not
    declared stuck, not relaunched, and another user's requests are answered."""
    server = stall_server
    _wait_health(server, 200)
    stalls, restarts = _metric(server, "agentkv_engine_stalls_total"), _metric(server, "agentkv_engine_restarts_total")
    engine = _engine(server)
    generated = _metric(server, "vllm:generation_tokens_total")
    sock = _stream_never_read(server, {
        "model": MODEL, "messages": [{"role": "user", "content": "tell me everything"}], "max_tokens": 2500,
        "stream": True, "ignore_eos": True, "logprobs": True, "top_logprobs": 20})
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:          # until the engine has generated the whole answer
            time.sleep(1)
            if _metric(server, "vllm:generation_tokens_total") >= generated + 2500 and \
                    _metric(server, "vllm:num_requests_running") == 0:
                break
        else:
            raise AssertionError("the engine did not finish the answer")
        time.sleep(4 * STALL_S)
        for _ in range(3):                          # another user is served meanwhile
            r = server.http().post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert r.status_code == 200, r.text
        assert httpx.get(f"{server.base_url}/health").status_code == 200
        assert _metric(server, "agentkv_engine_stalls_total") == stalls
        assert _metric(server, "agentkv_engine_restarts_total") == restarts
        assert _engine(server).pid == engine.pid
    finally:
        sock.close()
