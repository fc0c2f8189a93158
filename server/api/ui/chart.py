"""The session page's chart, drawn here as SVG (no script, no library to fetch: the page works
offline): each turn's prompt as the client sent it and as the model got it, and the tokens the
engine computed for it, against the window. Only numbers and fixed labels go into it."""

from __future__ import annotations

W, H, LEFT, RIGHT, TOP, BOTTOM = 760, 230, 62, 16, 14, 36


def _ticks(top: int) -> list[int]:
    step = max(1, top // 4)
    magnitude = 10 ** (len(str(step)) - 1)
    step = -(-step // magnitude) * magnitude
    return list(range(0, top + 1, step))


def chart(turns: list[dict]) -> str:
    if not turns:
        return ""
    window = max((t["window"] or 0) for t in turns)
    highest = max([t["prompt"] or 0 for t in turns] + [t["before"] or 0 for t in turns]) or 1
    # the window's line where it is near what the turns reach; else the scale is theirs, and the window said
    shown = window if window and window <= 1.6 * highest else 0
    top = max(shown, int(highest * 1.1)) or 1
    n = len(turns)

    def x(i: int) -> float:
        return LEFT + (W - LEFT - RIGHT) * (i / max(1, n - 1))

    def y(v: float) -> float:
        return TOP + (H - TOP - BOTTOM) * (1 - v / top)

    def line(key: str, cls: str) -> str:
        pts = " ".join(f"{x(i):.1f},{y(t[key] or 0):.1f}" for i, t in enumerate(turns))
        dots = "".join(f'<circle cx="{x(i):.1f}" cy="{y(t[key] or 0):.1f}" r="2.5" class="{cls}"/>'
                       for i, t in enumerate(turns))
        return f'<polyline points="{pts}" class="{cls}" fill="none"/>{dots}'

    grid = "".join(f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y(v):.1f}" y2="{y(v):.1f}" class="grid"/>'
                   f'<text x="{LEFT - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:,}</text>' for v in _ticks(top))
    xs = "".join(f'<text x="{x(i):.1f}" y="{H - BOTTOM + 16}" text-anchor="middle">{t["n"]}</text>'
                 for i, t in enumerate(turns) if n <= 30 or i % max(1, n // 15) == 0)
    limit = (f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{y(window):.1f}" y2="{y(window):.1f}" class="window"/>'
             f'<text x="{W - RIGHT}" y="{y(window) - 4:.1f}" text-anchor="end" class="window">window {window:,}</text>'
             if shown else f'<text x="{W - RIGHT}" y="{TOP + 2}" text-anchor="end" class="window">window {window:,} '
                           f'(above)</text>' if window else "")
    return (f'<svg viewBox="0 0 {W} {H}" role="img" aria-label="prompt and computed tokens per turn" '
            f'class="chart">{grid}{limit}{line("before", "before")}{line("prompt", "prompt")}'
            f'{line("computed", "computed")}{xs}'
            f'<text x="{(W + LEFT) / 2}" y="{H - 4}" text-anchor="middle">turn</text></svg>')
