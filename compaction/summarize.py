"""Summarization: the oldest part of the conversation becomes one summary message.

The summary has two parts (first seed's design): a handoff note written by the served model and
updated, not rewritten, at the next compaction; and parts copied by code from the log, never
paraphrased: the user's messages (newest first, up to a budget), the agent's notes, and the files
it changed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .groups import sized_groups
from .prompt import Message, PromptRenderer
from .prompt import content_text as _text

if TYPE_CHECKING:
    from .edit_kinds.compact import Compact

SUMMARY = "[conversation summary]"
NOTE_START, NOTE_END = "<handoff_note>", "</handoff_note>"
DEFAULT_INSTRUCTIONS = (
    "You are writing a handoff note so that another engineer can continue this agent session. "
    "Update the previous note with what happened since; do not drop what still holds. Sections: "
    "Goal; Done; Decisions (with reasons); Rejected approaches (and why); Next steps. Be specific: "
    "names of files, commands, values, errors.")
HEADER = ("This replaces the older part of the conversation. The user's messages, the notes and the "
          "list of changed files below are copied from the session log word for word. For exact "
          "details, re-read the files or call recall instead of answering from memory.")
_WRITE_TOOL = re.compile(r"write|edit|patch|create|replace|save|apply", re.I)
_PATH_KEYS = ("path", "file_path", "filepath", "filename", "file")
TRANSCRIPT_CHARS = 24_000
RESULT_CHARS = 600


class ModelClient(Protocol):
    """What summarization needs from a model: one chat completion, text out (a client may also take
    a ``cache_salt`` keyword: the prefix-cache namespace of the request)."""

    def complete(self, messages: list[Message], max_tokens: int) -> str: ...


class SummaryPending(Exception):
    """A ``ModelClient`` that writes its summaries outside the step asking for them (the server's
    context step) has none for this request yet: not a failed edit, it goes up to the caller."""


class OpenAIModelClient:
    """A ModelClient over an OpenAI-compatible endpoint (our own server, in practice)."""

    def __init__(self, client, model: str):
        self.client, self.model = client, model

    def complete(self, messages: list[Message], max_tokens: int, cache_salt: str | None = None) -> str:
        r = self.client.chat.completions.create(model=self.model, messages=messages, max_tokens=max_tokens,
                                                temperature=0,
                                                extra_body={"cache_salt": cache_salt} if cache_salt else None)
        return r.choices[0].message.content or ""


@dataclass
class SummaryResult:
    messages: list[Message]
    summarized_messages: int = 0
    summary_tokens: int = 0
    tokens_before: int = 0
    tokens_after: int = 0
    note: str | None = None


def is_summary(message: Message) -> bool:
    return message.get("role") == "user" and _text(message.get("content")).startswith(SUMMARY)


def previous_note(messages: list[Message]) -> str | None:
    for m in messages:
        if is_summary(m):
            text = _text(m["content"])
            if NOTE_START in text and NOTE_END in text:
                return text.split(NOTE_START, 1)[1].split(NOTE_END, 1)[0].strip()
    return None


def transcript(messages: list[Message], limit: int = TRANSCRIPT_CHARS) -> str:
    """Plain-text transcript for the summarizer, tool results shortened, newest kept if too long."""
    lines = []
    for m in messages:
        if is_summary(m):
            continue
        role, text = m.get("role"), _text(m.get("content"))
        if role == "tool":
            text = text if len(text) <= RESULT_CHARS else text[:RESULT_CHARS] + " [...]"
        calls = "".join(f"\n  -> {c['function'].get('name')}({c['function'].get('arguments', '')})"
                        for c in m.get("tool_calls") or [])
        lines.append(f"{role}: {text}{calls}")
    out = "\n".join(lines)
    return out if len(out) <= limit else "[...]\n" + out[-limit:]


def changed_files(history: list[Message]) -> list[str]:
    """Paths passed to file-writing tools (by tool name), in first-seen order."""
    seen: dict[str, None] = {}
    for m in history:
        for c in m.get("tool_calls") or []:
            fn = c.get("function", {})
            if not _WRITE_TOOL.search(fn.get("name", "")):
                continue
            args = fn.get("arguments")
            try:
                args = json.loads(args) if isinstance(args, str) else (args or {})
            except ValueError:
                continue
            for k in _PATH_KEYS:
                if isinstance(args, dict) and isinstance(args.get(k), str):
                    seen.setdefault(args[k], None)
    return list(seen)


def user_messages(history: list[Message], renderer: PromptRenderer, budget: int) -> list[str]:
    """The user's messages, newest first, while they fit in ``budget`` tokens."""
    out, used = [], 0
    for m in reversed(history):
        if m.get("role") != "user" or is_summary(m):
            continue
        text = _text(m.get("content"))
        t = renderer.count_text(text)
        if used + t > budget:
            break
        out.append(text)
        used += t
    return out


def summary_message(note: str, users: list[str], notes: list[str], files: list[str]) -> Message:
    parts = [SUMMARY, HEADER, f"{NOTE_START}\n{note.strip()}\n{NOTE_END}"]
    if users:
        parts.append("User messages (newest first):\n" + "\n".join(f"- {u}" for u in users))
    if notes:
        parts.append("Agent notes:\n" + "\n".join(f"- {n}" for n in notes))
    if files:
        parts.append("Files changed:\n" + "\n".join(f"- {f}" for f in files))
    return {"role": "user", "content": "\n\n".join(parts)}


def _cut(messages: list[Message], renderer: PromptRenderer, start: int, keep_tokens: int,
         tools) -> int:
    """Index where the kept recent part begins: a group boundary, newest groups within budget."""
    used, cut = 0, len(messages) - start
    for g, t in reversed(sized_groups(renderer, messages[start:], tools)):
        if used + t > keep_tokens:
            break
        used += t
        cut = g[0]
    return start + cut


def summarize(messages: list[Message], renderer: PromptRenderer, cfg: Compact, client: ModelClient,
              tools: list | None = None, notes: list[str] | None = None,
              history: list[Message] | None = None, window: int | None = None) -> SummaryResult:
    """Compact ``messages`` (the current view) once it reaches ``cfg.trigger`` tokens.

    ``history``: the full session log, for the copied parts (default: ``messages``);
    ``notes``: the agent's notes, copied into the summary; ``window``: the model's context, which
    the summarizer's own request must fit (the transcript loses its oldest part until it does;
    no summary when even the bare request does not fit)."""
    before = renderer.count(messages, tools)
    unchanged = SummaryResult(messages, tokens_before=before, tokens_after=before)
    if before < cfg.trigger:
        return unchanged
    head = 0
    while head < len(messages) and messages[head].get("role") in ("system", "developer"):
        head += 1
    cut = _cut(messages, renderer, head, cfg.keep_recent_tokens, tools)
    old = messages[head:cut]
    if not [m for m in old if not is_summary(m)]:
        return unchanged
    prior = previous_note(old)
    text = transcript(old)
    while True:
        ask = [{"role": "system", "content": cfg.instructions or DEFAULT_INSTRUCTIONS},
               {"role": "user", "content": (f"Previous handoff note:\n{prior}\n\n" if prior else "") +
                f"Conversation to fold into the note:\n{text}\n\nWrite the updated handoff note."}]
        if window is None or renderer.count(ask) + cfg.summary_max_tokens <= window:
            break
        if not text:
            return unchanged
        text = "[...]\n" + text[len(text) // 4 + 1:] if len(text) > 64 else ""
    note = client.complete(ask, cfg.summary_max_tokens)
    source = history if history is not None else messages
    summary = summary_message(note, user_messages(source, renderer, cfg.user_messages_tokens),
                              list(notes or []), changed_files(source))
    new = messages[:head] + [summary] + messages[cut:]
    after = renderer.count(new, tools)
    if after >= before and not cfg.always:
        return unchanged
    return SummaryResult(new, len(old), renderer.count_text(summary["content"]), before, after, note)
