"""Security. Stored data: session ids cannot name anything outside the caller's own namespace (no
path characters, no other key's sessions), and one key's sessions are invisible to another.
Local users: no secret in any process's argv (the front, the vLLM child and its workers), none in
the log, and everything under $AGENTKV_HOME private to the server's user whatever the umask."""

from __future__ import annotations

import json
import logging
import os
import pwd
import re
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from agentkv.server.config import ServeConfig, url_passwords
from agentkv.server.engine.process import EngineProcess
from agentkv.server.home import secure_home

from conftest import API_KEY, OTHER_KEY, start_server, stop_server

MODEL = "agentkv-tiny"
BAD_IDS = ["../../etc/passwd", "..", ".", "a/b", "a\\b", "x" * 129, "sp ace", "nul\x00", "%2e%2e%2f", "é",
           "abc\n", "tab\tid", "cr\r", "\x1b[31m"]


def _chat(server, key=None, session=None, text="hello", header=True):
    http = server.http(**({"api_key": key} if key else {}))
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": text}]}
    headers = {}
    if session is not None:
        if header:
            headers["X-Session-Id"] = session
        else:
            body["session_id"] = session
    return http.post("/v1/chat/completions", json=body, headers=headers)


def _wal(db) -> bytes:
    wal = db.with_name(db.name + "-wal")
    return wal.read_bytes() if wal.exists() else b""


def _tree(root) -> set[str]:
    return {os.path.join(d, f) for d, _, files in os.walk(root) for f in files}


@pytest.mark.parametrize("bad", BAD_IDS)
def test_path_like_session_ids_are_refused(server, bad):
    """Path-like ids, and ids with a newline or other control characters (a final "\\n" passed a
    ``$``-anchored check once): a 400 naming the field, before anything is logged."""
    before = _tree(server.home.parent)
    marker = f"never-logged-{uuid.uuid4().hex}"
    if bad.isprintable() and bad.isascii():  # header values must be printable ASCII
        r = _chat(server, session=bad, text=marker)
        assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text
    r = _chat(server, session=bad, header=False, text=marker)
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text
    db = server.home / "sessions.db"
    assert not db.exists() or marker.encode() not in db.read_bytes() + _wal(db)
    from urllib.parse import quote

    r = server.http().get(f"/v1/sessions/{quote(bad, safe='')}")
    assert r.status_code in (400, 404), r.text          # refused, or no such route: never a file
    new = _tree(server.home.parent) - before
    assert all(p.startswith(str(server.home)) for p in new), new


def test_one_keys_sessions_are_invisible_to_another(server):
    sid = "isolation-check"
    assert _chat(server, session=sid, text="secret for A: 4417").status_code == 200
    mine = server.http().get(f"/v1/sessions/{sid}")
    assert mine.status_code == 200 and mine.json()["messages"] == 1
    assert "4417" in server.http().get(f"/v1/sessions/{sid}/messages").json()["data"][0]["content"]
    theirs = server.http(api_key=OTHER_KEY).get(f"/v1/sessions/{sid}")
    assert theirs.status_code == 404 and theirs.json()["error"]["code"] == "session_not_found"
    assert server.http(api_key=OTHER_KEY).get(f"/v1/sessions/{sid}/messages").status_code == 404
    # the same id under the other key is a different session: A's log is untouched
    assert _chat(server, key=OTHER_KEY, session=sid, text="B writes here").status_code == 200
    b = server.http(api_key=OTHER_KEY).get(f"/v1/sessions/{sid}/messages").json()["data"]
    assert [m["content"] for m in b] == ["B writes here"]
    a = server.http().get(f"/v1/sessions/{sid}/messages").json()["data"]
    assert [m["content"] for m in a] == ["secret for A: 4417"]


# --- local users: argv, logs, file modes -------------------------------------------------------

DB_PASSWORD = "pw-S3cr3t-9931"
LOOSE_UMASK = 0o022  # the usual default: files 0644, folders 0755


def _cli(*args: str, env: dict[str, str], umask: int = LOOSE_UMASK,
         inherit: bool = True) -> subprocess.CompletedProcess:
    """`agentkv ...` in a subprocess started with ``umask`` (what a caller's shell would have);
    ``env`` adds to this process's environment, or replaces it with ``inherit=False``."""
    old = os.umask(umask)
    try:
        return subprocess.run([sys.executable, "-m", "agentkv.server.cli", *args],
                              env=dict(os.environ, **env) if inherit else env,
                              capture_output=True, text=True, timeout=300)
    finally:
        os.umask(old)


def _modes(root: Path) -> dict[str, int]:
    """Permission bits of ``root`` and of everything under it (links not followed)."""
    paths = [root] + [Path(d, n) for d, dirs, files in os.walk(root) for n in dirs + files]
    return {str(p): stat.S_IMODE(p.lstat().st_mode) for p in paths if not p.is_symlink()}


def _assert_private(root: Path) -> None:
    modes = _modes(root)
    expected = {p: 0o700 if Path(p).is_dir() else 0o600 for p in modes}
    assert {p: oct(m) for p, m in modes.items()} == {p: oct(m) for p, m in expected.items()}


def _nobody_owned(path: Path) -> Path:
    """Give ``path`` to another user (root only), to simulate a home the server cannot own."""
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root; not root here")
    nobody = pwd.getpwnam("nobody").pw_uid
    os.chown(path, nobody, -1)
    return path


def test_secure_home_tightens_what_is_there_and_leaves_link_targets(tmp_path, monkeypatch, caplog):
    home, outside = tmp_path / "home", tmp_path / "outside.txt"
    (home / "models" / "m").mkdir(parents=True)
    for p, mode in ((home, 0o755), (home / "models", 0o775), (home / "models" / "m", 0o755)):
        p.chmod(mode)
    (home / "sessions.db").write_text("log")
    (home / "sessions.db").chmod(0o644)
    (home / "models" / "m" / "run.sh").write_text("#!/bin/sh\n")
    (home / "models" / "m" / "run.sh").chmod(0o755)
    outside.write_text("not agentkv's")
    outside.chmod(0o644)
    (home / "link").symlink_to(outside)
    monkeypatch.setenv("AGENTKV_HOME", str(home))
    with caplog.at_level(logging.WARNING, logger="agentkv.server.home"):
        assert secure_home() == home.resolve()
    assert _modes(home) == {str(home): 0o700, str(home / "models"): 0o700, str(home / "models" / "m"): 0o700,
                            str(home / "sessions.db"): 0o600, str(home / "models" / "m" / "run.sh"): 0o700}
    assert stat.S_IMODE(outside.stat().st_mode) == 0o644
    assert [r.getMessage() for r in caplog.records] == [
        f"tightened 5 path(s) that other users could access to owner-only ({home.resolve()}, ...)"]
    caplog.clear()
    secure_home()  # already private: nothing to say
    assert caplog.records == []


def test_home_owned_by_another_user_is_a_cli_error(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    _nobody_owned(home)
    for args in (["serve", "--port", "0"], ["model", "build"]):
        r = _cli(*args, env={"AGENTKV_HOME": str(home)})
        assert r.returncode == 2, r.stderr
        assert f"agentkv: error: AGENTKV_HOME {home} is owned by uid {pwd.getpwnam('nobody').pw_uid}" in r.stderr
        assert "Traceback" not in r.stderr
    assert list(home.iterdir()) == []  # nothing was written into it


def test_file_in_home_owned_by_another_user_is_a_cli_error(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "sessions.db").write_text("")
    _nobody_owned(home / "sessions.db")
    r = _cli("serve", "--port", "0", env={"AGENTKV_HOME": str(home)})
    assert r.returncode == 2 and f"agentkv: error: {home / 'sessions.db'} is owned by uid" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_model_build_is_private_whatever_the_umask(tmp_path):
    home = tmp_path / "fresh" / "home"
    env = {k: v for k, v in os.environ.items() if k != "AGENTKV_MODELS"}   # the default: $AGENTKV_HOME/models
    r = _cli("model", "build", "agentkv-tiny-2l", env=dict(env, AGENTKV_HOME=str(home)), inherit=False)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == home / "models" / "agentkv-tiny-2l"
    assert len(_modes(home)) == 11  # home, models, the model folder, its 8 files
    _assert_private(home)
    assert stat.S_IMODE((tmp_path / "fresh").stat().st_mode) == 0o700  # parents it created, too


@pytest.mark.parametrize("url", [
    f"postgresql://agentkv:{DB_PASSWORD}@127.0.0.1:1/agentkv",           # refused
    f"postgresql://agentkv:{DB_PASSWORD}@[::1/agentkv",                  # libpq echoes the whole URL
    f"postgresql://agentkv@127.0.0.1:1/agentkv?password={DB_PASSWORD}&bogus=1",
])
def test_session_db_password_is_never_in_a_cli_error(tmp_path, url):
    r = _cli("serve", "--port", "0", env={"AGENTKV_HOME": str(tmp_path), "AGENTKV_SESSION_DB": url})
    assert r.returncode == 2 and "cannot open the session log (--session-db)" in r.stderr, r.stderr
    assert DB_PASSWORD not in r.stderr + r.stdout and "Traceback" not in r.stderr


def test_config_never_shows_its_secrets():
    url = f"postgresql://u:{DB_PASSWORD}%21@h/db"
    cfg = ServeConfig(api_key=(API_KEY, OTHER_KEY), session_db=url)
    assert url_passwords(url) == (DB_PASSWORD + "!", DB_PASSWORD + "%21")
    assert cfg.secrets == (API_KEY, OTHER_KEY, DB_PASSWORD + "!", DB_PASSWORD + "%21")
    for shown in (repr(cfg), str(cfg)):
        assert not any(s in shown for s in cfg.secrets), shown
    assert cfg.redact(f"{url} via {OTHER_KEY}") == "postgresql://u:***@h/db via ***"
    with pytest.raises(ValidationError, match="per-launch secret"):
        ServeConfig(engine_args=("--api-key=mine",))


def test_engine_secret_and_front_settings_stay_out_of_the_child(monkeypatch):
    monkeypatch.setenv("AGENTKV_API_KEY", f"{API_KEY},{OTHER_KEY}")
    monkeypatch.setenv("AGENTKV_SESSION_DB", f"postgresql://u:{DB_PASSWORD}@h/db")
    cfg = ServeConfig(api_key=(API_KEY, OTHER_KEY), session_db=f"postgresql://u:{DB_PASSWORD}@h/db")
    eng = EngineProcess(cfg, "/m", "cpu")
    argv, env = " ".join(eng.argv()), eng.env()
    assert not any(s in argv for s in (eng.secret, API_KEY, OTHER_KEY, DB_PASSWORD)), argv
    assert env["VLLM_API_KEY"] == eng.secret
    assert "AGENTKV_API_KEY" not in env and "AGENTKV_SESSION_DB" not in env
    assert not any(s in v for v in env.values() for s in (API_KEY, OTHER_KEY, DB_PASSWORD))
    eng.stop()


def _process_tree(root: int) -> dict[int, bytes]:
    """argv (``/proc/<pid>/cmdline``, what any local user can read) of ``root`` and its descendants."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                pass  # gone meanwhile
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, pp in parents.items() if pp == pid]
        tree.update(kids)
        frontier += kids
    return {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in tree}


def _engine_pid(procs: dict[int, bytes]) -> int:
    return next(p for p, cmd in procs.items() if b"vllm.entrypoints.openai.api_server" in cmd)


def _engine_secret(pid: int) -> str:
    """The engine's per-launch secret, from its environment (readable by its own user only)."""
    environ = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in kv)
    return environ[b"VLLM_API_KEY"].decode()


def _fd_links(pid: int) -> set[str]:
    """What a process's open files are (``socket:[inode]`` for a socket)."""
    links = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass  # closed meanwhile
    return links


def _assert_no_secret_visible(server, secrets: list[str]) -> None:
    procs = _process_tree(server.proc.pid)
    engine = _engine_pid(procs)
    secret = _engine_secret(engine)
    assert len(secret) >= 24 and len(procs) >= 3, procs  # the front, the vLLM server, its engine core
    for pid, cmdline in procs.items():
        for s in [secret, *secrets]:
            assert s.encode() not in cmdline, (pid, cmdline)
    log = server.log_path.read_text(errors="replace")
    assert not any(s in log for s in [secret, *secrets])
    # vLLM's API listens on a Unix socket in a folder only its user may enter, on no TCP port (its
    # engine's own processes may: torch.distributed's store is on loopback TCP)
    sock = re.search(rb"--uds\x00([^\x00]+)", procs[engine]).group(1).decode()
    assert stat.S_IMODE(os.stat(os.path.dirname(sock)).st_mode) == 0o700 and stat.S_ISSOCK(os.stat(sock).st_mode)
    assert b"--port" not in procs[engine]
    listening = {int(line.split()[9]) for f in ("/proc/net/tcp", "/proc/net/tcp6") if os.path.exists(f)
                 for line in Path(f).read_text().splitlines()[1:] if line.split()[3] == "0A"}   # inodes in LISTEN
    assert not {f"socket:[{inode}]" for inode in listening} & _fd_links(engine), "vLLM's API listens on TCP"
    # the engine honours VLLM_API_KEY: without the secret it refuses, with it it answers
    with httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://engine", timeout=30) as engine_http:
        assert engine_http.get("/v1/models").status_code == 401
        for key in (API_KEY, OTHER_KEY):
            assert engine_http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 401
        ok = engine_http.get("/v1/models", headers={"Authorization": f"Bearer {secret}"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == MODEL


@pytest.fixture(scope="module")
def private_server(tmp_path_factory):
    """A server on a loose existing home (0755, a 0755 models folder, the 0644 log the harness
    writes), started from a process with umask 022, its keys in the environment."""
    home = tmp_path_factory.mktemp("agentkv-loose-home")
    old = os.umask(LOOSE_UMASK)
    try:
        home.chmod(0o755)
        (home / "models").mkdir()
        srv = start_server(home)
    finally:
        os.umask(old)
    yield srv
    stop_server(srv)


def test_no_secret_in_any_argv_or_the_log(private_server):
    _assert_no_secret_visible(private_server, [API_KEY, OTHER_KEY])


def test_everything_under_the_home_is_private(private_server):
    home = private_server.home
    assert _chat(private_server, session="modes-check").status_code == 200  # the session log is written
    assert {"sessions.db", "sessions.db-wal", "sessions.db-shm", "models", "run", "server.log"} <= \
        {p.name for p in home.iterdir()}
    _assert_private(home)
    assert (f"tightened 3 path(s) that other users could access to owner-only ({home}, ...)"
            in private_server.log_tail(10_000))


def test_no_session_db_password_in_any_argv_or_the_log(tmp_path, postgres_db):
    """The PostgreSQL URL with a password comes from AGENTKV_SESSION_DB (the test server trusts
    loopback, so any password connects) and is seen by no one but the front."""
    url = re.sub(r"^(postgresql://[^@/:]+)@", rf"\1:{DB_PASSWORD}@", postgres_db)
    assert DB_PASSWORD in url
    server = start_server(tmp_path, env={"AGENTKV_SESSION_DB": url})
    try:
        assert _chat(server, session="pg-secret").status_code == 200
        _assert_no_secret_visible(server, [API_KEY, OTHER_KEY, DB_PASSWORD])
    finally:
        stop_server(server)


def test_engine_socket_is_private_and_short_whatever_tmpdir(tmp_path, monkeypatch):
    """The engine's socket lies in a new 0700 folder; a TMPDIR too long for a socket path (107
    bytes) falls back to /tmp; the folder goes with the engine."""
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    for tmp in (str(tmp_path), str(deep)):
        monkeypatch.setattr("tempfile.tempdir", tmp)
        eng = EngineProcess(ServeConfig(), "/m", "cpu")
        assert len(eng.socket_path.encode()) <= 107 and stat.S_IMODE(os.stat(eng.socket_dir).st_mode) == 0o700
        assert eng.socket_path.startswith(tmp if len(tmp) <= 64 else "/tmp/")
        assert ["--uds", eng.socket_path] == eng.argv()[eng.argv().index("--uds"):][:2]
        eng.stop()


def test_every_request_the_engine_receives_carries_a_cache_salt(small_server):
    """Whatever reached the small server's engine (its log holds each request body vLLM received:
    the fixture turns vLLM's request logger on) carries a cache salt: turns, completions, and the
    summarizer's requests of on-demand compaction; two keys' salts differ."""
    marker = f"salted-{uuid.uuid4().hex[:8]}"
    for key in (API_KEY, OTHER_KEY):
        http = small_server.http(api_key=key)
        r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": f"{marker} hello"}]})
        assert r.status_code == 200, r.text
    http = small_server.http()
    assert http.post("/v1/completions",
                     json={"model": MODEL, "prompt": f"{marker} x", "max_tokens": 2}).status_code == 200
    r = http.post("/v1/responses/compact", json={"model": MODEL, "input": [
        {"role": "user", "content": f"{marker} summarize this"}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "and this"}]})
    assert r.status_code == 200, r.text
    lines = small_server.log_path.read_text(errors="replace").split("\n")   # not splitlines: U+2028 is JSON text
    bodies = [json.loads(line.split(" JSON body: ", 1)[1]) for line in lines if " JSON body: " in line]
    mine = [b for b in bodies if marker in json.dumps(b)]
    assert len(mine) >= 4, len(mine)   # two turns, a completion, the summary (its prompt holds the marker)
    assert all(b.get("cache_salt") for b in bodies), [b for b in bodies if not b.get("cache_salt")][:1]
    turns = [b for b in mine if b.get("messages") and b["messages"][-1]["content"].endswith(" hello")]
    assert len({b["cache_salt"] for b in turns}) == 2
