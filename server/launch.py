"""``agentkv launch claude|codex|opencode|pi [-- ARGS]``: start an agent client against a running
agentkv, configured the way docs/agents-and-clients.md says.

First it asks the server what it serves (``/v1/models``: the model, its window, whether tool calls
are parsed) and refuses at once, saying why and what to serve instead, where the client cannot
work: a window its first request alone (system prompt and tool definitions) nearly fills, or no
tool calls. Then it runs the client with its configuration in the client's own environment
variables and a temporary config folder of its own (removed afterwards): the user's own config
files (``~/.claude.json``, ``~/.codex``, ``~/.config/opencode``, ``~/.pi``, ...) are never read
for writing, nor changed. The client's exit code is the command's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx

PINNED = Path(__file__).resolve().parents[1] / "tests" / "clients" / "node_modules"   # setup.sh's, in a checkout
ROOM = 4096   # tokens beyond a client's first request: its first answers and tool results
SUGGESTED = ("agentkv serve --model Qwen/Qwen3-Coder-30B-A3B-Instruct --tool-call-parser qwen3_coder "
             "--max-model-len 131072")


class LaunchError(Exception):
    """Why the client is not started (said to the user as is)."""


@dataclass(frozen=True)
class Served:
    url: str
    key: str
    model: str
    window: int
    tool_calls: bool


@dataclass(frozen=True)
class Client:
    name: str                     # what the user calls it
    title: str
    binary: str                   # its command on PATH
    pinned: str                   # where setup.sh's copy is, under tests/clients/node_modules
    first_request: int            # tokens of its first request (SmolLM2's tokenizer, docs/agents-and-clients.md)
    configure: Callable[[Served, Path], tuple[list[str], dict[str, str]]]   # (arguments first, environment)

    @property
    def window_needed(self) -> int:
        return self.first_request + ROOM


def _claude(s: Served, tmp: Path) -> tuple[list[str], dict[str, str]]:
    config = tmp / "claude"
    config.mkdir()
    # its global config (CLAUDE_CONFIG_DIR/.claude.json): onboarding done, this key approved
    (config / ".claude.json").write_text(json.dumps({"hasCompletedOnboarding": True,
                                                     "customApiKeyResponses": {"approved": [s.key[-20:]],
                                                                               "rejected": []}}))
    return ["--model", s.model], {"ANTHROPIC_BASE_URL": s.url, "ANTHROPIC_API_KEY": s.key,
                                  "CLAUDE_CONFIG_DIR": str(config), "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                                  "DISABLE_AUTOUPDATER": "1"}


def _codex(s: Served, tmp: Path) -> tuple[list[str], dict[str, str]]:
    home = tmp / "codex"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = {json.dumps(s.model)}\nmodel_provider = "agentkv"\nmodel_context_window = {s.window}\n\n'
        f'[model_providers.agentkv]\nname = "agentkv"\nbase_url = {json.dumps(s.url + "/v1")}\n'
        f'env_key = "AGENTKV_API_KEY"\nwire_api = "responses"\n')
    return [], {"CODEX_HOME": str(home), "AGENTKV_API_KEY": s.key}


def _xdg(tmp: Path) -> dict[str, str]:
    """XDG folders of its own: opencode keeps its sessions and state under them (and the provider
    package it installs in npm's cache, given its own too)."""
    out = {}
    for name in ("CONFIG", "DATA", "STATE", "CACHE"):
        (tmp / "xdg" / name.lower()).mkdir(parents=True)
        out[f"XDG_{name}_HOME"] = str(tmp / "xdg" / name.lower())
    return out


def _opencode(s: Served, tmp: Path) -> tuple[list[str], dict[str, str]]:
    config = tmp / "opencode.json"
    config.write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json", "model": f"agentkv/{s.model}",
        "provider": {"agentkv": {"npm": "@ai-sdk/openai-compatible", "name": "agentkv",
                                 "options": {"baseURL": s.url + "/v1", "apiKey": s.key},
                                 "models": {s.model: {"name": s.model, "limit": {
                                     "context": s.window, "output": min(32_000, max(256, s.window // 4))}}}}}}))
    return [], {"OPENCODE_CONFIG": str(config), "OPENCODE_DISABLE_MODELS_FETCH": "1",
                "OPENCODE_DISABLE_AUTOUPDATE": "1", "npm_config_cache": str(tmp / "npm"), **_xdg(tmp)}


def _pi(s: Served, tmp: Path) -> tuple[list[str], dict[str, str]]:
    agent = tmp / "pi"
    agent.mkdir()
    (agent / "models.json").write_text(json.dumps({"providers": {"agentkv": {
        "baseUrl": s.url + "/v1", "api": "openai-completions", "apiKey": s.key,
        "models": [{"id": s.model, "contextWindow": s.window, "maxTokens": min(32_000, max(256, s.window // 4))}]}}}))
    return ["--provider", "agentkv", "--model", s.model], {"PI_CODING_AGENT_DIR": str(agent), "PI_OFFLINE": "1"}


CLIENTS = {c.name: c for c in (
    Client("claude", "Claude Code", "claude", ".bin/claude", 12_200, _claude),
    Client("codex", "Codex", "codex", ".bin/codex", 9_100, _codex),
    Client("opencode", "opencode", "opencode", "opencode-linux-x64/bin/opencode", 7_700, _opencode),
    Client("pi", "pi", "pi", ".bin/pi", 1_500, _pi),
)}


NO_KEY = "agentkv"   # what a client sends where none was given (a server without keys takes any)


def served(url: str, key: str) -> Served:
    """What the server at ``url`` serves; ``LaunchError`` where it cannot be reached or refuses the key."""
    url = url.rstrip("/")
    try:
        health = httpx.get(f"{url}/health", timeout=10)
    except httpx.TransportError:
        raise LaunchError(f"no agentkv server answers at {url}: start one with `agentkv serve` (README's quick "
                          "start), or name yours with --url") from None
    if health.status_code != 200:
        raise LaunchError(f"the agentkv server at {url} is not ready: {health.text[:300]}")
    r = httpx.get(f"{url}/v1/models", timeout=30, headers={"Authorization": f"Bearer {key}"})
    if r.status_code == 401:
        raise LaunchError(f"the server at {url} refused the API key given (--api-key, or AGENTKV_API_KEY): pass one "
                          "of its --api-key values" if key != NO_KEY else
                          f"the server at {url} wants one of its API keys: pass --api-key KEY or set AGENTKV_API_KEY")
    if r.status_code != 200:
        raise LaunchError(f"the server at {url} answered /v1/models with {r.status_code}: {r.text[:300]}")
    model = r.json()["data"][0]
    info = model.get("agentkv") or {}
    return Served(url, key, model["id"], int(model.get("max_model_len") or 0), bool(info.get("tool_calls", True)))


def why_not(client: Client, s: Served) -> str | None:
    """Why ``client`` cannot work with what ``s`` serves, naming what to serve instead; None if it can."""
    if s.window and s.window < client.window_needed:
        return (f"{client.title} cannot work with this server: its first request alone is about "
                f"{client.first_request:,} tokens (its system prompt and tool definitions), and {s.model}'s window "
                f"is {s.window:,} tokens. Serve a model with tool calling and a window of at least "
                f"{client.window_needed:,} tokens, for example on a GPU: {SUGGESTED}")
    if not s.tool_calls:
        return (f"{client.title} works through tool calls, and this server parses none (--tool-call-parser ''): "
                f"serve {s.model} with its model's parser (vLLM's --tool-call-parser names, e.g. hermes)")
    return None


def binary(client: Client, given: str | None = None) -> str:
    """The client's command: ``given``, else on PATH, else setup.sh's pinned copy."""
    for found in (given, shutil.which(client.binary), PINNED / client.pinned):
        if found and Path(found).exists():
            return str(found)
    raise LaunchError(f"{client.title} is not installed: no `{client.binary}` on PATH (install it with npm, or name "
                      f"it with --bin)")


def launch(name: str, url: str, key: str | None, args: list[str], bin_path: str | None = None,
           run: Callable[..., int] = subprocess.call) -> int:
    """Start client ``name`` against the server at ``url``; its exit code. ``LaunchError`` where
    it is not started."""
    client = CLIENTS[name]
    key = key or (os.environ.get("AGENTKV_API_KEY") or "").split(",")[0] or NO_KEY
    s = served(url, key)
    problem = why_not(client, s)
    if problem:
        raise LaunchError(problem)
    command = binary(client, bin_path)
    with tempfile.TemporaryDirectory(prefix=f"agentkv-launch-{name}-") as tmp:
        first, env = client.configure(s, Path(tmp))
        print(f"agentkv launch: {client.title} against {s.url} ({s.model}, window {s.window:,}); its config: {tmp} "
              "(removed on exit)", file=sys.stderr)
        return run([command, *first, *args], env={**os.environ, **env})
