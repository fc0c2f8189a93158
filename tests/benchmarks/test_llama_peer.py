"""The llama.cpp peer (`agentkv.benchmarks.llama_peer`): a real ``llama-server`` on SmolLM2's GGUF file
answers a token-id prompt built with SmolLM2's tokenizer and chat template, ``--cache-reuse`` shifts
the kept K/V after a middle span is cut (0 reuses the common prefix only), and the server is gone
after the context manager exits, on exceptions too. Skipped where no ``llama-server`` was built
(``python -m agentkv.benchmarks.llama_peer build``, or ``$AGENTKV_LLAMA_SERVER``)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from agentkv.benchmarks.llama_peer import (
    ENV_BINARY,
    LlamaServer,
    PeerError,
    binary_in,
    cpu_flags,
    default_dest,
    find_binary,
)
from agentkv.server.embedded_model.catalog import model_dir

from conftest import REAL

CTX = 4096
REUSE = 256


@pytest.fixture(scope="module")
def binary() -> Path:
    found = find_binary(None)
    if found is None:
        pytest.skip(f"no llama-server binary (${ENV_BINARY} unset or absent, and none built for this CPU at "
                    f"{binary_in(default_dest())}): build it with `python -m agentkv.benchmarks.llama_peer build`")
    return found


@pytest.fixture(scope="module")
def gguf() -> Path:
    from agentkv.server.embedded_model.smollm2 import ModelBuildError, packaged_gguf

    try:
        return packaged_gguf()
    except ModelBuildError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    path = model_dir(REAL)
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"{REAL} is not built at {path} (run ./setup.sh or `agentkv model build`)")
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def peer(binary, gguf):
    with LlamaServer(binary, gguf, ctx=CTX, cache_reuse=REUSE) as server:
        yield server


def chat_ids(tokenizer, content: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def tool_outputs(seed: int, n: int) -> list[str]:
    """``n`` directory listings with seeded file names and sizes, each about 230 tokens."""
    rng = random.Random(seed)
    words = ("alpha", "delta", "orbit", "ledger", "quartz", "harbor", "signal", "vector", "meadow", "copper")
    out = []
    for i in range(n):
        lines = [f"Tool output {i}: ls -l /srv/data/{rng.choice(words)}"]
        lines += [f"-rw-r--r-- 1 app app {rng.randint(100, 99999):>6} {rng.choice(words)}_{rng.randint(0, 999)}.log"
                  for _ in range(8)]
        out.append("\n".join(lines))
    return out


def long_prompt(tokenizer, outputs: list[str]) -> list[int]:
    return chat_ids(tokenizer, "\n\n".join(outputs) + "\n\nWhich listing has the largest file?")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# The bare question is a near tie for SmolLM2-135M at the first token, already in float32 ("The" -1.88
# against "L" -1.96 nats); llama.cpp's Q4_1 (activations quantized to Q8_1 in its dot products) tips
# it to "L'Étoile, ...". Asking for one word leaves a 1.6-nat margin, so the answer is the model's,
# not the noise's.
CAPITAL = "What is the capital of France? Answer in one word."


def test_answers_a_token_id_prompt(peer, tokenizer):
    ids = chat_ids(tokenizer, CAPITAL)
    r = peer.complete(ids, max_tokens=24)
    assert "Paris" in r.text
    assert r.stop_type == "eos" and r.token_ids[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.decode(r.token_ids, skip_special_tokens=True) == r.text
    assert r.prompt_tokens_evaluated + r.cached == len(ids)
    assert 0 < r.ttft_s <= r.total_s


def test_top_logprobs_come_per_generated_token(peer, tokenizer):
    r = peer.complete(chat_ids(tokenizer, CAPITAL), max_tokens=4, n_probs=3)
    assert r.stop_type == "limit" and len(r.top_logprobs) == len(r.token_ids) == 4
    for chosen, top in zip(r.token_ids, r.top_logprobs):
        assert len(top) == 3 and max(top, key=top.get) == chosen  # greedy: the chosen token is the most likely
        assert all(lp <= 0 for lp in top.values())


def test_cache_reuse_shifts_the_kept_span_after_a_middle_cut(peer, tokenizer):
    outputs = tool_outputs(seed=17, n=4)
    full = long_prompt(tokenizer, outputs)
    cut = long_prompt(tokenizer, outputs[:1] + outputs[2:])
    prefix = common_prefix(full, cut)
    assert len(full) >= 600 and len(cut) - prefix > REUSE  # the kept tail is long enough to be reused
    first = peer.complete(full, max_tokens=4)
    assert first.prompt_tokens_evaluated + first.cached == len(full)
    second = peer.complete(cut, max_tokens=4)
    assert second.prompt_tokens_evaluated + second.cached == len(cut)
    assert second.cached > prefix + REUSE  # K/V after the cut was shifted into place, not recomputed
    assert second.prompt_tokens_evaluated < len(cut) - prefix - REUSE


def test_without_cache_reuse_only_the_common_prefix_is_kept(binary, gguf, tokenizer):
    outputs = tool_outputs(seed=18, n=4)
    full = long_prompt(tokenizer, outputs)
    cut = long_prompt(tokenizer, outputs[:1] + outputs[2:])
    with LlamaServer(binary, gguf, ctx=CTX, cache_reuse=0) as server:
        server.complete(full, max_tokens=4)
        second = server.complete(cut, max_tokens=4)
    assert second.cached == common_prefix(full, cut)
    assert second.prompt_tokens_evaluated == len(cut) - second.cached


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_server_is_stopped_when_the_block_raises(binary, gguf, error):
    with pytest.raises(error):
        with LlamaServer(binary, gguf, ctx=512) as server:
            proc = server.proc
            assert proc is not None and proc.poll() is None
            raise error("raised inside the with-block")
    assert proc.returncode is not None and server.proc is None
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)


def test_a_server_that_cannot_load_its_model_is_an_error_with_its_log(binary, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file")
    server = LlamaServer(binary, bad, ctx=512)
    with pytest.raises(PeerError, match="llama-server exited with") as info:
        with server:
            pass
    assert str(bad) in str(info.value)  # the log's tail names the file it could not load
    assert server.proc is None


def _executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_find_binary_takes_the_explicit_path_then_the_environment(tmp_path, monkeypatch):
    explicit, from_env = _executable(tmp_path / "explicit"), _executable(tmp_path / "from-env")
    monkeypatch.setenv(ENV_BINARY, str(from_env))
    assert find_binary(explicit) == explicit
    assert find_binary(None) == from_env
    assert find_binary(tmp_path / "absent") is None  # a path given but absent is not replaced by another
    (tmp_path / "plain").write_text("")
    assert find_binary(tmp_path / "plain") is None  # not executable


def test_find_binary_defaults_to_the_build_location(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_BINARY, raising=False)
    monkeypatch.setenv("AGENTKV_HOME", str(tmp_path))
    assert find_binary(None) is None
    built = binary_in(tmp_path / "llama.cpp")
    built.parent.mkdir(parents=True)
    _executable(built)
    assert find_binary(None) is None   # built before its needs were recorded: unknown, not run
    stamp = built.parent / "agentkv-required-cpu-flags.txt"
    stamp.write_text(" ".join(sorted(cpu_flags())) + "\n")
    assert find_binary(None) == built
    stamp.write_text(" ".join(sorted(cpu_flags() | {"an_instruction_set_this_cpu_lacks"})) + "\n")
    assert find_binary(None) is None   # it needs an instruction set this CPU lacks


@pytest.mark.parametrize("kw", [{"ctx": 0}, {"cache_reuse": -1}])
def test_bad_server_settings_are_errors(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        LlamaServer(Path("llama-server"), Path("model.gguf"), **kw)


def test_a_missing_binary_is_an_error(tmp_path):
    with pytest.raises(PeerError, match="cannot run llama-server"):
        with LlamaServer(tmp_path / "llama-server", tmp_path / "model.gguf"):
            pass
