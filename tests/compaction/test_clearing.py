"""Tool-result clearing: invariants (hypothesis) and exact prompt edits."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from agentkv.compaction.clearing import clear_tool_uses, is_cleared
from agentkv.compaction.config import ClearToolUses, Trigger
from agentkv.compaction.edits import apply_edits
from agentkv.compaction.groups import tool_uses

from agent_sessions import TOOLS, conversations

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
CONFIGS = st.builds(ClearToolUses, trigger=st.sampled_from([0, 200, 10_000]), keep=st.integers(0, 3),
                    clear_at_least=st.sampled_from([0, 50, 5000]), clear_to=st.sampled_from([None, None, 0, 300]),
                    exclude_tools=st.sampled_from([[], ["grep"], ["bash", "read_file"]]),
                    clear_tool_inputs=st.booleans())


@SETTINGS
@given(msgs=conversations(), cfg=CONFIGS)
def test_clearing_invariants(renderer, msgs, cfg):
    r = clear_tool_uses(msgs, renderer, cfg, TOOLS)
    new = r.messages
    assert len(new) == len(msgs)
    assert r.tokens_after <= r.tokens_before                                  # never grows
    assert r.tokens_after == renderer.count(new, TOOLS)
    for a, b in zip(msgs, new):
        assert a["role"] == b["role"]
        if a["role"] in ("system", "user"):
            assert a == b                                                      # never cleared
    old_uses = tool_uses(msgs)
    new_uses = tool_uses(new)                                                  # pairs intact
    assert [(u.call_id, u.call_index, u.result_index, u.name) for u in old_uses] == \
        [(u.call_id, u.call_index, u.result_index, u.name) for u in new_uses]
    answered = [u for u in old_uses if u.result_index is not None]
    protected = answered[len(answered) - cfg.keep:] if cfg.keep else []
    if cfg.clear_to is not None and r.edits:   # a low-water mark clears the kept ones too, all but the newest
        protected = protected[-1:]
    for u in answered:
        if u in protected or cfg.excluded(u.name):
            assert new[u.result_index] == msgs[u.result_index]
    if r.edits:
        assert r.tokens_before >= cfg.trigger.value and r.cleared_tokens >= cfg.clear_at_least
    else:
        assert new == msgs
    # the edits turn the old prompt's tokens into the new prompt's tokens, exactly
    old_ids = renderer.render(msgs, TOOLS).token_ids
    assert apply_edits(old_ids, r.edits) == renderer.render(new, TOOLS).token_ids
    for e in r.edits:
        assert 0 <= e.start <= e.end <= len(old_ids)


@SETTINGS
@given(msgs=conversations(), cfg=CONFIGS)
def test_clearing_is_idempotent(renderer, msgs, cfg):
    once = clear_tool_uses(msgs, renderer, cfg, TOOLS)
    twice = clear_tool_uses(once.messages, renderer, cfg, TOOLS)
    assert twice.messages == once.messages and twice.edits == []


def test_placeholder_names_tool_arguments_and_recall(renderer):
    msgs = [{"role": "user", "content": "check media"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "bash", "arguments": '{"cmd": "diag.py media"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "timeout_ms = 1050\n" * 50},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c2", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]},
            {"role": "tool", "tool_call_id": "c2", "content": "a.py b.py"}]
    r = clear_tool_uses(msgs, renderer, ClearToolUses(trigger=0, keep=1))
    assert r.cleared_tool_uses == 1 and is_cleared(r.messages[2]) and not is_cleared(r.messages[4])
    text = r.messages[2]["content"]
    assert "bash" in text and "diag.py media" in text and "recall" in text
    (edit,) = r.edits
    assert edit.kind == "clear_tool_result" and edit.message_index == 2
    start, end = renderer.render(msgs).ranges[2]
    assert start < edit.start < edit.end < end          # only the content tokens are replaced
    assert r.cleared_tokens > 200


def test_trigger_and_clear_at_least_leave_the_prompt_alone(renderer):
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "grep", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "hit " * 100}]
    n = renderer.count(msgs)
    assert clear_tool_uses(msgs, renderer, ClearToolUses(trigger=n + 1, keep=0)).messages == msgs
    assert clear_tool_uses(msgs, renderer, ClearToolUses(trigger=0, keep=0, clear_at_least=n)).messages == msgs
    assert clear_tool_uses(msgs, renderer, ClearToolUses(trigger=0, keep=0)).messages != msgs


def test_anthropic_style_thresholds_are_accepted():
    cfg = ClearToolUses.model_validate({"trigger": {"type": "input_tokens", "value": 30000},
                                        "keep": {"type": "tool_uses", "value": 2}})
    assert cfg.trigger == Trigger(type="input_tokens", value=30000) and cfg.keep == 2
    with pytest.raises(ValidationError, match="tool_uses"):
        ClearToolUses.model_validate({"keep": {"type": "input_tokens", "value": 2}})


def _uses(n: int, result: str = "hit " * 100) -> list[dict]:
    msgs = [{"role": "user", "content": "x"}]
    for i in range(n):
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"c{i}", "type": "function",
                      "function": {"name": ["grep", "bash"][i % 2], "arguments": f'{{"q": "{i}"}}'}}]},
                 {"role": "tool", "tool_call_id": f"c{i}", "content": result}]
    return msgs


def test_trigger_on_tool_uses(renderer):
    msgs = _uses(4)
    at = ClearToolUses.model_validate({"trigger": {"type": "tool_uses", "value": 4}, "keep": 1})
    above = ClearToolUses.model_validate({"trigger": {"type": "tool_uses", "value": 5}, "keep": 1})
    assert clear_tool_uses(msgs, renderer, at).cleared_tool_uses == 3
    assert clear_tool_uses(msgs, renderer, above).messages == msgs


def test_clear_tool_inputs_of_named_tools_only(renderer):
    msgs = _uses(4)
    r = clear_tool_uses(msgs, renderer, ClearToolUses(trigger=0, keep=0, clear_tool_inputs=["bash"]))
    args = [m["tool_calls"][0]["function"]["arguments"] for m in r.messages if m.get("tool_calls")]
    assert args == ['{"q": "0"}', "{}", '{"q": "2"}', "{}"]            # grep's kept, bash's cleared
    assert r.cleared_tool_uses == 4


def test_count_equals_full_tokenization(renderer):
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hello world " * 30}]
    assert renderer.count(msgs, TOOLS) == len(renderer.render(msgs, TOOLS).token_ids)


def test_a_request_naming_no_size_edit_keeps_the_default_clearing_and_compaction():
    from agentkv.compaction.config import ClearThinking, Compact
    from agentkv.compaction.policy import ContextManagement, default_policy, with_defaults

    default = default_policy(8192, 3000, 0.8, 0.2, 0.9)
    assert with_defaults(None, default) == default
    off = ContextManagement(edits=[])
    assert with_defaults(off, default) == off                           # {"edits": []}: no management
    claude = ContextManagement.model_validate({"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]})
    merged = with_defaults(claude, default)
    assert [type(e) for e in merged.edits] == [ClearThinking, ClearToolUses, Compact]
    assert merged.edits[1:] == default.edits
    only_clear = ContextManagement.model_validate({"edits": [{"type": "clear_thinking"},
                                                             {"type": "clear_tool_uses", "trigger": 100}]})
    assert with_defaults(only_clear, default) == only_clear             # names clearing: exactly that
    only_compact = ContextManagement.model_validate({"edits": [{"type": "compact", "trigger": 100}]})
    assert with_defaults(only_compact, default) == only_compact
    assert with_defaults(claude, None) == claude                        # --no-context-management



def test_a_batch_that_cannot_get_under_its_trigger_waits_for_the_summary(renderer):
    """With a low-water mark (the server default's clearing), a conversation whose bulk is text
    (user and assistant messages, which clearing never touches) is not cleared a little on every
    turn: a batch that leaves the prompt over its trigger waits for the policy's summary while the
    prompt is under the summary's trigger (and the window); at that trigger, or with no summary in
    the policy, or for Anthropic's clearing (no ``clear_to``), it is made."""
    from agentkv.compaction.config import Compact
    from agentkv.compaction.policy import ContextManagement

    text = " ".join(["the cache of the server"] * 120)
    msgs = [{"role": "user", "content": text}]
    for i in range(4):
        msgs += [{"role": "assistant", "content": text, "tool_calls": [{"id": f"c{i}", "type": "function",
                  "function": {"name": "grep", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": f"c{i}", "content": " ".join(["result line"] * 60)}]
    before = renderer.count(msgs, TOOLS)
    results = sum(renderer.count_text(m["content"]) for m in msgs if m["role"] == "tool")
    summary = ContextManagement(edits=[Compact(trigger=before + 100)])
    reachable = ClearToolUses(trigger=before - results // 2, keep=1, clear_to=0)
    r = clear_tool_uses(msgs, renderer, reachable, TOOLS)
    assert r.edits and not reachable.left_to_summary(r.tokens_before, r.tokens_after, summary.edits, 10 * before)
    text_bound = ClearToolUses(trigger=before - results - 50, keep=1, clear_to=0)     # text alone is over it
    r = clear_tool_uses(msgs, renderer, text_bound, TOOLS)
    assert r.edits and r.tokens_after >= text_bound.trigger.value
    assert text_bound.left_to_summary(r.tokens_before, r.tokens_after, summary.edits, 10 * before)      # waits
    waits = functools.partial(text_bound.left_to_summary, edits=summary.edits, window=10 * before)
    assert clear_tool_uses(msgs, renderer, text_bound, TOOLS, wait=waits).edits == []             # as the step asks
    assert clear_tool_uses(msgs, renderer, reachable, TOOLS, wait=functools.partial(
        reachable.left_to_summary, edits=summary.edits, window=10 * before)).edits
    assert not text_bound.left_to_summary(r.tokens_before, r.tokens_after, summary.edits, before)       # window
    at_summary = ContextManagement(edits=[Compact(trigger=before)])
    assert not text_bound.left_to_summary(r.tokens_before, r.tokens_after, at_summary.edits, 10 * before)
    assert not text_bound.left_to_summary(r.tokens_before, r.tokens_after, ContextManagement().edits, 10 * before)
    anthropic = text_bound.model_copy(update={"clear_to": None})
    assert not anthropic.left_to_summary(r.tokens_before, r.tokens_after, summary.edits, 10 * before)
