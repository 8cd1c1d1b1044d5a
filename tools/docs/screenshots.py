"""Screenshots of the built docs site, opened from disk as a newcomer opens it (``make docs-shots``).

Pages are loaded over file:// (no server) at 1280 px wide in Debian's Chromium driven by Playwright,
and each is checked for what the eye checks: a code element that wraps onto two lines inside a table
(a name cut mid-word), a code block or table wider than its column (it scrolls sideways), and the
search box answering a query with no server. The findings are printed and written beside the PNGs;
the exit status is 1 when any page has one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from playwright.sync_api import sync_playwright

REPO = Path(__file__).resolve().parents[2]
PAGES = ["index", "reference", "simulation"]
QUERY = "tolerance"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# What the page does wrong, found in the page itself: each entry a line of the report.
_FINDINGS = """() => {
  const found = [];
  for (const code of document.querySelectorAll('.md-content table code')) {
    const name = code.textContent.trim();  // a name has no space: two lines means it was cut mid-word
    if (!/\\s/.test(name) && code.getClientRects().length > 1) found.push('name cut across lines: ' + name);
  }
  for (const el of document.querySelectorAll('.md-content pre > code, .md-content .md-typeset__table')) {
    if (el.scrollWidth > el.clientWidth + 1) {
      const text = el.textContent.trim().split('\\n')[0].slice(0, 60);
      found.push(`scrolls sideways (${el.scrollWidth} px in ${el.clientWidth}): ${text}`);
    }
  }
  const active = document.querySelector('.md-nav__link--active');
  const title = document.querySelector('.md-nav--primary > .md-nav__title');
  if (active && title) {
    const a = active.getBoundingClientRect(), t = title.getBoundingClientRect();
    if (a.top < t.bottom && a.bottom > t.top) found.push('the current page hides under the sidebar title');
  }
  return found;
}"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, default=REPO / "site")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "site")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--allow-wide-output", action="append", default=[],
                        help="a code block's first words that may scroll (program output, not a command)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report: list[str] = [f"# {args.width} px, file://, Chromium headless (tools/docs/screenshots.py)"]
    bad = 0
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=args.chromium, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": args.width, "height": 900})
        for name in PAGES:
            page.goto((args.site / f"{name}.html").as_uri())
            page.wait_for_load_state("load")
            page.screenshot(path=args.out / f"{name}-{args.width}.png", full_page=name == "reference")
            found = page.evaluate(_FINDINGS)
            page.mouse.wheel(0, 1200)  # the sidebar's title is sticky: scrolled, it must not cover the page
            page.wait_for_timeout(300)
            found += [f"scrolled: {f}" for f in page.evaluate(_FINDINGS) if "sidebar" in f]
            found = [f for f in found if not any(allowed in f for allowed in args.allow_wide_output)]
            bad += len(found)
            report.append(f"{name}: " + ("fits" if not found else f"{len(found)} finding(s)"))
            report.extend(f"  {f}" for f in found)
        page.goto((args.site / "index.html").as_uri())
        page.keyboard.press("/")  # Material's shortcut to the search box
        page.keyboard.type(QUERY)
        page.wait_for_selector(".md-search-result__item", timeout=10_000)
        hits = page.locator(".md-search-result__item").count()
        meta = page.locator(".md-search-result__meta").inner_text()
        page.screenshot(path=args.out / f"search-{args.width}.png")
        report.append(f"search from file:// for {QUERY!r}: {meta} ({hits} shown)")
        browser.close()
    (args.out / f"findings-{args.width}.txt").write_text("\n".join(report) + "\n")
    print("\n".join(report))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
