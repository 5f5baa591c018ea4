"""mkdocs hook: keep notebook code out of the search index, so a search lands on the prose.

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
