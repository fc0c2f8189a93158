"""Differential test of the token-ids path: over real chat templates (tests/data/chat_templates,
licenses in its README) and two tokenizer families (byte-level BPE, SentencePiece-style Metaspace),
seeded random conversations grown turn by turn (null and empty content, content parts, 10 / 10.0 /
true in tool schemas and arguments, unicode, special-token text inside content, tool calls and
results, system and developer messages anywhere, earlier tool results cleared) are rendered by the
front (``render.engine_chat``: vLLM's chat preprocessing with incremental tokenization per
conversation) and by vLLM's own chat route in process (its ``OnlineRenderer`` over its unmodified
``HfRenderer``). At every turn the front's ids equal vLLM's, or the front sends the request as
messages (counted); the counting renderer's ids equal them too. The review's three cases are named
tests below."""

from __future__ import annotations

import asyncio
import copy
import json
import random
from pathlib import Path

import pytest

from agentkv.server.render.engine_chat import NotRendered, counting_renderer, for_model

CORPUS = Path(__file__).resolve().parents[2] / "data" / "chat_templates"
TEMPLATES = sorted(p.name for p in CORPUS.glob("*.jinja"))
TOKENS = json.loads((CORPUS / "tokens.json").read_text())
SPECIAL = sorted({t for v in TOKENS.values() for t in v["special"] + [v.get("bos_token"), v.get("eos_token")] if t})
MARKUP = sorted({t for v in TOKENS.values() for t in v.get("other_markup", [])})
WORDS = ["alpha", "beta", "port", "timeout", "été", "日本語", "🙂", "x=10", "{\"a\": 1}", "\n", "  ", "\t", "E2033",
         "1050", "ok.", "<tool_call>", "</think>", "<|im_end|>", "<|eot_id|>", "[INST]", "<start_of_turn>",
         "<｜User｜>", "▁", "a" * 40]


def _sentencepiece_style(path: Path, base) -> None:
    """A Metaspace tokenizer (prepend_scheme "first", byte fallback), trained here on a small text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    text = [" ".join(random.Random(i).choices(WORDS + MARKUP + ["the", "system", "user", "assistant", "tool"], k=40))
            for i in range(400)]
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=["<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    fast.save_pretrained(str(path))


@pytest.fixture(scope="module", params=["byte_level", "metaspace"])
def model_dir(request, tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model's config with a tokenizer of one family, every corpus template's special
    tokens added (some with ``rstrip`` / ``lstrip`` / ``normalized``, as real tokenizers have)."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp(f"render-{request.param}")
    if request.param == "byte_level":
        AutoTokenizer.from_pretrained(str(tiny_model_dir)).save_pretrained(str(path))
    else:
        _sentencepiece_style(path, tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(str(path))
    odd = {"<|end|>": dict(rstrip=True), "</s>": dict(lstrip=True), "<|im_sep|>": dict(normalized=True)}
    tok.add_special_tokens({"additional_special_tokens": [
        AddedToken(t, **{"special": True, "normalized": False, **odd[t]}) if t in odd else t for t in SPECIAL]},
        replace_extra_special_tokens=False)
    tok.bos_token, tok.eos_token = "<s>", "</s>"
    tok.save_pretrained(str(path))
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["vocab_size"] = len(tok)
    (path / "config.json").write_text(json.dumps(config))
    return path


def reference(chat):
    """vLLM's own chat route over the same configuration: its ``OnlineRenderer`` with its
    unmodified ``HfRenderer`` (whole-text tokenization)."""
    from vllm.renderers.hf import HfRenderer

    ref = copy.copy(chat.online)
    ref.renderer = HfRenderer(chat.renderer.config, chat.base_tokenizer)
    return ref


class Conversation:
    """A seeded agent conversation that grows turn by turn; ``alternating``: user and assistant
    turns only, as strict templates (Gemma, Mistral) require."""

    def __init__(self, seed: int, alternating: bool):
        self.rnd, self.alternating = random.Random(seed), alternating
        self.calls = 0
        r = self.rnd
        described = r.random() < 0.75   # a tool without a description: vLLM hands the template null
        self.tools = None if r.random() < 0.2 else [
            {"type": "function", "function": {"name": "read", "description": "Read a file" if described else None,
                                              "parameters": {"type": "object", "properties": {
                                                  "path": {"type": "string"},
                                                  "n": {"type": "integer", "maximum": r.choice([10, 10.0, True])}}}}},
            {"type": "function", "function": {"name": "run", "description": "Run a command", "parameters": {
                "type": "object", "properties": {
                    "cmd": {"type": "string", "default": r.choice(["ls", 1e3, 0.5, False])}}}}}]
        self.messages: list[dict] = []
        if alternating:
            self.messages.append({"role": "user", "content": self.text()})
        else:
            if r.random() < 0.8:
                self.messages.append({"role": r.choice(["system", "developer"]), "content": self.content()})
            self.messages.append({"role": "user", "content": self.content()})

    def text(self, lo: int = 1, hi: int = 14) -> str:
        return " ".join(self.rnd.choices(WORDS + MARKUP, k=self.rnd.randint(lo, hi)))

    def content(self):
        r = self.rnd.random()
        if r < 0.08:
            return ""
        if r < 0.25:
            return [{"type": "text", "text": self.text()} for _ in range(self.rnd.randint(1, 3))]
        return self.text()

    def grow(self) -> None:
        r, msgs = self.rnd, self.messages
        if self.alternating:
            msgs.append({"role": "assistant", "content": self.text()})
            msgs.append({"role": "user", "content": self.content()})
            return
        kind = r.choice(["calls", "calls", "text", "null", "user", "system", "developer", "clear"])
        if kind == "calls" and self.tools:
            ids = []
            for _ in range(r.randint(1, 2)):
                self.calls += 1
                ids.append(f"call_{self.calls}")
            args = [r.choice([json.dumps({"path": "a.py", "n": 10}), '{"n": 10.0}', '{"ok": true}', "{}", "not json",
                              json.dumps({"q": self.text(1, 4)})]) for _ in ids]
            msgs.append({"role": "assistant", "content": r.choice([None, "", self.text(1, 4)]),
                         "tool_calls": [{"id": i, "type": "function", "function": {"name": "read", "arguments": a}}
                                        for i, a in zip(ids, args)]})
            for i in ids:
                msgs.append({"role": "tool", "tool_call_id": i, "content": self.content()})
        elif kind == "null":
            msgs.append({"role": "assistant", "content": None})
            msgs.append({"role": "user", "content": self.content()})
        elif kind == "text":
            msgs.append({"role": "assistant", "content": self.text(), **({"reasoning": self.text(1, 6)}
                                                                          if r.random() < 0.3 else {})})
            msgs.append({"role": "user", "content": self.content()})
        elif kind == "clear":   # an earlier tool result replaced, as clearing does
            tools = [i for i, m in enumerate(msgs) if m["role"] == "tool"]
            if tools:
                i = r.choice(tools)
                msgs[i] = {**msgs[i], "content": "[cleared: 120 tokens]"}
            msgs.append({"role": "user", "content": self.content()})
        else:
            msgs.append({"role": kind, "content": self.content()})

    def body(self) -> dict:
        out = {"model": "model", "messages": copy.deepcopy(self.messages)}
        if self.tools:
            out["tools"] = copy.deepcopy(self.tools)
        return out


async def _render_both(chat, ref, body: dict, slot) -> tuple[list[int] | None, list[int] | None]:
    """(the front's ids or None where it sends messages, vLLM's ids or None where it refuses)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    sent = copy.deepcopy(body)
    try:
        mine = await chat.prompt_ids(body, slot)
    except NotRendered:
        mine = None
    assert body == sent   # the request the engine is sent is not changed by the front's render
    try:
        result = await ref.render_chat(ChatCompletionRequest.model_validate(copy.deepcopy(body)))
        theirs = None if isinstance(result, ErrorResponse) else result[1][0]["prompt_token_ids"]
    except Exception:  # noqa: BLE001 - vLLM refuses this conversation (a template's raise_exception)
        theirs = None
    return mine, theirs


def _grow_and_compare(chat, ref, counter, convo: Conversation, slot, turns: int, stats: dict) -> None:
    async def run():
        for _ in range(turns):
            body = convo.body()
            mine, theirs = await _render_both(chat, ref, body, slot)
            if theirs is None:
                stats["refused"] += 1
                assert mine is None, "the front rendered what vLLM refuses"
            elif mine is None:
                stats["as_messages"] += 1
            else:
                assert mine == theirs, f"turn {len(convo.messages)}: the front's ids differ from vLLM's"
                stats["equal"] += 1
            if theirs is not None:
                counted = counter.render(body["messages"], body.get("tools")).token_ids
                assert counted == theirs, "the counting renderer's ids differ from vLLM's"
                assert counter.count(body["messages"], body.get("tools")) == len(theirs)
            convo.grow()
    asyncio.run(run())


def _chat(model_dir, template: str):
    """The front's render for an engine serving ``template`` with tools, as ``agentkv serve`` starts it."""
    return for_model(str(model_dir), "--chat-template", str(CORPUS / template), "--max-model-len", "32768",
                     "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.mark.parametrize("template", TEMPLATES)
def test_the_fronts_ids_are_vllms_render_at_every_turn(model_dir, template):
    """Templates that read the clock (Llama 3.x, Granite) go as messages: vLLM renders them at its
    own moment; every other template's ids are vLLM's."""
    chat = _chat(model_dir, template)
    clock = "strftime_now" in (CORPUS / template).read_text()
    assert (chat.unrendered is not None) == clock
    ref, counter = reference(chat), counting_renderer(chat)
    stats = {"equal": 0, "as_messages": 0, "refused": 0}
    for seed in range(8):
        _grow_and_compare(chat, ref, counter, Conversation(seed, alternating=seed % 3 == 0), ("k", template, seed),
                          10, stats)
    served = stats["equal"] + stats["as_messages"]
    assert served >= 20, stats                                  # the template serves enough of these turns
    assert stats["as_messages"] == (served if clock else 0), stats
    if not clock:
        assert chat.token_cache.stats.reused_tokens > 0         # and the incremental path was taken


# -- the review's three cases -----------------------------------------------------------------

@pytest.mark.parametrize("first, second", [(10, 10.0), (10.0, True), (1, True)])
def test_schema_numbers_that_python_finds_equal_render_as_sent_across_keys(model_dir, first, second):
    """Key k1's tools say ``"maximum": 10``, then key k2's say ``10.0`` (Python: ``10 == 10.0``):
    each gets vLLM's render of its own request, on the sent path and in counting alike."""
    chat = _chat(model_dir, "meta-llama-Llama-3.1-8B-Instruct.jinja")   # renders tools, by segments
    ref, counter = reference(chat), counting_renderer(chat)

    def body(value):
        return {"model": "m", "messages": [{"role": "user", "content": "hello"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                    "type": "object", "properties": {"n": {"type": "integer", "maximum": value}}}}}]}

    async def run():
        out = []
        for key, value in (("k1", first), ("k2", second)):
            mine, theirs = await _render_both(chat, ref, body(value), (key, "branch"))
            assert mine == theirs and theirs is not None
            assert counter.render(body(value)["messages"], body(value)["tools"]).token_ids == theirs
            out.append(theirs)
        return out

    a, b = asyncio.run(run())
    assert a != b   # the two requests do render differently


@pytest.mark.parametrize("template", ["meta-llama-Llama-3.1-8B-Instruct.jinja", "google-gemma-3-it.jinja"])
def test_null_content_renders_as_vllm_renders_it(model_dir, template):
    """An assistant turn with ``content: null`` (and one with only tool calls): Llama-3-style
    templates would print "None" were the value handed over as is, Gemma-3-style ones refuse it;
    vLLM makes it empty. The front's ids and counts are vLLM's."""
    chat = _chat(model_dir, template)
    ref, counter = reference(chat), counting_renderer(chat)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
            {"role": "user", "content": "again"}]
    mine, theirs = asyncio.run(_render_both(chat, ref, {"model": "m", "messages": msgs}, ("k", "null")))
    assert theirs is not None and mine == theirs
    assert counter.render(msgs).token_ids == theirs and counter.count(msgs) == len(theirs)
    assert "None" not in chat.chat_text(msgs, None, True)


def test_a_template_with_conversation_wide_state_stays_exact_turn_by_turn(model_dir):
    """DeepSeek-V3's template keeps state across its message loop (``ns.is_last_user``,
    ``ns.is_tool``, the system prompt gathered from every system message): a conversation built
    turn by turn, system messages arriving late, stays equal to vLLM's render at every turn (the
    review saw per-message rendering drift from the third turn). Its tool calls concatenate the
    arguments as text, which vLLM hands over as objects: vLLM refuses those, and so does the front."""
    chat = _chat(model_dir, "deepseek-ai-DeepSeek-V3.1.jinja")
    ref, counter = reference(chat), counting_renderer(chat)
    msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Read a.py"}]

    async def run():
        for turn in range(8):
            body = {"model": "m", "messages": copy.deepcopy(msgs)}
            mine, theirs = await _render_both(chat, ref, body, ("k", "ds"))
            assert theirs is not None and mine == theirs, f"turn {turn}"
            assert counter.render(body["messages"]).token_ids == theirs, f"turn {turn}"
            msgs.append({"role": "assistant", "content": f"<think>step {turn}</think>Done {turn}."})
            if turn % 3 == 1:
                msgs.append({"role": "system", "content": f"Note {turn}."})
            msgs.append({"role": "user", "content": f"Next {turn}."})
        calls = msgs + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "read", "arguments": '{"n": 10}'}}]}]
        assert await _render_both(chat, ref, {"model": "m", "messages": calls}, ("k", "ds")) == (None, None)

    asyncio.run(run())
    assert chat.token_cache.stats.reused_tokens > 0
