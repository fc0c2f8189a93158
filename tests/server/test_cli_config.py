"""CLI flags derive from ServeConfig; bad values are a CLI message, not a traceback."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from agentkv.server.cli import build_parser
from agentkv.server.config import ServeConfig
from agentkv.server.engine.process import EngineProcess


def _serve_flags() -> set[str]:
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    return {opt for a in serve._actions for opt in a.option_strings}


def test_every_config_field_has_a_flag():
    flags = _serve_flags()
    for name in ServeConfig.model_fields:
        flag = "--engine-arg" if name == "engine_args" else "--" + name.replace("_", "-")
        assert flag in flags, flag


def test_defaults_come_from_the_config():
    ns = build_parser().parse_args(["serve"])
    from agentkv.server.cli import _config_from

    assert _config_from(ns) == ServeConfig()
    assert ServeConfig().port == 8000 and ServeConfig().host == "127.0.0.1"


def test_environment_sets_fields_and_flags_win(monkeypatch):
    from agentkv.server.cli import _config_from

    monkeypatch.setenv("AGENTKV_API_KEY", "k1,k2")
    monkeypatch.setenv("AGENTKV_SESSION_DB", "postgresql://u@h/db")
    monkeypatch.setenv("AGENTKV_PORT", "9001")
    monkeypatch.setenv("AGENTKV_SERVER_TOOLS", "true")
    cfg = _config_from(build_parser().parse_args(["serve", "--port", "9002"]))
    assert cfg.api_key == ("k1", "k2") and cfg.session_db == "postgresql://u@h/db"
    assert cfg.port == 9002 and cfg.server_tools is True


@pytest.mark.parametrize("args, needle", [
    (["--session-db", "mysql://x/y"], "--session-db"),
    (["--session-db", "postgresql://nobody@127.0.0.1:1/nothing"], "cannot open the session log"),
    (["--port", "70000"], "--port"),
    (["--device", "tpu"], "invalid choice"),
    (["--kv-cache-gib", "0"], "--kv-cache-gib"),
    (["--blend-strategy", "middle"], "invalid choice"),
    (["--blend-fraction", "1.5"], "--blend-fraction"),
    (["--engine-reserved-cores", "-1"], "--engine-reserved-cores"),
    (["--clear-at", "0.3", "--clear-to", "0.4"], "clear_to (0.4) must be below clear_at (0.3)"),
    (["--engine-arg=--api-key=mine"], "--engine-arg: Value error, the engine's key is agentkv's own"),
    (["--kv-offload-gib", "-1"], "--kv-offload-gib"),
    (["--kv-reuse", "shift", "--kv-offload-gib", "100000"], "kv_offload_gib: 100000 GiB of host memory per worker"),
])
def test_bad_flags_exit_2_with_a_message(args, needle, tmp_path):
    r = subprocess.run([sys.executable, "-m", "agentkv.server.cli", "serve", *args], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, AGENTKV_HOME=str(tmp_path)))
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr


def test_engine_argv_cpu_defaults():
    eng = EngineProcess(ServeConfig(engine_args=("--max-num-seqs", "8")), "/m", "cpu")
    argv = eng.argv()
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager",
                 "--enable-auto-tool-choice"):
        assert flag in argv
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert argv[-2:] == ["--max-num-seqs", "8"]
    assert eng.env()["VLLM_CPU_KVCACHE_SPACE"] == "1"
    eng.stop()   # nothing started: its socket folder goes
    assert not os.path.exists(eng.socket_dir)


def test_the_engine_reserves_the_same_cores_whatever_the_kv_mode(monkeypatch):
    """vLLM reserves one core more once a KV connector is configured; agentkv sets the reservation
    itself, so a shift server and a recompute server compute on the same cores (issue 39: on 2
    cores the default server had one compute core and the shift server two)."""
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "5")          # the front's own environment: overridden
    for cores, default in ((2, "0"), (4, "0"), (16, "1")):
        monkeypatch.setattr(os, "cpu_count", lambda cores=cores: cores)
        envs = []
        for mode in ("recompute", "shift", "blend"):
            for retention in (True, False):      # the connector loaded, or (recompute) not
                eng = EngineProcess(ServeConfig(kv_reuse=mode, kv_retention=retention), "/m", "cpu")
                envs.append(eng.env()["VLLM_CPU_NUM_OF_RESERVED_CPU"])
                eng.stop()
        assert envs == [default] * 6
    eng = EngineProcess(ServeConfig(engine_reserved_cores=1, kv_reuse="shift"), "/m", "cpu")
    assert eng.env()["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    eng.stop()


def test_the_host_tier_reaches_the_connector_sized_from_free_memory_by_default():
    """--kv-offload-gib goes to the connector's config in bytes; by default a quarter of the free
    memory, at most 8 GiB, split over the workers; 0 turns it off."""
    import json

    from agentkv.server.config import mem_available_gib

    def offload(cfg: ServeConfig) -> int:
        eng = EngineProcess(cfg, "/m", "cpu")
        argv = eng.argv()
        eng.stop()
        return json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]["offload_bytes"]

    assert offload(ServeConfig(kv_reuse="shift", kv_offload_gib=0.5)) == 2**29
    assert offload(ServeConfig(kv_reuse="shift", kv_offload_gib=0)) == 0
    default = offload(ServeConfig(kv_reuse="shift")) / 2**30
    assert 0 < default <= min(8, (mem_available_gib() or 1.0) / 4 * 1.05)
    halved = offload(ServeConfig(kv_reuse="blend", tensor_parallel_size=2)) / 2**30
    assert halved <= min(8, (mem_available_gib() or 1.0) / 8 * 1.05)


def test_engine_argv_cuda_defaults():
    eng = EngineProcess(ServeConfig(tensor_parallel_size=2), "/m", "cuda")
    argv = eng.argv()
    eng.stop()
    assert "--enforce-eager" not in argv and argv[argv.index("--dtype") + 1] == "auto"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert "--gpu-memory-utilization" in argv


def test_socket_folders_of_killed_fronts_are_removed():
    """A front killed with SIGKILL leaves its engine's socket folder; the next engine's start removes
    it, and only it: not a live engine's, not one whose engine is still starting."""
    from pathlib import Path

    from agentkv.server.engine.process import SOCKET_PREFIX, remove_stale_socket_folders

    tmp_path = Path(tempfile.mkdtemp(prefix="akv-", dir="/tmp"))   # short: a socket path has 107 bytes

    def folder(name: str, listening: bool | None, age_s: float) -> str:
        path = tmp_path / f"{SOCKET_PREFIX}{name}"
        path.mkdir(mode=0o700)
        if listening is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(str(path / "engine.sock"))
            if listening:
                sock.listen()
                held.append(sock)
            else:
                sock.close()   # the file stays, nobody listens: what a killed engine leaves
            os.utime(path / "engine.sock", (time.time() - age_s,) * 2)
        return str(path)

    held: list[socket.socket] = []
    dead, live, starting, fresh = (folder("dead", False, 600), folder("live", True, 600),
                                   folder("starting", None, 600), folder("fresh", False, 1))
    (tmp_path / "other").mkdir()
    assert remove_stale_socket_folders(str(tmp_path)) == [dead]
    assert not os.path.exists(dead) and all(os.path.exists(p) for p in (live, starting, fresh, tmp_path / "other"))
    for sock in held:
        sock.close()
    shutil.rmtree(tmp_path)


def test_a_socket_folder_whose_owner_lives_is_never_removed(tmp_path):
    """Ownership, not whether the socket answers: another front's folder, its engine still starting
    (a socket file that refuses connections, old enough to look stale), stays while that front
    lives, and goes once it is gone (killed: the kernel lets go of its lock)."""
    import signal
    from pathlib import Path

    from agentkv.server.engine.process import release_socket_folder, remove_stale_socket_folders, socket_folder

    base = Path(tempfile.mkdtemp(prefix="akv-", dir="/tmp"))
    other = subprocess.Popen([sys.executable, "-c", (
        "import socket, sys, tempfile, time, os\n"
        f"tempfile.tempdir = {str(base)!r}\n"
        "from agentkv.server.engine.process import socket_folder\n"
        "path = socket_folder()\n"
        "s = socket.socket(socket.AF_UNIX); s.bind(os.path.join(path, 'engine.sock')); s.close()\n"
        "os.utime(os.path.join(path, 'engine.sock'), (time.time() - 600,) * 2)\n"
        "print(path, flush=True); time.sleep(600)")], stdout=subprocess.PIPE, text=True)
    try:
        theirs = other.stdout.readline().strip()
        assert os.path.isdir(theirs)
        assert remove_stale_socket_folders(str(base)) == [] and os.path.isdir(theirs)
        tempfile.tempdir = str(base)
        try:
            mine = socket_folder()                         # a second front starting beside it
        finally:
            tempfile.tempdir = None
        assert os.path.isdir(theirs) and os.path.isdir(mine)
        assert remove_stale_socket_folders(str(base)) == []   # my own folder is mine: kept too
        other.send_signal(signal.SIGKILL)
        other.wait()
        assert remove_stale_socket_folders(str(base)) == [theirs] and os.path.isdir(mine)
        release_socket_folder(mine)
        assert not os.path.exists(mine)
    finally:
        other.kill()
        shutil.rmtree(base, ignore_errors=True)


def test_the_default_server_loads_the_connector_and_computes_on_every_core(server):
    """Retention loads the KV connector in the default mode; vLLM, left alone, would then reserve a
    core more for it. On a machine of up to 4 cores the engine binds its compute threads to every
    core it may run on, as it did before the connector was loaded in every mode."""
    log = server.log_path.read_text(errors="replace")
    assert "AgentKVConnector" in log and "'retain': True" in log
    bound = re.search(r"local_rank=0, core ids=\[([0-9, ]*)\]", log)
    assert bound, "vLLM logged no thread binding"
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) <= 4:
        assert [int(c) for c in bound.group(1).split(",")] == cores
        assert "reserve_cpu_num=0" in log
