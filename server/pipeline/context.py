"""Applies a context policy to a session's conversation: the request path's compaction step.

Order per request: sync the conversation into the session log (before any edit, as the client sent
it; one short transaction), rebuild the view from the edits in force, drop what a client-sent
compaction block replaces, put every message in the form the engine takes (``engine_form``, given
by the API's format module), run the policy's edits on that view, and save what fired onto the
state the edits were made on (a second short transaction: if another request saved the branch in
between, the step runs again on the newer state). No edit runs while the log is held. A summary
the policy needs is written by the model between two runs of the step and read by the next one
(``summaries``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentkv.compaction.edit_kinds import EditKind, EditStep, Failed
from agentkv.compaction.edits import PromptEdit, compose
from agentkv.compaction.policy import ContextManagement, default_policy, with_defaults
from agentkv.compaction.prompt import Message, PromptRenderer, one_step
from agentkv.compaction.prompt_segments import SegmentCache
from agentkv.compaction.summarize import ModelClient
from agentkv.kernels.connector.params import prompt_hash
from agentkv.server import timing

from .sessions import SessionRef, Sessions, ViewState
from .summaries import Summaries, SummaryNeeded

log = logging.getLogger(__name__)
EngineForm = Callable[[Message], Message]


@dataclass
class Prepared:
    key: str                # the session's storage key (owner/id)
    session_id: str         # its public id (X-Session-Id)
    messages: list[Message]
    report: dict[str, Any]
    edits: list[PromptEdit]  # of clearing in this request, against the pre-clearing view prompt
    old_ids: list[int]      # the pre-clearing view prompt (when clearing edited it)
    compaction: Message | None = None  # the summary a compact edit wrote in this request
    compact_edit: EditKind | None = None  # ... and that edit
    prompt_ids: list[int] = field(default_factory=list)  # the final view prompt (want_ids: bench front)
    branch: str = ""        # the conversation branch's identity (``Synced.identity``): what KV reuse holds blocks for
    moved: bool = False     # moved K/V may be in this request's prompt (the branch's, or this request's edit)
    moved_before: bool = False  # ... already before this request (its priming request reads them)
    held: tuple[int, str] | None = None  # (tokens, prompt_hash) of the branch's previous prompt (``identity``)


@dataclass
class _Run:
    """What one pass of the policy's edits did to a view."""

    view: list[Message]
    where: list[int]
    applied: list[dict] = field(default_factory=list)
    failed: list[dict] = field(default_factory=list)
    kv_edits: list[PromptEdit] = field(default_factory=list)
    old_ids: list[int] = field(default_factory=list)
    summary: Message | None = None
    compact_edit: EditKind | None = None


def is_compaction(message: Message) -> bool:
    """A message holding a compaction block with a summary (``content`` null: a failed one, a no-op)."""
    content = message.get("content")
    return isinstance(content, list) and any(
        isinstance(p, dict) and p.get("type") == "compaction" and p.get("content") for p in content)


def after_compaction(view: list[Message], where: list[int]) -> tuple[list[Message], list[int]]:
    """Anthropic's rule for a compaction block the client sends back: everything before the latest
    one is dropped; the leading system messages stay."""
    last = max((i for i, m in enumerate(view) if is_compaction(m)), default=None)
    lead = 0
    while lead < len(view) and view[lead].get("role") in ("system", "developer"):
        lead += 1
    if last is None or last <= lead:
        return view, where
    return view[:lead] + view[last:], where[:lead] + where[last:]


SAVE_TRIES = 4   # a summary to write, or a branch another request saved meanwhile: the step runs again


class ContextManager:
    """The context step. ``renderer``: the served model's render, whose caches no key uses: each key
    gets a sibling with caches of its own (``renderer_for``), the least recently used of at most
    ``max_keys`` dropped; with ``shared_caches`` (a server without API keys: one tenant) every
    caller uses one."""

    def __init__(self, sessions: Sessions, renderer: PromptRenderer, summarizer: ModelClient | None,
                 max_keys: int = 16, shared_caches: bool = False):
        self.sessions, self.renderer = sessions, renderer
        self.summaries = Summaries(summarizer)
        self.max_keys, self.shared_caches = max_keys, shared_caches
        self._renderers: OrderedDict[str, PromptRenderer] = OrderedDict()
        self._lock = threading.Lock()

    def renderer_for(self, owner: str) -> PromptRenderer:
        """The renderer whose caches hold this key's conversations only."""
        if self.shared_caches:
            return self.renderer
        with self._lock:
            r = self._renderers.get(owner)
            if r is None:
                r = self._renderers[owner] = self.renderer.sibling(SegmentCache(
                    max_segments=16384, max_tokens=2_000_000, max_layouts=128, max_id_tokens=1_000_000))
                while len(self._renderers) > self.max_keys:
                    self._renderers.popitem(last=False)
            self._renderers.move_to_end(owner)
            return r

    def _view(self, state: ViewState, messages: list[Message], engine_form: EngineForm | None):
        view, where = after_compaction(*state.view(messages))
        if engine_form is not None:
            view = [engine_form(m) for m in view]
        return view, where

    def _edit(self, renderer: PromptRenderer, run: _Run, state: ViewState, tools: list | None,
              policy: ContextManagement | None, history: list[Message], notes_key: str | None, window: int | None,
              summarizer: ModelClient | None = None) -> _Run:
        """Run the policy's edits on ``run.view``, recording what replaces which conversation
        message in ``state``. Each edit does its own part (``compaction.edit_kinds``); what it did
        is recorded here, the same for every kind. Summaries are written only with ``notes_key``
        (a session to write to) and a ``summarizer`` (``SummaryNeeded`` from it goes up)."""
        if policy is None:
            return run
        step = EditStep(renderer, tools, policy.edits, window, history, notes_key,
                        None if notes_key is None else functools.partial(self._notes, notes_key), summarizer)
        tokens_moved = False  # an edit changed tokens before clearing's: its KV edits no longer apply
        for edit in policy.edits:
            out = edit.apply(run.view, step)
            if out is None:
                continue
            if isinstance(out, Failed):
                run.failed.append(out.report)
                continue
            where = run.where
            for i in out.replaced:
                state.replaced[where[i]] = out.messages[i]
            if out.summary is not None:
                head, cut = out.summary
                state.summary, state.summary_start = out.messages[head], where[head]
                state.summary_end = where[cut] if cut < len(where) else len(history)
                run.where = where[:head + 1] + where[cut:]
                run.summary, run.compact_edit = out.messages[head], edit
            if out.kv_edits is not None:
                if tokens_moved or not out.kv_edits:
                    run.kv_edits, run.old_ids = [], []
                elif run.kv_edits:   # an earlier edit of this step: both, as edits of the prompt before it
                    new_ids = renderer.render(out.messages, tools).token_ids
                    run.kv_edits = compose(run.kv_edits, run.old_ids, out.kv_edits, out.old_ids, new_ids)
                else:
                    run.kv_edits, run.old_ids = out.kv_edits, out.old_ids
            tokens_moved = tokens_moved or out.moves_tokens
            run.view = out.messages
            run.applied.append(out.report)
        return run

    def _notes(self, key: str) -> list[str]:
        """The session's notes, as a summary copies them."""
        return [f"{kind}: {text}" for kind, text in self.sessions.log.notes(key)]

    def prepare(self, owner: str, ref: SessionRef, messages: list[Message], tools: list | None,
                policy: ContextManagement | None, window: int | None = None,
                engine_form: EngineForm | None = None, want_ids: bool = False, may_summarize: bool = True,
                identity: bool = False, shifting: bool = False, salt: str | None = None) -> Prepared:
        """The request's view, its edits applied and saved on the state they were made on.
        ``may_summarize=False``: raise ``SummaryNeeded`` where a summary must be written first (the
        sync, which a second call finds done, is saved). ``identity``: keep the identity of the
        prompt sent (the next KV edit names the prompt it is on by it); ``shifting``: a clearing
        edit of this request goes to the KV connector (the branch then holds moved K/V);
        ``salt``: the cache salt of the summarizer's requests."""
        renderer = self.renderer_for(owner)
        with one_step():
            return self._prepare(renderer, owner, ref, messages, tools, policy, window, engine_form, want_ids,
                                 may_summarize, identity, shifting, salt)

    def _prepare(self, renderer: PromptRenderer, owner: str, ref: SessionRef, messages: list[Message],
                 tools: list | None, policy: ContextManagement | None, window: int | None,
                 engine_form: EngineForm | None, want_ids: bool, may_summarize: bool, identity: bool,
                 shifting: bool, salt: str | None) -> Prepared:
        keys = renderer.known.keys(messages)
        history = [engine_form(m) for m in messages] if engine_form else messages
        before = renderer.count(history, tools)
        for attempt in range(SAVE_TRIES):
            last = attempt == SAVE_TRIES - 1
            synced = self.sessions.sync(owner, ref, messages, keys)       # the log before any edit
            work = synced.state.copy()
            try:
                run = self._edit(renderer, _Run(*self._view(work, messages, engine_form)), work, tools, policy,
                                 history, synced.key, window, self.summaries.reader(owner, last_try=last))
            except SummaryNeeded:
                if not may_summarize:
                    raise
                self._write_summary(renderer, synced, messages, tools, policy, history, window, engine_form, owner,
                                    salt)
                continue
            if identity:             # what the KV connector will hold for this branch
                ids = renderer.render(run.view, tools).token_ids
                work.sent = [len(ids), prompt_hash(ids)]
            work.moved = synced.state.moved or bool(shifting and run.kv_edits)
            if self.sessions.save(synced, work) or last:   # else a request saved this branch meanwhile: again
                break
        else:   # pragma: no cover - the loop always breaks on its last try
            raise RuntimeError("unreachable")
        view = run.view
        same = len(view) == len(history) and renderer.known.keys(view) == renderer.known.keys(history)
        after = before if same else renderer.count(view, tools)
        report = {"session_id": synced.id, "applied_edits": run.applied,
                  "prompt_tokens_before": before, "prompt_tokens_after": after}
        if run.failed:
            report["failed_edits"] = run.failed
        ids = renderer.render(view, tools).token_ids if want_ids else []
        return Prepared(synced.key, synced.id, view, report, run.kv_edits, run.old_ids, run.summary, run.compact_edit,
                        ids, synced.identity, work.moved, synced.state.moved,
                        tuple(synced.state.sent) if synced.state.sent else None)

    def _write_summary(self, renderer: PromptRenderer, synced, messages: list[Message], tools: list | None,
                       policy: ContextManagement | None, history: list[Message], window: int | None,
                       engine_form: EngineForm | None, owner: str, salt: str | None) -> None:
        """Run the edits on the synced state, the model writing what they need (into ``summaries``);
        nothing is saved here."""
        state = synced.state.copy()
        self._edit(renderer, _Run(*self._view(state, messages, engine_form)), state, tools, policy, history,
                   synced.key, window, self.summaries.writer(owner, salt))

    def count(self, owner: str, messages: list[Message], tools: list | None, policy: ContextManagement | None,
              engine_form: EngineForm | None = None) -> tuple[int, int]:
        """(prompt tokens as the engine would get them, before any edit) for a conversation outside
        any session: the request's clearing edits apply, a summary is not written (that takes a
        generation), nothing is logged."""
        renderer = self.renderer_for(owner)
        state = ViewState()
        with one_step():
            history = [engine_form(m) for m in messages] if engine_form else messages
            run = self._edit(renderer, _Run(*self._view(state, messages, engine_form)), state, tools, policy, history,
                             None, None)
            return renderer.count(run.view, tools), renderer.count(history, tools)


# a conversation this small (characters of text) costs its context step a millisecond or two: on the
# event loop, where a thread's hand-offs (the GIL, the log's lock) cost tens to hundreds of
# milliseconds under a burst of streams (front time before the engine at 64 streams: p50 1.3-1.4 ms
# against 53-515 ms). Larger ones, summaries and a remote log keep the thread.
INLINE_CHARS = 64_000


def text_size(messages: list[Message], limit: int) -> int:
    """Characters of the messages' text and tool-call arguments, counted up to just past ``limit``."""
    n = 0
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            n += len(content)
        elif isinstance(content, list):
            n += sum(len(str(p.get("text") or p.get("content") or "")) if isinstance(p, dict) else 0 for p in content)
        for c in m.get("tool_calls") or []:
            n += len(str((c.get("function") or {}).get("arguments") or ""))
        if n > limit:
            break
    return n


async def manage(ctx: ContextManager, cfg, window: int, owner: str, ref: SessionRef,
                 conversation: list[Message], tools: list | None, requested: ContextManagement | None, *,
                 salt: str, fixed: int = 0, engine_form: EngineForm | None = None, shifting: bool = False) -> Prepared:
    """The request path's compaction step for any API: the session, the policy (the request's edits
    with the server default's for the kinds it does not name, see ``with_defaults``), then
    ``prepare``: ``fixed`` is the tokens of the system prompt and tools (the default's levels are
    set above it); small conversations on the event loop (see ``INLINE_CHARS``) when the session log
    is free, the rest off it."""
    default = (default_policy(window, fixed, cfg.clear_at, cfg.clear_to, cfg.compact_at)
               if cfg.context_management else None)
    policy = with_defaults(requested, default)
    args = (owner, ref, conversation, tools, policy, window or None, engine_form)
    timing.mark("context_start")
    prepared = None
    kw = {"identity": cfg.kv_connector, "shifting": shifting, "salt": salt}
    log = ctx.sessions.log
    # inline only where the log is free at once: waiting for its lock (a transaction on a thread)
    # would stall the event loop, so a held log sends the step to a thread
    if log.LOCAL and text_size(conversation, INLINE_CHARS) <= INLINE_CHARS and log.lock.acquire(blocking=False):
        try:
            prepared = ctx.prepare(*args, may_summarize=False, **kw)
        except SummaryNeeded:
            pass
        finally:
            log.lock.release()
    if prepared is None:
        prepared = await asyncio.to_thread(functools.partial(ctx.prepare, *args, **kw))
    timing.mark("context_end")
    return prepared
