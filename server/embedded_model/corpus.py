"""Deterministic training text for the embedded model's tokenizer.

The text imitates what an agent's context holds (prose, shell commands, logs, JSON tool output,
Python code), generated from a seeded RNG so every build trains on the same bytes.
"""

from __future__ import annotations

import json
import random

_WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not which "
    "but all can were their has one more if will would there about what when so up out do into "
    "time only new some could them other than then now its also after first two way use how our "
    "work because any these most may well should where much before through back years must still "
    "agent context tool output result file read write search error retry timeout port region owner "
    "service report summary note decision rejected approach progress next step goal done cache "
    "prefix token block layer head model server request response session message user assistant "
    "system function call arguments value config build test run install deploy memory clear keep"
).split()
_SERVICES = ("auth", "media", "billing", "search", "gateway", "storage", "queue", "notify")
_LEVELS = ("INFO", "WARN", "ERROR", "DEBUG")
_REGIONS = ("eu-west-1", "us-east-2", "ap-south-1", "sa-east-1")
_COMMANDS = ("ls -la", "git status", "pytest -q", "cat README.md", "grep -rn TODO src/",
             "python diag.py", "make build", "curl -s localhost:8000/health")
_CODE = (
    "def {f}({a}, {b}):\n    if {a} is None:\n        return {b}\n    return {a} + {b}\n",
    "class {F}:\n    def __init__(self, {a}):\n        self.{a} = {a}\n\n    def {f}(self):\n        return self.{a}\n",
    "for {a} in range({n}):\n    {b} = {f}({a})\n    print({a}, {b})\n",
    "import json\n\nwith open('{a}.json') as fh:\n    {b} = json.load(fh)\n",
)


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 16))]
    return " ".join(words).capitalize() + rng.choice((".", ".", "?", "!"))


def _log_line(rng: random.Random) -> str:
    return (f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:"
            f"{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z {rng.choice(_LEVELS)} "
            f"service={rng.choice(_SERVICES)} latency_ms={rng.randint(1, 5000)} "
            f"code=E{rng.randint(1000, 9999)}")


def _json_blob(rng: random.Random) -> str:
    blob = {"service": rng.choice(_SERVICES), "port": rng.randint(1024, 65535),
            "timeout_ms": rng.randint(100, 9000), "region": rng.choice(_REGIONS),
            "owner": rng.choice(_WORDS), "errors": [f"E{rng.randint(1000, 9999)}" for _ in range(3)]}
    return json.dumps(blob)


def _code(rng: random.Random) -> str:
    names = {"f": rng.choice(_WORDS) + "_" + rng.choice(_WORDS), "F": rng.choice(_WORDS).title(),
             "a": rng.choice(_WORDS) + "_x", "b": rng.choice(_WORDS) + "_y", "n": rng.randint(2, 99)}
    return rng.choice(_CODE).format(**names)


def _shell(rng: random.Random) -> str:
    return f"$ {rng.choice(_COMMANDS)}\n" + "\n".join(_log_line(rng) for _ in range(rng.randint(1, 4)))


def training_text(seed: int, n_chunks: int = 6000) -> list[str]:
    """Return ``n_chunks`` text chunks; the same seed always gives the same chunks."""
    rng = random.Random(seed)
    makers = (_sentence, _log_line, _json_blob, _code, _shell)
    return ["\n".join(rng.choice(makers)(rng) for _ in range(4)) for _ in range(n_chunks)]
