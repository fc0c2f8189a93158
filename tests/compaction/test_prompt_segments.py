"""The segmented renderer (compaction/prompt_segments.py) against the whole-conversation render:
same text, token ids, message ranges and counts on randomized conversations grown message by
message and edited in place, for the tiny model's template and SmolLM2's; templates that do not
render message by message are detected and rendered whole."""

from __future__ import annotations

import copy
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentkv.compaction.prompt import KnownMessages, PromptRenderer, message_key
from agentkv.compaction.prompt_segments import check_template

from agent_sessions import TOOLS
from conftest import REAL

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
WORDS = st.sampled_from("alpha beta gamma port timeout region <tool_call> {\"a\": 1} E2033 1050 \n \u00e9t\u00e9 "
                        "retry config ok. <|im_end|> line".split(" "))


def _text(draw, lo: int, hi: int) -> str:
    return " ".join(draw(st.lists(WORDS, min_size=lo, max_size=hi)))


@st.composite
def messages(draw):
    """Every kind of message the templates render, in any order after a system or user message."""
    out = [{"role": draw(st.sampled_from(["system", "user"])), "content": _text(draw, 1, 8)}]
    calls = 0
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["user", "parts", "text", "calls", "reasoning", "system", "empty"]))
        if kind == "user":
            out.append({"role": "user", "content": _text(draw, 0, 12)})
        elif kind == "parts":
            out.append({"role": "user", "content": [{"type": "text", "text": _text(draw, 1, 5)}
                                                    for _ in range(draw(st.integers(1, 3)))]})
        elif kind == "text":
            out.append({"role": "assistant", "content": _text(draw, 1, 12)})
        elif kind == "reasoning":
            out.append({"role": "assistant", "content": _text(draw, 1, 6), "reasoning": _text(draw, 1, 6)})
        elif kind == "system":
            out.append({"role": "system", "content": _text(draw, 1, 6)})
        elif kind == "empty":
            out.append({"role": "assistant", "content": ""})
        else:
            ids = []
            for _ in range(draw(st.integers(1, 3))):
                calls += 1
                ids.append(f"call_{calls}")
            args = [draw(st.sampled_from(['{"path": "a.py"}', "{}", "not json", json.dumps({"q": _text(draw, 1, 4)})]))
                    for _ in ids]
            out.append({"role": "assistant", "content": draw(st.sampled_from([None, _text(draw, 1, 4)])),
                        "tool_calls": [{"id": i, "type": "function", "function": {"name": "bash", "arguments": a}}
                                       for i, a in zip(ids, args)]})
            out += [{"role": "tool", "tool_call_id": i, "content": "\n".join(_text(draw, 0, 8) for _ in range(3))}
                    for i in ids]
    return out


@pytest.fixture(scope="module", params=["tiny", REAL])
def renderers(request, tiny_model_dir):
    from agentkv.server.embedded_model.catalog import model_dir

    path = str(tiny_model_dir if request.param == "tiny" else model_dir(REAL))
    if request.param == REAL and not (model_dir(REAL) / "tokenizer.json").exists():
        pytest.skip(f"{REAL} is not built here (./setup.sh builds it)")
    seg, whole = PromptRenderer.from_pretrained(path), PromptRenderer.from_pretrained(path, segments=False)
    assert seg.segmented and not whole.segmented
    return seg, whole


def same(seg: PromptRenderer, whole: PromptRenderer, msgs, tools) -> None:
    a, b = seg.render(msgs, tools), whole.render(msgs, tools)
    assert a.text == b.text
    assert a.token_ids == b.token_ids == whole.tokenizer(b.text, add_special_tokens=False)["input_ids"]
    assert a.ranges == b.ranges
    assert seg.count(msgs, tools) == whole.count(msgs, tools) == len(b.token_ids)
    assert seg.char_bounds(msgs, tools) == whole.char_bounds(msgs, tools)
    assert seg.render_text(msgs, tools, False) == whole.render_text(msgs, tools, False)


@SETTINGS
@given(msgs=messages(), tools=st.sampled_from([None, TOOLS]), data=st.data())
def test_growing_and_edited_conversations_render_as_the_whole_template(renderers, msgs, tools, data):
    seg, whole = renderers
    for n in range(1, len(msgs) + 1):  # a conversation growing one message a request
        same(seg, whole, msgs[:n], tools)
    i = data.draw(st.integers(0, len(msgs) - 1))  # an edit in place (clearing), then growth again
    edited = msgs[:i] + [{**msgs[i], "content": "[cleared]"}] + msgs[i + 1:]
    same(seg, whole, edited, tools)
    same(seg, whole, edited + [{"role": "user", "content": "next"}], tools)
    same(seg, whole, msgs[:max(1, i)], tools)   # a retry of an earlier turn
    other = TOOLS[:1] if tools else TOOLS       # the tools changed: the header moves every token
    same(seg, whole, msgs, other)
    assert seg.segmented  # no conversation fell off the segmented path


def test_a_message_changed_in_place_gets_its_new_key():
    known = KnownMessages()
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "tool_calls": []}]
    assert known.keys(msgs) == [message_key(m) for m in msgs]
    msgs[1]["content"] = "changed"
    msgs[1]["tool_calls"].append({"id": "x"})
    assert known.keys(msgs) == [message_key(m) for m in msgs]
    assert known.keys(msgs + [{"role": "user", "content": "c"}])[2] == message_key({"role": "user", "content": "c"})


# Templates that do not render message by message, each as its family does it.
GROUPED_TOOLS = (  # Qwen2.5: consecutive tool results share one turn, closed by the next message
    "{%- for m in messages -%}{%- if m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<|im_start|>user{%- endif -%}"
    "\n<tool_response>{{ m.content }}</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}<|im_end|>\n{%- endif -%}"
    "{%- else -%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")
LAST_QUERY = (  # Qwen3: reasoning shown only after the last user message
    "{%- set ns = namespace(last=0) -%}{%- for m in messages -%}{%- if m.role == 'user' -%}"
    "{%- set ns.last = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
    "{%- if m.role == 'assistant' and m.reasoning_content and loop.index0 > ns.last -%}"
    "<think>{{ m.reasoning_content }}</think>{%- endif -%}{{ m.content }}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")
LATER_HEADER = (  # the header depends on later messages (tool instructions once any message calls a tool)
    "{%- if messages | selectattr('tool_calls') | list -%}<|im_start|>system\nTools were called.<|im_end|>\n"
    "{%- endif -%}{%- for m in messages -%}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")
CLOCK = ("<|im_start|>system\n{{ strftime_now('%d %b %Y') }}<|im_end|>\n"
         "{%- for m in messages -%}{{ m.content }}{%- endfor -%}")
PLAIN = (  # no special token between messages: segments are text, their tokens must be joined by tokenizing
    "{%- for m in messages -%}{{ m.role }}: {{ m.content }}\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}assistant:{%- endif -%}")
LONG_ONLY = (  # renders message by message in short conversations only: caught on real data
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- if messages | length > 6 %} (long){% endif -%}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")


def _with_template(tiny_model_dir, template: str, **kw) -> PromptRenderer:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.chat_template = template
    return PromptRenderer(tok, **kw)


@pytest.mark.parametrize("template, why", [(GROUPED_TOOLS, "re-renders|does not render on its own"),
                                           (LAST_QUERY, "re-renders|does not render on its own"),
                                           (LATER_HEADER, "re-renders|does not render on its own"),
                                           (CLOCK, "reads the clock")])
def test_templates_that_rerender_earlier_messages_are_rendered_whole(tiny_model_dir, template, why):
    r = _with_template(tiny_model_dir, template)
    assert not r.segmented and re.search(why, r.not_segmented)
    whole = _with_template(tiny_model_dir, template, segments=False)
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r"},
            {"role": "tool", "tool_call_id": "1", "content": "t1"},
            {"role": "tool", "tool_call_id": "2", "content": "t2"},
            {"role": "user", "content": "q2"}]
    for n in range(1, len(msgs) + 1):
        assert r.render(msgs[:n]) == whole.render(msgs[:n]) and r.count(msgs[:n]) == whole.count(msgs[:n])


def test_segments_without_special_tokens_between_them_are_tokenized_joined(tiny_model_dir):
    r, whole = _with_template(tiny_model_dir, PLAIN), _with_template(tiny_model_dir, PLAIN, segments=False)
    assert r.segmented
    msgs = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "  spaced\n\n"},
            {"role": "user", "content": "again"}]
    for n in range(1, 4):
        a, b = r.render(msgs[:n]), whole.render(msgs[:n])
        assert a.token_ids == b.token_ids == whole.tokenizer(b.text, add_special_tokens=False)["input_ids"]
        assert a.text == b.text and r.char_bounds(msgs[:n]) == whole.char_bounds(msgs[:n])


def test_a_conversation_whose_segments_do_not_join_is_rendered_whole_from_then_on(tiny_model_dir, caplog):
    """The probe passes, a real conversation's first sight does not: that conversation is rendered
    whole from then on (its later turns too); other conversations keep their segments."""
    import logging

    caplog.set_level(logging.INFO, logger="agentkv.compaction.prompt")
    r, whole = _with_template(tiny_model_dir, LONG_ONLY), _with_template(tiny_model_dir, LONG_ONLY, segments=False)
    assert check_template(r._render_full, LONG_ONLY).reason is None and r.segmented  # the probe passes...
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(8)]
    assert r.render(msgs) == whole.render(msgs)                               # ...the first sight does not
    assert r.segmented and r._prompt(msgs, None) is None
    assert "did not join" in caplog.text
    grown = msgs + [{"role": "user", "content": "more"}]
    assert r.render(grown) == whole.render(grown) and r.count(grown) == whole.count(grown)
    assert r._prompt(grown, None) is None
    short = [{"role": "user", "content": "other"}, {"role": "assistant", "content": "conversation"}]
    assert r._prompt(short, None) is not None and r.render(short) == whole.render(short)


def test_a_template_that_checks_roles_alternate_renders_by_segments(tiny_model_dir):
    alternating = ("{%- for m in messages -%}{%- if (m.role == 'user') != (loop.index0 % 2 == 0) -%}"
                   "{{ raise_exception('roles must alternate') }}{%- endif -%}"
                   "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor -%}"
                   "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")
    r, whole = _with_template(tiny_model_dir, alternating), _with_template(tiny_model_dir, alternating, segments=False)
    assert r.segmented  # the reduced contexts keep each message's index parity
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"m{i}"} for i in range(9)]
    for n in range(1, 10):
        assert r.render(msgs[:n]) == whole.render(msgs[:n])
    with pytest.raises(Exception, match="alternate"):  # what the engine refuses, we refuse alike
        r.count([msgs[0], msgs[0]])
    assert r.segmented


def test_the_cache_is_bounded(tiny_model_dir):
    from agentkv.compaction.prompt_segments import SegmentCache

    r = PromptRenderer.from_pretrained(str(tiny_model_dir))
    r._cache = SegmentCache(max_segments=10, max_tokens=10_000, max_layouts=3, max_id_tokens=100)
    whole = PromptRenderer(r.tokenizer, segments=False)
    base = [{"role": "system", "content": "s"}]
    for k in range(8):
        msgs = base + [{"role": "user", "content": f"conversation {k} turn {t}"} for t in range(4)]
        assert r.count(msgs) == whole.count(copy.deepcopy(msgs))
        assert r.render(msgs) == whole.render(msgs)
    cache = r._cache
    assert len(cache._segments) <= 10 and cache._n_layouts <= 3
    held = [x for g in cache._layouts.values() for x in g if x.ids is not None]
    assert sorted(map(id, held)) == sorted(cache._with_ids) and cache._id_tokens == sum(len(x.ids) for x in held)
    assert cache._id_tokens <= 100 or len(held) == 1


def test_a_whole_render_is_made_once_per_conversation(tiny_model_dir):
    """Where the template renders whole conversations, counting a prompt and then taking its ids
    (a turn on the token-in path) renders the template once."""
    from agentkv.compaction.prompt import PromptRenderer

    r = PromptRenderer.from_pretrained(str(tiny_model_dir), segments=False)
    calls = []
    full = r._render_full
    r._render_full = lambda *a: calls.append(a[2]) or full(*a)
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hello there"}]
    n = r.count(msgs)
    assert len(r.render(msgs).token_ids) == n
    assert calls.count(True) == 1   # the prompt with its generation prompt, once
