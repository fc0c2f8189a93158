"""Stored responses (``store: true``): each response's new input and output, kept in the session log
database, so ``previous_response_id`` continues a conversation and ``GET /v1/responses/{id}``
returns it, to the key that made it only."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping

from agentkv.compaction.log.session_log import SessionLog
from agentkv.compaction.prompt import Message
from agentkv.server.errors import APIError
from agentkv.server.pipeline.sessions import SessionRef, session_ref

from .convert import Conversation, to_messages
from .protocol import CompactRequest, ResponsesRequest

RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")


async def stored(log: SessionLog, owner: str, response_id: str, param: str) -> tuple[str, dict]:
    """(session key, response object) of the caller's stored response; 404 for any other id."""
    found = None
    if RESPONSE_ID.fullmatch(response_id):
        found = await asyncio.to_thread(log.get_response, response_id)
    if found is None or not found[0].startswith(f"{owner}/"):
        raise APIError(404, f"no stored response {response_id!r}", param=param, code="response_not_found")
    return found


async def continued(log: SessionLog, owner: str, req: ResponsesRequest | CompactRequest,
                    headers: Mapping[str, str]) -> tuple[SessionRef, list[Message]]:
    """(the session a request continues, the messages stored before it): the session of its
    ``previous_response_id`` and that response's conversation, else the session the request names."""
    if req.previous_response_id:
        key, _ = await stored(log, owner, req.previous_response_id, "previous_response_id")
        prior = await asyncio.to_thread(log.response_conversation, req.previous_response_id)
        return SessionRef(key.split("/", 1)[1], "previous_response_id"), prior
    return session_ref(headers, {"session_id": req.session_id, "prompt_cache_key": req.prompt_cache_key,
                                 "metadata": req.metadata}), []


class StoredTurn:
    """What a finished response leaves: its record for ``store: true``. A compaction item in the
    output does not cut the stored chain: the session's view holds the summary, so a continuation by
    ``previous_response_id`` sees the same compacted prompt."""

    def __init__(self, log: SessionLog, req: ResponsesRequest, key: str, conv: Conversation):
        self.log, self.req, self.key = log, req, key
        converted = conv.converted
        # a compaction item in the input starts a new chain: the messages it left are the whole turn
        self.parent = None if converted.compacted else req.previous_response_id
        self.new = converted.messages if converted.compacted else converted.messages[len(conv.prior):]

    async def store(self, response: dict) -> None:
        if not self.req.store or response["status"] not in ("completed", "incomplete"):
            return
        produced = [i for i in response["output"] if i["type"] != "compaction"]
        turn = self.new + to_messages(produced, lambda item, where: []).messages
        await asyncio.to_thread(self.log.put_response, response["id"], self.key, self.parent, turn, response)
