"""Thinking clearing (`clear_thinking_20251015`): which turns lose their reasoning, and what that
frees under a template that renders reasoning (and under one that does not)."""

from __future__ import annotations

import copy

import pytest
from pydantic import ValidationError

from agentkv.compaction.config import ClearThinking
from agentkv.compaction.policy import ContextManagement
from agentkv.compaction.thinking import clear_thinking, has_thinking

from conftest import engine_renderer


def _turns(n: int) -> list[dict]:
    msgs = [{"role": "system", "content": "s"}]
    for i in range(n):
        msgs += [{"role": "user", "content": f"question {i}"},
                 {"role": "assistant", "content": f"answer {i}", "reasoning": f"thinking about {i} " * 20}]
    return msgs + [{"role": "assistant", "content": "no reasoning here"}]


@pytest.fixture(scope="module")
def reasoning_renderer(tiny_model_dir):
    """The tiny model under a template that renders ``reasoning_content`` (as Qwen3's does), as
    vLLM renders it (it gives an assistant's ``reasoning`` as ``reasoning_content`` too)."""
    from transformers import AutoTokenizer

    template = AutoTokenizer.from_pretrained(str(tiny_model_dir)).chat_template.replace(
        "{{- '<|im_start|>assistant\\n' + text(message.content) -}}",
        "{{- '<|im_start|>assistant\\n' -}}{%- if message.reasoning_content -%}"
        "{{- '<think>' + message.reasoning_content + '</think>' -}}{%- endif -%}{{- text(message.content) -}}")
    assert template.count("<think>") == 1
    return engine_renderer(tiny_model_dir, template)


@pytest.mark.parametrize("keep, cleared", [(1, 2), (0, 3), (3, 0), ("all", 0)])
def test_oldest_thinking_turns_are_cleared(reasoning_renderer, keep, cleared):
    msgs = _turns(3)
    original = copy.deepcopy(msgs)
    r = clear_thinking(msgs, reasoning_renderer, ClearThinking(keep=keep))
    assert msgs == original                                              # the input is not changed
    assert r.cleared_turns == cleared
    kept = [i for i, m in enumerate(r.messages) if has_thinking(m)]
    assert kept == [i for i, m in enumerate(msgs) if has_thinking(m)][cleared:]
    assert [m.get("content") for m in r.messages] == [m.get("content") for m in msgs]
    if cleared:
        assert r.tokens_before - r.tokens_after == r.cleared_tokens > 20 * cleared
        assert r.tokens_after == reasoning_renderer.count(r.messages)
    else:
        assert r.messages is msgs


def test_a_template_without_reasoning_frees_nothing_but_the_turns_are_cleared(renderer):
    r = clear_thinking(_turns(2), renderer, ClearThinking(keep=1))
    assert r.cleared_turns == 1 and r.cleared_tokens == 0
    assert "reasoning" not in r.messages[2] and r.messages[4]["reasoning"]


def test_anthropic_shapes_and_first_position():
    cm = ContextManagement.model_validate({"edits": [
        {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 2}},
        {"type": "clear_tool_uses_20250919"}]})
    assert cm.edits[0].keep == 2 and cm.edits[0].type == "clear_thinking_20251015"
    assert ContextManagement.model_validate({"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}) \
        .edits[0].keep == "all"
    assert ClearThinking.model_validate({"keep": {"type": "all"}}).keep == "all"
    assert ClearThinking().keep == 1                                      # Anthropic's default
    with pytest.raises(ValidationError, match="first"):
        ContextManagement.model_validate({"edits": [{"type": "compact"}, {"type": "clear_thinking"}]})
    with pytest.raises(ValidationError, match="thinking_turns"):
        ClearThinking.model_validate({"keep": {"type": "tool_uses", "value": 1}})
