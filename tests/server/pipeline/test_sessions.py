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
    assert sa.id.startswith(derived_id(a) + ".") and sb.id.startswith(derived_id(a) + ".") and sa.id != sb.id
    a2 = a + [{"role": "assistant", "content": "done"}, {"role": "user", "content": "next"}]
    b2 = b + [{"role": "assistant", "content": "drafted"}]
    assert sessions.sync("o", SessionRef(None), a2).id == sa.id                  # each continues its own
    assert sessions.sync("o", SessionRef(None), b2).id == sb.id
    assert sessions.sync("o", SessionRef(None), a2).id == sa.id                  # a retry of the same turn
    assert sessions.log.history(sa.key) == a2
    assert sessions.log.history(sb.key) == b2
    assert sessions.sync("p", SessionRef(None), b).id not in (sa.id, sb.id)      # another owner: its own


def test_without_an_id_a_conversation_never_joins_one_holding_what_it_did_not_send(log_target):
    """A new conversation whose first turn is where a stored one began gets a session of its own
    (on c095b51 it joined the stored one, got its id and could read all of it), and that id is
    not one anybody can guess from the first messages."""
    sessions = Sessions(open_session_log(log_target))
    secret = conv("hello", "the deploy key is 7731")
    stored = sessions.sync("o", SessionRef(None), secret)
    newcomer = sessions.sync("o", SessionRef(None), conv("hello"))              # the same first turn
    assert newcomer.id != stored.id
    assert sessions.log.history(newcomer.key) == conv("hello")                  # nothing else is readable
    assert "7731" not in json.dumps(sessions.log.history(newcomer.key))
    again = Sessions(open_session_log(log_target)).sync("o", SessionRef(None), conv("hello", "x"))
    assert again.id not in (stored.id, newcomer.id) or again.id == newcomer.id  # it may continue only its own
    assert len({stored.id.rsplit(".", 1)[1], newcomer.id.rsplit(".", 1)[1]}) == 2   # random tokens, not .1 .2
    assert all(len(x.id.rsplit(".", 1)[1]) == 16 for x in (stored, newcomer))


def test_conversations_under_one_explicit_id_are_branches(log_target):
    """Two message lists alternating under one id (an agent and its subagent under Claude Code's
    session id): each keeps its own view state, and the log gets each message once (on c095b51
    every switch re-appended the other's tail and reset its edits)."""
    sessions = Sessions(open_session_log(log_target))
    ref = SessionRef("cc-1", "x-claude-code-session-id")
    main, sub = conv("hello", "fix the build"), conv("hello", "you are a subagent: grep")
    first = sessions.sync("o", ref, main)
    edited = first.state.copy()                         # an edit in force on the main branch
    edited.replaced[1] = {"role": "user", "content": "[cleared]"}
    assert sessions.save(first, edited)
    for turn in range(4):
        main = main + [{"role": "assistant", "content": f"main {turn}"}, {"role": "user", "content": f"go {turn}"}]
        sub = sub + [{"role": "assistant", "content": f"sub {turn}"}, {"role": "user", "content": f"more {turn}"}]
        m, b = sessions.sync("o", ref, main), sessions.sync("o", ref, sub)
        assert m.id == b.id == "cc-1" and m.key == b.key == first.key
        assert m.branch == first.branch and b.branch != m.branch
        assert m.state.replaced == {1: {"role": "user", "content": "[cleared]"}}   # the edit survives the switches
        assert b.state.replaced == m.state.replaced      # inherited: it was made before the branches diverged
    s = sessions.sync("o", ref, sub)                    # an edit on the subagent's branch only
    edited = s.state.copy()
    edited.replaced[4] = {"role": "assistant", "content": "[sub edit]"}
    assert sessions.save(s, edited)
    assert 4 not in sessions.sync("o", ref, main).state.replaced
    assert 4 in sessions.sync("o", ref, sub).state.replaced
    logged = sessions.log.history(first.key)
    assert len(logged) == len(main) + len(sub) - 3            # linear: the shared 3 messages once
    assert logged[:len(conv("hello", "fix the build"))] == conv("hello", "fix the build")


def test_an_edit_is_saved_only_onto_the_state_it_was_made_on(log_target):
    """A request whose edits were made on a state another request has since saved (a newer turn of
    the same session) does not overwrite it: its save is refused and it runs again (on c095b51 the
    edit was saved over the newer keys, and the next request logged its messages a second time)."""
    log = open_session_log(log_target)
    sessions = Sessions(log)
    ref = SessionRef("s", "x-session-id")
    short, longer = conv("go", "a"), conv("go", "a", "b")
    slow = sessions.sync("o", ref, short)                 # request A synced ...
    sessions.sync("o", ref, longer)                        # ... request B, newer, synced meanwhile
    edited = slow.state.copy()
    edited.replaced[1] = {"role": "user", "content": "[edit]"}
    assert not sessions.save(slow, edited)                 # A's edit would overwrite B's keys: refused
    again = sessions.sync("o", ref, short)                 # A runs again, on the newest state
    assert sessions.save(again, again.state.copy())
    sessions.sync("o", ref, longer + [{"role": "assistant", "content": "c"}])
    assert log.history("o/s") == longer + [{"role": "assistant", "content": "c"}]   # every message once
    # a retried request that changes nothing writes nothing: its save still fits
    same = sessions.sync("o", ref, longer + [{"role": "assistant", "content": "c"}])
    assert sessions.sync("o", ref, longer + [{"role": "assistant", "content": "c"}]).state.version == same.state.version


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
    (fork,) = logs[0].states_like("o/" + derived_id(turns[-1]))   # both clients always in one session
    assert logs[1].history(fork) == turns[-1]


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


def test_a_branch_shares_the_longest_prefix_and_the_log_gets_no_message_twice(log_target):
    sessions = Sessions(open_session_log(log_target))
    ref = SessionRef("x", "x-session-id")
    full = conv("go", "step")                                    # [s, u, a0, u1]
    sessions.sync("o", ref, full)
    sessions.sync("o", ref, full[:2])                            # a retry of the first turn: a branch
    other = full[:3] + [{"role": "user", "content": "another step"}]
    sessions.sync("o", ref, other)                               # shares 3 with the first branch
    assert sessions.log.history("o/x") == full + other[3:]       # "reply 0" once


def test_a_conversation_without_an_id_never_lands_in_an_explicit_branch(log_target):
    """A client that sends its derived id back explicitly makes branches under it; a request without
    an id still finds only the forks themselves."""
    sessions = Sessions(open_session_log(log_target))
    a = conv("hi", "one")
    fork = sessions.sync("o", SessionRef(None), a)
    sessions.sync("o", SessionRef(fork.id, "x-session-id"), conv("hi", "two"))      # a branch "<fork>#1"
    again = sessions.sync("o", SessionRef(None), conv("hi", "two") + [{"role": "assistant", "content": "x"}])
    assert "#" not in again.key and again.key != fork.key


def test_within_one_key_whoever_sent_a_first_turn_holds_the_session_it_grows_into(log_target):
    """The documented limit (README, "Security"): the key is the unit of trust. A conversation
    without a session id joins the stored session whose messages it continues, so a caller of the
    same key who sent its first turn first holds the id that conversation's later turns land in,
    and can read them. Another key never; a conversation under an explicit id never joins it."""
    sessions = Sessions(open_session_log(log_target))
    planted = sessions.sync("o", SessionRef(None), conv("hello"))                  # sent first by another caller
    real = conv("hello", "the deploy key is 7731")
    assert sessions.sync("o", SessionRef(None), real).id == planted.id              # the real client joins it
    assert "7731" in json.dumps(sessions.log.history(planted.key))                  # readable by that id
    assert sessions.sync("p", SessionRef(None), real).id != planted.id              # another key: never
    guarded = real + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "the token is 9911"}]
    assert sessions.sync("o", SessionRef("mine", "x-session-id"), guarded).key == "o/mine"
    assert "9911" not in json.dumps(sessions.log.history(planted.key))


def test_a_claim_has_one_holder_across_processes_sharing_the_log(log_target):
    """What keeps one message-thread continue at a time on every replica: two connections to one
    log (two processes), concurrent claimers, one winner; released or expired, it can be taken
    again, and a holder whose claim expired and was taken cannot release the new holder's."""
    one, two = open_session_log(log_target), open_session_log(log_target)
    won: list[str | None] = []
    threads = [threading.Thread(target=lambda log=log: won.append(log.claim("thread-continue:msg_a", 60)))
               for log in (one, two, one, two)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (holder,) = [h for h in won if h]
    assert won.count(None) == 3
    two.release("thread-continue:msg_a", holder)
    first = one.claim("thread-continue:msg_a", 0.0)
    assert first and two.claim("thread-continue:msg_b", 60)
    second = two.claim("thread-continue:msg_a", 60)   # the first one's claim expired at once
    assert second
    one.release("thread-continue:msg_a", first)       # too late: the claim is the second holder's
    assert one.claim("thread-continue:msg_a", 60) is None
    assert one.claim("thread-continue:msg_b", 60) is None


def test_a_branch_identity_is_never_reused_when_its_state_key_is(log_target):
    """Past ``MAX_BRANCHES`` a new branch takes the least recently used branch's state key; its
    identity (what the KV connector and the approximate cache salt know it by) is its own, so it
    never reads the old branch's held or moved K/V (issue 51: it took the old one's name, token and
    salt). A branch that continues keeps its identity turn after turn."""
    from agentkv.server.pipeline.sessions import MAX_BRANCHES

    sessions = Sessions(open_session_log(log_target))
    ref = SessionRef("many", "x-session-id")
    seen: dict[str, set[str]] = {}
    for i in range(MAX_BRANCHES + 6):
        s = sessions.sync("o", ref, conv("hello", f"subagent {i}"))
        seen.setdefault(s.branch, set()).add(s.identity)
        again = sessions.sync("o", ref, conv("hello", f"subagent {i}") + [{"role": "assistant", "content": "ok"}])
        assert again.branch == s.branch and again.identity == s.identity    # the same branch, continued
    assert len(seen) <= MAX_BRANCHES                                        # state keys are bounded...
    assert any(len(ids) > 1 for ids in seen.values())                       # ... so some were reused
    identities = [i for ids in seen.values() for i in ids]
    assert len(identities) == len(set(identities)) == MAX_BRANCHES + 6     # ... but never an identity


def test_an_id_holding_at_signs_keeps_its_branch_identity_and_its_page(log_target):
    """Ids may hold "@" (``SESSION_ID``); a branch's identity joined its state key and the identity
    drawn for it with "@", and the sessions page split the turn's identity at the first "@": for
    ``me@host`` it looked up the state of ``me`` (none, or another session's) and showed an empty
    view. The separator is now "~", which no id, owner or state key holds."""
    from agentkv.server.api.ui import views
    from agentkv.server.pipeline.sessions import IDENT, SESSION_ID, branch_of

    assert not SESSION_ID.fullmatch(IDENT) and not SESSION_ID.fullmatch(f"a{IDENT}b")
    log = open_session_log(log_target)
    sessions = Sessions(log)
    ref = SessionRef("me@host:1@x", "x-session-id")
    first = sessions.sync("o", ref, conv("hello", "fix the build"))
    assert first.identity == first.branch == "o/me@host:1@x" == branch_of(first.identity)
    other = conv("hello", "write the docs")
    second = sessions.sync("o", ref, other)                                 # a branch of its own, an identity drawn
    assert second.branch != first.branch and second.state.ident
    assert second.identity == f"{second.branch}{IDENT}{second.state.ident}"
    assert branch_of(second.identity) == second.branch
    sessions.sync("o", SessionRef("me", "x-session-id"), conv("another", "session"))   # what "@" split to
    log.add_turn(first.key, first.identity, {"api": "chat"})
    log.add_turn(second.key, second.identity, {"api": "chat"})
    page = views.session(log, "o", "me@host:1@x")
    assert page is not None and page["branches"] == 2 and [t["branch"] for t in page["turns"]] == [1, 2]
    assert [m["text"] for m in page["view"]] == [m["content"] for m in other]   # the last turn's branch

