"""The built site works in a real browser: pages render, notebook outputs show, search returns results.

Serves the session's one `mkdocs build --strict` of the site (`docs_build` in tests/conftest.py,
which tests/test_docs.py checks) on 127.0.0.1 with Python's http.server, and drives the system
Chromium (Debian's `chromium` package) through Playwright's Python API. Playwright's pip wheel
ships its own driver, and `executable_path` points at the system browser, so nothing is
downloaded. Screenshots go to the test session's temporary folder, so a run leaves the tree as it
found it; `TPUPEDIA_SCREENSHOTS=docs/images/screenshots make test` refreshes the committed ones the
contributing guide shows.

Skipped, with the reason, where Chromium or Playwright is missing. `make test` installs Chromium
with apt where it can, and a CJK font (Debian's `fonts-noto-cjk`): without one the Chinese pages
draw every character as the same missing-glyph box, and the Chinese-page test fails and says so.
"""

from __future__ import annotations

import functools
import http.server
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHOTS_ENV = "TPUPEDIA_SCREENSHOTS"
"""The folder screenshots are written to (relative to the repository); unset: the test session's
temporary folder."""
VIEWPORT = {"width": 1280, "height": 800}
TIMEOUT_MS = 30_000

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install -r requirements/ci.txt)"
)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no system Chromium on PATH (Debian/Ubuntu: apt-get install -y chromium)",
)

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

SEARCH_TIMEOUT_MS = 120_000
"""How long a search waits for its first result: the index is built by a web worker in the page,
which takes seconds on a quiet machine and has taken over 30 s (the default) while `make test`'s
two workers load both cores. A wait, not a speed target."""


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest output clean
        pass


@pytest.fixture(scope="module")
def site(docs_build):
    """Serve the session's strict build of the site (`docs_build` in tests/conftest.py, the one
    tests/test_docs.py checks); yields (base URL, site directory)."""
    assert docs_build.returncode == 0, docs_build.stderr[-3000:]
    site_dir = docs_build.site
    handler = functools.partial(_QuietHandler, directory=str(site_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)  # port 0: a free port
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", site_dir
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def page():
    with tempfile.TemporaryDirectory(prefix="tpupedia-chromium-") as profile:
        with sync_api.sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                profile,  # a fresh user-data-dir for every run
                executable_path=CHROMIUM,
                headless=True,
                args=CHROMIUM_ARGS,
                viewport=VIEWPORT,
                locale="en-US",
            )
            try:
                pg = context.new_page()
                pg.set_default_timeout(TIMEOUT_MS)
                yield pg
            finally:
                context.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    """Where this module's screenshots go (`SHOTS_ENV`)."""
    import os

    named = os.environ.get(SHOTS_ENV)
    folder = ROOT / named if named else tmp_path_factory.mktemp("screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _shot(pg, folder: Path, name: str) -> Path:
    path = folder / f"{name}.png"
    pg.screenshot(path=str(path))
    try:  # keep committed screenshots small: a 256-colour palette is plenty for a docs page
        from PIL import Image

        with Image.open(path) as im:
            small = im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
        small.save(path, optimize=True)
    except ImportError:
        pass
    assert path.stat().st_size > 5_000, f"{path.name} looks empty"
    return path


# Draws characters on a canvas in the given CSS font and compares the pixels with the missing-glyph
# (.notdef, "tofu") box of U+E000, a private-use code point no text font maps. Canvas text goes
# through the same font fallback as the page, so with no CJK font every Chinese character draws as
# that same box; with one, each draws its own glyph.
_GLYPH_PROBE_JS = """
([chars, font]) => {
  const W = 64, H = 64;
  const canvas = document.createElement("canvas");
  canvas.width = W; canvas.height = H;
  const ctx = canvas.getContext("2d", {willReadFrequently: true});
  const raster = (ch) => {
    ctx.clearRect(0, 0, W, H);
    ctx.font = font; ctx.textBaseline = "top"; ctx.fillStyle = "#000";
    ctx.fillText(ch, 8, 8);
    const data = ctx.getImageData(0, 0, W, H).data;
    let key = "", ink = 0;
    for (let i = 3; i < data.length; i += 4) { key += String.fromCharCode(data[i]); if (data[i]) ink++; }
    return {key, ink};
  };
  const tofu = raster("\\uE000");
  const drawn = chars.map((ch) => ({ch, ...raster(ch)}));
  return {
    tofu_ink: tofu.ink,
    as_tofu: drawn.filter((d) => d.key === tofu.key).map((d) => d.ch),
    blank: drawn.filter((d) => d.ink === 0).map((d) => d.ch),
    distinct: new Set(drawn.map((d) => d.key)).size,
  };
}
"""


def _assert_cjk_glyphs(pg, url: str, selector: str = "article") -> None:
    """Fail where the Chinese text of `selector` on this page falls back to missing-glyph boxes."""
    text = pg.locator(selector).first.text_content() or ""  # the DOM text, even where none draws
    chars = list(dict.fromkeys(ch for ch in text if "\u4e00" <= ch <= "\u9fff"))[:12]
    assert chars, f"{url}: no Chinese characters in <{selector}>"
    font = pg.eval_on_selector(
        selector,
        "el => { const s = getComputedStyle(el);"
        " return `${s.fontStyle} ${s.fontWeight} 40px ${s.fontFamily}`; }",
    )
    probe = pg.evaluate(_GLYPH_PROBE_JS, [chars, font])
    bad = sorted(set(probe["as_tofu"]) | set(probe["blank"]), key=chars.index)
    if len(chars) > 1 and probe["distinct"] == 1:  # all drawn alike: some other box or blank
        bad = chars
    if bad:
        fc = shutil.which("fc-list")
        cjk_fonts = (
            subprocess.run([fc, ":lang=zh", "family"], capture_output=True, text=True).stdout.split("\n")
            if fc else []
        )
        pytest.fail(
            f"zh page {url}: the Chinese text renders as missing-glyph boxes (tofu): {''.join(bad)!r} "
            f"draw the same box as U+E000 ({len(probe['as_tofu'])} of {len(chars)}), nothing "
            f"({len(probe['blank'])}) or one shape for all ({probe['distinct']} distinct) in font "
            f"{font!r}; fc-list :lang=zh lists "
            f"{len([f for f in cjk_fonts if f.strip()])} CJK font(s). Install a CJK font for Chromium: "
            "apt-get install -y fonts-noto-cjk (`make test` does it where it can).",
            pytrace=False,
        )


def test_home_page(site, page, shots):
    base, _ = site
    page.goto(f"{base}/", wait_until="load")
    assert "gpu-tpu-pedia" in page.title()
    page.locator("article h1").first.wait_for(state="visible")
    page.locator("nav.md-nav").first.wait_for(state="visible")
    _shot(page, shots, "home")


def test_notebook_page_shows_stored_outputs(site, page, shots):
    base, _ = site
    page.goto(f"{base}/notebooks/00_start_here/", wait_until="load")
    # A stored output cell (computed when the notebook was executed, never re-run by the site).
    output = page.locator(".jp-OutputArea-output", has_text="v6e ridge point:").first
    output.wait_for(state="visible")
    output.scroll_into_view_if_needed()
    page.evaluate("window.scrollBy(0, -200)")
    _shot(page, shots, "notebook-00")


# Where each active link of the left navigation sits: the title of its top-level section (None for
# a top-level page), and whether it shows. A notebook page is listed in the English tree and again
# in the 中文 section; mkdocs gives both places one page, and the theme opened the last.
_ACTIVE_NAV_JS = """
() => [...document.querySelectorAll(".md-sidebar--primary a.md-nav__link--active")].map((a) => {
  let top = null;
  for (let el = a.parentElement; el; el = el.parentElement) {
    if (el.matches("li.md-nav__item--section")) top = el;
  }
  const label = top && top.querySelector(":scope > label.md-nav__link, :scope > .md-nav__link");
  return {tree: label ? label.textContent.trim() : null, shown: a.getClientRects().length > 0};
})
"""


@pytest.mark.parametrize("path, tree", [("notebooks/02_sharding/", "Notebooks"), ("results/", None),
                                        ("zh/kb/deepcache/", "中文")])
def test_the_left_navigation_opens_the_tree_of_the_page_s_language(site, page, path, tree):
    """An English notebook page (and the English results page) marks itself active in the English
    tree, not in the 中文 section that links it too (`docs/hooks.py`, `own_language_nav`); a Chinese
    page keeps the Chinese tree. Issue 42."""
    base, _ = site
    page.goto(f"{base}/{path}", wait_until="load")
    page.locator(".md-sidebar--primary nav.md-nav").first.wait_for(state="attached")
    active = page.evaluate(_ACTIVE_NAV_JS)
    assert active and all(a["tree"] == tree for a in active), f"{path}: active nav links sit in {active}, not {tree!r}"
    assert any(a["shown"] for a in active), f"{path}: the active nav link is in a collapsed section: {active}"
    opened = page.evaluate(
        "() => [...document.querySelectorAll('.md-sidebar--primary input.md-nav__toggle[id^=\"__nav\"]:checked')]"
        ".map((box) => document.getElementById(box.id + '_label')?.textContent.trim())")
    assert ("中文" in opened) == (tree == "中文"), f"{path}: the sections open are {opened}"


def test_chinese_home_page(site, page, shots):
    base, site_dir = site
    candidates = [p for p in ("zh/index.html", "zh/index/index.html") if (site_dir / p).exists()]
    if not candidates:
        pytest.skip("no Chinese edition in this build (docs/zh/ or an i18n plugin's zh/ output is absent)")
    url = f"{base}/{candidates[0].removesuffix('index.html')}"
    page.goto(url, wait_until="load")
    page.locator("article h1").first.wait_for(state="visible")
    lang = page.evaluate("document.documentElement.lang")
    text = page.locator("article").first.text_content() or ""
    assert lang.startswith("zh") or any("\u4e00" <= ch <= "\u9fff" for ch in text), (
        "the zh page has neither lang=zh nor Chinese text"
    )
    # Chinese that renders: with no CJK font Chromium draws every character as the same box.
    _assert_cjk_glyphs(page, url.removeprefix(base) or "/")
    _shot(page, shots, "home-zh")


def test_search_returns_results(site, page, shots):
    base, _ = site
    page.goto(f"{base}/", wait_until="load")
    # Material's search runs in a web worker; typing before the index is ready is fine, it
    # re-runs the query once the worker answers.
    box = page.locator("input.md-search__input")
    if not box.is_visible():  # narrow viewports hide the box behind a button
        page.locator("label.md-header__button[for='__search']").first.click()
    box.wait_for(state="visible")
    box.click()
    box.type("splash attention", delay=40)
    result = page.locator(".md-search-result__item").first
    result.wait_for(state="visible", timeout=SEARCH_TIMEOUT_MS)
    meta = page.locator(".md-search-result__meta").inner_text()
    assert "matching" in meta.lower() or "result" in meta.lower(), meta
    titles = page.locator(".md-search-result__article h1, .md-search-result__article h2").all_inner_texts()
    assert titles, "search rendered no result titles"
    # docs/search_hooks.py keeps notebook code out of the index: previews show prose, not source.
    previews = " ".join(page.locator(".md-search-result__article").all_inner_texts())
    assert "Copied!" not in previews and "import numpy" not in previews, previews[:500]
    _shot(page, shots, "search")


def test_chinese_search_returns_a_chinese_page(site, page, shots):
    """A Chinese word finds the Chinese pages: the search plugin segments Chinese text with jieba
    at build time (mkdocs.yml's separator splits on the U+200B it inserts), so "分片" (sharding)
    is a word in the index, not a run of characters glued to its neighbours."""
    base, _ = site
    page.goto(f"{base}/zh/", wait_until="load")
    box = page.locator("input.md-search__input")
    if not box.is_visible():
        page.locator("label.md-header__button[for='__search']").first.click()
    box.wait_for(state="visible")
    box.click()
    box.fill("分片")  # one input event: typed character by character, the results of "分" alone could show first
    page.locator(".md-search-result__item").first.wait_for(state="visible", timeout=SEARCH_TIMEOUT_MS)
    links = page.locator(".md-search-result__link")
    hrefs = [links.nth(i).get_attribute("href") or "" for i in range(links.count())]
    assert hrefs and "/zh/" in hrefs[0], f"the first result for 分片 is not a Chinese page: {hrefs[:5]}"
    first = page.locator(".md-search-result__article").first.inner_text()
    assert any("\u4e00" <= ch <= "\u9fff" for ch in first), first[:300]  # a Chinese title
    marked = {m.replace("\u200b", "").strip() for m in page.locator(".md-search-result mark").all_inner_texts()} - {""}
    assert marked and all(m.startswith("分片") for m in marked), marked  # the word, not 分析 or 分组
    _shot(page, shots, "search-zh")
