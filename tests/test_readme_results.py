"""README's result sections are rendered from the results files, every row (`agentkv bench report`)."""

from __future__ import annotations

from agentkv.benchmarks.harness import RESULTS
from agentkv.benchmarks.report import BLOCK, README, rewrite


def test_every_results_file_has_its_readme_block_and_they_match():
    readme = README.read_text()
    blocks = {m.group(2) for m in BLOCK.finditer(readme)}
    files = {p.stem for p in RESULTS.glob("*.json")}
    assert blocks == files, (sorted(files - blocks), sorted(blocks - files))
    assert rewrite(readme) == readme, "README results differ from benchmarks/results: run `agentkv bench report`"
