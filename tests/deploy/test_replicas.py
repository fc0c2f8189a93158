"""Two agentkv replicas (the tiny model) behind the router of ``deploy/router/haproxy.cfg`` (HAProxy,
the deployed file), sharing one PostgreSQL session log and one compaction key file.

A conversation's turns all land on one replica, on each API, through the official SDKs (the
router's per-replica response counts and the replicas' own request and prefix-cache counters show
it); a conversation moved to the other replica continues from the shared log; a compaction item and
a message thread made on one replica are taken by the other; a replica killed in the middle of a
streamed turn loses no logged message, and the conversation goes on on the other one.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import anthropic
import httpx
import openai
import psutil
import pytest

from agentkv.benchmarks.router import Router, run_router

from conftest import API_KEY, Server, new_database, start_server, stop_server

MODEL = "agentkv-tiny"
# long enough that a turn's prompt spans several KV blocks (the prefix cache reuses whole blocks)
SYSTEM = "You are an agent working on a fleet of services. " + " ".join(
    f"Rule {i}: check service {i} latency, disk and queue before changing it." for i in range(60))


@dataclass
class Cluster:
    router: Router
    replicas: list[Server]

    def served(self, before: dict[str, int]) -> list[int]:
        """The replicas (0, 1) that answered through the router since ``before``."""
        after = self.router.server_responses()
        return [i for i in (0, 1) if after.get(f"replica{i + 1}", 0) > before.get(f"replica{i + 1}", 0)]


STALL_S = 8   # the replicas' stall bound (a stopped engine leaves the pool within seconds)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, postgres_url, haproxy):
    root = tmp_path_factory.mktemp("replicas")
    key = root / "compaction.key"
    key.write_text(secrets.token_hex(32))   # one key for both, as the Secret gives every replica
    with contextlib.ExitStack() as stack:
        db = stack.enter_context(new_database(postgres_url))
        homes = [root / "r1", root / "r2"]
        with ThreadPoolExecutor(2) as pool:   # both engines start at once
            futures = [pool.submit(start_server, h.mkdir() or h, "--session-db", db, "--compaction-key-file", str(key),
                                   "--engine-stall-s", str(STALL_S))
                       for h in homes]
        replicas = []
        for f in futures:   # each one that came up is stopped, also when the other failed
            if f.exception() is None:
                replicas.append(f.result())
                stack.callback(stop_server, replicas[-1])
        for f in futures:
            f.result()
        router = stack.enter_context(run_router([r.base_url for r in replicas], root / "router"))
        yield Cluster(router, replicas)


def counter(server: Server, name: str, **labels: str) -> float:
    """A counter's value on one replica's /metrics (0 when it has no such sample yet)."""
    text = server.http().get("/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{re.escape(name)}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def log_of(server: Server, sid: str) -> list[dict]:
    r = server.http().get(f"/v1/sessions/{sid}/messages")
    assert r.status_code == 200, r.text
    return r.json()["data"]


def chat_turns(url: str, sid: str, turns: int, start: list[dict] | None = None, **headers: str) -> tuple[list, list]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    messages = start or [{"role": "system", "content": SYSTEM}]
    replies = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"turn {t}: which service is slow?"})
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                           extra_headers={"X-Session-Id": sid, **headers} if sid else headers)
        replies.append(r)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    return messages, replies


def test_each_conversation_stays_on_one_replica_on_every_api(cluster):
    """Chat (X-Session-Id), Messages (Claude Code's header), Responses (Codex's headers), and a
    client that sends no id (its body prefix): three turns each, one replica each, prefix cache hits
    from the second turn on; the other replica's counters do not move."""
    url = cluster.router.url
    before_requests = [counter(r, "agentkv_requests_total", route="/v1/chat/completions", status="200")
                       for r in cluster.replicas]
    cached = [counter(r, "agentkv_prompt_tokens_total", source="cached") for r in cluster.replicas]
    sid, messages, seen = f"chat-{uuid.uuid4().hex[:8]}", [{"role": "system", "content": SYSTEM}], []
    for t in range(3):
        before = cluster.router.server_responses()
        messages, (r,) = chat_turns(url, sid, 1, messages)
        seen += cluster.served(before)
        if t:
            assert r.usage.prompt_tokens_details.cached_tokens > 0, r.usage
    assert len(set(seen)) == 1 and len(seen) == 3, seen
    home = seen[0]
    gained = [counter(r, "agentkv_prompt_tokens_total", source="cached") - c for r, c in zip(cluster.replicas, cached)]
    assert gained[home] > 0 and gained[1 - home] == 0, gained
    after_requests = [counter(r, "agentkv_requests_total", route="/v1/chat/completions", status="200")
                      for r in cluster.replicas]
    assert after_requests[home] - before_requests[home] == 3 and after_requests[1 - home] == before_requests[1 - home]

    claude = anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0, timeout=300,
                                 default_headers={"X-Claude-Code-Session-Id": str(uuid.uuid4())})
    convo, seen = [], []
    for t in range(3):
        before = cluster.router.server_responses()
        convo.append({"role": "user", "content": f"turn {t}: read the logs"})
        m = claude.messages.create(model=MODEL, system=SYSTEM, messages=convo, max_tokens=4)
        convo.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
        seen += cluster.served(before)
        if t:
            assert m.usage.cache_read_input_tokens > 0, m.usage
    assert len(set(seen)) == 1 and len(seen) == 3, seen

    codex = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300,
                          default_headers={"session-id": (cid := str(uuid.uuid4())), "thread-id": cid})
    items, seen = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": SYSTEM}]}], []
    for t in range(3):
        before = cluster.router.server_responses()
        items.append({"role": "user", "content": f"turn {t}: list the failing checks"})
        r = codex.responses.create(model=MODEL, input=items, max_output_tokens=4, store=False)
        items += [o.model_dump(exclude_none=True, warnings=False) for o in r.output]
        seen += cluster.served(before)
        if t:
            assert r.usage.input_tokens_details.cached_tokens > 0, r.usage
    assert len(set(seen)) == 1 and len(seen) == 3, seen

    # no session id at all, or one the router cannot take (agentkv hashes it): the body's prefix routes
    for headers in ({}, {"X-Claude-Code-Session-Id": "not an id / " + "x" * 200}):
        seen = []
        messages = [{"role": "system", "content": f"{SYSTEM} Conversation {uuid.uuid4()}."}]
        for _ in range(3):
            before = cluster.router.server_responses()
            messages, _ = chat_turns(url, None, 1, messages, **headers)
            seen += cluster.served(before)
        assert len(set(seen)) == 1 and len(seen) == 3, (headers, seen)


def test_a_conversation_moved_to_the_other_replica_continues_from_the_shared_log(cluster):
    sid = f"moved-{uuid.uuid4().hex[:8]}"
    before = cluster.router.server_responses()
    messages, _ = chat_turns(cluster.router.url, sid, 2)
    (home,) = set(cluster.served(before))
    other = cluster.replicas[1 - home]
    messages.append({"role": "user", "content": "turn 2: and now?"})
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
    moved = other.http().post("/v1/chat/completions", json=body, headers={"X-Session-Id": sid})
    assert moved.status_code == 200, moved.text
    again = cluster.replicas[home].http().post("/v1/chat/completions", json=body, headers={"X-Session-Id": sid})
    assert again.status_code == 200, again.text
    # both replicas built the same view of the conversation from the one log, which holds every
    # message once, whichever replica is asked
    assert moved.json()["usage"]["prompt_tokens"] == again.json()["usage"]["prompt_tokens"]
    logs = [log_of(r, sid) for r in cluster.replicas]
    assert logs[0] == logs[1]
    assert [m["role"] for m in logs[0]] == ["system", "user", "assistant", "user", "assistant", "user"]


def test_a_compaction_item_and_a_thread_made_on_one_replica_work_on_the_other(cluster):
    one, two = cluster.replicas
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are an agent."}]},
             {"role": "user", "content": "Run the diagnostics."},
             {"type": "function_call", "call_id": "call_0", "name": "bash", "arguments": "{\"cmd\": \"diag\"}"},
             {"type": "function_call_output", "call_id": "call_0", "output": SYSTEM},
             {"role": "user", "content": "Which services look slow?"}]
    compacted = one.client().responses.compact(model=MODEL, input=items,
                                               extra_headers={"x-session-id": f"c-{uuid.uuid4().hex[:8]}"})
    item = compacted.output[-1]
    assert item.type == "compaction"
    nxt = [items[0], *[o.model_dump(exclude_none=True, warnings=False) for o in compacted.output],
           {"role": "user", "content": "Go on."}]
    r = two.http().post("/v1/responses", json={"model": MODEL, "input": nxt, "max_output_tokens": 4, "store": False})
    assert r.status_code == 200, r.text   # the other replica opens the item: one key for both

    betas = ["message-threads-2026-08-12"]
    created = anthropic.Anthropic(base_url=one.base_url, api_key=API_KEY, max_retries=0).beta.messages.create(
        model=MODEL, max_tokens=4, system="agent", messages=[{"role": "user", "content": "hi"}],
        betas=betas, thread={"type": "create"})
    cont = anthropic.Anthropic(base_url=two.base_url, api_key=API_KEY, max_retries=0).beta.messages.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "and then?"}], betas=betas,
        thread={"type": "continue", "previous_message_id": created.id})
    sid = cont.context_management.model_dump()["session_id"]
    assert sid == created.context_management.model_dump()["session_id"]
    assert [m["role"] for m in log_of(two, sid)] == ["system", "user", "assistant", "user"]


def test_a_thread_and_a_response_chain_without_a_session_id_stay_where_they_began(cluster):
    """A message-thread continue and a previous_response_id request carry neither a session id nor
    their conversation's prefix: the router places them by the token at the start of the id they
    name, which agentkv took from the router when it made that id."""
    url = cluster.router.url
    thread = anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0, timeout=300).beta.messages.thread(
        model=MODEL, max_tokens=4, system=f"{SYSTEM} Thread {uuid.uuid4()}.")
    seen, ids = [], []
    for t in range(3):
        before = cluster.router.server_responses()
        ids.append(thread.send({"role": "user", "content": f"turn {t}: and then?"}).id)
        seen += cluster.served(before)
    assert len(seen) == 3 and len(set(seen)) == 1, seen
    assert len({i[4:12] for i in ids}) == 1, ids     # one token down the chain

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    seen, previous = [], None
    for t in range(3):
        before = cluster.router.server_responses()
        r = client.responses.create(model=MODEL,
                                    input=f"{SYSTEM} step {t} of {uuid.uuid4()}" if t == 0 else f"step {t}",
                                    previous_response_id=previous, max_output_tokens=4, store=True)
        previous = r.id
        seen += cluster.served(before)
    assert len(seen) == 3 and len(set(seen)) == 1, seen


def test_ids_take_the_routers_token_and_nothing_else():
    from agentkv.server.api import ids

    ids.take_route({"x-agentkv-route": "0123ABCD"})
    assert re.fullmatch(r"msg_0123abcd[0-9a-f]{24}", ids.new_id("msg"))
    for bad in ("0123abc", "0123abcdef", "zzzzzzzz", ""):
        ids.take_route({"x-agentkv-route": bad})
        made = ids.new_id("resp")
        assert re.fullmatch(r"resp_[0-9a-f]{32}", made) and (not bad or not made[5:].startswith(bad.lower()))


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (one that died on its own meanwhile is fine: the
    engine dies with its front)."""
    proc = psutil.Process(pid)
    for p in [*proc.children(recursive=True), proc]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()


def test_a_replica_whose_engine_is_stopped_leaves_the_pool_and_its_conversation_moves(cluster):
    """A replica's engine stopped (SIGSTOP of its worker: a hang, from outside): its /health turns
    503 within the stall bound, the router's health checks take it out, and its conversation's next
    turn is answered by the other replica from the shared log; the stopped engine is replaced and
    the replica rejoins the pool."""
    sid = f"stopped-{uuid.uuid4().hex[:8]}"
    before = cluster.router.server_responses()
    messages, _ = chat_turns(cluster.router.url, sid, 2)
    (home,) = set(cluster.served(before))
    name, other = f"replica{home + 1}", f"replica{2 - home}"
    engine = next(p for p in psutil.Process(cluster.replicas[home].proc.pid).children(recursive=True)
                  if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline()))
    worker = next(p for p in engine.children(recursive=True) if not p.children() and p.name().startswith("VLLM::"))
    os.kill(worker.pid, signal.SIGSTOP)
    deadline = time.monotonic() + STALL_S + 60
    while cluster.router.up()[name] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert cluster.router.up() == {name: False, other: True}
    before = cluster.router.server_responses()
    more, _ = chat_turns(cluster.router.url, sid, 1, start=messages)
    assert cluster.served(before) == [1 - home]
    assert [m["content"] for m in log_of(cluster.replicas[1 - home], sid) if m["role"] == "user"] == \
        [m["content"] for m in more if m["role"] == "user"]
    deadline = time.monotonic() + 600   # relaunched: back in the pool (the next test needs both)
    while not all(cluster.router.up().values()) and time.monotonic() < deadline:
        time.sleep(1)
    assert all(cluster.router.up().values())
    assert "agentkv_engine_stalls_total 1.0" in cluster.replicas[home].http().get("/metrics").text


def test_a_replica_killed_mid_turn_loses_no_logged_message(cluster):
    """Runs last here (it kills a replica): a streamed turn is cut by the kill; the client retries it
    through the router, which sends it to the surviving replica; the log holds every message once."""
    sid = f"killed-{uuid.uuid4().hex[:8]}"
    before = cluster.router.server_responses()
    messages, _ = chat_turns(cluster.router.url, sid, 2)
    (home,) = set(cluster.served(before))
    victim, survivor = cluster.replicas[home], cluster.replicas[1 - home]
    messages.append({"role": "user", "content": "turn 2: write the whole report"})
    client = openai.OpenAI(base_url=f"{cluster.router.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    # a long generation (~20 s of the tiny model): the kill lands in its middle even when this client
    # reads its first chunk late (a busy machine), not after the whole answer sits in its socket
    killed = finished = False
    try:
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=28000, stream=True,
                                                temperature=0, extra_headers={"X-Session-Id": sid})
        for chunk in stream:
            if not killed:   # the turn is under way on the victim: kill its front and engine at once
                kill_tree(victim.proc.pid)
                killed = True
            finished = finished or any(c.finish_reason for c in chunk.choices)
    except (openai.APIError, httpx.HTTPError):
        pass
    assert killed and not finished   # the turn was cut by the kill
    victim.proc.wait(timeout=30)
    retried = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                             extra_headers={"X-Session-Id": sid})
    assert retried.choices[0].message is not None
    log = log_of(survivor, sid)
    assert [m["role"] for m in log] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in log if m["role"] == "user"] == [m["content"] for m in messages if m["role"] == "user"]
    deadline = time.monotonic() + 30   # and the router's health checks take the victim out
    while cluster.router.up()[f"replica{home + 1}"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert cluster.router.up() == {f"replica{home + 1}": False, f"replica{2 - home}": True}
