"""The registry of KV reuse modes (``--kv-reuse``, a request's ``kv_reuse``): what becomes of the
cached K/V of a prompt that clearing edited. Each mode is one class that carries every decision
that depends on it: whether the engine is started with agentkv's KV connector, whether a request's
edits go to the connector (and its prompt then takes the branch's approximate cache salt), and what
the front runs before the edited request (``kv.reuse.attach`` asks ``primes`` and ``refine``).

- ``recompute``: vLLM recomputes everything after the first edited token (exact); with retention
  (``--kv-retention``, the default) the connector still holds each turn's prompt and reads back
  what vLLM's prefix cache lost of it, exact K/V only.
- ``shift``: the connector moves the kept tokens' K/V (RoPE-rotated by the kernel) and the
  placeholders' from a priming request.
- ``blend``: ``shift``, then a share of the moved tokens is recomputed (``kv_blend``).

To add a KV mode: write one subclass of ``KVReuseMode`` in this module with its ``name`` (its wire
name), ``uses_connector``, and, where the defaults do not fit, ``primes`` (whether a priming request
computes the placeholders' K/V first), ``refine`` (what runs after priming: it gets the
``kv.reuse.ReuseJob``, whose methods run the engine requests, and returns the request's ``limit``
and what goes into the edits' ``kv`` report), ``engine_args`` and ``moves``. Then add it to the
``register`` calls at the end. Nothing else changes: ``options.KVMode`` (the ``Literal`` the server's
config, each request's ``kv_reuse`` and the CLI's choices are checked against) is built from the
registry when ``server.options`` is first imported, so a mode registers before that (registering
later is an error, never a silent no-op). A mode needing engine work no ``ReuseJob`` method does
yet adds that method in ``kv/reuse.py``: this module is below ``kv`` and ``engine`` (the engine's
arguments come from here), so it calls into them only through what it is handed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from agentkv.kernels.connector.params import Primed

if TYPE_CHECKING:
    from .config import ServeConfig
    from .kv.reuse import ReuseJob


class KVReuseMode:
    """One KV reuse mode. The defaults are those of a mode that moves K/V with the connector."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""             # what it does, for --help (`describe`); default: its name
    uses_connector: ClassVar[bool] = True   # a server whose --kv-reuse this is starts vLLM with the connector

    def engine_args(self, cfg: ServeConfig) -> list[str]:
        """vLLM's arguments of its own for a server whose default mode this is (the connector is
        the engine's whenever ``cfg.kv_connector``: ``engine.process.engine_args``)."""
        return []

    def moves(self, cfg: ServeConfig) -> bool:
        """Whether a request in this mode hands its clearing edits to the connector (the server runs
        one, and this mode uses it): its branch then holds moved K/V (the approximate salt)."""
        return cfg.kv_connector and self.uses_connector

    def primes(self, replacement_tokens: int) -> bool:
        """Whether the placeholders' K/V are computed by a priming request before the edited one."""
        return replacement_tokens > 0

    async def refine(self, job: ReuseJob, primed: Primed | None) -> tuple[int | None, dict]:
        """What runs after priming, before the edited request: its ``limit`` (the connector supplies
        nothing from there on; None: no limit) and what goes into the edits' ``kv`` report."""
        return None, {}


class Recompute(KVReuseMode):
    name = "recompute"
    summary = "recompute (exact)"
    uses_connector = False


class Shift(KVReuseMode):
    name = "shift"
    summary = "shift cached K/V with the kernel"


class Blend(KVReuseMode):
    name = "blend"
    summary = "blend (shift, recompute a share)"

    def primes(self, replacement_tokens: int) -> bool:
        return True   # blend plans with what the priming response says (block size, tokens held)

    async def refine(self, job: ReuseJob, primed: Primed | None) -> tuple[int | None, dict]:
        return await job.blend(primed)


_MODES: dict[str, KVReuseMode] = {}
_sealed = False


def register(mode: type[KVReuseMode]) -> type[KVReuseMode]:
    """Add a mode (usable as a class decorator); its name must be new."""
    if _sealed:
        raise RuntimeError(f"KV mode {mode.__name__} registered after the config models were built: "
                           "register it before agentkv.server.options is imported")
    if mode.name in _MODES:
        raise ValueError(f"KV mode {mode.name!r} already registered")
    _MODES[mode.name] = mode()
    return mode


def kv_mode(name: str) -> KVReuseMode:
    """The mode of a wire name (one the edge has checked against ``mode_literal``)."""
    return _MODES[name]


def describe() -> str:
    """The registered modes in one phrase, for ``--kv-reuse``'s help."""
    said = [m.summary or m.name for m in _MODES.values()]
    return ", ".join(said[:-1]) + (" or " if len(said) > 1 else "") + said[-1]


def mode_literal():
    """``Literal[<the registered names>]``, in registration order. Closes the registry (the
    config and request models are built from it)."""
    global _sealed
    _sealed = True
    return Literal[tuple(_MODES)]


register(Recompute)
register(Shift)
register(Blend)
