"""What no client can change: the engine fields that steer the KV connector are refused on every
route; every engine request carries a cache salt the server derives (one key's prefix cache is
its own, and K/V a shift or blend load made are never read by a request served exactly); the
compaction key is made without a race and kept. The exactness suite runs the real 30-layer
SmolLM2 with the connector: a 1-layer model cannot show what moved K/V do to later layers."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from agentkv.server.pipeline import cache_salt

from conftest import OTHER_KEY, REAL, start_server

MODEL = "agentkv-tiny"
SERVER_ONLY = {"kv_transfer_params": {"agentkv": {"session": "victim", "spans": [[0, 512, 1]]}},
               "vllm_xargs": {"kv_transfer_params": {"agentkv": {"session": "victim"}}}}


def _request(route: str, stream: bool, extra: dict) -> dict:
    user = {"role": "user", "content": "hi"}
    body = {"/v1/chat/completions": {"messages": [user], "max_tokens": 2},
            "/v1/completions": {"prompt": "hi", "max_tokens": 2},
            "/v1/messages": {"messages": [user], "max_tokens": 2},
            "/v1/responses": {"input": "hi", "max_output_tokens": 2}}[route]
    return {"model": MODEL, "stream": stream, **body, **extra}


@pytest.mark.parametrize("field", sorted(SERVER_ONLY))
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"])
def test_fields_only_the_server_sets_are_refused_on_every_route(server, route, stream, field):
    """On c095b51 the chat route dropped ``kv_transfer_params`` silently and the others passed it
    (and ``vllm_xargs``, which reaches the same place) on to vLLM's connector."""
    for extra in ({field: SERVER_ONLY[field]}, {field: SERVER_ONLY[field], "kv_reuse": "recompute"}, {field: None}):
        if route == "/v1/completions" and "kv_reuse" in extra:
            continue
        r = server.http().post(route, json=_request(route, stream, extra))
        assert r.status_code == 400, (route, extra, r.text)
        body = r.json()
        if route == "/v1/messages":
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
            assert field in body["error"]["message"]
        else:
            assert body["error"]["param"] == field and field in body["error"]["message"], body


def _cached(server, key: str | None, text: str, salt: str | None = None) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1,
            "context_management": {"edits": []}}
    if salt:
        body["cache_salt"] = salt
    r = server.http(**({"api_key": key} if key else {})).post(
        "/v1/chat/completions", json=body, headers={"X-Session-Id": f"salt-{uuid.uuid4().hex[:8]}"})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_one_keys_prefix_cache_is_its_own(server):
    """The same prompt: a hit for the key that sent it before, none for another key (on c095b51 the
    second key read the first one's blocks: a timing side channel between tenants). A client's own
    cache_salt still partitions within its key."""
    text = f"{uuid.uuid4()} " + "the report lists every service and its latency " * 60
    assert _cached(server, None, text) == 0
    assert _cached(server, None, text) >= 256                  # the same key: its prefix is cached
    assert _cached(server, OTHER_KEY, text) == 0               # another key: never
    assert _cached(server, OTHER_KEY, text) >= 256
    assert _cached(server, None, text, salt="mine") == 0        # the client's salt, within its key


def test_salts_are_the_servers():
    a, b = cache_salt.exact("owner-a", None), cache_salt.exact("owner-b", None)
    assert a != b and a == cache_salt.exact("owner-a", None)
    assert cache_salt.exact("owner-a", None, shared_across_keys=True) == cache_salt.exact("owner-b", None, True)
    assert cache_salt.exact("owner-a", "x") != a
    approx = cache_salt.approximate("owner-a/s1", None)
    assert approx not in (a, cache_salt.approximate("owner-a/s2", None), cache_salt.approximate("owner-b/s1", None))


# -- the compaction key ---------------------------------------------------------------------------
def test_a_reader_racing_the_first_writer_gets_the_whole_key(tmp_path, monkeypatch):
    """Another process reads the key while the first one is making it (on c095b51 the file existed,
    empty, while its key was written: the reader failed, a 500)."""
    from agentkv.server.pipeline import compaction_item as ci

    real, seen, racing_now = ci.secrets.token_bytes, [], []

    def racing(n: int) -> bytes:
        key = real(n)
        if not racing_now:   # the writer is between deciding to make a key and having it on disk
            racing_now.append(True)
            seen.append(ci.load_key(tmp_path))
        return key

    monkeypatch.setattr(ci.secrets, "token_bytes", racing)
    first = ci.load_key(tmp_path)
    assert len(first) == 32 and seen == [first]
    monkeypatch.undo()
    assert ci.load_key(tmp_path) == first                      # kept: the next start reads the same key
    assert not [p for p in tmp_path.iterdir() if p.name != "compaction.key"]   # no temporary file left


def test_the_key_file_takes_hex_and_refuses_what_is_not_a_key(tmp_path):
    from agentkv.server.pipeline.compaction_item import KeyFileError, load_key

    (tmp_path / "hex.key").write_text("ab" * 32 + "\n")        # `openssl rand -hex 32`, as a Secret holds it
    assert load_key(path=tmp_path / "hex.key") == bytes.fromhex("ab" * 32)
    (tmp_path / "bad.key").write_text("short")
    with pytest.raises(KeyFileError, match="32 bytes, or 64 hex digits"):
        load_key(path=tmp_path / "bad.key")


# -- exactness on a deep model --------------------------------------------------------------------
BLOCK, POOL_BLOCKS = 128, 72   # SmolLM2's 8,192-token window plus 8 blocks: one long request takes the pool


@pytest.fixture(scope="module")
def real_kv_server(tmp_path_factory):
    """SmolLM2-135M (30 layers), the default mode (recompute) with the connector that retention
    loads, on a pool of 72 blocks with a host tier of about 40: shifted K/V (``kv_reuse: shift`` per
    request) are approximate past layer 0, and K/V read back from the host tier are exact."""
    srv = start_server(tmp_path_factory.mktemp("real-kv"), f"--engine-arg=--num-gpu-blocks-override={POOL_BLOCKS}",
                       "--kv-offload-gib", "0.22", model=REAL)
    yield srv
    srv.stop()


CLEAR = {"edits": [{"type": "clear_tool_uses", "trigger": 0, "keep": 1}]}
NONE = {"edits": []}


def _conversation() -> list[dict]:
    msgs = [{"role": "system", "content": "You are an operations agent."},
            {"role": "user", "content": "Check the three services and tell me which is slow."}]
    for i, svc in enumerate(("media", "auth", "billing")):
        out = "\n".join(f"{svc} probe {j}: latency {(j * 37 + i * 11) % 300} ms, status ok" for j in range(40))
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"c{i}", "type": "function", "function": {"name": "probe", "arguments":
                                                                      json.dumps({"service": svc})}}]},
                 {"role": "tool", "tool_call_id": f"c{i}", "content": out}]
    return msgs


def _ask(server, key: str | None, sid: str, msgs: list[dict], cm: dict, mode: str) -> dict:
    r = server.http(**({"api_key": key} if key else {})).post("/v1/chat/completions", headers={"X-Session-Id": sid},
                                                               json={"model": REAL, "messages": msgs, "max_tokens": 1,
                                                                     "temperature": 0, "logprobs": True,
                                                                     "top_logprobs": 5, "context_management": cm,
                                                                     "kv_reuse": mode})
    assert r.status_code == 200, r.text
    return r.json()


def _top(body: dict) -> dict[str, float]:
    return {t["token"]: t["logprob"] for t in body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]}


def test_a_recompute_request_never_reads_moved_kv(real_kv_server):
    """After a shift turn under key A, the same request asked with ``recompute`` under key A gives
    the logprobs key B gets computing it from scratch, and its cached tokens stop before the first
    cleared result: the blocks the shift filled (approximate past layer 0) are under a salt no
    exact request uses. On c095b51 both requests read the shifted blocks as a prefix hit."""
    msgs, later = _conversation(), _conversation() + [{"role": "user", "content": "Which service is slow?"}]
    sid = f"x-{uuid.uuid4().hex[:8]}"
    _ask(real_kv_server, None, sid, msgs, NONE, "shift")
    shifted = _ask(real_kv_server, None, sid, later, CLEAR, "shift")
    (edit,) = shifted["context_management"]["applied_edits"]
    assert edit["kv"]["fallback"] is None and edit["kv"]["reused_tokens"] > 0, edit["kv"]
    first = min(edit["edits"], key=lambda e: e["start"])
    placeholder_end = first["start"] + first["replacement_tokens"]   # the exact priming request holds up to here

    exact_a = _ask(real_kv_server, None, f"{sid}-again", later, CLEAR, "recompute")
    exact_b = _ask(real_kv_server, OTHER_KEY, sid, later, CLEAR, "recompute")
    assert exact_b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0      # key B never saw any of it
    assert exact_a["usage"]["prompt_tokens_details"]["cached_tokens"] <= placeholder_end
    _same(exact_a, exact_b)
    # the same conversation's next turn asked exactly: the prompt its branch holds came from the
    # shift turn (moved K/V), so retention reads none of it back (what it has cached is exact_a's)
    retained = _metric(real_kv_server, "vllm:agentkv_kv_retained_tokens_total")
    again = later + [{"role": "assistant", "content": "billing"}, {"role": "user", "content": "And auth?"}]
    _same(_ask(real_kv_server, None, sid, again, CLEAR, "recompute"),
          _ask(real_kv_server, OTHER_KEY, f"{sid}-ref", again, CLEAR, "recompute"))
    time.sleep(1)
    assert _metric(real_kv_server, "vllm:agentkv_kv_retained_tokens_total") == retained


def _same(a_body: dict, b_body: dict, tol: float = 2e-3) -> None:
    a, b = _top(a_body), _top(b_body)
    assert list(a)[0] == list(b)[0] and set(a) == set(b)
    for tok in a:
        assert abs(a[tok] - b[tok]) < tol, (tok, a[tok], b[tok])


def _metric(server, name: str, at_least: float = 0.0) -> float:
    """A counter of the engine's; vLLM records them as it processes outputs: up to 30 s for it to
    reach ``at_least``."""
    deadline = time.monotonic() + 30
    while True:
        value = sum(float(line.rsplit(" ", 1)[1]) for line in server.http().get("/metrics").text.splitlines()
                    if line.startswith(name + "{") or line.startswith(name + " "))
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def _greedy(server, key: str | None, sid: str, msgs: list[dict]) -> dict:
    r = server.http(**({"api_key": key} if key else {})).post("/v1/chat/completions", headers={"X-Session-Id": sid},
                                                               json={"model": REAL, "messages": msgs, "max_tokens": 8,
                                                                     "temperature": 0, "logprobs": True,
                                                                     "top_logprobs": 3, "context_management": NONE})
    assert r.status_code == 200, r.text
    return r.json()


def _tokens(body: dict) -> list[tuple[str, dict[str, float]]]:
    return [(t["token"], {x["token"]: x["logprob"] for x in t["top_logprobs"]})
            for t in body["choices"][0]["logprobs"]["content"]]


def test_a_turn_read_back_from_the_host_tier_is_exact(real_kv_server, real_server):
    """Retention in the default mode (recompute): a session's held prompt, taken by another key's
    long request during the session's pause, is spilled to the host tier, and the next turn (no
    edit) reads it back: its prompt tokens are cached, and its greedy answer and every logprob are
    those of a fresh server computing everything (the default server, another process)."""
    msgs = _conversation()
    sid = f"r-{uuid.uuid4().hex[:8]}"
    first = _greedy(real_kv_server, None, sid, msgs)
    held = first["usage"]["prompt_tokens"]
    before = {n: _metric(real_kv_server, f"vllm:agentkv_kv_{n}_total") for n in ("spilled_blocks", "restores",
                                                                                  "retained_tokens")}
    big = real_kv_server.http(api_key=OTHER_KEY).post("/v1/chat/completions", json={
        "model": REAL, "messages": [{"role": "user", "content": "ok " * 7000}], "max_tokens": 1,
        "context_management": NONE})
    assert big.status_code == 200, big.text
    assert big.json()["usage"]["prompt_tokens"] + held > (POOL_BLOCKS - 1) * BLOCK   # it took the held blocks
    spilled = before["spilled_blocks"] + held // BLOCK
    assert _metric(real_kv_server, "vllm:agentkv_kv_spilled_blocks_total", spilled) >= spilled
    later = msgs + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "Which service is slow? Answer with its name."}]
    restored = _greedy(real_kv_server, None, sid, later)
    assert restored["usage"]["prompt_tokens_details"]["cached_tokens"] >= held // BLOCK * BLOCK
    assert _metric(real_kv_server, "vllm:agentkv_kv_restores_total", before["restores"] + 1) >= before["restores"] + 1
    retained = before["retained_tokens"] + held // BLOCK * BLOCK
    assert _metric(real_kv_server, "vllm:agentkv_kv_retained_tokens_total", retained) >= retained
    fresh = _greedy(real_server, None, f"fresh-{sid}", later)
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert restored["choices"][0]["message"]["content"] == fresh["choices"][0]["message"]["content"]
    for (tok_a, top_a), (tok_b, top_b) in zip(_tokens(restored), _tokens(fresh), strict=True):
        assert tok_a == tok_b and set(top_a) == set(top_b)
        for t in top_a:
            assert abs(top_a[t] - top_b[t]) < 2e-3, (t, top_a[t], top_b[t])


# -- sessions: what one conversation can see of another -------------------------------------------
def _chat(server, msgs: list[dict], headers: dict | None = None):
    r = server.http().post("/v1/chat/completions", headers=headers or {}, json={
        "model": MODEL, "messages": msgs, "max_tokens": 1, "context_management": {"edits": []}})
    assert r.status_code == 200, r.text
    return r


def test_a_conversation_without_an_id_never_gets_one_that_shows_another(server):
    """Two clients, one key, no session ids, the same first turn: the second gets a session of its
    own, whose log holds only what it sent (on c095b51 it got the first one's id and could read its
    whole log, and the first one's tail was appended again)."""
    system = {"role": "system", "content": f"agent {uuid.uuid4()}"}
    first = [system, {"role": "user", "content": "hello"}]
    secret = first + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "the vault code is 6612"}]
    owner_id = _chat(server, secret).headers["x-session-id"]
    other_id = _chat(server, first).headers["x-session-id"]
    assert other_id != owner_id
    seen = server.http().get(f"/v1/sessions/{other_id}/messages").json()
    assert "6612" not in json.dumps(seen) and seen["total"] == 2
    assert server.http().get(f"/v1/sessions/{owner_id}/messages").json()["total"] == 4   # nothing appended twice


def test_two_message_lists_alternating_under_one_claude_code_id_are_branches(server):
    """A main agent and a subagent under one ``x-claude-code-session-id``: each continues its own
    branch; the log grows by what is new (on c095b51 every switch re-appended the other's tail)."""
    headers = {"x-claude-code-session-id": str(uuid.uuid4())}
    main = [{"role": "system", "content": "main agent"}, {"role": "user", "content": "fix the build"}]
    sub = [{"role": "system", "content": "subagent"}, {"role": "user", "content": "grep for TODO"}]
    for turn in range(3):
        sid = _chat(server, main, headers).headers["x-session-id"]
        assert _chat(server, sub, headers).headers["x-session-id"] == sid
        main = main + [{"role": "assistant", "content": f"m{turn}"}, {"role": "user", "content": f"go {turn}"}]
        sub = sub + [{"role": "assistant", "content": f"s{turn}"}, {"role": "user", "content": f"more {turn}"}]
    sent = (2 + 2 * 2) * 2            # each list's messages of its last request, each logged once
    assert server.http().get(f"/v1/sessions/{sid}/messages").json()["total"] == sent
