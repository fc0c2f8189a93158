"""The form a chat prompt reaches vLLM in: its token ids (``--engine-input tokens``, the default)
or its messages.

vLLM's chat route renders the chat template and tokenizes the whole prompt on every request
(0.48 s at 200k tokens here: ``benchmarks/results/front.json``), work the front has already done,
incrementally (``compaction.prompt.PromptRenderer``). On the tokens path the chat request carries
the front's ids in ``kv_transfer_params.prompt_token_ids``: vLLM's decode-side token reuse (vLLM
0.32, ``renderers/online_renderer.py``), which skips only templating and tokenization. The rest of
vLLM's chat layer runs as it does for messages: tool-choice checks, the tool and reasoning
parsers' ``adjust_request`` (structured outputs for ``required`` / named tools), sampling defaults,
tool-call and reasoning parsing streamed and not, logprobs, finish reasons, ``n``, usage. So an
answer equals the messages path's token for token whenever the ids are the ones vLLM would render,
which is what this module guards:

- a request setting a field that changes vLLM's render in a way the front does not render
  (``RENDER_FIELDS``, or a field the chat template reads: ``TEMPLATE_FIELDS``), or holding
  non-text content (vLLM renders media itself), goes as messages;
- before the first request on the tokens path the front's render of a probe conversation (tools,
  a tool call, a tool result in parts, Claude Code's billing line) is checked against the engine's
  own (``/tokenize``): where they differ (a ``--chat-template`` in the engine's arguments, a
  tokenizer of its own) every request goes as messages, and the server says so once; where only
  content given as text parts differs (a template vLLM hands strings, the parts joined), requests
  with such content go as messages.
Each chat request to the engine is counted by the path it took and why
(``agentkv_engine_input_requests``). A conversation the chat template refuses to render is a 400
naming the request's field, on either path (``errors``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import meta

from ...compaction.prompt import Message, PromptRenderer, template_text
from ..engine.client import EngineClient, EngineUnavailable
from ..metrics import ENGINE_INPUT
from ..options import EngineInputMode
from .engine_call import Make

log = logging.getLogger("agentkv.engine_input")

# vLLM chat fields that change its render where the front renders without them (set: messages)
RENDER_FIELDS = ("chat_template", "chat_template_kwargs", "continue_final_message", "echo", "add_special_tokens",
                 "truncate_prompt_tokens", "mm_processor_kwargs", "media_io_kwargs",
                 "return_prompt_text")   # the prompt's text comes back only where vLLM rendered it
# vLLM chat fields it hands the chat template: they matter only to a template that reads them
TEMPLATE_FIELDS = {"documents": ("documents",), "reasoning_effort": ("reasoning_effort", "enable_thinking"),
                   "tool_choice": ("tool_choice",), "response_format": ("response_format",)}
PROBE_TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                                 "parameters": {"type": "object", "properties": {
                                                     "path": {"type": "string"}}, "required": ["path"]}}},
               {"type": "function", "function": {"name": "list_files"}}]
PROBE = [{"role": "system", "content": "x-anthropic-billing-header: cc_version=1.0.0;\nYou are a coding agent."},
         {"role": "user", "content": "What is in README.md?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "README.md"}'}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "# agentkv"},
                                                                {"type": "text", "text": "An inference server."}]},
         {"role": "user", "content": "Summarize it.", "name": "dev"}]
PARTS_PROBE = [{"role": "user", "content": [{"type": "text", "text": "Read"}, {"type": "text", "text": "this."}]}]


def template_variables(template) -> frozenset[str]:
    """The variables a chat template reads (those it does not set itself)."""
    template = template_text(template)
    if not template:
        return frozenset()
    try:
        return frozenset(meta.find_undeclared_variables(jinja2.Environment().parse(template)))
    except jinja2.TemplateError:   # a template jinja2 cannot parse: assume it reads everything
        return frozenset(v for names in TEMPLATE_FIELDS.values() for v in names)


def has_media(messages: list[Message]) -> bool:
    return any(isinstance(p, dict) and p.get("type", "text") != "text"
               for m in messages if isinstance(m.get("content"), list) for p in m["content"])


def has_parts(messages: list[Message]) -> bool:
    """Content given as parts anywhere but in a tool result (which vLLM always joins)."""
    return any(isinstance(m.get("content"), list) for m in messages if m.get("role") != "tool")


def why_messages(body: dict[str, Any], template_reads: frozenset[str]) -> str | None:
    """Why this engine request must go as messages (None: its ids are the front's render)."""
    for f in RENDER_FIELDS:
        if body.get(f) not in (None, False):
            return f"field:{f}"
    if body.get("add_generation_prompt") is False:
        return "field:add_generation_prompt"
    for f, names in TEMPLATE_FIELDS.items():
        if body.get(f) is not None and template_reads.intersection(names):
            return f"template_variable:{f}"
    if has_media(body["messages"]):
        return "non_text_content"
    return None


def known_mismatch(template: str | None, engine_args: tuple[str, ...], model_type: str | None) -> str | None:
    """Why the front cannot render as the engine does, known before asking it."""
    if template and "strftime_now" in template:
        return "the chat template reads the clock (vLLM renders it at each request)"
    for flag in ("--chat-template", "--default-chat-template-kwargs", "--chat-template-content-format", "--tokenizer"):
        if any(a == flag or a.startswith(flag + "=") for a in engine_args):
            return f"the engine runs with {flag}"
    if model_type == "gpt_oss":
        return "gpt-oss prompts are rendered by vLLM's harmony encoder"
    return None


class EngineInput:
    """The server's engine-input setting and what it has found out about the engine's render.
    ``engine_args``: the server's extra vLLM arguments; ``model_type``: the served model's."""

    def __init__(self, mode: EngineInputMode, renderer: PromptRenderer, model: str,
                 engine_args: tuple[str, ...] = (), model_type: str | None = None):
        self.mode, self.renderer, self.model = mode, renderer, model
        template = template_text(getattr(renderer.tokenizer, "chat_template", None))
        self.template_reads = template_variables(template)
        # why the front's render is not the engine's (known, or found by the check)
        self.mismatch: str | None = known_mismatch(template, engine_args, model_type)
        self.exclude_tools_none = "--exclude-tools-when-tool-choice-none" in engine_args
        self.parts_differ = False             # content given as parts renders differently (checked once)
        self._checked = self.mismatch is not None
        if self.mismatch and mode == "tokens":
            log.warning("%s: every prompt goes to vLLM as messages", self.mismatch)
        self._lock = asyncio.Lock()

    async def _differs(self, engine: EngineClient, messages: list[Message], tools: list | None) -> str | None:
        """Where the front's render of ``messages`` differs from the engine's (``/tokenize``);
        the engine unreachable or failing (5xx): ``EngineUnavailable`` (asked again later)."""
        body = {"model": self.model, "messages": messages, "add_generation_prompt": True}
        if tools:
            body["tools"] = tools
        status, payload = await engine.post_json("/tokenize", body)
        if status >= 500:
            raise EngineUnavailable(f"/tokenize answered {status}")
        if status != 200:   # the engine's template refuses the probe: it cannot vouch for the front's
            return f"the engine's /tokenize refused the probe ({status})"
        try:
            mine = self.renderer.render(messages, tools).token_ids
        except Exception as exc:  # noqa: BLE001 - the front's template refuses the probe
            return f"the front could not render the probe ({exc.__class__.__name__})"
        theirs = payload.get("tokens") or []
        if mine == theirs:
            return None
        at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        return f"first difference at token {at} of {len(mine)}"

    async def check(self, engine: EngineClient) -> bool:
        """The front's render of ``PROBE`` equals the engine's, asked once; and whether content
        given as text parts renders the same (a template vLLM hands strings joins them itself)."""
        if self._checked:
            return self.mismatch is None
        async with self._lock:
            if not self._checked:
                where = await self._differs(engine, PROBE, PROBE_TOOLS)
                if where:
                    self.mismatch = f"the engine renders the chat template differently from the front ({where})"
                    log.warning("%s: every prompt goes to vLLM as messages", self.mismatch)
                elif await self._differs(engine, PARTS_PROBE, None):
                    self.parts_differ = True
                    log.info("the engine joins content parts itself: requests with them go to vLLM as messages")
                self._checked = True
        return self.mismatch is None

    async def for_turn(self, engine: EngineClient, body: dict[str, Any], asked: EngineInputMode | None) -> Make:
        """How each engine request of a turn is made from its chat body: the ids added (tokens
        path), or the body as it is; ``asked``: the request's own ``engine_input``."""
        reason = None
        if self.mode == "messages":
            reason = "server"
        elif asked == "messages":
            reason = "request"
        else:
            reason = why_messages(body, self.template_reads)
        if reason is None and self.exclude_tools_none and body.get("tool_choice") == "none" and body.get("tools"):
            reason = "exclude_tools_when_tool_choice_none"   # vLLM renders without the tools
        if reason is None:
            try:
                if not await self.check(engine):
                    reason = "render_mismatch"
                elif self.parts_differ and has_parts(body["messages"]):
                    reason = "content_parts"
            except EngineUnavailable:   # the engine is starting or gone: this turn goes as messages
                reason = "unchecked"
        return InputPath("messages" if reason else "tokens", reason or "", self.renderer).request


@dataclass
class InputPath:
    """One turn's engine input: ``request(body)`` is the chat request sent for ``body`` (each
    server-tool round renders its own longer prompt)."""

    input: EngineInputMode
    reason: str
    renderer: PromptRenderer

    async def request(self, body: dict) -> dict:
        ENGINE_INPUT.labels(self.input, self.reason).inc()
        if self.input == "messages":
            return body
        args = (body["messages"], body.get("tools"))
        # cached segments join in a millisecond; a whole render (a template that does not render
        # message by message) tokenizes the whole prompt: off the event loop
        render = self.renderer.render(*args) if self.renderer.segmented else \
            await asyncio.to_thread(self.renderer.render, *args)
        kv = {**(body.get("kv_transfer_params") or {}), "prompt_token_ids": render.token_ids}
        return {**body, "kv_transfer_params": kv}
