"""OpenAI Responses requests in chat terms, so the Responses API runs on the same context
management and engine step as chat (converted once per request, like /v1/messages): the request's
fields as the engine's chat request (``to_chat``), its input items as chat messages
(``conversation``, ``to_messages``).

Input items, in order:
- a string: one user message;
- ``message`` (``type`` may be left out), roles user / assistant / system / developer, content a
  string or ``input_text`` / ``output_text`` / ``refusal`` parts: one message with their text;
- ``function_call``: a tool call of the assistant message just before it (a new assistant message
  when there is none, or when a reasoning item came in between); a ``namespace`` is kept in the
  tool name as ``namespace.name``;
- ``function_call_output``: a tool message;
- ``reasoning``: its text (``content``, else ``summary``) becomes ``reasoning`` of the assistant
  message that follows (its ``encrypted_content`` is not read);
- ``compaction``: the messages it stands for (``compaction_item.py``); every item before it except
  system and developer messages is dropped, as the compaction item replaces them;
- ``compaction_trigger``: only as the last item: compact instead of answering (Codex's remote compaction).
Any other type is a 400 naming ``input.N.type``.

Tools: function tools go to the model as chat tools; the function tools of a ``namespace`` tool are
offered as ``namespace.name`` and their calls come back as ``name`` + ``namespace``; every other tool
type (hosted ``web_search``, ``file_search``, ``mcp``, ``custom``, ...) is not offered to the model
and is listed in the response's ``tools_not_offered``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from agentkv.compaction.prompt import Message
from agentkv.server.errors import APIError
from agentkv.server.pipeline.compaction_item import CompactionSeal
from agentkv.server.pipeline.sessions import SessionRef

from .protocol import NOT_SENT, CompactRequest, ResponsesRequest

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
HEADER_ROLES = ("system", "developer")


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, "content must be a string or a list of content parts", param=where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise APIError(400, f"content part type {kind!r} is not supported: this server takes text "
                                f"({', '.join(TEXT_PARTS)})", param=f"{where}.{j}.type")
        value = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(value, str):
            raise APIError(400, "a text part needs its text as a string", param=f"{where}.{j}")
        out.append(value)
    return "".join(out)


def _reasoning_text(item: dict, where: str) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list):
        raise APIError(400, "reasoning content and summary must be lists of parts", param=f"{where}.summary")
    return "\n".join(p.get("text", "") for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))


def _string(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{name} must be a non-empty string", param=f"{where}.{name}")
    return value


@dataclass
class Converted:
    messages: list[Message] = field(default_factory=list)
    compacted: bool = False   # held a compaction item: nothing before it but system messages is kept
    trigger: bool = False     # ended with a compaction_trigger item


def to_messages(items: str | list, open_compaction: Callable[[dict, str], list[Message]],
                prior: list[Message] | None = None) -> Converted:
    """Chat messages of ``prior`` (a stored conversation, already messages) followed by ``items``."""
    out = Converted(list(prior or []))
    if isinstance(items, str):
        out.messages.append({"role": "user", "content": items})
        return out
    msgs = out.messages
    reasoning: str | None = None

    def assistant(content: str | None) -> Message:
        nonlocal reasoning
        m: Message = {"role": "assistant", "content": content}
        if reasoning is not None:
            m["reasoning"] = reasoning
            reasoning = None
        msgs.append(m)
        return m

    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise APIError(400, "an input item must be an object", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind != "reasoning" and reasoning is not None and kind not in ("message", "function_call"):
            assistant(None)   # a reasoning item with no answer after it
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise APIError(400, f"role must be one of {', '.join(ROLES)}", param=f"{where}.role")
            text = _text(item.get("content"), f"{where}.content")
            if role == "assistant":
                assistant(text)
            else:
                if reasoning is not None:
                    assistant(None)
                msgs.append({"role": role, "content": text})
        elif kind == "function_call":
            name = _string(item, "name", where)
            namespace = item.get("namespace")
            args = item.get("arguments", "{}")
            if not isinstance(args, str):
                raise APIError(400, "arguments must be a JSON string", param=f"{where}.arguments")
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": f"{namespace}.{name}" if namespace else name, "arguments": args}}
            last = msgs[-1] if msgs and reasoning is None else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                assistant(None)["tool_calls"] = [call]
        elif kind == "function_call_output":
            output = item.get("output")
            msgs.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                         "content": _text(output if output is not None else "", f"{where}.output")})
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            reasoning = text if reasoning is None else f"{reasoning}\n{text}"
        elif kind == "compaction":
            kept = [m for m in msgs if m["role"] in HEADER_ROLES]
            msgs[:] = kept + open_compaction(item, where)
            out.compacted = True
        elif kind == "compaction_trigger":
            if i != len(items) - 1:
                raise APIError(400, "compaction_trigger must be the last input item", param=f"{where}.type")
            out.trigger = True
        else:
            raise APIError(400, f"input item type {kind!r} is not supported (supported: message, function_call, "
                                "function_call_output, reasoning, compaction, compaction_trigger)",
                           param=f"{where}.type")
    if reasoning is not None:
        assistant(None)
    return out


@dataclass
class ChatTools:
    tools: list[dict] | None               # the chat tools offered to the model
    namespaces: dict[str, tuple[str, str]]  # flattened name -> (namespace, name)
    not_offered: list[str]                 # tool types (or namespace.name) the model is not offered


def _function(tool: dict, name: str, where: str) -> dict:
    fn: dict[str, Any] = {"name": name, "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
    if tool.get("description"):
        fn["description"] = tool["description"]
    if tool.get("strict") is not None:
        fn["strict"] = bool(tool["strict"])
    if not isinstance(fn["parameters"], dict):
        raise APIError(400, "parameters must be a JSON schema object", param=f"{where}.parameters")
    return {"type": "function", "function": fn}


def to_chat_tools(tools: list[dict] | None) -> ChatTools:
    offered: list[dict] = []   # out.tools, until the end
    out = ChatTools(offered, {}, [])
    for i, tool in enumerate(tools or []):
        where = f"tools.{i}"
        kind = tool.get("type")
        if kind == "function":
            offered.append(_function(tool, _string(tool, "name", where), where))
        elif kind == "namespace":
            space = _string(tool, "name", where)
            for j, inner in enumerate(tool.get("tools") or []):
                if not isinstance(inner, dict) or inner.get("type") != "function":
                    out.not_offered.append(f"{space}.{inner.get('name') if isinstance(inner, dict) else '?'}")
                    continue
                name = _string(inner, "name", f"{where}.tools.{j}")
                out.namespaces[f"{space}.{name}"] = (space, name)
                offered.append(_function(inner, f"{space}.{name}", f"{where}.tools.{j}"))
        else:
            out.not_offered.append(str(kind))
    out.tools = offered or None
    return out


def to_chat_tool_choice(choice: str | dict | None, tools: ChatTools) -> str | dict | None:
    """The chat ``tool_choice``; None leaves the engine's default (auto when tools are offered)."""
    if choice is None or (choice in ("auto", "none") and not tools.tools):
        return None
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools.tools:
            raise APIError(400, "tool_choice 'required' needs a function tool", param="tool_choice")
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if choice.get("namespace"):
            name = f"{choice['namespace']}.{name}"
        offered = {t["function"]["name"] for t in tools.tools or []}
        if name not in offered:
            raise APIError(400, f"tool_choice names {name!r}, which is not a function tool of this request",
                           param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    raise APIError(400, "tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}; "
                        "this server runs no hosted tools", param="tool_choice")


@dataclass
class ChatRequest:
    """A Responses request in chat terms, less its conversation."""

    model: str
    tools: ChatTools
    body: dict[str, Any]   # the engine's chat request, less messages and tools


def _refuse_unsupported(req: ResponsesRequest) -> None:
    for name, bad in (("background", req.background), ("conversation", req.conversation), ("prompt", req.prompt),
                      ("top_logprobs", req.top_logprobs)):
        if bad:
            raise APIError(400, f"{name} is not supported by this server", param=name)


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object", param="text.format")
    if fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise APIError(400, "text.format.type must be text, json_object or json_schema", param="text.format.type")


def _chat_body(req: ResponsesRequest, model: str, tools: ChatTools) -> dict:
    """The chat request for the engine, less its messages and tools."""
    extra = {k: v for k, v in (req.model_extra or {}).items() if k not in NOT_SENT}
    body: dict[str, Any] = {**extra, "model": model}
    choice = to_chat_tool_choice(req.tool_choice, tools)
    if choice is not None:
        body["tool_choice"] = choice
    for ours, theirs in (("parallel_tool_calls", "parallel_tool_calls"), ("max_output_tokens", "max_completion_tokens"),
                         ("temperature", "temperature"), ("top_p", "top_p")):
        if getattr(req, ours) is not None:
            body[theirs] = getattr(req, ours)
    if req.reasoning and req.reasoning.effort:
        body["reasoning_effort"] = req.reasoning.effort
    fmt = _response_format(req.text)
    if fmt:
        body["response_format"] = fmt
    return body


def to_chat(req: ResponsesRequest, served_model: str) -> ChatRequest:
    """The request's fields in chat terms, every one checked (a 400 naming it) before anything is logged."""
    _refuse_unsupported(req)
    model = req.model or served_model
    tools = to_chat_tools(req.tools)
    return ChatRequest(model, tools, _chat_body(req, model, tools))


def after_header(messages: list[Message]) -> list[Message]:
    """The messages after the leading system and developer ones."""
    i = 0
    while i < len(messages) and messages[i].get("role") in HEADER_ROLES:
        i += 1
    return messages[i:]


@dataclass
class Conversation:
    """A request's conversation: the session it continues, the messages stored before it (a
    ``previous_response_id``'s), its input converted, and the messages the engine sees."""

    ref: SessionRef
    prior: list[Message]
    converted: Converted
    messages: list[Message]


def conversation(req: ResponsesRequest | CompactRequest, ref: SessionRef, prior: list[Message],
                 seal: CompactionSeal, owner: str) -> Conversation:
    """``instructions`` as a system message, then ``prior`` and the input (compaction items opened with
    ``seal``, this caller's only); a request with nothing to answer is a 400."""
    converted = to_messages(req.input, partial(seal.open, owner), prior)
    system: list[Message] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages = system + converted.messages
    if not after_header(messages) and not converted.trigger:
        raise APIError(400, "the request has no input", param="input")
    return Conversation(ref, prior, converted, messages)
