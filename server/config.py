"""Server configuration: the one source of truth for defaults. CLI flags are derived from it."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal
from urllib.parse import unquote

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agentkv.compaction.log.open import is_postgres_url

from .embedded_model.names import DEFAULT_MODEL
from .kv_modes import describe, kv_mode
from .options import BlendStrategy, EngineInputMode, KVMode


def agentkv_home() -> Path:
    """Where built models and session data live (``$AGENTKV_HOME``, default ``~/.cache/agentkv``)."""
    return Path(os.environ.get("AGENTKV_HOME") or Path.home() / ".cache" / "agentkv")


def env_var(field: str) -> str:
    """The environment variable that sets a config field: ``AGENTKV_<FIELD>``."""
    return f"AGENTKV_{field.upper()}"


_URL_PASSWORD = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/?#@:]*:([^/?#]*)@|[?&]password=([^&#]*)")


def url_passwords(url: str) -> tuple[str, ...]:
    """The passwords in a database URL (``user:PASS@host``, ``?password=PASS``), raw and decoded."""
    found = {g for m in _URL_PASSWORD.finditer(url) for g in m.groups() if g}
    return tuple(sorted(found | {unquote(p) for p in found}))


SMALL_MACHINE_CORES = 4   # up to this many, every core computes (a reserved core is a large share of them)
OFFLOAD_SHARE, OFFLOAD_MAX_GIB = 0.25, 8.0   # the host tier's default: this share of the free memory, at most


def mem_available_gib() -> float | None:
    """Host memory free for new allocations now, in GiB: ``MemAvailable`` of /proc/meminfo, or less
    where this process's cgroup (v2) limit leaves less; None where neither can be read."""
    free: float | None = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) / 2**20
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            left = (int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())) / 2**30
            free = left if free is None else min(free, left)
    except (OSError, ValueError):
        pass
    return free


class ServeConfig(BaseModel):
    """Everything `agentkv serve` needs. Each field is a `--flag` of the same name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(DEFAULT_MODEL, description="an embedded model (smollm2-135m-instruct: SmolLM2-135M-Instruct, "
                       "built from PyPI; agentkv-tiny, agentkv-tiny-<N>l: random test models) "
                       "or an HF model id / local path")
    host: str = Field("127.0.0.1", description="address the OpenAI-compatible API binds to")
    port: int = Field(8000, ge=0, le=65535, description="port of the API (0: pick a free one)")
    max_model_len: int | None = Field(None, gt=0, description="context window; default: the model's")
    api_key: tuple[str, ...] = Field((), repr=False, description="accepted API key (repeat for several); each key "
                                     "sees only its own sessions")
    served_model_name: str | None = Field(None, description="model name clients use; default: --model")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where vLLM runs; auto: cuda if a GPU is "
                                                   "visible")
    tool_call_parser: str | None = Field("hermes", description="vLLM tool-call parser for the model ('' to disable)")
    dtype: str = Field("auto", description="weights/activation dtype (auto: float32 on CPU, model's on GPU)")
    kv_cache_gib: int = Field(1, ge=1, description="CPU only: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE)")
    engine_reserved_cores: int | None = Field(
        None, ge=0, description="CPU only: cores kept free of vLLM's compute threads (VLLM_CPU_NUM_OF_RESERVED_CPU), "
                                "the same whatever --kv-reuse; default: 0 on machines of up to 4 cores, else 1")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="GPU only: fraction of GPU memory vLLM may use")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallelism (GPUs per replica)")
    pipeline_parallel_size: int = Field(1, ge=1, description="vLLM pipeline parallelism (Ray for multi-node)")
    enforce_eager: bool | None = Field(None, description="disable graph capture (default: on for CPU, off for GPU)")
    engine_startup_timeout_s: float = Field(900.0, gt=0, description="seconds to wait for vLLM to become healthy")
    engine_restarts: int = Field(3, ge=0, description="relaunch vLLM when it dies, at most this many times an hour "
                                 "(0: never)")
    engine_stall_s: float | None = Field(
        None, gt=0, description="seconds the engine may go without progress (work in flight, or any of its "
                                "processes stopped) before it is killed and relaunched; default: 120 on CPU and GPU "
                                "(docs/reliability.md)")
    engine_args: tuple[str, ...] = Field((), description="extra arguments passed verbatim to vLLM")
    engine_input: EngineInputMode = Field(
        "tokens", description="how prompts reach vLLM: the front's token ids (tokens: vLLM skips rendering and "
                              "tokenizing the whole prompt) or the messages (vLLM renders them)")
    context_management: bool = Field(True, description="apply the default context policy to requests without one")
    clear_at: float = Field(0.8, gt=0, le=1, description="default policy: clear old tool results when the prompt fills "
                            "this fraction of the room (the window less the system prompt and tools)")
    clear_to: float = Field(0.2, ge=0, lt=1, description="default policy: ... in one batch down to this fraction of "
                            "the room (below --clear-at)")
    compact_at: float = Field(0.9, gt=0, le=1, description="default policy: summarize at this fraction of the room")
    server_tools: bool = Field(False, description="offer the server-executed recall and note tools to every request")
    max_server_tool_rounds: int = Field(4, ge=1, le=16, description="bound on server tool calls per request")
    kv_reuse: KVMode = Field(
        "recompute", description=f"after clearing: {describe()}; shift and blend load agentkv's vLLM KV connector")
    kv_retention: bool = Field(
        True, description="connector, in every mode: a session's last prompt stays held across its pause (pool, then "
                          "host tier) and its next turn reads back what vLLM's prefix cache no longer has (off: "
                          "recompute loads no connector, and only an edit reads held K/V)")
    blend_strategy: BlendStrategy = Field(
        "tail", description="blend: which moved blocks are recomputed: the last (tail), the first after each cut "
                            "(cuts, EPIC-like) or those whose early-layer K/V moved most (deviation, CacheBlend-like)")
    blend_fraction: float = Field(0.15, ge=0, le=1, description="blend: fraction of the moved tokens recomputed")
    kv_hold_fraction: float = Field(0.25, ge=0, le=1, description="connector: share of the KV pool that may hold "
                                    "sessions' last prompt blocks for their next turn (0: hold nothing, recompute)")
    kv_hold_ttl_s: float = Field(300.0, gt=0, description="connector: seconds a session's blocks are held at most")
    kv_offload_gib: float | None = Field(
        None, ge=0, description="connector: GiB of host memory per engine worker that keeps held blocks vLLM takes "
                                "back, for the session's next turn (0: none); default: a quarter of the memory free at "
                                f"start, at most {OFFLOAD_MAX_GIB:g}")
    shared_prefix_cache: bool = Field(False, description="one tenant: requests of every API key share prefix-cache "
                                      "blocks (off: each key's are its own, so no key can time another's prompts)")
    max_request_mb: float = Field(32.0, gt=0, description="largest accepted request body (MiB)")
    ui: bool = Field(True, description="the sessions page at /ui: each session's turns, edits and KV reuse beside its "
                                        "log (same keys as the API; a browser signs in once with its key)")
    body_timeout_s: float = Field(60.0, gt=0, description="seconds a request body may take to arrive (then 408): a "
                                  "slow sender cannot hold a connection open forever")
    compaction_key_file: str | None = Field(None, description="the key that signs compaction items: 32 bytes or 64 hex "
                                            "digits, made when missing; default $AGENTKV_HOME/compaction.key "
                                            "(replicas must share it)")
    session_db: str | None = Field(None, repr=False, description="session log: a SQLite path or a postgresql:// URL; "
                                   "default $AGENTKV_HOME/sessions.db")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")

    @field_validator("host")
    @classmethod
    def _host_not_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("host must not be empty")
        return v

    @field_validator("model")
    @classmethod
    def _model_not_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("model must not be empty")
        return v

    @field_validator("session_db")
    @classmethod
    def _db_kind(cls, v: str | None) -> str | None:
        if v is not None and "://" in v and not is_postgres_url(v):
            raise ValueError("session_db must be a SQLite file path or a postgresql:// URL")
        return v

    @field_validator("api_key")
    @classmethod
    def _keys_not_empty(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(not k for k in v):
            raise ValueError("an API key must not be empty")
        return v

    @field_validator("engine_args")
    @classmethod
    def _engine_key_is_ours(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(a == "--api-key" or a.startswith("--api-key=") for a in v):
            raise ValueError("the engine's key is agentkv's own per-launch secret; "
                             "clients' keys are agentkv's --api-key")
        return v

    @model_validator(mode="after")
    def _levels(self) -> ServeConfig:
        if self.clear_to >= self.clear_at:
            raise ValueError(f"clear_to ({self.clear_to}) must be below clear_at ({self.clear_at}): clearing "
                             "that does not bring the prompt under its trigger fires again on the next turn")
        return self

    @model_validator(mode="after")
    def _offload_fits(self) -> ServeConfig:
        if self.kv_offload_gib and self.kv_connector:
            workers = self.tensor_parallel_size * self.pipeline_parallel_size
            free = mem_available_gib()
            if free is not None and self.kv_offload_gib * workers > free:
                raise ValueError(f"kv_offload_gib: {self.kv_offload_gib:g} GiB of host memory per worker x {workers} "
                                 f"cannot be had: {free:.1f} GiB is free (lower it, or 0 for no host tier)")
        return self

    @property
    def kv_offload_bytes(self) -> int:
        """The host tier's size per engine worker (0: none): ``kv_offload_gib``, or its default."""
        gib = self.kv_offload_gib
        if gib is None:   # where the free memory cannot be read: a quarter of 1 GiB
            free = mem_available_gib()
            gib = min(OFFLOAD_MAX_GIB, OFFLOAD_SHARE * (1.0 if free is None else free)
                      / (self.tensor_parallel_size * self.pipeline_parallel_size))
        return int(gib * 2**30)

    def cpu_env(self) -> dict[str, str]:
        """vLLM's CPU settings, the same for every KV mode: vLLM reserves one core for its scheduler
        and one more once a KV connector is configured, which on a 2-core machine left the default
        server one compute core and bound a connector server's threads to both (docs/serving.md, "CPU engine")."""
        reserved = self.engine_reserved_cores
        if reserved is None:
            reserved = 0 if (os.cpu_count() or 1) <= SMALL_MACHINE_CORES else 1
        return {"VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), "VLLM_CPU_NUM_OF_RESERVED_CPU": str(reserved)}

    @property
    def secrets(self) -> tuple[str, ...]:
        """What must never be logged, shown or put in a child's argv: the API keys and the
        session database's password."""
        return self.api_key + (url_passwords(self.session_db) if self.session_db else ())

    def redact(self, text: str) -> str:
        """``text`` with every secret of this config replaced by ``***``."""
        for secret in sorted(self.secrets, key=len, reverse=True):
            text = text.replace(secret, "***")
        return text

    @property
    def kv_connector(self) -> bool:
        """Whether vLLM runs agentkv's KV connector: retention is on, or the server's default mode
        uses it."""
        return self.kv_retention or kv_mode(self.kv_reuse).uses_connector

    @property
    def session_db_path(self) -> str:
        return self.session_db or str(agentkv_home() / "sessions.db")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model
