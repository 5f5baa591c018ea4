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
REQUIRED_TWINS = ["index.md", "learning-path.md", "guides/tpu-vm.md", "kb/corrections.md"]
_FRONT = re.compile(r"\A---\n(.*?)\n---\n", re.S)


def front_matter(path: Path) -> dict:
    match = _FRONT.match(path.read_text(encoding="utf-8"))
    return (yaml.safe_load(match.group(1)) or {}) if match else {}


def source_hash(source: Path) -> str:
    return hashlib.sha256(source.read_bytes()).hexdigest()[:12]


def twins() -> list[Path]:
    return sorted(ZH.rglob("*.md"))


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


def test_chinese_pages_are_chinese():
    for page in twins():
        body = _FRONT.sub("", page.read_text(encoding="utf-8"))
        han = len(re.findall(r"[\u4e00-\u9fff]", body))
        assert han > 200, f"{page}: only {han} Chinese characters; is it translated?"


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


def test_no_page_points_outside_the_repository():
    forbidden = re.compile(r"\.\./shared|shared/reference|upstream-digest|stack-probe|seeds/")
    offenders = [
        str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md")
        if "notebooks" not in p.relative_to(DOCS).parts and forbidden.search(p.read_text(encoding="utf-8"))
    ]
    assert not offenders, f"pages that point outside the repository: {offenders}"


def main(argv: list[str]) -> int:
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
