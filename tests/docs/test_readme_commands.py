"""README's setup and test commands are the ones CI runs."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_commands():
    readme = (REPO / "README.md").read_text()
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    for command in ("./setup.sh", ".venv/bin/pytest"):
        assert f"\n{command}" in readme, command
        assert any(line.startswith(command) for line in ci), command
    assert "\n.venv/bin/agentkv serve" in readme
