"""Bad input: schemathesis fuzzes every operation of the server's own OpenAPI schema (no 5xx, no
request left hanging); the size and message-count limits; the API key on every route but /health."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import API_KEY

OPEN = {"/health", "/health/live"}  # the probes answer without a key


def test_schemathesis_finds_no_server_error_and_no_hang(small_server, tmp_path):
    st = Path(sys.executable).with_name("schemathesis")
    cmd = [str(st), "run", f"{small_server.base_url}/openapi.json",
           "-H", f"Authorization: Bearer {API_KEY}",
           "--checks", "not_a_server_error", "--max-examples", "25", "--seed", "20261202",
           "--request-timeout", "120", "--generation-database", "none", "--no-color",
           "--output-sanitize", "false", "--report", "junit", "--report-dir", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:] + "\n--- server log ---\n" + small_server.log_tail(80)
    assert "Tested: " in out  # it ran the operations (a schema it cannot load fails above)
    assert small_server.proc.poll() is None and httpx.get(f"{small_server.base_url}/health").status_code == 200


def _operations(server) -> list[tuple[str, str]]:
    schema = httpx.get(f"{server.base_url}/openapi.json").json()
    return [(method.upper(), path) for path, ops in schema["paths"].items() for method in ops]


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_every_route_but_health_needs_the_api_key(small_server, key):
    ops = _operations(small_server)
    assert ("POST", "/v1/chat/completions") in ops and ("GET", "/v1/sessions/{session_id}") in ops
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for method, path in ops:
        url = small_server.base_url + path.replace("{session_id}", "s1")
        r = httpx.request(method, url, headers=headers, json={}, timeout=60)
        if path in OPEN:
            assert r.status_code == 200, (method, path, r.text)
        else:
            assert r.status_code == 401, (method, path, r.status_code, r.text)
            err = r.json()
            if path.startswith("/v1/messages"):  # Anthropic's error shape there
                assert err["type"] == "error" and err["error"]["type"] == "authentication_error"
            else:
                assert err["error"]["code"] == "invalid_api_key"


def test_message_count_limit_is_a_clean_400(small_server):
    msgs = [{"role": "user", "content": "x"}] * 20_001
    r = small_server.http().post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("body", [b"{", b"[]", b'{"messages": "hi"}', b'{"messages": [{"role": "robot"}]}',
                                  "{\"messages\": [{\"role\": \"user\", \"content\": \"\\ud800\"}]}".encode(),
                                  b'\xff\xfe'])
def test_malformed_bodies_are_400(small_server, body):
    r = small_server.http().post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_body_without_a_key_is_refused_before_it_is_read(small_server):
    """A 32 KiB gzip body that inflates to 32 MiB of JSON, sent without a key, eight at once: each a
    401 in the API's shape (Anthropic's on /v1/messages) before anything is inflated or parsed (the
    front grows by less than 50 MiB); /health answers all the while. With a key, too deep a
    nesting is a 400, never a 500."""
    import gzip
    import threading

    import psutil

    bomb = gzip.compress(b"[" + b"0," * (16 * 2**20 - 2) + b"0]", 9)
    assert len(bomb) < 64 * 2**10
    front = psutil.Process(small_server.proc.pid)
    rss = front.memory_info().rss
    health, answers, done = [], [], threading.Event()

    def probe():
        while not done.is_set():
            health.append(httpx.get(f"{small_server.base_url}/health", timeout=30).status_code)

    def send(path):
        answers.append(httpx.post(small_server.base_url + path, content=bomb, timeout=120, headers={
            "content-encoding": "gzip", "content-type": "application/json"}))

    prober = threading.Thread(target=probe)
    prober.start()
    senders = [threading.Thread(target=send, args=(p,)) for p in ["/v1/chat/completions"] * 6 + ["/v1/messages"] * 2]
    for t in senders:
        t.start()
    for t in senders:
        t.join()
    done.set()
    prober.join()
    assert [r.status_code for r in answers] == [401] * 8
    assert all(r.json()["error"]["type"] == "authentication_error"
               for r in answers if r.request.url.path == "/v1/messages")
    assert front.memory_info().rss - rss < 50 * 2**20
    assert health and set(health) == {200}
    r = small_server.http().post("/v1/chat/completions", content=b"[" * 100_000 + b"]" * 100_000,
                                 headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("text", [None, 5, ["a"]])
@pytest.mark.parametrize("api", ["chat", "messages", "responses", "count_tokens"])
def test_a_text_part_whose_text_is_not_a_string_is_a_400_on_every_api(small_server, api, text):
    """Null or non-string text in a content part: a 400 in the API's shape naming the part, on
    every API (chat answered 500 once), nothing logged."""
    part = {"type": "input_text" if api == "responses" else "text", "text": text}
    path, body = {
        "chat": ("/v1/chat/completions", {"model": "agentkv-tiny", "max_tokens": 2,
                                          "messages": [{"role": "user", "content": [part]}]}),
        "messages": ("/v1/messages", {"model": "agentkv-tiny", "max_tokens": 2,
                                      "messages": [{"role": "user", "content": [part]}]}),
        "responses": ("/v1/responses", {"model": "agentkv-tiny", "max_output_tokens": 16,
                                        "input": [{"role": "user", "content": [part]}]}),
        "count_tokens": ("/v1/messages/count_tokens", {"model": "agentkv-tiny",
                                                       "messages": [{"role": "user", "content": [part]}]}),
    }[api]
    r = small_server.http().post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()
    if path.startswith("/v1/messages"):
        assert err["type"] == "error" and "content.0" in err["error"]["message"]
    else:
        assert err["error"]["type"] == "invalid_request_error" and "content" in err["error"]["param"]


def test_what_only_the_engines_request_model_refuses_is_its_400_not_a_500(small_server):
    """``stream_options`` on a request that does not stream: vLLM's request model raises its own
    validation error (not pydantic's), which the front's render once let through as a 500. Now the
    request goes to vLLM as messages and its 400 names the field (seen with opencode's recorded
    requests replayed without streaming)."""
    r = small_server.http().post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": False,
        "stream_options": {"include_usage": True}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "stream_options" and "stream" in r.json()["error"]["message"]
