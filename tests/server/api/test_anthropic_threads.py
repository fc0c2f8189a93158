"""Anthropic message threads and compaction on demand, through the official ``anthropic`` SDK (its
thread helper and its typed errors) against the small server (its log on PostgreSQL, 1k window)."""

from __future__ import annotations

import asyncio
import time
import uuid

import anthropic
import pytest

from agentkv.compaction.log.open import open_session_log
from agentkv.server.api.messages import threads
from agentkv.server.errors import APIError

from conftest import OTHER_KEY

MODEL = "agentkv-tiny"
THREADS = "message-threads-2026-08-12"
COMPACT = "compact-2026-09-04"


def client(server, key: str | None = None) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=key or server.api_key, max_retries=0, timeout=300)


def cm(message) -> dict:
    """agentkv's report beside Anthropic's fields in the SDK's ``context_management``."""
    return message.context_management.model_dump()


def _create(c, messages, **kw):
    return c.beta.messages.create(model=MODEL, max_tokens=8, messages=messages, betas=[THREADS], **kw)


def test_a_continue_sends_only_the_new_messages_and_the_engine_gets_the_whole_conversation(small_server):
    c = client(small_server)
    system = f"agent {uuid.uuid4()}"
    first = [{"role": "user", "content": "list the services"}]
    created = _create(c, first, system=system, thread={"type": "create"})
    nxt = [{"role": "user", "content": "which one is slow?"}]
    cont = _create(c, nxt, thread={"type": "continue", "previous_message_id": created.id})
    whole = first + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in created.content]}] + nxt
    resent = c.beta.messages.create(model=MODEL, max_tokens=8, system=system, messages=whole,
                                    extra_headers={"X-Session-Id": f"whole-{uuid.uuid4().hex[:8]}"})
    assert cm(cont)["prompt_tokens_after"] == cm(resent)["prompt_tokens_after"]
    sid = cm(cont)["session_id"]
    assert sid == cm(created)["session_id"]          # one session, served from its log
    log = small_server.http().get(f"/v1/sessions/{sid}/messages").json()["data"]
    assert [m["role"] for m in log] == ["system", "user", "assistant", "user"]
    # each response is continued once; the SDK's helper replays the whole conversation on that error
    with pytest.raises(anthropic.BadRequestError) as again:
        _create(c, nxt, thread={"type": "continue", "previous_message_id": created.id})
    assert again.value.error_code == "thread_already_continued"


def test_a_thread_is_its_keys_and_keeps_its_system_and_tools(small_server):
    c = client(small_server)
    created = _create(c, [{"role": "user", "content": "hi"}], system="agent", thread={"type": "create"})
    with pytest.raises(anthropic.NotFoundError) as foreign:
        _create(client(small_server, OTHER_KEY), [{"role": "user", "content": "more"}],
                thread={"type": "continue", "previous_message_id": created.id})
    assert foreign.value.error_code == "thread_not_found"
    with pytest.raises(anthropic.NotFoundError) as unknown:
        _create(c, [{"role": "user", "content": "more"}], thread={"type": "continue",
                                                                 "previous_message_id": f"msg_{uuid.uuid4().hex}"})
    assert unknown.value.error_code == "thread_not_found"
    with pytest.raises(anthropic.BadRequestError) as changed:
        _create(c, [{"role": "user", "content": "more"}], system="another agent",
                thread={"type": "continue", "previous_message_id": created.id})
    assert changed.value.error_code == "thread_fingerprint_mismatch" and "system" in str(changed.value)


def test_the_sdks_thread_helper_runs_turns_streamed_and_not(small_server):
    c = client(small_server)
    thread = c.beta.messages.thread(model=MODEL, max_tokens=8, system=f"agent {uuid.uuid4()}")
    one = thread.send({"role": "user", "content": "first question"})
    with thread.stream({"role": "user", "content": "second question"}) as stream:
        two = stream.get_final_message()
    three = thread.send({"role": "user", "content": "third question"})
    sid = cm(three)["session_id"]
    assert cm(one)["session_id"] == cm(two)["session_id"] == sid
    log = small_server.http().get(f"/v1/sessions/{sid}/messages").json()["data"]
    assert [m["role"] for m in log] == ["system", "user", "assistant", "user", "assistant", "user"]


def test_a_thread_expires_five_minutes_after_its_last_response(tmp_path):
    """Checked on the log itself: a response stored 301 s ago cannot be continued (404 thread_not_found)."""
    log = open_session_log(tmp_path / "log.db")
    mid = f"msg_{uuid.uuid4().hex}"
    log.put_response(mid, "o/s", None, [{"role": "user", "content": "hi"}], {"kind": threads.KIND})
    body = {"messages": [{"role": "user", "content": "more"}],
            "thread": {"type": "continue", "previous_message_id": mid}}
    assert asyncio.run(threads.resume(log, "o", dict(body))).parent == mid
    with log.lock:
        log.conn.execute("UPDATE responses SET created = ? WHERE id = ?", (time.time() - threads.TTL_S - 1, mid))
    with pytest.raises(APIError) as expired:
        asyncio.run(threads.resume(log, "o", dict(body)))
    assert expired.value.status == 404 and expired.value.error_code == "thread_not_found"


# -- compaction on demand -------------------------------------------------------------------------
def _conversation() -> list[dict]:
    return [{"role": "user", "content": "check the media service"},
            {"role": "assistant", "content": "media is up; latency 40 ms"},
            {"role": "user", "content": "and auth?"}, {"role": "assistant", "content": "auth is down"}]


def _compact(c, messages, **kw):
    return c.beta.messages.create(model=MODEL, max_tokens=64, messages=messages, betas=[COMPACT],
                                  compaction={"type": "summarize"}, **kw)


def test_compaction_on_demand_round_trip(small_server):
    c = client(small_server)
    done = _compact(c, _conversation())
    assert done.stop_reason == "compaction" and [b.type for b in done.content] == ["compaction"]
    block = done.content[0].model_dump(exclude_none=True)
    assert block["content"] and block["signature"].startswith("akv1.")
    later = [{"role": "assistant", "content": [block]}, {"role": "user", "content": "what was down?"}]
    answer = c.beta.messages.create(model=MODEL, max_tokens=8, messages=later, betas=[COMPACT])
    assert answer.stop_reason in ("end_turn", "max_tokens")
    counted = c.beta.messages.count_tokens(model=MODEL, messages=later, compaction={"type": "summarize"},
                                           betas=[COMPACT])   # count_tokens ignores the parameter
    assert counted.input_tokens == cm(answer)["prompt_tokens_before"]
    with c.beta.messages.stream(model=MODEL, max_tokens=64, messages=_conversation(), betas=[COMPACT],
                                compaction={"type": "summarize"}) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "compaction" and streamed.content[0].type == "compaction"


def test_altered_forged_foreign_and_misplaced_blocks_get_anthropics_errors(small_server):
    c = client(small_server)
    block = _compact(c, _conversation()).content[0].model_dump(exclude_none=True)
    after = {"role": "user", "content": "go on"}
    cases = [
        ([{"role": "assistant", "content": [{**block, "content": block["content"] + " (edited)"}]}, after],
         c, "compaction_content_mismatch"),
        ([{"role": "assistant", "content": [{**block, "signature": block["signature"][:-4] + "AAAA"}]}, after],
         c, "compaction_signature_invalid"),
        ([{"role": "assistant", "content": [block]}, after], client(small_server, OTHER_KEY),
         "compaction_signature_invalid"),
        ([after, {"role": "assistant", "content": [block]}, after], c, "compaction_block_misplaced"),
        ([{"role": "assistant", "content": [block, {**block}]}, after], c, "compaction_block_ambiguous"),
    ]
    for messages, who, code in cases:
        with pytest.raises(anthropic.BadRequestError) as refused:
            who.beta.messages.create(model=MODEL, max_tokens=8, messages=messages, betas=[COMPACT])
        assert refused.value.error_code == code, (code, refused.value)
    # an unsigned block (compact_20260112's, or a client's own) is no second summary of ours
    beside = c.beta.messages.create(model=MODEL, max_tokens=8, betas=[COMPACT], messages=[
        {"role": "assistant", "content": [block, {"type": "compaction", "content": "another summary"}]}, after])
    assert beside.stop_reason in ("end_turn", "max_tokens")
    with pytest.raises(anthropic.BadRequestError) as both:     # a thread is not compacted on demand
        c.beta.messages.create(model=MODEL, max_tokens=8, messages=_conversation(), betas=[COMPACT, THREADS],
                               compaction={"type": "summarize"}, thread={"type": "create"})
    assert both.value.error_code == "thread_unsupported_request"
    unanswered = _conversation()[:-1] + [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "probe", "input": {}}]}]
    for messages, extra, code in [(unanswered, {}, "compaction_incomplete_turn"),
                                  ([{"role": "user", "content": ""}], {}, "compaction_nothing_to_summarize"),
                                  (_conversation(), {"stop_sequences": ["x"]}, None)]:
        with pytest.raises(anthropic.BadRequestError) as refused:
            _compact(c, messages, **extra)
        assert refused.value.error_code == code, (code, refused.value)
