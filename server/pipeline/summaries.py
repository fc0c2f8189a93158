"""Summaries written once per conversation state: the context step's model calls, remembered.

A summary takes the model seconds to minutes, so it is written outside the session's transaction
(``Summaries.writer``) and read inside it (``Summaries.reader``: a miss there raises
``SummaryNeeded`` instead of calling the model). The same request retried (a client that timed out,
Claude Code's retries) finds its summary here and is not summarized again. Keyed by exactly what the
model would be asked (messages and token limit), so a summary is reused only for the same input.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict

from ...compaction.prompt import Message
from ...compaction.summarize import ModelClient


class SummaryNeeded(Exception):
    """A compact edit would fire and its summary is not written yet: the step calls the model, and
    belongs off the event loop and outside the session's transaction."""


class Summaries:
    """At most ``size`` summaries (least recently used out); thread-safe."""

    def __init__(self, model: ModelClient | None, size: int = 256):
        self.model, self.size = model, size
        self._done: OrderedDict[str, str | BaseException] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _key(messages: list[Message], max_tokens: int) -> str:
        raw = json.dumps([messages, max_tokens], sort_keys=True, ensure_ascii=False).encode()
        return hashlib.sha256(raw).hexdigest()

    def _get(self, key: str, consume_error: bool) -> str | BaseException | None:
        with self._lock:
            found = self._done.get(key)
            if found is not None:
                self._done.move_to_end(key)
                if isinstance(found, BaseException) and consume_error:   # a failure is reported once
                    del self._done[key]
            return found

    def _put(self, key: str, value: str | BaseException) -> None:
        with self._lock:
            self._done[key] = value
            self._done.move_to_end(key)
            while len(self._done) > self.size:
                self._done.popitem(last=False)

    def writer(self) -> ModelClient:
        """Calls the model on a miss and remembers the summary (or its failure, for the reader)."""
        return _Writer(self)

    def reader(self, last_try: bool = False) -> ModelClient:
        """Never calls the model: a miss raises ``SummaryNeeded`` (``last_try``: a ``RuntimeError``,
        which the step reports as a failed edit)."""
        return _Reader(self, last_try)


class _Writer:
    def __init__(self, cache: Summaries):
        self.cache = cache

    def complete(self, messages: list[Message], max_tokens: int) -> str:
        key = self.cache._key(messages, max_tokens)
        found = self.cache._get(key, consume_error=False)
        if isinstance(found, str):
            return found
        if self.cache.model is None:
            raise RuntimeError("no summarizer model")
        try:
            text = self.cache.model.complete(messages, max_tokens)
        except Exception as exc:
            self.cache._put(key, exc)
            raise
        self.cache._put(key, text)
        return text


class _Reader:
    def __init__(self, cache: Summaries, last_try: bool):
        self.cache, self.last_try = cache, last_try

    def complete(self, messages: list[Message], max_tokens: int) -> str:
        found = self.cache._get(self.cache._key(messages, max_tokens), consume_error=True)
        if isinstance(found, str):
            return found
        if isinstance(found, BaseException):
            raise found
        if self.last_try:
            raise RuntimeError("the conversation changed while its summary was written")
        raise SummaryNeeded
