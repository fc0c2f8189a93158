"""Anthropic message threads (beta ``message-threads-2026-08-12``), kept in the session log.

``thread: {"type": "create"}`` with the whole conversation: the conversation (as the client sent it,
plus the reply, in Anthropic's form), its ``system`` and ``tools`` are stored under the response's
``id``. ``thread: {"type": "continue", "previous_message_id"}`` with only the new messages: the
conversation is rebuilt from the stored chain (the session log database: the saved re-send) and the
request runs as if the client had sent it whole. As Anthropic documents: a thread expires 5 minutes
after its last response (``thread_not_found``, 404: the client replays with ``create``); a response
is continued once (``thread_already_continued``) and by one request at a time
(``thread_continue_in_flight``: a claim in the session log, so replicas sharing one log agree);
``system`` and ``tools`` come from the thread, and a continue that sends other ones is refused
(``thread_fingerprint_mismatch``; ``cache_control`` markers aside). A thread belongs to the API key
that made it: any other key gets the same 404 as for an id that does not exist.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

from agentkv.compaction.log.session_log import SessionLog
from agentkv.server.errors import APIError
from agentkv.server.pipeline.sessions import SessionRef

logger = logging.getLogger(__name__)
TTL_S = 300.0
IN_FLIGHT_S = 600.0   # a continue still marked in flight after this long is taken as gone (a stream never started)
KIND = "message_thread"
MESSAGE_ID = re.compile(r"msg_[0-9a-f]{32}")


def _claim_name(previous: str) -> str:
    """The session log claim a continue of ``previous`` holds while it runs."""
    return f"thread-continue:{previous}"


@dataclass
class Thread:
    """A request's thread: what it continues (``parent``) and the messages it adds."""

    parent: str | None
    new_messages: list[dict]
    system: Any = None
    tools: Any = None
    session: SessionRef | None = None        # the thread's session, for a continue
    holder: str | None = None                # the continue's claim (``SessionLog.claim``)


def _unmarked(value: Any) -> Any:
    """``value`` without ``cache_control`` markers anywhere (Claude Code moves them every turn)."""
    if isinstance(value, dict):
        return {k: _unmarked(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_unmarked(v) for v in value]
    return value


def _not_found(previous: str) -> APIError:
    return APIError(404, f"no usable thread state for previous_message_id {previous!r} (unknown, expired after "
                         f"{TTL_S:.0f} s, or another key's): replay the whole conversation with "
                         "thread: {\"type\": \"create\"}", param="thread.previous_message_id",
                    error_code="thread_not_found")


def _already_continued(previous: str) -> APIError:
    return APIError(400, f"the response {previous} has already been continued; continue from the thread's latest "
                         "response", param="thread.previous_message_id", error_code="thread_already_continued")


async def resume(log: SessionLog, owner: str, body: dict) -> Thread | None:
    """The request's thread, its body completed from the stored one for a continue (messages,
    system, tools); None without ``thread``."""
    thread = body.get("thread")
    if not thread:
        return None
    if thread["type"] == "create":
        return Thread(None, list(body["messages"]), body.get("system"), body.get("tools"))
    previous = thread["previous_message_id"]
    record = await asyncio.to_thread(log.response_record, previous) if MESSAGE_ID.fullmatch(previous) else None
    if record is None or not record[0].startswith(f"{owner}/"):
        raise _not_found(previous)
    key, stored, created, continued = record
    if stored.get("kind") != KIND or time.time() - created > TTL_S:
        raise _not_found(previous)
    if continued:
        raise _already_continued(previous)
    differ = [f for f in ("system", "tools")
              if body.get(f) is not None and _unmarked(body[f]) != _unmarked(stored.get(f))]
    if differ:
        raise APIError(400, f"{' and '.join(differ)} differ from the thread's: a continue takes them from the thread "
                            "(leave them out, or replay with thread: {\"type\": \"create\"} to change them)",
                       param=differ[0], error_code="thread_fingerprint_mismatch")
    holder = await asyncio.to_thread(log.claim, _claim_name(previous), IN_FLIGHT_S)   # one continue wins
    if holder is None:
        raise APIError(400, f"another request is continuing from {previous}; wait for its response",
                       param="thread.previous_message_id", error_code="thread_continue_in_flight")
    try:
        # a continue that finished between the check above and the claim: it has been continued now
        if await asyncio.to_thread(log.is_continued, previous):
            raise _already_continued(previous)
        history = await asyncio.to_thread(log.response_conversation, previous)
    except BaseException:
        _release(log, previous, holder)
        raise
    new = list(body["messages"])
    body.update(messages=history + new, system=stored.get("system"), tools=stored.get("tools"))
    for name in ("system", "tools"):
        if body[name] is None:
            body.pop(name)
    return Thread(previous, new, stored.get("system"), stored.get("tools"), SessionRef(key.split("/", 1)[1], "thread"),
                  holder)


class Claim:
    """A thread request in progress (a continue was marked in flight by ``resume``); ``done`` stores
    its finished response (or only lets go, for one that failed)."""

    def __init__(self, log: SessionLog, thread: Thread):
        self.log, self.thread, self.session_key = log, thread, ""
        self._open = True

    def release(self) -> None:
        t = self.thread   # a continue's thread has both its parent and its claim's holder
        if self._open and t.parent is not None and t.holder is not None:
            _release(self.log, t.parent, t.holder)
        self._open = False

    async def done(self, message_id: str, content: list[dict] | None, stop_reason: str | None) -> None:
        """Store the response (its new messages and the reply) under its id; nothing for a failed one."""
        try:
            if self._open and content is not None and stop_reason is not None:
                turn = self.thread.new_messages + [{"role": "assistant", "content": content}]
                await asyncio.to_thread(self.log.put_response, message_id, self.session_key, self.thread.parent, turn,
                                        {"kind": KIND, "system": self.thread.system, "tools": self.thread.tools})
        finally:
            self.release()


def _release(log: SessionLog, previous: str, holder: str) -> None:
    """Let go of a continue's claim, off the event loop (a database round trip) and without waiting
    for it: this runs on every way out of a request, cancellation included."""
    def release() -> None:
        try:
            log.release(_claim_name(previous), holder)
        except Exception as exc:   # the claim then expires by itself (IN_FLIGHT_S)
            logger.warning("could not release the thread claim of %s: %s", previous, exc)

    try:
        asyncio.get_running_loop().run_in_executor(None, release)
    except RuntimeError:   # no event loop: here and now
        release()


def claim(log: SessionLog, thread: Thread | None) -> Claim | None:
    return None if thread is None else Claim(log, thread)
