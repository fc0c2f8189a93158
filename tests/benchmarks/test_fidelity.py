"""The fidelity benchmark: its seeded questions and scoring, its CLI errors, and a --quick run on
the real model through a server it starts (every KV mode, each blend strategy at 15%)."""

from __future__ import annotations

import json

import pytest

from agentkv.benchmarks import fidelity_scenario as sc
from agentkv.benchmarks.fidelity import near_of
from agentkv.server.cli import main


def test_questions_are_seeded_and_cover_kept_and_cleared_facts():
    msgs, questions = sc.conversation(3, 6)
    assert (msgs, questions) == sc.conversation(3, 6) and questions != sc.conversation(4, 6)[1]
    assert len(questions) == 6 * 5 and sum(q.kept for q in questions) == 15
    tools = [m for m in msgs if m["role"] == "assistant"]
    assert [t["tool_calls"][0]["function"]["name"] for t in tools] == [sc.CLEARED_TOOL, sc.KEPT_TOOL] * 3
    for q in questions:   # each answer is stated once, in the result of its service's tool
        holder = [m for m in msgs if m["role"] == "tool" and f"The {q.fact} of the {q.service} service is {q.answer}."
                  in m["content"]]
        assert len(holder) == 1 and (": " + q.service) in holder[0]["content"].splitlines()[0]
        assert holder[0]["content"].startswith("== config") == q.kept


def test_answers_are_scored_by_exact_match():
    q = sc.Question("auth", "port", "56364", True, "What is the port of the auth service?")
    assert sc.correct("The port of the auth service is 56364.", q)
    assert sc.correct("56364", q)
    assert not sc.correct("The port of the auth service is 563640.", q)
    assert not sc.correct("The port of the auth service is 5636.", q)
    assert sc.extract("The owner of the media service is Bruno.") == "Bruno"


def test_kept_facts_are_placed_after_a_cut(renderer):
    msgs, questions = sc.conversation(1, 6)
    near = near_of(renderer, msgs, questions)
    kept = [near[q] for q in questions if q.kept]
    assert all(d is None for q, d in near.items() if not q.kept)
    assert all(0 < d < len(renderer.render(msgs).token_ids) for d in kept)
    assert min(kept) < sc.NEAR <= max(kept)     # both kinds occur


@pytest.mark.parametrize("argv, error", [
    (["--fractions", "1.5"], "--fractions"), (["--fractions", "0"], "--fractions"),
    (["--fractions", "x"], "--fractions"),
    (["--strategies", "middle"], "--strategies"), (["--uses", "1"], "--uses"), (["--uses", "40"], "--uses"),
    (["--llama-server", "/nonexistent/llama-server"], "llama-server not found"),
])
def test_bad_arguments_are_cli_errors(capsys, argv, error):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "fidelity", *argv])
    assert exc.value.code == 2 and error in capsys.readouterr().err


def test_quick_run_on_the_real_model(tmp_path):
    main(["bench", "fidelity", "--quick", "--no-peer", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "fidelity-quick.json").read_text())
    assert (tmp_path / "fidelity-quick.png").stat().st_size > 1000
    assert result["model"] == "smollm2-135m-instruct" and result["questions"] == 20 and result["block_size"] == 32
    rows = {r["mode"]: r for r in result["rows"]}
    assert set(rows) == {"recompute", "shift", "tail 15%", "cuts 15%", "deviation 15%"}
    for r in rows.values():
        assert r["fallback"] is None and r["question_prefix_hit"] > 0.5        # the unedited head from the cache
        assert r["kept"]["n"] == r["ghost"]["n"] == 10 and 0 <= r["kept"]["right"] <= 10
    assert rows["recompute"]["reused_tokens"] == 0 and rows["shift"]["reused_tokens"] > 0
    # each answer is its own edited request: it reads the K/V its mode moved (not recompute's)
    assert rows["recompute"]["question_reused_tokens"] == 0 and rows["shift"]["question_reused_tokens"] > 0
    assert (rows["shift"]["recomputed_tokens"] < rows["tail 15%"]["recomputed_tokens"]
            < rows["recompute"]["recomputed_tokens"])
    assert rows["cuts 15%"]["passes"] >= 1 and rows["deviation 15%"]["probe_s"] > 0
    assert rows["recompute"]["top1_agree"] == 1.0 and rows["recompute"]["kl_top"] == 0
    assert result["decision"]["uses"] == 4 and len(result["decision"]["modes"]) == 4
