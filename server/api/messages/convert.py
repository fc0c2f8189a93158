"""Anthropic Messages requests in agentkv's terms: one conversion, used for the log, the policy and
the engine.

``conversation(system, messages, ...)`` gives the conversation as OpenAI chat messages, the form
the session log stores and the policy edits. It keeps every block whole, fields included, except
request metadata that is not conversation: ``cache_control`` markers (Claude Code moves them to the
newest message every turn) and Claude Code's ``x-anthropic-billing-header`` system line (it can
change between requests; vLLM drops it as well).

- the top-level ``system`` -> a system message; a ``system`` message in ``messages`` stays where it is;
- a user turn, in order: each ``tool_result`` -> a tool message (``content`` as sent, ``is_error``
  kept), each run of other blocks -> a user message (a string stays a string);
- an assistant turn: ``tool_use`` blocks -> ``tool_calls`` (after the turn's other blocks: their
  order relative to those is not kept), the other blocks (text, thinking, redacted_thinking) stay
  in ``content``; a ``compaction`` block -> an assistant message of its own.

A block the served model cannot take is refused there, before anything is logged: a 400 naming it
(``messages.N.content.M``). ``engine_message`` then gives each logged message as vLLM's chat
completions takes it: text blocks joined into one string, ``thinking`` as the turn's ``reasoning``
(rendered by templates of reasoning models), ``redacted_thinking`` left out (encrypted: no text
form), documents and search results as their text, images as ``image_url`` parts (only for a model
that takes images), a compaction block as a user message holding its summary.
"""

from __future__ import annotations

import json
from typing import Any

from agentkv.compaction.prompt import Message
from agentkv.server.errors import APIError
from agentkv.server.options import AGENTKV_FIELDS

BILLING_HEADER = "x-anthropic-billing-header"
TOOL_CHANGES = {"tool_addition", "tool_removal"}   # beta mid-conversation-tool-changes-2026-07-01
USER_BLOCKS = {"text", "image", "document", "search_result", "tool_result", *TOOL_CHANGES}
ASSISTANT_BLOCKS = {"text", "thinking", "redacted_thinking", "tool_use", "compaction"}
RESULT_BLOCKS = {"text", "image", "document", "search_result", "tool_reference"}
# the fields of a block this module reads: (types, required); others are kept as they are
FIELDS: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "text": {"text": ((str,), True)},
    "thinking": {"thinking": ((str,), True)},
    "redacted_thinking": {"data": ((str,), True)},
    "tool_use": {"id": ((str,), True), "name": ((str,), True), "input": ((dict,), False)},
    "tool_result": {"tool_use_id": ((str,), True), "content": ((str, list), False)},
    "image": {"source": ((dict,), True)},
    "document": {"source": ((dict,), True), "title": ((str,), False), "context": ((str,), False)},
    "search_result": {"content": ((list,), True), "title": ((str,), False), "source": ((str,), False)},
    "compaction": {"content": ((str, type(None)), False), "signature": ((str,), False)},
    "tool_reference": {"tool_name": ((str,), True)},
    "tool_addition": {"tool": ((dict,), True)},
    "tool_removal": {"tool": ((dict,), True)},
}
TYPE_NAMES: dict[type, str] = {str: "a string", dict: "an object", list: "a list"}   # FIELDS' types, in errors
# request fields this module maps (or knowingly ignores), never passed on to vLLM; any other field
# passes through (vLLM's own sampling extensions: seed, repetition_penalty, structured_outputs, ...)
MAPPED = {"model", "messages", "system", "max_tokens", "stream", "tools", "tool_choice", "stop_sequences",
          "temperature", "top_p", "top_k", "metadata", "thinking", "output_config", "service_tier",
          "container", "mcp_servers", "thread", "compaction", *AGENTKV_FIELDS}


def _whole(block: dict) -> dict:
    """A block as the log keeps it: everything but ``cache_control`` (nested blocks too)."""
    out = {k: v for k, v in block.items() if k != "cache_control"}
    if isinstance(out.get("content"), list):
        out["content"] = [_whole(b) if isinstance(b, dict) else b for b in out["content"]]
    return out


def _without_billing(text: str) -> str:
    return text.partition("\n")[2] if text.startswith(BILLING_HEADER) else text


def _system_content(content: Any, where: str, tool_changes: bool) -> str | list[dict] | None:
    """System text without the billing header; in a system *message* (not the top-level ``system``)
    also ``tool_addition`` / ``tool_removal`` blocks (Claude Code sends its tool changes so)."""
    if isinstance(content, str):
        return _without_billing(content) or None
    blocks = []
    for j, b in enumerate(content or []):
        if tool_changes and isinstance(b, dict) and b.get("type") in TOOL_CHANGES and isinstance(b.get("tool"), dict):
            blocks.append(_whole(b))
            continue
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            takes = "text blocks ({'type': 'text', 'text': <string>})" + \
                (" and tool_addition / tool_removal blocks" if tool_changes else "")
            raise APIError(400, f"{where}.{j}: system content takes {takes}, not {b!r:.100}", param=f"{where}.{j}")
        text = _without_billing(b["text"])
        if text:
            blocks.append(_whole({**b, "text": text}))
    return blocks or None


class _Checker:
    """Refuses, with a 400 naming it, a block the served model cannot take."""

    def __init__(self, takes_images: bool):
        self.takes_images = takes_images

    def block(self, b: Any, allowed: set[str], where: str) -> dict:
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise APIError(400, f"{where}: a content block must be an object with a 'type'", param=where)
        kind = b["type"]
        if kind not in allowed:
            raise APIError(400, f"{where}: content block type {kind!r} is not supported here "
                                f"(supported: {sorted(allowed)})", param=where)
        for key, (types, required) in FIELDS.get(kind, {}).items():
            value = b.get(key)
            if value is None and not required:
                continue
            if not isinstance(value, types):
                names = " or ".join("null" if t is type(None) else TYPE_NAMES[t] for t in types)
                raise APIError(400, f"{where}.{key}: a {kind} block's '{key}' must be {names}", param=f"{where}.{key}")
        if kind == "search_result":
            for k, item in enumerate(b["content"]):
                self.block(item, {"text"}, f"{where}.content.{k}")
        if kind == "image" and not self.takes_images:
            raise APIError(400, f"{where}: the served model takes text only; an image block has no faithful "
                                "text form", param=where)
        if kind == "document" and _document_text(b) is None:
            raise APIError(400, f"{where}: agentkv passes documents on as text; this {_source_kind(b)} document "
                                "has no text form (send it as a text source, or as content blocks)", param=where)
        if kind == "tool_result" and isinstance(b.get("content"), list):
            for k, item in enumerate(b["content"]):
                self.block(item, RESULT_BLOCKS, f"{where}.content.{k}")
        return _whole(b)


def _source_kind(b: dict) -> str:
    source = b.get("source") or {}
    return str(source.get("media_type") or source.get("type") or "unknown")


def _document_text(b: dict) -> str | None:
    """A document's text form (title, context, text), or None where it has none (a PDF)."""
    source = b.get("source") or {}
    if source.get("type") == "text" and isinstance(source.get("data"), str):
        text = source["data"]
    elif source.get("type") == "content":
        inner = source.get("content")
        if isinstance(inner, str):
            text = inner
        elif isinstance(inner, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in inner):
            text = "\n".join(p.get("text") or "" for p in inner)
        else:
            return None
    else:
        return None
    return "\n\n".join(x for x in (b.get("title"), b.get("context"), text) if x)


def _search_result_text(b: dict) -> str:
    texts = [p.get("text") or "" for p in b.get("content") or [] if isinstance(p, dict)]
    return "\n\n".join(x for x in (b.get("title"), b.get("source"), "\n".join(texts)) if x)


def _tool_call(b: dict) -> dict:
    return {"id": b["id"], "type": "function",
            "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})}}


def _flush(out: list[Message], group: list[dict], calls: list[dict]) -> None:
    """The assistant blocks and tool calls gathered so far as one message, then none gathered."""
    if group or calls:
        msg: Message = {"role": "assistant", "content": list(group) or None}
        if calls:
            msg["tool_calls"] = list(calls)
        out.append(msg)
    group.clear()
    calls.clear()


def conversation(system: Any, messages: list[dict], takes_images: bool = False) -> list[Message]:
    """The request's conversation as OpenAI messages, every block whole (see the module docstring)."""
    check = _Checker(takes_images)
    out: list[Message] = []
    top = _system_content(system, "system", tool_changes=False) if system else None
    if top:
        out.append({"role": "system", "content": top})
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content")
        where = f"messages.{i}.content"
        if role == "system":
            text = _system_content(content, where, tool_changes=True)
            if text:
                out.append({"role": "system", "content": text})
        elif isinstance(content, str):
            out.append({"role": role, "content": content})
        elif role == "user":
            run: list[dict] = []
            for j, b in enumerate(content or []):
                b = check.block(b, USER_BLOCKS, f"{where}.{j}")
                if b["type"] != "tool_result":
                    run.append(b)
                    continue
                if run:
                    out.append({"role": "user", "content": run})
                    run = []
                extra = {k: v for k, v in b.items() if k not in ("type", "tool_use_id", "content")}
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": b.get("content", ""),
                            **extra})
            if run or not content:
                out.append({"role": "user", "content": run})
        else:
            group: list[dict] = []
            calls: list[dict] = []

            for j, b in enumerate(content or []):
                b = check.block(b, ASSISTANT_BLOCKS, f"{where}.{j}")
                if b["type"] == "compaction":
                    _flush(out, group, calls)
                    out.append({"role": "assistant", "content": [b]})
                elif b["type"] == "tool_use":
                    calls.append(_tool_call(b))
                else:
                    group.append(b)
            _flush(out, group, calls)
            if not content:
                out.append({"role": "assistant", "content": []})
    return out


def _image_url(source: dict) -> str:
    if source.get("type") == "url":
        return source.get("url", "")
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _engine_parts(content: list) -> tuple[list[dict], list[str]]:
    """(content parts for vLLM, reasoning texts) of a block list."""
    parts, thinking = [], []
    for p in content:
        kind = p.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": p.get("text") or ""})
        elif kind == "thinking":
            thinking.append(p.get("thinking") or "")
        elif kind in ("redacted_thinking", "compaction", *TOOL_CHANGES):  # no text form (a failed compaction:
            continue                                                     # no summary; tool changes: in ``tools``)
        elif kind == "tool_reference":
            parts.append({"type": "text", "text": f"Tool loaded: {p.get('tool_name')}"})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(p.get("source") or {})}})
        elif kind == "image_url":
            parts.append(p)
        elif kind == "document":
            parts.append({"type": "text", "text": _document_text(p) or ""})
        elif kind == "search_result":
            parts.append({"type": "text", "text": _search_result_text(p)})
        else:
            raise ValueError(f"no engine form for a {kind!r} block")
    return parts, thinking


def engine_message(m: Message) -> Message:
    """A logged message as vLLM's chat completions takes it (idempotent: an engine-form message,
    such as a cleared or summarized one, comes back unchanged)."""
    content = m.get("content")
    if isinstance(content, list):
        summary = next((p.get("content") for p in content if isinstance(p, dict) and p.get("type") == "compaction"),
                       None)
        if summary:
            return {"role": "user", "content": summary}
    out: Message = {"role": m["role"]}
    if m.get("tool_call_id") is not None:
        out["tool_call_id"] = m["tool_call_id"]
    reasoning = m.get("reasoning")
    if isinstance(content, list):
        parts, thinking = _engine_parts(content)
        if thinking:
            reasoning = "".join(thinking)
        if all(p["type"] == "text" for p in parts):
            content = "\n".join(p["text"] for p in parts) if parts else (None if m["role"] == "assistant" else "")
        else:
            content = parts
    out["content"] = content
    if m.get("tool_calls"):
        out["tool_calls"] = m["tool_calls"]
    if reasoning is not None:
        out["reasoning"] = reasoning
    return out


def _tool(block: dict) -> dict:
    """A ``tool_addition`` / ``tool_removal`` block's ``tool`` (``{}``: not an object)."""
    tool = block.get("tool")
    return tool if isinstance(tool, dict) else {}


def _named(ref: dict) -> str | None:
    name = ref.get("name") if ref.get("type") == "tool_reference" else None
    return name if isinstance(name, str) else None


def offered_tools(tools: list[dict] | None, messages: list[dict]) -> list[dict] | None:
    """The tools the model is offered at the end of the conversation: the request's, but those with
    ``defer_loading`` until a ``tool_reference`` block in a tool result loads them (beta
    ``advanced-tool-use-2025-11-20``: Claude Code's ToolSearch), then the conversation's
    ``tool_addition`` / ``tool_removal`` blocks in order (beta ``mid-conversation-tool-changes-2026-07-01``:
    a tool by reference, or an inline ``tool_definition``). MCP references name no tool this server runs."""
    declared = {t["name"]: t for t in tools or [] if isinstance(t, dict) and t.get("name")}
    offered = {name: t for name, t in declared.items() if not t.get("defer_loading")}
    for m in messages:
        content = m.get("content")
        for b in content if isinstance(content, list) else []:
            if not isinstance(b, dict):
                continue
            kind = b.get("type")
            if kind == "tool_result" and isinstance(b.get("content"), list):
                for name in (r.get("tool_name") for r in b["content"] if isinstance(r, dict)
                             and r.get("type") == "tool_reference"):
                    if isinstance(name, str) and name in declared:
                        offered[name] = declared[name]
            elif kind == "tool_addition":
                tool = _tool(b)
                definition = tool.get("definition") if tool.get("type") == "tool_definition" else None
                if isinstance(definition, dict) and isinstance(definition.get("name"), str):
                    declared[definition["name"]] = offered[definition["name"]] = definition
                elif _named(tool) in declared:
                    offered[_named(tool)] = declared[_named(tool)]
            elif kind == "tool_removal":
                offered.pop(_named(_tool(b)), None)
    return [{k: v for k, v in t.items() if k != "defer_loading"} for t in offered.values()] or None


def tools_to_openai(tools: list[dict] | None) -> list[dict] | None:
    if not tools:
        return None
    return [{"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                              "parameters": t.get("input_schema") or {"type": "object"}}}
            for t in tools]


def _tool_choice(choice: dict, body: dict) -> None:
    kind = choice.get("type")
    if kind == "tool":
        if not choice.get("name"):
            raise APIError(400, "tool_choice.name: required with type 'tool'", param="tool_choice.name")
        body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif kind in ("auto", "any", "none"):
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    else:
        raise APIError(400, f"tool_choice.type: expected auto, any, tool or none, not {kind!r}",
                       param="tool_choice.type")
    if choice.get("disable_parallel_tool_use"):
        body["parallel_tool_calls"] = False


def chat_request(body: dict[str, Any], model: str) -> dict[str, Any]:
    """The engine's chat completions request for an Anthropic request (``body``, as sent), less
    its messages and tools (the turn adds the managed view and the tools). ``thinking`` and
    ``output_config.effort`` are not passed on (the served models have no reasoning parser by
    default; a reasoning model's template decides by itself); ``metadata`` is read for the session
    only."""
    out = {k: v for k, v in body.items() if k not in MAPPED}
    out.update(model=model, max_tokens=body["max_tokens"], stream=bool(body.get("stream")))
    for key in ("temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            out[key] = body[key]
    if body.get("stop_sequences"):
        out["stop"] = body["stop_sequences"]
    if body.get("tool_choice"):
        _tool_choice(body["tool_choice"], out)
    fmt = (body.get("output_config") or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                          "schema": fmt.get("schema") or {}}}
    return out
