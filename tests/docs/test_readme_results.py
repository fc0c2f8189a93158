"""The result sections are rendered from the results files, every row (`agentkv bench report`):
every results file has its block in benchmarks/README.md, and the top README's headline table
is current."""

from __future__ import annotations

from agentkv.benchmarks.harness import RESULTS
from agentkv.benchmarks.report import BLOCK, HEADLINES, README, TOP_README, rewrite


def test_every_results_file_has_its_readme_block_and_they_match():
    readme = README.read_text()
    blocks = {m.group(2) for m in BLOCK.finditer(readme)}
    files = {p.stem for p in RESULTS.glob("*.json")}
    assert blocks == files, (sorted(files - blocks), sorted(blocks - files))
    assert rewrite(readme) == readme, "benchmarks/README.md differs from benchmarks/results: run `agentkv bench report`"


def test_the_top_readme_headlines_are_rendered_from_the_results():
    top = TOP_README.read_text()
    assert len(HEADLINES.findall(top)) == 1 and not BLOCK.findall(top)
    assert rewrite(top) == top, "README's headline table differs from benchmarks/results: run `agentkv bench report`"
