"""The Chinese edition stays in step with the English pages it translates.

Every page under ``docs/zh/`` is a translation of one English page. Its front matter names the
source page and records the first 12 hex digits of the SHA-256 of that page's bytes:

    ---
    description: "…"
    source: guides/tpu-vm.md
    source_sha256: 1a2b3c4d5e6f
    ---

When someone changes the English page, the recorded hash no longer matches and
``test_chinese_pages_match_their_english_source`` fails, naming the page. Update the Chinese
translation to match, then record the new hash:

    .venv/bin/python tests/test_i18n.py                 # list every twin and whether it is current
    .venv/bin/python tests/test_i18n.py --update docs/zh/guides/tpu-vm.md

``--update`` only rewrites the ``source_sha256`` line. Run it *after* the translation is updated,
never instead of updating it. ``--update`` with no path updates every stale twin.

A twin is a translation, not a summary, and these tests hold it to that (``check_twin``, which
``--check`` runs on a draft before it is moved in):

* every heading anchor of the English page exists in the twin (a Chinese heading keeps the English
  anchor with ``{#english-anchor}``), so a link to ``page.md#section`` lands on both editions;
* the twin has the same ``{{ figure:… }}`` and table placeholders, so its numbers are printed from
  the same results files (``docs/hooks.py``);
* every number the English prose quotes (a decimal, or three digits and more, also after a hyphen:
  both of "128-to-512") appears in the twin, and the twin quotes no such number the English page
  lacks; a heading's ``{#anchor}`` is not a quoted number;
* the twin follows the one glossary of terms, ``docs/zh/terms.yml`` (rendered as ``zh/terms.md``, 译名表).
  Where the English uses a term's word in another sense ("a cell of the table" is not a notebook
  cell), the term lists that phrase under ``other_senses``; English prose inside such a phrase
  does not require the glossary's form, so the twin can say it in plain Chinese.

    .venv/bin/python tests/test_i18n.py --check draft.md --as docs/zh/kb/deepcache.md

The module also checks that every page of the site has a ``description`` (it becomes the page's
meta description and search preview), that the language switch is configured, and that no
committed page points outside this repository.
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
ZH = DOCS / "zh"
# Every knowledge-base page and guide has a twin, with the home page and the learning path. The
# notebooks, the results page and the API reference are linked in English from the Chinese nav.
REQUIRED_TWINS = ["index.md", "learning-path.md",
                  *sorted(str(p.relative_to(DOCS)) for d in ("kb", "guides") for p in (DOCS / d).glob("*.md"))]
TERMS = ZH / "terms.yml"
NOT_TWINS = ["terms.md"]  # the glossary page itself: written in Chinese, translating no English page
_FRONT = re.compile(r"\A---\n(.*?)\n---\n", re.S)
_FENCE = re.compile(r"(?ms)^ *(```|~~~).*?^ *\1")
# A number: not the tail of a word, an identifier or another number; a hyphen before it is fine
# ("128-to-512" quotes 128 and 512, "5.10-5.11" both ends).
_NUMBER = re.compile(r"(?<![A-Za-z0-9_.])(\d+(?:[.,]\d+)+|\d{3,})")
_ATTR_LIST = re.compile(r"\{:?\s*#[^}\n]*\}")  # a heading's {#anchor}: an id, not a quoted number
_PLACEHOLDER = re.compile(r"\{\{ *([\w:.-]+) *(?:\|[^}]*)?\}\}")  # a diagram's caption after `|` is the page's own


def front_matter(path: Path) -> dict:
    match = _FRONT.match(path.read_text(encoding="utf-8"))
    return (yaml.safe_load(match.group(1)) or {}) if match else {}


def source_hash(source: Path) -> str:
    return hashlib.sha256(source.read_bytes()).hexdigest()[:12]


def twins() -> list[Path]:
    return sorted(p for p in ZH.rglob("*.md") if str(p.relative_to(ZH)) not in NOT_TWINS)


def terms() -> list[dict]:
    return yaml.safe_load(TERMS.read_text(encoding="utf-8"))


def body(text: str) -> str:
    return _FRONT.sub("", text, count=1)


def prose(text: str) -> str:
    """The page without its front matter, fenced code blocks, inline code and link targets."""
    text = _FENCE.sub("", body(text))
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.sub(r"\]\([^)\s]*\)", "]", text)


def anchors(text: str) -> list[str]:
    """The ids of the page's headings below the title, as mkdocs renders them (toc + attr_list)."""
    import markdown

    md = markdown.Markdown(extensions=["toc", "attr_list", "md_in_html", "admonition", "tables", "def_list",
                                       "pymdownx.superfences", "pymdownx.details", "pymdownx.tabbed"])
    html = md.convert(body(text))
    return re.findall(r'<h[2-6][^>]* id="([^"]+)"', html)


def numbers(text: str) -> set[str]:
    return set(_NUMBER.findall(_ATTR_LIST.sub("", text)))


def check_twin(text: str, source: Path) -> list[str]:
    """What keeps `text` (a Chinese page) from being a faithful twin of the English page `source`."""
    english = source.read_text(encoding="utf-8")
    problems = []
    missing = [a for a in anchors(english) if a not in set(anchors(text))]
    if missing:
        problems.append(f"headings without the English anchor (write '## 标题 {{#anchor}}'): {missing}")
    if sorted(_PLACEHOLDER.findall(english)) != sorted(_PLACEHOLDER.findall(text)):
        problems.append(f"placeholders differ: English {sorted(_PLACEHOLDER.findall(english))}, "
                        f"twin {sorted(_PLACEHOLDER.findall(text))}")
    dropped = sorted(numbers(prose(english)) - numbers(body(text)))
    if dropped:
        problems.append(f"numbers the English prose quotes and the twin lacks: {dropped}")
    added = sorted(numbers(body(text)) - numbers(body(english)))
    if added:
        problems.append(f"numbers the twin quotes and the English page lacks: {added}")
    english_prose, twin_prose = prose(english).lower(), prose(text).lower()
    english_prose = re.sub(r"\s+", " ", english_prose)  # an `other_senses` phrase may wrap across lines
    for term in terms():
        for avoid in term.get("avoid", []):
            if avoid in text:
                problems.append(f"uses {avoid!r}; the glossary's term for {term['en']!r} is {term['zh']!r}")
        in_sense = english_prose
        for phrase in term.get("other_senses", []):  # the word in another sense: no glossary form owed
            in_sense = in_sense.replace(phrase.lower(), " ")
        used = re.search(rf"(?<![\w-]){re.escape(term['en'].lower())}(?![\w-])", in_sense)
        if used and term["zh"].lower() not in twin_prose:
            problems.append(f"the English page says {term['en']!r}; the twin never uses the glossary's {term['zh']!r}")
    han = len(re.findall(r"[\u4e00-\u9fff]", body(text)))
    if han <= 200:
        problems.append(f"only {han} Chinese characters")
    return problems


def stale(page: Path) -> tuple[str, str] | None:
    """`(recorded, current)` when the page's English source changed since translation, else None."""
    meta = front_matter(page)
    recorded, current = str(meta.get("source_sha256", "")), source_hash(DOCS / meta["source"])
    return None if recorded == current else (recorded, current)


def update(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    current = source_hash(DOCS / front_matter(page)["source"])
    new, count = re.subn(r"(?m)^source_sha256: .*$", f"source_sha256: {current}", text, count=1)
    if count != 1:
        raise SystemExit(f"{page}: no 'source_sha256:' line in its front matter")
    page.write_text(new, encoding="utf-8")


def test_every_required_page_has_a_chinese_twin():
    missing = [p for p in REQUIRED_TWINS if not (ZH / p).exists()]
    assert not missing, f"docs/zh/ lacks translations of: {missing}"


@pytest.mark.parametrize("page", twins(), ids=lambda p: str(p.relative_to(ZH)))
def test_chinese_pages_match_their_english_source(page):
    meta = front_matter(page)
    assert "source" in meta and "source_sha256" in meta, f"{page}: front matter needs source and source_sha256"
    source = DOCS / meta["source"]
    assert source.exists(), f"{page}: source {meta['source']} does not exist"
    assert meta["source"] == str(page.relative_to(ZH)), f"{page}: a twin sits at its source's path under docs/zh/"
    mismatch = stale(page)
    assert mismatch is None, (
        f"docs/{meta['source']} changed since {page.relative_to(ROOT)} was translated "
        f"(recorded {mismatch[0]}, now {mismatch[1]}). Update the Chinese page, then run: "
        f".venv/bin/python tests/test_i18n.py --update {page.relative_to(ROOT)}"
    )


@pytest.mark.parametrize("page", twins(), ids=lambda p: str(p.relative_to(ZH)))
def test_chinese_pages_are_faithful_twins(page):
    """Anchors, placeholders, numbers and terms: `check_twin`."""
    problems = check_twin(page.read_text(encoding="utf-8"), DOCS / front_matter(page)["source"])
    assert not problems, f"{page.relative_to(ROOT)}:\n  " + "\n  ".join(problems)


def test_the_twin_check_finds_what_it_is_for(tmp_path):
    """A page that drops a number, a heading's anchor and a placeholder, and uses a word the
    glossary avoids, fails on each; the same page with them fixed passes."""
    source = tmp_path / "page.md"
    source.write_text("---\ndescription: x\n---\n# Title\n\n## The step time\n\nThe floor is 0.33 s per step "
                      "on the mesh, {{ figure:run.07 }}.\n", encoding="utf-8")
    filler = "这是一段用来凑够字数的中文说明文字。" * 15
    bad = f"# 标题\n\n## 单步时间\n\n{filler}在设备网格上，下限是每步 0.34 秒。\n"
    good = f"# 标题\n\n## 单步时间 {{#the-step-time}}\n\n{filler}在 mesh 上，下限是每步 0.33 秒，{{{{ figure:run.07 }}}}。\n"
    problems = "\n".join(check_twin(bad, source))
    for expected in ("the-step-time", "placeholders differ", "'0.33'", "'0.34'", "'设备网格'"):
        assert expected in problems, f"{expected} not reported in:\n{problems}"
    assert check_twin(good, source) == []


def test_a_number_after_a_hyphen_counts_and_an_anchor_does_not(tmp_path):
    """"128-to-512" quotes two numbers; a heading's `{#…-107}` quotes none."""
    source = tmp_path / "page.md"
    source.write_text("---\ndescription: x\n---\n# Title\n\n## Gains of 10.7%\n\nThe decoder widens "
                      "128-to-512 channels, at 5.10-5.11 s.\n", encoding="utf-8")
    filler = "这是一段用来凑够字数的中文说明文字。" * 15
    def twin(n: int) -> str:
        return f"# 标题\n\n## 提升 10.7% {{#gains-of-107}}\n\n{filler}解码器的通道数从 128 增加到 {n}，耗时 5.10-5.11 秒。\n"

    problems = "\n".join(check_twin(twin(256), source))
    assert "'512'" in problems and "'256'" in problems and "'107'" not in problems, problems
    assert check_twin(twin(512), source) == []


def test_a_term_in_another_sense_needs_no_glossary_form(tmp_path):
    """`other_senses` in terms.yml: "check a cell" of a table owes no notebook "cell"; the
    notebook sense still does."""
    source = tmp_path / "page.md"
    filler = "这是一段用来凑够字数的中文说明文字。" * 15
    source.write_text("---\ndescription: x\n---\n# Title\n\nTo check a cell: 2 x 3 = 6.\n", encoding="utf-8")
    assert check_twin(f"# 标题\n\n{filler}核对表中任一格：2 x 3 = 6。\n", source) == []
    source.write_text("---\ndescription: x\n---\n# Title\n\nTo check a cell, run the next cell.\n", encoding="utf-8")
    problems = "\n".join(check_twin(f"# 标题\n\n{filler}核对表中任一格，运行下一格。\n", source))
    assert "'cell'" in problems, problems


def test_every_page_has_a_description():
    pages = [p for p in DOCS.rglob("*.md") if "notebooks" not in p.relative_to(DOCS).parts]
    missing = [str(p.relative_to(DOCS)) for p in pages if not str(front_matter(p).get("description", "")).strip()]
    assert not missing, f"pages without a 'description:' in their front matter: {missing}"


def test_language_switch_and_chinese_nav():
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    # mkdocs.yml uses !!python tags in places; read only what this test needs.
    alternate = re.search(r"(?ms)^extra:\n  alternate:\n(.*?)(?=^\S)", config)
    assert alternate, "mkdocs.yml needs extra.alternate (the language switch)"
    langs = re.findall(r"lang: (\w+)", alternate.group(1))
    assert langs[:1] == ["en"] and "zh" in langs
    for twin in REQUIRED_TWINS:
        assert f"zh/{twin}" in config, f"mkdocs.yml nav lacks zh/{twin}"


def test_chinese_nav_mirrors_the_english_one():
    """The 中文 section lists the knowledge base and the guides in the English order, each as its
    twin, and links every notebook and the results and reference pages in English."""
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = config[config.index("\nnav:\n"):config.index("\nplugins:")]
    english, chinese = nav[:nav.index("\n  - 中文:")], nav[nav.index("\n  - 中文:"):]
    pages = lambda text, pattern: re.findall(rf"^ +- .+: ({pattern})$", text, re.M)  # noqa: E731
    for pattern in (r"kb/[\w-]+\.md", r"guides/[\w-]+\.md"):
        assert pages(chinese, "zh/" + pattern) == ["zh/" + p for p in pages(english, pattern)]
    for pattern in (r"notebooks/\w+\.ipynb", r"results/index\.md", r"reference/[\w-]+\.md"):
        assert pages(chinese, pattern) == pages(english, pattern), f"the Chinese nav does not link every {pattern}"
    assert "zh/terms.md" in chinese


def test_no_page_points_outside_the_repository():
    forbidden = re.compile(r"\.\./shared|shared/reference|upstream-digest|stack-probe|seeds/")
    offenders = [
        str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md")
        if "notebooks" not in p.relative_to(DOCS).parts and forbidden.search(p.read_text(encoding="utf-8"))
    ]
    assert not offenders, f"pages that point outside the repository: {offenders}"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--check"] and len(argv) == 4 and argv[2] == "--as":
        draft, target = Path(argv[1]), Path(argv[3]).resolve()
        source = DOCS / target.relative_to(ZH)
        problems = check_twin(draft.read_text(encoding="utf-8"), source)
        meta = front_matter(draft)
        if meta.get("source") != str(source.relative_to(DOCS)) or str(meta.get("source_sha256")) != source_hash(source):
            problems.append(f"front matter needs source: {source.relative_to(DOCS)} and source_sha256: {source_hash(source)}")
        print("\n".join(problems) or "ok")
        return int(bool(problems))
    if argv[:1] == ["--update"]:
        targets = [Path(a).resolve() for a in argv[1:]] or [p for p in twins() if stale(p)]
        for page in targets:
            update(page)
            print(f"updated {page.relative_to(ROOT)}")
        return 0
    status = 0
    for page in twins():
        mismatch = stale(page)
        state = "current" if mismatch is None else f"STALE (recorded {mismatch[0]}, now {mismatch[1]})"
        print(f"{page.relative_to(ROOT)} <- docs/{front_matter(page)['source']}: {state}")
        status |= mismatch is not None
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
