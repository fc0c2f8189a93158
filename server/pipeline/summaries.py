"""Summaries written once per conversation state: the context step's model calls, remembered.

A summary takes the model seconds to minutes, so it is written outside the session's transaction
(``Summaries.writer``) and read by the step's next run (``Summaries.reader``: a miss there raises
``SummaryNeeded`` instead of calling the model). The same request retried (a client that timed out,
Claude Code's retries) finds its summary here and is not summarized again. Keyed by the API key it
was written for and exactly what the model was asked (messages and token limit): a summary is
reused only for the same key and the same input, and no key can tell from its timing whether
another key's conversation was summarized (the model's requests carry that key's cache salt too).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from agentkv.compaction.prompt import Message, message_key
from agentkv.compaction.summarize import ModelClient, SummaryPending


class SummaryNeeded(SummaryPending):
    """A compact edit would fire and its summary is not written yet: the step calls the model, and
    belongs off the event loop and outside the session's transaction."""


class Summaries:
    """At most ``size`` summaries (least recently used out); thread-safe."""

    def __init__(self, model: ModelClient | None, size: int = 256):
        self.model, self.size = model, size
        self._done: OrderedDict[str, str | BaseException] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _key(namespace: str, messages: list[Message], max_tokens: int) -> str:
        return message_key([namespace, messages, max_tokens])   # exact: 10 and 10.0, key order, all told apart

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

    def writer(self, namespace: str, salt: str | None = None) -> ModelClient:
        """Calls the model on a miss (its requests under ``salt``) and remembers the summary (or its
        failure, for the reader) under ``namespace`` (the caller's key)."""
        return _Writer(self, namespace, salt)

    def reader(self, namespace: str, last_try: bool = False) -> ModelClient:
        """Never calls the model: a miss raises ``SummaryNeeded`` (``last_try``: a ``RuntimeError``,
        which the step reports as a failed edit)."""
        return _Reader(self, namespace, last_try)


class _Writer:
    def __init__(self, cache: Summaries, namespace: str, salt: str | None):
        self.cache, self.namespace, self.salt = cache, namespace, salt

    def complete(self, messages: list[Message], max_tokens: int) -> str:
        key = self.cache._key(self.namespace, messages, max_tokens)
        found = self.cache._get(key, consume_error=False)
        if isinstance(found, str):
            return found
        if self.cache.model is None:
            raise RuntimeError("no summarizer model")
        try:
            text = self.cache.model.complete(messages, max_tokens, **({"cache_salt": self.salt} if self.salt else {}))
        except Exception as exc:
            self.cache._put(key, exc)
            raise
        self.cache._put(key, text)
        return text


class _Reader:
    def __init__(self, cache: Summaries, namespace: str, last_try: bool):
        self.cache, self.namespace, self.last_try = cache, namespace, last_try

    def complete(self, messages: list[Message], max_tokens: int) -> str:
        found = self.cache._get(self.cache._key(self.namespace, messages, max_tokens), consume_error=True)
        if isinstance(found, str):
            return found
        if isinstance(found, BaseException):
            raise found
        if self.last_try:
            raise RuntimeError("the conversation changed while its summary was written")
        raise SummaryNeeded
