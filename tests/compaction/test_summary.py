"""Summarization and the baselines: structure, the copied parts, update-not-rewrite, group atomicity."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentkv.compaction.baselines import head_tail, sliding_window
from agentkv.compaction.config import Compact
from agentkv.compaction.groups import groups, tool_uses
from agentkv.compaction.summarize import NOTE_START, OpenAIModelClient, is_summary, previous_note, summarize, transcript

from agent_sessions import TOOLS, conversations


class RecordingClient:
    """A ModelClient that answers with a fixed note and keeps the prompts it was given."""

    def __init__(self, note: str):
        self.note, self.prompts = note, []

    def complete(self, messages, max_tokens):
        self.prompts.append(messages)
        return self.note


def session(n_turns: int = 12) -> list[dict]:
    msgs = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Fix the media timeout. Never touch auth.py."}]
    for i in range(n_turns):
        name = "write_file" if i % 3 == 0 else "bash"
        args = {"path": f"src/mod{i}.py"} if name == "write_file" else {"cmd": f"python diag.py step{i}"}
        msgs.append({"role": "assistant", "content": f"step {i}", "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]})
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"output {i}\n" + "noise line\n" * 40})
        if i == 5:
            msgs.append({"role": "user", "content": "Also keep the retry codes E2033 and E3201."})
    return msgs


def test_summary_copies_user_messages_notes_and_files(renderer):
    msgs = session()
    client = RecordingClient("Goal: fix media timeout. Done: steps 0-8.")
    cfg = Compact(trigger=0, keep_recent_tokens=400)
    r = summarize(msgs, renderer, cfg, client, TOOLS, notes=["decision: raise timeout to 1500"])
    assert r.tokens_before == renderer.count(msgs, TOOLS) and r.tokens_after == renderer.count(r.messages, TOOLS)
    assert r.tokens_after < r.tokens_before
    assert len(r.messages) == len(msgs) - r.summarized_messages + 1            # one summary for the old part
    assert r.messages[0] == msgs[0]
    summary = r.messages[1]
    assert is_summary(summary)
    text = summary["content"]
    assert "Never touch auth.py." in text and "E2033 and E3201" in text       # copied word for word
    assert "decision: raise timeout to 1500" in text
    assert "src/mod0.py" in text and "src/mod3.py" in text
    assert previous_note(r.messages) == client.note
    assert r.messages[2:] == msgs[len(msgs) - len(r.messages) + 2:]           # recent part untouched
    assert r.messages[2]["role"] != "tool"                                     # cut on a group boundary
    old = msgs[1:1 + r.summarized_messages]
    assert client.prompts[0][1]["content"] == \
        f"Conversation to fold into the note:\n{transcript(old)}\n\nWrite the updated handoff note."


def test_next_compaction_updates_the_previous_note(renderer):
    first = summarize(session(), renderer, Compact(trigger=0, keep_recent_tokens=400),
                      RecordingClient("note v1: steps 0-8 done"), TOOLS)
    grown = first.messages + session(6)[2:]
    client = RecordingClient("note v2")
    second = summarize(grown, renderer, Compact(trigger=0, keep_recent_tokens=300), client, TOOLS)
    ask = client.prompts[0][1]["content"]
    assert ask.startswith("Previous handoff note:\nnote v1: steps 0-8 done")
    assert sum(is_summary(m) for m in second.messages) == 1
    assert previous_note(second.messages) == "note v2"


def test_custom_instructions_replace_the_default_prompt(renderer):
    client = RecordingClient("n")
    summarize(session(), renderer, Compact(trigger=0, keep_recent_tokens=300, instructions="Only list ports."),
              client, TOOLS)
    assert client.prompts[0][0] == {"role": "system", "content": "Only list ports."}


def test_below_trigger_nothing_happens(renderer):
    msgs = session(2)
    client = RecordingClient("n")
    assert summarize(msgs, renderer, Compact(trigger=10**9), client, TOOLS).messages == msgs
    assert client.prompts == []


def test_summary_with_the_real_embedded_model(server, renderer):
    client = OpenAIModelClient(server.client(), "agentkv-tiny")
    r = summarize(session(), renderer, Compact(trigger=0, keep_recent_tokens=400, summary_max_tokens=24),
                  client, TOOLS)
    assert is_summary(r.messages[1]) and NOTE_START in r.messages[1]["content"]
    assert previous_note(r.messages) == r.note.strip()
    assert r.summary_tokens == renderer.count_text(r.messages[1]["content"])
    assert r.tokens_after == renderer.count(r.messages, TOOLS) < r.tokens_before


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msgs=conversations(max_turns=10), budget=st.integers(50, 1500), ratio=st.sampled_from([0.0, 0.3, 0.5]))
def test_baselines_fit_and_keep_groups_whole(renderer, msgs, budget, ratio):
    out = head_tail(msgs, renderer, budget, ratio, TOOLS)
    assert out[0] == msgs[0]
    kept = {id(m) for m in out}
    for g in groups(msgs):
        assert len({id(msgs[i]) in kept for i in g}) == 1                      # whole group or none
    if len(out) > 1:
        assert renderer.count(out, TOOLS) <= max(budget, renderer.count(out[:1], TOOLS)) + 8
    for u in tool_uses(out):
        assert u.result_index is not None or all(m.get("tool_call_id") != u.call_id for m in msgs)
    window = sliding_window(msgs, renderer, budget, TOOLS)
    if len(window) > 1:
        assert window[-1] == msgs[-1]


def test_head_ratio_validated(renderer):
    with pytest.raises(ValueError):
        head_tail(session(1), renderer, 100, 1.5)


@pytest.mark.parametrize("window", [600, 1024, 4096])
def test_summarizer_request_fits_the_window(renderer, window):
    msgs = session(30)
    client = RecordingClient("Goal: fix media timeout.")
    cfg = Compact(trigger=0, keep_recent_tokens=200, summary_max_tokens=128)
    r = summarize(msgs, renderer, cfg, client, TOOLS, window=window)
    unbounded = summarize(msgs, renderer, cfg, RecordingClient("x"), TOOLS)   # the window trims the transcript,
    assert r.summarized_messages == unbounded.summarized_messages and len(client.prompts) == 1  # not the cut
    assert renderer.count(client.prompts[0]) + cfg.summary_max_tokens <= window
    if window == 600:                                   # the oldest part of the transcript went first
        assert "[...]" in client.prompts[0][1]["content"] and "step 29" not in client.prompts[0][1]["content"]


def test_no_summary_when_even_the_bare_request_cannot_fit(renderer):
    client = RecordingClient("x")
    cfg = Compact(trigger=0, keep_recent_tokens=200, summary_max_tokens=128)
    r = summarize(session(), renderer, cfg, client, TOOLS, window=150)
    assert client.prompts == [] and r.summarized_messages == 0


def test_anthropic_compact_summarizes_everything_before_the_point_of_compaction(renderer):
    cfg = Compact.model_validate({"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 50_000},
                                  "instructions": "Only list ports."})
    assert (cfg.keep_recent_tokens, cfg.pause_after_compaction, cfg.trigger) == (0, False, 50_000)
    assert Compact.model_validate({"type": "compact_20260112"}).trigger == 150_000     # Anthropic's default
    with pytest.raises(ValueError, match="at least 50000"):
        Compact.model_validate({"type": "compact_20260112", "trigger": 49_999})
    client = RecordingClient("ports: none")
    low = cfg.model_copy(update={"trigger": 0})
    r = summarize(session(), renderer, low, client, TOOLS)
    assert [m["role"] for m in r.messages] == ["system", "user"] and is_summary(r.messages[1])
    assert r.summarized_messages == len(session()) - 1
    assert client.prompts[0][0]["content"] == "Only list ports."
