"""The top README stays short and points into docs/; what the pages say can be followed: every
relative link in README.md, docs/*.md and benchmarks/README.md resolves to a file (and, with an
anchor, to a heading of it, by GitHub's slug rules); every test file a page names exists; every
`agentkv serve` flag is on docs/serving.md; every module is on docs/layout.md."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from agentkv.server.cli import flag_name
from agentkv.server.config import ServeConfig

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, REPO / "benchmarks" / "README.md", *sorted(DOCS.glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
LINK = re.compile(r"\]\(([^()\s]+)\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def _prose(text: str) -> str:
    """The text outside fenced code blocks (a `#` line in a shell block is no heading)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but `-` and `_`
    removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(_prose(path.read_text())):
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(_prose(path.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", m.group(1))]   # http:, https:, mailto: are not checked


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move detail into docs/"


def test_readme_links_every_docs_page():
    linked = {(README.parent / t.split("#")[0]).resolve() for t in links(README)}
    missing = [p.name for p in DOCS.glob("*.md") if p.resolve() not in linked]
    assert not missing, f"docs pages README.md does not link: {missing}"


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in links(page):
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_slug_rules():
    assert slug("Responses API (`/v1/responses`)") == "responses-api-v1responses"
    assert slug("agentkv's own request fields") == "agentkvs-own-request-fields"
    assert slug("gpu_check") == "gpu_check"
    assert slug("Design: the front proxies a vLLM child process") == "design-the-front-proxies-a-vllm-child-process"


def test_every_named_source_file_exists():
    """Every test file and module a page names (``tests/test_x.py``, ``server/app.py``, ...)."""
    missing = []
    for page in PAGES:
        for name in set(re.findall(r"(?<![\w/.])(?:tests|server|compaction|kernels|benchmarks)/[\w/]+\.py",
                                   page.read_text())):
            if not (REPO / name).exists():
                missing.append(f"{page.relative_to(REPO)}: {name}")
    assert not missing, "\n".join(missing)


def test_every_serve_flag_is_documented():
    page = (DOCS / "serving.md").read_text()
    missing = [flag_name(f) for f in ServeConfig.model_fields if f"`{flag_name(f)}`" not in page
               and f"`{flag_name(f)}` /" not in page]
    assert not missing, f"flags missing from docs/serving.md: {missing}"


def _modules() -> list[str]:
    """The committed modules (git's list; a module someone is still writing is not one yet), or
    every file where there is no git checkout."""
    tops = ("server", "compaction", "kernels", "benchmarks")
    try:
        out = subprocess.run(["git", "ls-files", "--", *tops], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        out = [p.relative_to(REPO).as_posix() for top in tops for p in (REPO / top).rglob("*.py")]
    return [m for m in out if m.endswith(".py") and not m.endswith("__init__.py") and "__pycache__" not in m]


def test_every_module_is_on_the_layout_page():
    page = (DOCS / "layout.md").read_text()
    modules = _modules()
    assert modules
    missing = sorted(m for m in modules if f"`{m}`" not in page)
    assert not missing, f"modules missing from docs/layout.md: {missing}"
