"""Screenshots of the sessions page for docs/: the recorded Claude Code session
(benchmarks/data/sessions) replayed through a real `agentkv serve` (the 1-layer random test model
with a 65,536-token window, where the session outgrows the room and the default policy clears),
then the page in Chromium (Playwright for Python). Not a test: run it by hand,

    .venv/bin/python tests/ui_screenshots.py [OUT_DIR]     (default docs/images)
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KEY = "sk-screenshots"


def main(out: Path) -> None:
    from playwright.sync_api import sync_playwright

    from agentkv.benchmarks.harness import Endpoint
    from agentkv.benchmarks.session_record import DATA, load
    from agentkv.benchmarks.sessions import replay, wide_model

    path, name = wide_model(1)
    home = Path(tempfile.mkdtemp(prefix="agentkv-shots-"))
    requests = load(DATA / "claude-code-2.1.332.json.xz")["requests"]
    with Endpoint(serve_args=("--model", path, "--served-model-name", name, "--max-model-len", "65536",
                              "--api-key", KEY, "--session-db", str(home / "sessions.db"))) as ep:
        rows = replay(ep.url, KEY, requests, 0, name, 0, 0)
        print(f"replayed {len(rows)} turns: {sum(r['status'] == 200 for r in rows)} answered, "
              f"edits at turns {[r['turn'] for r in rows if r.get('edits')]}")
        out.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox",
                                        "--disable-gpu", "--no-first-run", "--disable-background-networking"])
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{ep.url}/ui/login")
            page.fill("#key", KEY)
            page.click("button[type=submit]")
            page.wait_for_url(f"{ep.url}/ui")
            page.screenshot(path=str(out / "ui-sessions.png"))
            page.click("table a")
            page.wait_for_selector("tr.turn")
            page.set_viewport_size({"width": 1400, "height": 2000})
            page.screenshot(path=str(out / "ui-session.png"))
            page.set_viewport_size({"width": 1400, "height": 1500})
            page.evaluate("document.querySelector('#log').scrollIntoView()")
            page.screenshot(path=str(out / "ui-session-log.png"))
            browser.close()
    print(f"wrote {out}/ui-sessions.png, ui-session.png, ui-session-log.png")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO / "docs" / "images")
