"""Server-executed tools: `recall` (search this session's full log) and `note` (store a note
that every later summary copies). The model calls them like any tool; the server runs them."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from agentkv.compaction.log.recall import format_hits, recall
from agentkv.compaction.log.session_log import SessionLog
from agentkv.server.errors import APIError

NOTE_KINDS = ("decision", "rejected", "progress", "note")
DEFINITIONS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "recall",
        "description": "Search the full log of this session, including tool outputs that were cleared "
                       "or summarized away. Give words, not a phrase; returns matching lines.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                       "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "note",
        "description": "Write down a decision, a rejected approach or progress; notes are kept in "
                       "every summary of this session.",
        "parameters": {"type": "object", "properties": {
            "kind": {"type": "string", "enum": list(NOTE_KINDS)}, "text": {"type": "string"}},
            "required": ["kind", "text"]}}},
]
NAMES = {d["function"]["name"] for d in DEFINITIONS}


def with_server_tools(tools: list | None) -> list:
    names = {t.get("function", {}).get("name") for t in tools or []}
    clash = names & NAMES
    if clash:
        raise APIError(400, f"tool name(s) {sorted(clash)} are reserved for server tools", param="tools")
    return list(tools or []) + DEFINITIONS


def execute(log: SessionLog, session: str, name: str, arguments: str) -> str:
    """Run one server tool call; errors become the tool's answer (the model can correct itself)."""
    try:
        args = json.loads(arguments) if arguments else {}
    except ValueError:
        return f"error: arguments are not JSON: {arguments[:200]}"
    if not isinstance(args, dict):
        return "error: arguments must be a JSON object"
    if name == "recall":
        query = args.get("query")
        if not isinstance(query, str) or not query.strip():
            return "error: recall needs a non-empty 'query' string"
        return format_hits(recall(log, session, query))
    if name == "note":
        kind, text = args.get("kind", "note"), args.get("text")
        if kind not in NOTE_KINDS or not isinstance(text, str) or not text.strip():
            return f"error: note needs 'kind' in {list(NOTE_KINDS)} and a non-empty 'text'"
        log.add_note(session, kind, text.strip())
        return "noted"
    return f"error: unknown server tool {name!r}"


class ToolRunner:
    """Executes server tool calls against one session and logs the exchange (append-only)."""

    def __init__(self, log: SessionLog, session: str, max_rounds: int, refit_output: bool = False):
        self.log, self.session, self.max_rounds = log, session, max_rounds
        self.refit_output = refit_output   # the output limit was lowered to the room: a longer follow-up drops it

    async def run(self, calls: list[dict]) -> list[dict]:
        def work() -> list[dict]:
            out = [{"id": c.get("id"), "name": c["function"]["name"], "arguments": c["function"].get("arguments", ""),
                    "result": execute(self.log, self.session, c["function"]["name"],
                                      c["function"].get("arguments", ""))} for c in calls]
            self.log.append(self.session, [{"role": "assistant", "content": None, "tool_calls": calls}] +
                            [{"role": "tool", "tool_call_id": r["id"], "content": r["result"]} for r in out])
            return out
        return await asyncio.to_thread(work)
