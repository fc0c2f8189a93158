"""What the sessions page shows, assembled from the session log (plain data; the templates and the
JSON routes both read it): one key's sessions, and for one session its turns (sizes against the
window, tokens computed and cached, every edit and what KV reuse did) beside its full log and the
view the model got, cleared and summarized messages marked."""

from __future__ import annotations

import json
from typing import Any

from agentkv.compaction.log.session_log import SessionLog
from agentkv.compaction.prompt import Message, content_text, message_key
from agentkv.kernels.connector.params import FALLBACKS
from agentkv.server.pipeline.sessions import BRANCH, ViewState, branch_of, session_key

TEXT_SHOWN = 4000   # characters of a message shown (the rest is counted)
FRONT_FALLBACKS = {"connector_disabled": "the server runs without the KV connector"}


def sessions(log: SessionLog, owner: str, limit: int = 200) -> list[dict[str, Any]]:
    """The owner's sessions with turns, the most recently active first."""
    out = []
    for key, last, turns in log.sessions_under(owner + "/", limit):
        out.append({"id": key.split("/", 1)[1], "last_turn": last, "turns": turns, "messages": log.count(key)})
    return out


def _text(message: Message) -> str:
    parts = [content_text(message.get("content")) if not isinstance(message.get("content"), list) else
             "".join(str(p.get("text") or p.get("content") or "") for p in message["content"] if isinstance(p, dict))]
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        parts.append(f"→ {fn.get('name')}({args if isinstance(args, str) else json.dumps(args)})")
    return "\n".join(p for p in parts if p)


def _shown(message: Message, status: str) -> dict[str, Any]:
    text = _text(message)
    return {"role": str(message.get("role")), "text": text[:TEXT_SHOWN], "more": max(0, len(text) - TEXT_SHOWN),
            "status": status}


def _kv(edit: dict) -> dict[str, Any] | None:
    kv = edit.get("kv")
    if not kv:
        return None
    reason = kv.get("fallback")
    return {"mode": kv.get("mode"), "reused_tokens": kv.get("reused_tokens"), "primed_tokens": kv.get("primed_tokens"),
            "fallback": reason, "why": FALLBACKS.get(reason) or FRONT_FALLBACKS.get(reason) if reason else None}


def _edit(edit: dict) -> dict[str, Any]:
    kind = str(edit.get("type", ""))
    facts = {k: v for k, v in edit.items() if k not in ("type", "kv", "edits") and not isinstance(v, (dict, list))}
    return {"type": kind, "facts": facts, "kv": _kv(edit)}


def session(log: SessionLog, owner: str, session_id: str) -> dict[str, Any] | None:
    """One of the owner's sessions, or None (another key's answers as one that does not exist)."""
    key, sid = session_key(owner, session_id)
    count = log.count(key)
    records = log.turns(key)
    if not count and not records:
        return None
    branches: dict[str, int] = {}
    turns = []
    for n, (branch, r, when) in enumerate(records, 1):
        label = branches.setdefault(branch, len(branches) + 1)
        turns.append({"n": n, "when": when, "branch": label, "api": r.get("api"), "window": r.get("window") or 0,
                      "before": r.get("prompt_tokens_before"), "after": r.get("prompt_tokens_after"),
                      "prompt": r.get("prompt_tokens"), "cached": r.get("cached_tokens"),
                      "computed": r.get("computed_tokens"), "completion": r.get("completion_tokens"),
                      "kv_mode": r.get("kv_mode"), "edits": [_edit(e) for e in r.get("applied_edits") or []],
                      "failed": [_edit(e) for e in r.get("failed_edits") or []], "summary": r.get("summary")})
    # the last turn's branch: its conversation, from the log by its messages' keys, and its view
    branch = branch_of(records[-1][0]) if records else key
    state = ViewState.load(log.get_state(branch))
    by_key = {message_key(m): m for m in log.history(key)}
    conversation = [by_key[k] for k in state.keys if k in by_key]
    marks = dict.fromkeys(state.replaced, "cleared")
    if state.summary is not None:
        marks.update(dict.fromkeys(range(state.summary_start, state.summary_end), "summarized"))
    view, where = state.view(conversation)
    model_view = []
    for m, i in zip(view, where):
        status = "summary" if state.summary is not None and m is state.summary else \
            "cleared" if i in state.replaced else "kept"
        model_view.append(_shown(m, status))
    return {"id": sid, "messages": count, "branches": len(log.states_like(key, BRANCH)) or 1,
            "turns": turns, "log": [_shown(m, marks.get(i, "kept")) for i, m in enumerate(conversation)],
            "view": model_view}
