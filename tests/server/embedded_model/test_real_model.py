"""The default model, SmolLM2-135M-Instruct (built from the PyPI package's GGUF file): a fresh
`agentkv serve` with no flags answers for real, through the official OpenAI and Anthropic clients,
and forced tool calls come back parsed. Its build is deterministic and bad GGUF files are CLI errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import anthropic
import pytest

from agentkv.server.embedded_model.catalog import model_dir

from conftest import API_KEY, REAL

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
README = Path(__file__).resolve().parents[3] / "README.md"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}


def test_models_route_names_the_default_model_and_its_window(real_server):
    (model,) = real_server.http().get("/v1/models").json()["data"]
    assert model["id"] == REAL and model["max_model_len"] == 8192


def test_capital_of_france_through_the_openai_client(real_server):
    r = real_server.client().chat.completions.create(model=REAL, messages=QUESTION, max_tokens=24, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_capital_of_france_through_the_anthropic_client(real_server):
    client = anthropic.Anthropic(base_url=real_server.base_url, api_key=API_KEY, max_retries=0)
    msg = client.messages.create(model=REAL, max_tokens=24, messages=QUESTION, extra_body={"temperature": 0})
    assert "Paris" in "".join(b.text for b in msg.content if b.type == "text")


def test_readmes_first_example_prints_what_it_says(real_server):
    """README's first Python example, run as written against the default server (only its base URL
    pointed at this one): it prints the answer its comment shows."""
    readme = README.read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "chat.completions.create" in b)
    shown = re.search(r"print\(.*\)\s+# (.+)", code).group(1).strip()
    code = code.replace("http://127.0.0.1:8000/v1", f"{real_server.base_url}/v1")
    code = code.replace('"unused-without---api-key"', repr(real_server.api_key))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == shown


def test_readmes_question_with_the_model_cards_sampling_names_paris_first(real_server):
    """README's question, no sampling field (the model card's temperature 0.2, top_p 0.9 apply): at
    least 5 of 6 answers name Paris in their first sentence (24 of 24 with transformers, seed 0)."""
    readme = README.read_text()
    question = re.search(r'question = "(.+?)"', readme).group(1)
    answers = [real_server.client().chat.completions.create(
        model=REAL, messages=[{"role": "user", "content": question}], max_tokens=24).choices[0].message.content
        for _ in range(6)]
    assert sum("Paris" in a.split(".")[0] for a in answers) >= 5, answers


def test_the_built_generation_config_holds_the_model_cards_sampling(real_server):
    """vLLM applies it to requests that name no sampling field (its log says so at start)."""
    assert "overridden by the model's `generation_config.json`: `{'temperature': 0.2, 'top_p': 0.9}`" in \
        real_server.log_path.read_text()
    config = json.loads((model_dir(REAL) / "generation_config.json").read_text())
    assert (config["do_sample"], config["temperature"], config["top_p"]) == (True, 0.2, 0.9)


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_call_is_parsed_with_json_arguments(real_server, stream):
    client = real_server.client()
    kw = dict(model=REAL, messages=[{"role": "user", "content": "What is the weather in Oslo?"}], tools=[WEATHER],
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=40, temperature=0)
    if not stream:
        r = client.chat.completions.create(**kw)
        (call,) = r.choices[0].message.tool_calls
        name, args = call.function.name, call.function.arguments
    else:
        name, args = "", ""
        for chunk in client.chat.completions.create(stream=True, **kw):
            for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                name += tc.function.name or ""
                args += tc.function.arguments or ""
    parsed = json.loads(args)
    assert name == "get_weather" and list(parsed) == ["city"] and isinstance(parsed["city"], str)


def _build(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agentkv.server.cli", "model", "build", *args],
                          capture_output=True, text=True, timeout=600)


def test_build_is_deterministic(tmp_path):
    """Built again from the same GGUF file: the same bytes (manifest of SHA-256s)."""
    built = model_dir(REAL)
    out = tmp_path / "again"
    r = _build(REAL, "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    assert (out / "manifest.json").read_text() == (built / "manifest.json").read_text()
    config = json.loads((out / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (30, 3, 64)
    assert "quantization_config" not in config


@pytest.mark.parametrize("content", [None, b"", b"GGUF\x03\x00\x00\x00" + b"\x00" * 64, b"not a gguf file at all"])
def test_missing_or_corrupt_gguf_is_a_cli_error_naming_the_file(tmp_path, content):
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if content is not None:
        gguf.write_bytes(content)
    r = _build(REAL, "--gguf", str(gguf), "--out", str(tmp_path / "out"))
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert str(gguf) in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_unknown_model_name_is_a_cli_error(tmp_path):
    r = _build("smollm3-1b", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "unknown embedded model 'smollm3-1b'" in r.stderr
