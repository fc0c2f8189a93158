"""Shared fixtures. `server` starts one real agentkv server (vLLM + embedded model) per test session."""

from __future__ import annotations

import os

import torch

# Triton kernels run on CPU only under the interpreter; it must be chosen before triton.jit runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
TINY = "agentkv-tiny"           # the random test model: fast, its answers are noise
REAL = "smollm2-135m-instruct"  # the default model: real answers, ~10x slower on CPU

# Models are built once, where setup.sh built them, not in every test server's home.
from agentkv.server.embedded_model.catalog import models_dir  # noqa: E402
from agentkv.server.engine.process import dies_with_parent  # noqa: E402

os.environ.setdefault("AGENTKV_MODELS", str(models_dir()))
API_KEY = "sk-agentkv-test"
OTHER_KEY = "sk-agentkv-other"
STARTUP_TIMEOUT_S = 900
SMALL_BODY_TIMEOUT_S = 6   # the small server's --body-timeout-s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    log_path: Path
    home: Path
    api_key: str = API_KEY
    session_db: str = ""

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.base_url}/v1", api_key=kw.pop("api_key", self.api_key),
                      max_retries=0, timeout=kw.pop("timeout", 300), **kw)

    def stop(self, timeout: float = 60) -> int:
        return stop_server(self, timeout)

    def http(self, **kw) -> httpx.Client:
        headers = {"Authorization": f"Bearer {kw.pop('api_key', self.api_key)}"}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=300, **kw)


def start_server(home: Path, *extra: str, env: dict[str, str] | None = None, model: str | None = TINY) -> Server:
    """`agentkv serve` with its home in ``home``; the keys come from the environment, as README
    advises (argv is visible to every local user), ``env`` adds to it. ``model``: the tiny random
    model by default (protocol tests), ``None`` for the server's default (the real SmolLM2)."""
    port = _free_port()
    log_path = home / "server.log"
    env = dict(os.environ, AGENTKV_HOME=str(home), AGENTKV_API_KEY=f"{API_KEY},{OTHER_KEY}", **(env or {}))
    if model is not None and "--model" not in extra:
        extra = ("--model", model, *extra)
    cmd = [sys.executable, "-m", "agentkv.server.cli", "serve", "--port", str(port), *extra]
    with open(log_path, "wb") as log:   # it dies with this test run, however the run ends
        proc = subprocess.Popen(cmd, env=env, cwd=home, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=dies_with_parent())
    server = Server(proc, f"http://127.0.0.1:{port}", log_path, home)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"agentkv serve exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            r = httpx.get(f"{server.base_url}/health", timeout=5)
            if r.status_code == 200:
                return server
            if r.json().get("status") == "failed":  # the engine will not come up: say why now
                stop_server(server)
                raise RuntimeError(f"the engine failed to start: {r.text}\n{server.log_tail()}")
        except httpx.TransportError:
            pass
        time.sleep(1)
    stop_server(server)
    raise RuntimeError(f"agentkv serve not healthy after {STARTUP_TIMEOUT_S} s:\n{server.log_tail()}")


def stop_server(server: Server, timeout: float = 60) -> int:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()
    return server.proc.returncode


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    srv = start_server(tmp_path_factory.mktemp("agentkv-home"))
    yield srv
    stop_server(srv)


def pytest_configure(config):
    """SIGTERM ends the run as Ctrl-C does: fixtures stop the servers they started."""
    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, stop)


def pytest_collection_modifyitems(items):
    """Tests marked `last` (they stop the shared server) run after all others."""
    items.sort(key=lambda item: item.get_closest_marker("last") is not None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The embedded 2-layer model, built once per test session."""
    from agentkv.server.embedded_model import build_model

    return build_model(tmp_path_factory.mktemp("tiny") / "agentkv-tiny-2l")


def engine_renderer(model_dir, template: str | None = None, tmp: Path | None = None):
    """A ``PromptRenderer`` counting as the server does: vLLM's render of the model at
    ``model_dir`` (with ``template`` as its ``--chat-template`` where given)."""
    from agentkv.server.render.engine_chat import counting_renderer, for_model

    args = []
    if template is not None:
        path = Path(tempfile.mkdtemp(dir=tmp)) / "template.jinja"
        path.write_text(template)
        args = ["--chat-template", str(path)]
    return counting_renderer(for_model(str(model_dir), *args))


@pytest.fixture(scope="session")
def renderer(tiny_model_dir):
    """The tiny model's render, as the server counts with it (vLLM's)."""
    return engine_renderer(tiny_model_dir)


@pytest.fixture(scope="session")
def postgres_url(tmp_path_factory):
    """A PostgreSQL server: `$AGENTKV_TEST_POSTGRES` (.ci/run starts one), else one this test
    session starts with `.ci/postgres` where PostgreSQL is installed."""
    url = os.environ.get("AGENTKV_TEST_POSTGRES")
    if url:
        yield url
        return
    script, pgdir = REPO / ".ci" / "postgres", Path(tempfile.mkdtemp(prefix="agentkv-pg-"))
    try:
        url = subprocess.run([script, "start", str(pgdir), str(_free_port())], check=True,
                             capture_output=True, text=True).stdout.strip()
    except subprocess.CalledProcessError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL did not start: {exc.stderr[-2000:]}")
        pytest.skip(f"no PostgreSQL here (set AGENTKV_TEST_POSTGRES): {exc.stderr.strip()[-300:]}")
    yield url
    subprocess.run([script, "stop", str(pgdir)], capture_output=True)


@pytest.fixture(scope="session")
def haproxy() -> str:
    """HAProxy, the router of deploy/router/: Debian's package, installed here first where it is
    missing and this runs as root (as .ci/postgres does for PostgreSQL)."""
    from agentkv.benchmarks.router import find_haproxy as find

    if find() is None and os.geteuid() == 0:
        subprocess.run(["bash", "-c", "apt-get update -qq && "
                                      "DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy"],
                       capture_output=True, timeout=600)
    if find() is None:
        if os.environ.get("CI"):
            pytest.fail("HAProxy could not be installed (Debian package haproxy)")
        pytest.skip("no HAProxy here (Debian: apt-get install haproxy)")
    return find()


@contextlib.contextmanager
def new_database(postgres_url: str):
    """The URL of a new, empty UTF-8 database on that server, dropped afterwards."""
    import psycopg

    name = f"agentkv_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name} ENCODING 'UTF8' TEMPLATE template0")
    try:
        yield postgres_url.rsplit("/", 1)[0] + "/" + name
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.fixture
def postgres_db(postgres_url) -> str:
    with new_database(postgres_url) as url:
        yield url


@pytest.fixture(params=["sqlite", "postgres"])
def log_target(request, tmp_path) -> str:
    """Where a session log lives: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "log.db")
    return request.getfixturevalue("postgres_db")


@pytest.fixture(scope="session")
def no_connector_server(tmp_path_factory) -> Server:
    """The ``server`` fixture's settings with no KV connector (``--no-kv-retention``, recompute):
    what agentkv did before retention, for the tests that compare with it or need it absent; and no
    sessions page (``--no-ui``)."""
    srv = start_server(tmp_path_factory.mktemp("agentkv-no-connector"), "--no-kv-retention", "--no-ui")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def real_server(tmp_path_factory) -> Server:
    """`agentkv serve` with no model flag: the default, SmolLM2-135M-Instruct (8192-token window).
    For the tests whose answers must be right; everything else uses the tiny model."""
    srv = start_server(tmp_path_factory.mktemp("agentkv-real"), model=None)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="session")
def wide_server(tmp_path_factory) -> Server:
    """The tiny model with a 200k window, for the real agent harnesses (Claude Code's first request
    is ~40k tokens with the tiny tokenizer and it assumes a 200k window; Codex assumes 258k); its
    answers end by themselves (``TinyModelSpec.eos_weight``)."""
    from agentkv.server.embedded_model import TinyModelSpec, build_model

    home = tmp_path_factory.mktemp("agentkv-wide")
    model = build_model(home / "tiny-wide", TinyModelSpec(max_position_embeddings=262144, eos_weight=3.5))
    srv = start_server(home, "--model", str(model), "--served-model-name", "agentkv-tiny",
                       "--max-model-len", "200000")
    yield srv
    stop_server(srv)


# vLLM's logging with its request logger at DEBUG: the engine writes every request body it receives
# (cache salt included) to the server's log, for the tests that check what reached it
ENGINE_REQUEST_LOGGING = {
    "version": 1, "disable_existing_loggers": False,
    "formatters": {"vllm": {"()": "vllm.logging_utils.NewLineFormatter", "datefmt": "%m-%d %H:%M:%S",
                            "format": "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"}},
    "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": "DEBUG",
                          "stream": "ext://sys.stdout"}},
    "loggers": {"vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False},
                "vllm.entrypoints.serve.utils.request_logger": {"handlers": ["vllm"], "level": "DEBUG",
                                                                "propagate": False}},
}


@pytest.fixture(scope="session")
def small_server(tmp_path_factory, request) -> Server:
    """A second server for the reliability tests: a 1024-token window (every generation is short,
    so fuzzing cannot make a request run for minutes), a body deadline of 6 s and its session log
    on PostgreSQL where one is available (SQLite otherwise)."""
    with contextlib.ExitStack() as stack:
        try:
            db = stack.enter_context(new_database(request.getfixturevalue("postgres_url")))
        except pytest.skip.Exception:
            db = None
        home = tmp_path_factory.mktemp("agentkv-small")
        logging_config = home / "vllm-logging.json"   # the engine logs each request body it receives
        logging_config.write_text(json.dumps(ENGINE_REQUEST_LOGGING))
        srv = start_server(home, "--max-model-len", "1024", "--engine-arg=--enable-log-requests",
                           "--body-timeout-s", str(SMALL_BODY_TIMEOUT_S),
                           *(["--session-db", db] if db else []),
                           env={"VLLM_LOGGING_CONFIG_PATH": str(logging_config)})
        srv.session_db = db or str(home / "sessions.db")
        yield srv
        stop_server(srv)
