"""Which session a request lands in (the documented precedence, derived ids that never merge two
conversations) and the atomic log sync under concurrent requests, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import threading

import pytest

from agentkv.compaction.log.open import open_session_log
from agentkv.server.errors import APIError
from agentkv.server.pipeline.sessions import SOURCES, SessionRef, Sessions, derived_id, session_ref

CLAUDE = "0f8e2c1a-3b4d-4e5f-8a9b-1c2d3e4f5a6b"


def test_precedence_first_present_wins():
    headers = {"x-session-id": "mine", "x-claude-code-session-id": CLAUDE, "session-id": "codex",
               "thread-id": "thread"}
    body = {"session_id": "body", "prompt_cache_key": "pck",
            "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "meta"})}}
    names = [name for name, _, _ in SOURCES]
    expected = {"x-session-id": "mine", "session_id": "body", "x-claude-code-session-id": CLAUDE,
                "session-id": "codex", "thread-id": "thread", "metadata.user_id": "meta",
                "prompt_cache_key": "pck"}
    for name in names:  # drop the sources before `name`: `name` must win
        h = {k: v for k, v in headers.items() if names.index(k) >= names.index(name)} \
            if name in headers else {k: v for k, v in headers.items() if names.index(k) > names.index(name)}
        b = {k: v for k, v in body.items()
             if names.index("metadata.user_id" if k == "metadata" else k) >= names.index(name)}
        assert session_ref(h, b) == SessionRef(expected[name], name)
    assert session_ref({}, {}) == SessionRef(None, "derived")
    assert session_ref({"session_id": "pi-1", "session-id": "codex"}, {}) == SessionRef("pi-1", "session_id")


def test_metadata_user_id_forms_and_foreign_ids_hashed():
    legacy = f"user_abc_account_{CLAUDE[::-1]}_session_{CLAUDE}"
    assert session_ref({}, {"metadata": {"user_id": legacy}}).id == CLAUDE
    assert session_ref({}, {"metadata": {"user_id": "someone"}}).id is None
    odd = session_ref({"session-id": "a/b c"}, {})
    assert odd.source == "session-id" and odd.id.startswith("h-") and len(odd.id) == 34
    assert session_ref({"session-id": "a/b c"}, {}) == odd                         # stable
    with pytest.raises(APIError) as bad:                                            # agentkv's own: 400
        session_ref({"x-session-id": "../etc"}, {})
    assert bad.value.status == 400 and bad.value.param == "session_id"


def conv(first_user: str, *more: str) -> list[dict]:
    msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": first_user}]
    for i, text in enumerate(more):
        msgs += [{"role": "assistant", "content": f"reply {i}"}, {"role": "user", "content": text}]
    return msgs


def test_derived_ids_never_merge_two_conversations(log_target):
    sessions = Sessions(open_session_log(log_target))
    a, b = conv("hello", "fix the build"), conv("hello", "write the docs")   # same system + first user
    sa = sessions.sync("o", SessionRef(None), a)
    sb = sessions.sync("o", SessionRef(None), b)
    assert sa.id == derived_id(a) and sb.id == derived_id(a) + ".1"
    a2 = a + [{"role": "assistant", "content": "done"}, {"role": "user", "content": "next"}]
    b2 = b + [{"role": "assistant", "content": "drafted"}]
    assert sessions.sync("o", SessionRef(None), a2).id == sa.id                  # each continues its own
    assert sessions.sync("o", SessionRef(None), b2).id == sb.id
    assert sessions.sync("o", SessionRef(None), a[:2]).id == sa.id               # a retry of turn one
    assert sessions.log.history(sa.key) == a2
    assert sessions.log.history(sb.key) == b2
    assert sessions.sync("p", SessionRef(None), b).id == derived_id(b)           # another owner: its own
    # an explicit id is the client's word: a diverging conversation appends to it
    sessions.sync("o", SessionRef("mine", "x-session-id"), a)
    sessions.sync("o", SessionRef("mine", "x-session-id"), b)
    assert sessions.log.history("o/mine") == a + b[3:]   # "reply 0" is common to both


def test_concurrent_requests_on_one_session_append_each_message_once(log_target):
    """Two replicas (two connections) sync the same growing conversation at once."""
    logs = [open_session_log(log_target), open_session_log(log_target)]
    replicas = [Sessions(log) for log in logs]
    turns = [conv("go", *[f"step {i}" for i in range(n)]) for n in range(12)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def client(i: int, sid: str | None) -> None:
        try:
            for msgs in turns:
                barrier.wait(timeout=60)
                replicas[i % 2].sync("o", SessionRef(sid, "x-session-id" if sid else "derived"), msgs)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i, sid)) for i, sid in enumerate(["s", "s", None, None])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert logs[0].history("o/s") == turns[-1]
    assert logs[1].history("o/" + derived_id(turns[-1])) == turns[-1]
    assert logs[0].states_like("o/" + derived_id(turns[-1])).keys() == {"o/" + derived_id(turns[-1])}


def test_forks_found_by_key_range_not_a_scan(log_target):
    """A derived session's forks are one key range of the views' primary key: neighbours of the
    name are left out, and the lookup uses the index (its cost does not grow with the sessions stored)."""
    log = open_session_log(log_target)
    names = ["o/ab", "o/ab.1", "o/ab.12", "o/ab.x", "o/a", "o/abc", "o/ab-1", "o/ab/1", "o/ab0", "p/ab", "o/AB.1"]
    for n in names:
        log.put_state(n, {"name": n})
    assert log.states_like("o/ab") == {n: {"name": n} for n in ["o/ab", "o/ab.1", "o/ab.12", "o/ab.x"]}
    assert log.states_like("o/zz") == {}
    with log.lock:
        if log_target.startswith("postgres"):
            log.conn.execute("SET enable_seqscan = off")   # a table this small is scanned unless told
            plan = log.conn.execute("EXPLAIN " + log.FORKS_SQL.replace("?", "%s"), ("o/ab", "o/ab/")).fetchall()
            log.conn.execute("RESET enable_seqscan")
            assert "views_session_bytes" in str(plan), plan
        else:
            plan = log.conn.execute("EXPLAIN QUERY PLAN " + log.FORKS_SQL, ("o/ab", "o/ab/")).fetchall()
            assert "USING INDEX" in str(plan) and "session>? AND session<?" in str(plan), plan
    log.close()
