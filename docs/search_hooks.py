"""mkdocs hook: keep notebook code out of the search index, so a search lands on the prose; and
find Chinese queries whole (`on_post_build`, below).

mkdocs-jupyter renders each code cell as a prompt (`In [3]:`), a copy button (with a hidden
"Copied!" notice), the highlighted source in a `<pre>` and a hidden plain-text copy of it. Without help, those fill the search
previews of notebook pages. Material's search plugin skips any element that carries
`data-search-exclude` (and strips the attribute from the published page), so this hook marks
those pieces on notebook pages. Markdown cells and stored outputs stay in the index; the
page readers see is unchanged.

Only leaf-like elements are marked: Material's parser tracks skipped elements by tag name, so
marking an outer `<div>` would stop skipping at the first nested `</div>`.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.exceptions import PluginError

_MARK = ' data-search-exclude="code"'
_PATTERNS = [
    # the highlighted source of a code cell
    (re.compile(r'(<div class="highlight-ipynb[^"]*">\s*<pre)(>)'), r"\1" + _MARK + r"\2"),
    # the copy button, its hidden "Copied!" notice, and the plain-text copy of the source it copies
    (re.compile(r"<clipboard-copy(?=[\s>])"), "<clipboard-copy" + _MARK),
    (re.compile(r'<div class="clipboard-copy-txt"'), '<div class="clipboard-copy-txt"' + _MARK),
    # the In [n]: / Out[n]: prompts
    (re.compile(r'<div class="(jp-(?:Input|Output)Prompt [^"]*)"'), r'<div class="\1"' + _MARK),
]


def on_page_content(html: str, page, **_) -> str:
    if not page.file.src_uri.endswith(".ipynb"):
        return html
    for pattern, replacement in _PATTERNS:
        html = pattern.sub(replacement, html)
    return html


# Chinese queries. The search plugin segments Chinese text with jieba at build time; in the browser,
# the search worker splits a Chinese query into the words the index knows (its function for that
# walks the query's substrings). In Material 9.8.1 that walk stops one character short of the end
# of the query, so the last word is never found whole: 显存占用 searches for 显存 alone, and 分片
# for 分, which matches 分析 and 分组 too. Tried here, in Node, on the worker's own function.
# After the build, the two bounds are moved one character on in the site's copy of the worker;
# tests/test_browser.py searches 分片 and checks that every highlighted word is 分片. A Material
# release that changes the function stops the build here, so the patch is never applied blind.
_SEGMENT_BUG = ("for(let o=s+1;o<t.length;o++)t.slice(s,o)in e&&(n[s]=o-s)",
                "n[a]&&a<t.length-1&&(i[s++]=a)")
_SEGMENT_FIX = ("for(let o=s+1;o<=t.length;o++)t.slice(s,o)in e&&(n[s]=o-s)",
                "n[a]&&a<t.length&&(i[s++]=a)")


def on_post_build(config, **_) -> None:
    workers = sorted(Path(config["site_dir"], "assets", "javascripts", "workers").glob("search.*.min.js"))
    if len(workers) != 1:
        raise PluginError(f"docs/search_hooks.py: expected one search worker in the site, found {len(workers)}")
    source = workers[0].read_text(encoding="utf-8")
    if all(fixed in source for fixed in _SEGMENT_FIX):
        return
    if not all(bug in source for bug in _SEGMENT_BUG):
        raise PluginError(f"docs/search_hooks.py: {workers[0].name} no longer holds the query segmentation this hook "
                          "patches (Material changed it); check whether Chinese queries still lose their last word")
    for bug, fixed in zip(_SEGMENT_BUG, _SEGMENT_FIX):
        source = source.replace(bug, fixed)
    workers[0].write_text(source, encoding="utf-8")
