"""Our kernels/ folder must never pass for the PyPI package `kernels` that transformers probes for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import sys
from transformers.utils.import_utils import is_kernels_available
import agentkv.kernels
print(is_kernels_available(), agentkv.kernels.__name__, agentkv.kernels.__file__)
"""


def _probe(cwd: Path) -> list[str]:
    # `python -c` puts the working directory first on sys.path, the worst case for shadowing.
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_installed_name_is_namespaced(tmp_path):
    available, name, origin = _probe(tmp_path)
    assert available == "False" and name == "agentkv.kernels"
    assert Path(origin) == REPO / "kernels" / "__init__.py"


def test_not_mistaken_even_with_repo_root_on_sys_path():
    available, _, _ = _probe(REPO)
    assert available == "False"


def test_engine_child_runs_outside_the_repo():
    from agentkv.server.config import agentkv_home

    assert REPO not in (agentkv_home() / "run").resolve().parents
