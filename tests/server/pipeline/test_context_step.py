"""Where the request path's context step runs: small conversations on the event loop, large ones
and summaries on a thread; the result and the session log are the same either way."""

from __future__ import annotations

import asyncio
import json
import threading

from agentkv.compaction.config import Compact
from agentkv.compaction.log.open import open_session_log
from agentkv.compaction.policy import ContextManagement
from agentkv.server.config import ServeConfig
from agentkv.server.pipeline.context import INLINE_CHARS, ContextManager, manage
from agentkv.server.pipeline.sessions import SessionRef, Sessions

NO_DEFAULT = ServeConfig(context_management=False)   # only the edits a test asks for


class Note:
    """The summarizer: a fixed note (what the summary says is not under test here)."""

    def complete(self, messages, max_tokens, cache_salt=None):
        assert cache_salt == "s"   # the step's salt reaches the summarizer's request
        return "Goal: fix the timeout."


class Where(ContextManager):
    """Records the thread each ``prepare`` call ran on, and whether it finished."""

    def __init__(self, *a):
        super().__init__(*a)
        self.calls: list[tuple[str, bool]] = []

    def prepare(self, *a, **kw):
        try:
            out = super().prepare(*a, **kw)
        except Exception:
            self.calls.append((threading.current_thread().name, False))
            raise
        self.calls.append((threading.current_thread().name, True))
        return out


def conversation(system: str, tool_output_chars: int) -> list[dict]:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Fix it."}]
    for i in range(6):
        msgs.append({"role": "assistant", "content": f"step {i}", "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"cmd": "ls"})}}]})
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": "x " * (tool_output_chars // 12)})
    return msgs


def run(ctx, session: str, msgs: list[dict], policy: ContextManagement | None = None):
    """(the event loop's thread, what manage prepared)."""
    async def go():
        prepared = await manage(ctx, NO_DEFAULT, 8192, "o", SessionRef(session), msgs, None, policy, salt="s")
        return threading.current_thread().name, prepared
    return asyncio.run(go())


def test_small_conversations_inline_large_ones_on_a_thread(renderer, tmp_path):
    ctx = Where(Sessions(open_session_log(tmp_path / "log.db")), renderer, Note())
    small = conversation("agent a", 6_000)
    loop, prepared = run(ctx, "a", small)
    assert ctx.calls == [(loop, True)] and prepared.messages == small
    ctx.calls.clear()
    big = conversation("agent b", 2 * INLINE_CHARS)
    loop, prepared = run(ctx, "b", big)
    assert len(ctx.calls) == 1 and ctx.calls[0][0] != loop and ctx.calls[0][1] and prepared.messages == big


def test_a_summary_moves_the_step_to_a_thread_and_logs_each_message_once(renderer, tmp_path):
    log = open_session_log(tmp_path / "log.db")
    ctx = Where(Sessions(log), renderer, Note())
    msgs = conversation("agent c", 3_000)
    policy = ContextManagement(edits=[Compact(trigger=10, keep_recent_tokens=50)])
    loop, prepared = run(ctx, "c", msgs, policy)
    assert ctx.calls[0] == (loop, False)                        # stopped before calling the model
    assert len(ctx.calls) == 2 and ctx.calls[1][0] != loop and ctx.calls[1][1]
    assert [e["type"] for e in prepared.report["applied_edits"]] == ["compact"]
    assert prepared.compaction is not None and prepared.compaction in prepared.messages
    assert log.history("o/c") == msgs                           # the inline try's sync was not repeated


class Counting(Note):
    def __init__(self):
        self.calls = 0

    def complete(self, messages, max_tokens, cache_salt=None):
        self.calls += 1
        return super().complete(messages, max_tokens, cache_salt)


def test_a_retried_request_is_not_summarized_again(renderer, tmp_path):
    """A client that retries the same request (it timed out waiting, or was refused after the
    summary) gets the summary already written: the model writes it once."""
    model = Counting()
    ctx = ContextManager(Sessions(open_session_log(tmp_path / "log.db")), renderer, model)
    msgs = conversation("agent d", 3_000)
    policy = ContextManagement(edits=[Compact(trigger=10, keep_recent_tokens=50)])
    first = run(ctx, "d", msgs, policy)[1]
    again = run(ctx, "d2", msgs, policy)[1]       # the same conversation, retried (here under a new session)
    assert model.calls == 1
    assert first.compaction == again.compaction and first.messages == again.messages


def test_a_small_step_goes_to_a_thread_while_the_log_is_held(renderer, tmp_path):
    """A small conversation's step runs inline only where the session log is free at once: with
    its lock held (a transaction on another thread) the step runs on a thread and the event loop
    never waits for the lock; the result is the same."""
    log = open_session_log(tmp_path / "log.db")
    ctx = Where(Sessions(log), renderer, Note())
    held, release = threading.Event(), threading.Event()

    def hold():
        with log.lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    small = conversation("agent e", 3_000)

    async def go():
        step = asyncio.create_task(manage(ctx, NO_DEFAULT, 8192, "o", SessionRef("e"), small, None, None, salt="s"))
        await asyncio.sleep(0.2)
        assert not step.done()          # it waits for the log, on its thread
        release.set()                   # the loop went on meanwhile: this line ran
        return threading.current_thread().name, await step

    loop, prepared = asyncio.run(go())
    holder.join()
    assert len(ctx.calls) == 1 and ctx.calls[0][0] != loop and ctx.calls[0][1]
    assert prepared.messages == small and log.history("o/e") == small


def test_a_keys_context_step_does_the_same_work_whatever_another_key_sent(renderer, tmp_path):
    """Caches of renders and counts are per key: key B's step on a conversation key A just sent
    renders as much as B's step on a server that never saw it (the same path, so the same time:
    no key can time whether another sent a conversation), while A's own repeat renders less."""
    from agentkv.compaction.prompt import PromptRenderer

    calls = [0]

    def counted():
        def render(messages, tools, generation_prompt):
            calls[0] += 1
            return renderer._render_text(messages, tools, generation_prompt)
        return PromptRenderer(renderer.tokenizer, render_text=render, check=renderer.check)

    def step(ctx, owner, msgs) -> int:
        before = calls[0]
        asyncio.run(manage(ctx, NO_DEFAULT, 8192, owner, SessionRef(f"s-{owner}"), msgs, None, None, salt=owner))
        return calls[0] - before

    msgs = conversation("agent f", 3_000)
    cold = step(ContextManager(Sessions(open_session_log(tmp_path / "a.db")), counted(), Note()), "B", msgs)
    ctx = ContextManager(Sessions(open_session_log(tmp_path / "b.db")), counted(), Note())
    assert step(ctx, "A", msgs) == cold > 0
    assert step(ctx, "B", msgs) == cold          # A's traffic changed nothing of B's path
    assert step(ctx, "A", msgs) < cold           # A's own caches serve A


def test_a_summary_is_an_edit_the_kv_connector_can_move_with_the_clears_of_its_step(renderer, tmp_path):
    """A summary replaces messages [head, cut) by one: one span of the prompt, so with shift the kept
    tail's K/V move instead of being recomputed. Made in the step that also cleared, both are edits
    of the prompt before the step: clears inside the summarized part are absorbed, later ones stay."""
    from agentkv.compaction.config import ClearToolUses
    from agentkv.compaction.edits import apply_edits

    ctx = ContextManager(Sessions(open_session_log(tmp_path / "log.db")), renderer, Note())
    msgs = conversation("agent e", 3_000)
    for policy in (ContextManagement(edits=[Compact(trigger=10, keep_recent_tokens=600)]),
                   ContextManagement(edits=[ClearToolUses(trigger=0, keep=1), Compact(trigger=10,
                                                                                      keep_recent_tokens=900)])):
        prepared = asyncio.run(manage(ctx, NO_DEFAULT, 8192, "o", SessionRef(f"e{len(policy.edits)}"), msgs, None,
                                      policy, salt="s", shifting=True))
        types = [e["type"] for e in prepared.report["applied_edits"]]
        assert types[-1] == "compact" and prepared.compaction is not None, types
        final = renderer.render(prepared.messages).token_ids
        assert prepared.edits and prepared.moved
        assert apply_edits(prepared.old_ids, prepared.edits) == final
        assert prepared.old_ids == renderer.render(msgs).token_ids           # edits of the prompt the client sent
        summary = prepared.edits[0]
        assert final[summary.start:summary.start + len(summary.replacement_ids)] == list(summary.replacement_ids)
        assert len(final) - (summary.start + len(summary.replacement_ids)) > 100   # a kept tail to move
        if types == ["clear_tool_uses", "compact"]:
            assert len(prepared.edits) >= 2                                  # the clears after the cut stay
