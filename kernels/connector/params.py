"""The wire contract between agentkv's front and its vLLM KV connector, owned here and nowhere else.

Standard library only: the front imports this module and nothing else of the connector (it never
imports vLLM's connector classes or torch through it).

- **the engine's config**: ``transfer_config`` is vLLM's ``--kv-transfer-config`` for the connector
  (module, class, failure policy, ``DEFAULTS`` of its extra config, which the connector reads too).
- **front -> connector**, per request, in ``kv_transfer_params["agentkv"]`` (``Params``):

  - ``session``: when this request finishes, hold its prompt blocks as this session's prompt; when
    it is scheduled, the session's older entries are given back; a request with no edit reads back
    (``retain``) what vLLM's prefix cache no longer has of the session's held prompt;
  - ``exact``: the request's K/V must all be computed by vLLM for it or an exact earlier request
    (its cache salt is the exact one): it reads only entries held by exact requests, and what it
    holds is exact (an entry held without it may contain moved K/V and serves approximate requests
    only);
  - ``prime``: hold it as the session's priming prompt instead, give nothing back; the answer is a
    ``Primed`` (block size, tokens of the session's prompt held: 0 when that is not ``held``);
  - ``spans``: ``[[start, end, replacement], ...]``: the edit between the session's held prompt and
    this one (positions of the held prompt); the connector claims what it can supply after vLLM's
    own prefix hit, up to ``limit`` (a position of this prompt) when given;
  - ``held``: ``[tokens, digest]``: which prompt the edit was computed against (its length and
    ``prompt_hash``); a held prompt that is not that one is never read (``held_mismatch``);
  - ``pass``: one of the front's blend passes: hold nothing, give nothing back.

- **connector -> front**, in a finished request's ``kv_transfer_params["agentkv"]``: an
  ``Outcome`` (tokens reused, or why it fell back: one of ``FALLBACKS``) or a ``Primed``.

A malformed value is refused by ``Params.from_wire`` with ``ValueError``; the connector logs it and
treats the request as carrying none (a bad hint never fails a request).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

NAMESPACE = "agentkv"   # the key in kv_transfer_params
CONNECTOR_MODULE = "agentkv.kernels.connector.plugin"
CONNECTOR_CLASS = "AgentKVConnector"
DEFAULTS = {"hold_fraction": 0.25, "hold_ttl_s": 300.0, "offload_bytes": 0, "retain": True}

# Why a planned reuse fell back to recompute (the connector's reasons; the front adds its own).
FALLBACKS = {
    "not_held": "the session's previous prompt (or the priming prompt) was never held",
    "evicted": "its held blocks were handed to other requests (budget, memory pressure, time-to-live)",
    "prompt_changed": "the new prompt's token ids differ from the held ones where the edit maps them "
                      "(before vLLM's hit too)",
    "too_short": "less than one block could be supplied",
    "load_failed": "the worker could not move the tokens; vLLM recomputed them",
    "unsupported": "this model or KV cache cannot be shifted (see the engine log)",
    "no_budget": "the held-block budget is zero",
    "held_mismatch": "the held prompt is not the one the edit was computed against (another branch, a lost turn)",
    "geometry": "a worker's KV tensors are not laid out as the scheduler's block ids address them (see the engine log)",
}


def prompt_hash(token_ids: Sequence[int]) -> str:
    """The identity of a prompt's token ids: both sides hash the same 64-bit little-endian ids (a
    numpy int64 array's own bytes, or the same built here)."""
    raw = token_ids.tobytes() if hasattr(token_ids, "tobytes") else array("q", token_ids).tobytes()
    return hashlib.sha256(raw).hexdigest()[:32]


def transfer_config(hold_fraction: float, hold_ttl_s: float, offload_bytes: int = 0, retain: bool = True) -> dict:
    """vLLM's ``--kv-transfer-config`` for agentkv's connector (``offload_bytes``: the host tier's
    size on each worker, 0 for none; ``retain``: turns with no edit read back their session's held
    prompt, else only edits read it). A load that fails late is recomputed by vLLM, never an error
    (``kv_load_failure_policy``)."""
    return {"kv_connector": CONNECTOR_CLASS, "kv_role": "kv_both", "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"hold_fraction": hold_fraction, "hold_ttl_s": hold_ttl_s,
                                          "offload_bytes": offload_bytes, "retain": retain}}


def _ours(kv_transfer_params: Any) -> dict | None:
    raw = kv_transfer_params.get(NAMESPACE) if isinstance(kv_transfer_params, dict) else None
    return raw if isinstance(raw, dict) and raw else None


@dataclass(frozen=True)
class Params:
    """The front's instructions for one engine request."""

    session: str
    prime: bool = False
    spans: tuple[tuple[int, int, int], ...] = ()   # (start, end, replacement tokens) of the held prompt
    limit: int | None = None                        # supply nothing at or after this position
    keep: bool = False                              # a blend pass (``pass`` on the wire)
    held: tuple[int, str] | None = None             # (tokens, prompt_hash) of the prompt the spans are on
    exact: bool = False                             # reads and holds exact K/V only

    def to_wire(self) -> dict:
        raw: dict[str, Any] = {"session": self.session}
        if self.exact:
            raw["exact"] = True
        if self.prime:
            raw["prime"] = True
        if self.spans:
            raw["spans"] = [list(s) for s in self.spans]
        if self.limit is not None:
            raw["limit"] = self.limit
        if self.keep:
            raw["pass"] = True
        if self.held is not None:
            raw["held"] = list(self.held)
        return {NAMESPACE: raw}

    @classmethod
    def from_wire(cls, kv_transfer_params: Any) -> Params | None:
        """The instructions a request carries, None when it carries none; ``ValueError`` when they
        are malformed."""
        raw = _ours(kv_transfer_params)
        if raw is None:
            return None
        try:
            spans = tuple((int(s), int(e), int(n)) for s, e, n in raw.get("spans") or ())
            limit, held = raw.get("limit"), raw.get("held")
            if held is not None and (not isinstance(held, (list, tuple)) or len(held) != 2):
                raise ValueError(f"held must be [tokens, digest], not {held!r:.60}")
            return cls(str(raw["session"]), bool(raw.get("prime", False)), spans,
                       None if limit is None else int(limit), bool(raw.get("pass", False)),
                       None if held is None else (int(held[0]), str(held[1])), raw.get("exact") is True)
        except (LookupError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed agentkv kv_transfer_params: {exc!r}") from None


@dataclass(frozen=True)
class Outcome:
    """What came of an edit: tokens whose K/V were moved, or why it fell back (``FALLBACKS``)."""

    reused_tokens: int = 0
    fallback: str | None = None

    def to_wire(self) -> dict:
        return {NAMESPACE: {"reused_tokens": self.reused_tokens, "fallback": self.fallback}}

    @classmethod
    def from_wire(cls, kv_transfer_params: Any) -> Outcome | None:
        raw = _ours(kv_transfer_params)
        if raw is None or "reused_tokens" not in raw:
            return None
        return cls(int(raw.get("reused_tokens") or 0), raw.get("fallback"))


@dataclass(frozen=True)
class Primed:
    """The answer to a priming request: the engine's block size and how many tokens of the
    session's prompt are held (0: none, the edit will fall back)."""

    block_size: int
    held_tokens: int

    def to_wire(self) -> dict:
        return {NAMESPACE: {"block_size": self.block_size, "held_tokens": self.held_tokens}}

    @classmethod
    def from_wire(cls, kv_transfer_params: Any) -> Primed | None:
        raw = _ours(kv_transfer_params)
        if raw is None or "block_size" not in raw:
            return None
        return cls(int(raw["block_size"]), int(raw.get("held_tokens") or 0))
