"""The six core ideas' pictures (`tpupedia.diagrams`): each drawn by one notebook cell, each shown on
a knowledge-base page in both editions, and the page's picture the notebook's own."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest

from tpupedia import diagrams

ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDER = re.compile(r"\{\{ diagram:([\w-]+)(?: \| [^}]+?)? \}\}")


def placements(edition: str = "") -> dict[str, set[str]]:
    """Diagram name -> the knowledge-base pages (paths relative to the edition's docs root) placing it."""
    base = ROOT / "docs" / edition if edition else ROOT / "docs"
    out: dict[str, set[str]] = {}
    for page in sorted((base / "kb").glob("*.md")):
        for name in PLACEHOLDER.findall(page.read_text(encoding="utf-8")):
            out.setdefault(name, set()).add(page.relative_to(base).as_posix())
    return out


@pytest.mark.parametrize("name", list(diagrams.DIAGRAMS))
def test_one_notebook_cell_draws_each_diagram_and_stores_one_picture(name):
    picture = diagrams.png(name, ROOT)
    assert picture.startswith(b"\x89PNG\r\n\x1a\n") and len(picture) > 10_000  # a drawing, not an empty canvas


def test_each_diagram_is_on_a_knowledge_base_page_and_on_its_chinese_twin():
    english, chinese = placements(), placements("zh")
    assert set(english) == set(diagrams.DIAGRAMS), f"not on any kb page: {set(diagrams.DIAGRAMS) - set(english)}"
    assert chinese == english, "the Chinese edition places the diagrams on other pages than the English one"


def test_a_placeholder_becomes_the_notebooks_picture_and_a_wrong_name_is_refused():
    html = diagrams.render("before\n\n{{ diagram:mesh | 设备网格 }}\n\nafter", ROOT)
    data = re.search(r'src="data:image/png;base64,([^"]+)"', html).group(1)
    assert base64.b64decode(data) == diagrams.png("mesh", ROOT) and "设备网格" in html and "{{" not in html
    with pytest.raises(diagrams.DiagramError, match="no diagram named 'meshes'; known: mesh"):
        diagrams.render("{{ diagram:meshes }}", ROOT)


def test_a_cell_tagged_for_a_diagram_with_no_picture_is_refused(tmp_path):
    (tmp_path / "notebooks").mkdir()
    stem = diagrams.DIAGRAMS["hosts"][0]
    cell = {"cell_type": "code", "metadata": {"tags": ["diagram-hosts"]}, "outputs": [], "source": "", "execution_count": 1}
    (tmp_path / "notebooks" / f"{stem}.ipynb").write_text(json.dumps({"cells": [cell]}))
    with pytest.raises(diagrams.DiagramError, match="stores 0 pictures"):
        diagrams.png("hosts", tmp_path)
