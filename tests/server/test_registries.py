"""Adding an edit kind or a KV mode is one class and its registration: a kind and a mode defined
and registered here (before the request models are built, in a fresh interpreter, as the built-in
ones are) are checked at the edge, run by the context step and by KV reuse, and recorded, with no
other change. No engine runs: the mode registered here sends nothing to one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = r'''
import asyncio, json, sys
from typing import Literal

from agentkv.compaction.edit_kinds import Applied, EditKind, register
from agentkv.server import kv_modes


@register
class RedactWord(EditKind):
    """Replace the user messages that hold ``word``."""

    type: Literal["redact_word", "redact_word_20990101"] = "redact_word"
    word: str

    def apply(self, view, step):
        hit = [i for i, m in enumerate(view) if m.get("role") == "user" and self.word in str(m.get("content"))]
        if not hit:
            return None
        new = [{**m, "content": "[redacted]"} if i in hit else m for i, m in enumerate(view)]
        return Applied(new, {"type": self.type, "redacted_messages": len(hit)}, replaced=hit)


@kv_modes.register
class Head(kv_modes.KVReuseMode):
    """Moves K/V up to the first edit only, with no priming request."""

    name = "head"

    def primes(self, replacement_tokens):
        return False

    async def refine(self, job, primed):
        return job.edits[0].start, {"head_tokens": job.edits[0].start}


from pydantic import ValidationError

from agentkv.compaction.config import ClearToolUses
from agentkv.compaction.log.open import open_session_log
from agentkv.compaction.policy import ContextManagement
from agentkv.compaction.prompt import PromptRenderer
from agentkv.server.api.chat.protocol import ChatCompletionRequest
from agentkv.server.cli import build_parser
from agentkv.server.config import ServeConfig
from agentkv.server.engine.process import engine_args
from agentkv.server.kv import reuse
from agentkv.server.options import AgentKVFields
from agentkv.server.pipeline.context import ContextManager, manage
from agentkv.server.pipeline.sessions import SessionRef, Sessions

model_dir, tmp = sys.argv[1], sys.argv[2]
out = {}

# the edge: the request models take the new kind by either name, as strictly as the others
cm = {"edits": [{"type": "redact_word_20990101", "word": "hunter2"}]}
chat = ChatCompletionRequest.model_validate(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "context_management": cm})
out["parsed"] = type(chat.context_management.edits[0]).__name__
try:
    ContextManagement.model_validate({"edits": [{"type": "redact_word", "wrod": "x"}]})
except ValidationError as e:
    out["bad"] = sorted({(".".join(map(str, err["loc"])), err["type"]) for err in e.errors()})
try:
    register(type("Late", (RedactWord,), {"__annotations__": {"type": Literal["late"]}, "type": "late"}))
except RuntimeError:
    out["late_kind"] = "refused"

# the context step runs it and records what it replaced: the next request's view keeps it
ctx = ContextManager(Sessions(open_session_log(tmp + "/log.db")), PromptRenderer.from_pretrained(model_dir), None)
off = ServeConfig(context_management=False)
msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "my password is hunter2"},
        {"role": "assistant", "content": "noted"}]
policy = ContextManagement.model_validate(cm)
first = asyncio.run(manage(ctx, off, 4096, "o", SessionRef("s"), msgs, None, policy, salt="s"))
out["applied"] = first.report["applied_edits"]
out["view"] = [m["content"] for m in first.messages]
later = asyncio.run(manage(ctx, off, 4096, "o", SessionRef("s"), msgs + [{"role": "user", "content": "ok"}], None,
                           ContextManagement(edits=[]), salt="s"))
out["later_view"] = [m["content"] for m in later.messages]

# the KV mode: config, request field, CLI and engine arguments take it; KV reuse runs its plan
cfg = ServeConfig(kv_reuse="head", context_management=False)
out["connector"] = cfg.kv_connector
out["engine_args"] = "--kv-transfer-config" in engine_args(cfg, "/m", "cpu", "/s")
out["field"] = AgentKVFields.model_validate({"kv_reuse": "head"}).kv_reuse
serve = next(a for a in build_parser()._actions if a.dest == "command").choices["serve"]
out["choices"] = next(a.choices for a in serve._actions if a.dest == "kv_reuse")
try:
    kv_modes.register(type("Late", (kv_modes.KVReuseMode,), {"name": "late"}))
except RuntimeError:
    out["late_mode"] = "refused"


class NoEngine:
    async def post_json(self, path, body):
        raise AssertionError("this mode sends no request of its own")


tools = [{"role": "system", "content": "agent"}, {"role": "user", "content": "go"}]
for i in range(3):
    tools += [{"role": "assistant", "content": None, "tool_calls": [
                  {"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": "{}"}}]},
              {"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i}\n" + "noise line\n" * 60}]
clear = ContextManagement(edits=[ClearToolUses(trigger=0, keep=1)])
prepared = asyncio.run(manage(ctx, cfg, 4096, "o", SessionRef("k"), tools, None, clear, salt="s",
                              shifting=kv_modes.kv_mode("head").moves(cfg)))
body = {"model": "m"}
asyncio.run(reuse.attach(cfg, NoEngine(), body, prepared, None, None, None, reuse.Salts("exact", "approx")))
out["first_edit"] = min(e.start for e in prepared.edits)
out["wire"] = body["kv_transfer_params"]["agentkv"]
out["salt"] = body["cache_salt"]
out["kv"] = prepared.report["applied_edits"][0]["kv"]
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def registered(tiny_model_dir, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("registries")
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_dir), str(tmp)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_registered_edit_kind_is_checked_at_the_edge_and_run_by_the_context_step(registered):
    assert registered["parsed"] == "RedactWord"
    assert registered["bad"] == [["edits.0.redact_word.word", "missing"],
                                 ["edits.0.redact_word.wrod", "extra_forbidden"]]
    assert registered["late_kind"] == "refused"
    assert registered["applied"] == [{"type": "redact_word_20990101", "redacted_messages": 1}]
    assert registered["view"] == ["agent", "[redacted]", "noted"]
    assert registered["later_view"] == ["agent", "[redacted]", "noted", "ok"]   # recorded in the session


def test_a_registered_kv_mode_reaches_config_engine_and_kv_reuse(registered):
    assert registered["connector"] is True and registered["engine_args"] is True
    assert registered["field"] == "head" and registered["choices"] == ["recompute", "shift", "blend", "head"]
    assert registered["late_mode"] == "refused"
    start = registered["first_edit"]
    assert registered["wire"]["limit"] == start and len(registered["wire"]["spans"]) == 2   # two results cleared
    assert registered["kv"] == {"mode": "head", "primed_tokens": registered["kv"]["primed_tokens"],
                                "head_tokens": start}
    assert registered["kv"]["primed_tokens"] > 0
    assert registered["salt"] == "approx"   # its edit moved K/V in this branch
