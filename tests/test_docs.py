"""`mkdocs build --strict` succeeds and the site shows what the notebooks stored."""

import base64
import json
import re
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_strict_docs_build_renders_stored_notebook_outputs(docs_build):
    """`mkdocs build --strict` exits 0 without a warning, and the site it wrote shows the notebooks'
    stored outputs, the API reference, the pages rendered from data files, the Chinese search fix
    and every numbered list and section link. The build is the session's one (`docs_build` in
    tests/conftest.py, which tests/test_browser.py serves too); its status and stderr are recorded,
    and a failed build fails here."""
    site = docs_build.site
    assert docs_build.returncode == 0, docs_build.stderr[-3000:]
    assert "WARNING" not in docs_build.stderr, docs_build.stderr[-3000:]

    page = (site / "notebooks" / "00_start_here" / "index.html").read_text()
    assert "v6e ridge point: 560 FLOP/byte" in page  # a stored output, not re-executed
    assert "RESOURCE_EXHAUSTED" in page

    api = (site / "reference" / "api" / "index.html").read_text()
    assert "make_mesh" in api and "simulate_cpu_devices" in api

    hardware = (site / "kb" / "hardware" / "index.html").read_text()
    assert "{{ hardware_table }}" not in hardware and "918" in hardware

    results_page = (site / "results" / "index.html").read_text()
    assert "{{ plans_table }}" not in results_page and "v6e:2x4 (8 chips)" in results_page  # docs/results/plans.json

    terms = (site / "zh" / "terms" / "index.html").read_text()  # the Chinese edition's glossary, from docs/zh/terms.yml
    assert "{{ zh_terms }}" not in terms and "<td>张量并行</td>" in terms

    worker = next((site / "assets" / "javascripts" / "workers").glob("search.*.min.js")).read_text()
    assert "o<=t.length" in worker  # docs/search_hooks.py: Chinese queries keep their last word

    assert (site / "guides" / "tpu-vm" / "index.html").exists()
    assert not list(site.rglob("*.py")), "python sources leaked into the site"

    for page in sorted((ROOT / "docs").rglob("*.md")):  # every link into a notebook's section lands on it
        for stem, anchor in re.findall(r"notebooks/(\w+)\.ipynb#([\w-]+)", page.read_text()):
            rendered = (site / "notebooks" / stem / "index.html").read_text()
            assert f'id="{anchor}"' in rendered, f"{page.relative_to(ROOT)} links to {stem}#{anchor}, which it lacks"

    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        rendered = (site / "notebooks" / notebook.stem / "index.html").read_text()
        missing = Counter(numbered_lists(notebook)) - Counter(ordered_list_lengths(rendered))
        assert not missing, (f"{notebook.name}: numbered lists of these lengths (length: count) do not render as "
                             f"one <ol> each: {dict(missing)}")


def test_the_knowledge_base_shows_the_notebooks_diagrams_in_both_editions(docs_build):
    """Every `{{ diagram:NAME }}` on a kb page, English or Chinese, is on the built page as the
    picture its notebook stores (`tpupedia.diagrams`), not as the placeholder."""
    from tpupedia import diagrams

    placed = 0
    for page in sorted((ROOT / "docs").glob("**/kb/*.md")):
        names = re.findall(r"\{\{ diagram:([\w-]+)", page.read_text(encoding="utf-8"))
        rel = page.relative_to(ROOT / "docs").with_suffix("")
        built = (docs_build.site / rel / "index.html").read_text()
        for name in names:
            png = base64.b64encode(diagrams.png(name, ROOT)).decode("ascii")
            assert f'id="diagram-{name}"' in built and png in built, f"{rel}: diagram {name} not rendered"
            placed += 1
        assert "{{ diagram:" not in built, rel
    assert placed >= 2 * len(diagrams.DIAGRAMS)


def test_the_site_folds_every_solution_and_check_cell(docs_build):
    """Each notebook page wraps every cell tagged `solution` or `check` in a closed `<details>` of
    that class (`docs/hooks.py`, `fold_tagged_cells`), with the cell's source inside it."""
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        rendered = (docs_build.site / "notebooks" / notebook.stem / "index.html").read_text()
        for tag in ("solution", "check"):
            tagged = [c for c in cells if tag in c.get("metadata", {}).get("tags", [])]
            blocks = re.findall(rf'<details class="{tag}"><summary>.*?</summary>(.*?)</details>', rendered, re.S)
            assert len(blocks) == len(tagged), f"{notebook.name}: {len(tagged)} {tag} cells, {len(blocks)} folded"
            for cell, block in zip(tagged, blocks):
                first = next(line for line in "".join(cell["source"]).splitlines() if line.strip())
                word = re.findall(r"[A-Za-z_]{4,}", first)[0]  # highlighting splits the line into spans
                assert word in block, f"{notebook.name}: a folded {tag} block lacks its cell's source ({word!r})"


def numbered_lists(notebook: Path) -> list[int]:
    """The item count of each numbered list ("1. ...", "2. ...") in the notebook's markdown cells."""
    lengths = []
    for cell in json.loads(notebook.read_text())["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        items = None
        for line in "".join(cell["source"]).splitlines():
            item = re.match(r"(\d+)\. ", line)
            if item and int(item.group(1)) == 1:
                if items:
                    lengths.append(items)
                items = 1
            elif item and items and int(item.group(1)) == items + 1:
                items += 1
            elif items and line.strip() and not line.startswith(" "):  # the list has ended
                lengths.append(items)
                items = None
        if items:
            lengths.append(items)
    return lengths


def ordered_list_lengths(html: str) -> list[int]:
    """The number of direct `<li>` items of each `<ol>` in `html`."""

    class Lists(HTMLParser):
        def __init__(self):
            super().__init__()
            self.stack, self.lengths = [], []

        def handle_starttag(self, tag, attrs):
            if tag in ("ol", "ul"):
                self.stack.append([tag, 0])
            elif tag == "li" and self.stack:
                self.stack[-1][1] += 1

        def handle_endtag(self, tag):
            if tag in ("ol", "ul") and self.stack:
                kind, count = self.stack.pop()
                if kind == "ol":
                    self.lengths.append(count)

    parser = Lists()
    parser.feed(html)
    return parser.lengths


def test_numbered_lists_are_found_and_counted(tmp_path):
    """The two helpers of the rendering check: lists in a notebook's markdown, `<ol>` items in HTML
    (a list that renders whole, and one broken in two, as a list without its blank line renders)."""
    source = "The parts:\n\n1. one;\n2. two, which goes on\n   over a line;\n3. three.\n\nThen:\n1. alone\n"
    notebook = tmp_path / "00_lists.ipynb"
    notebook.write_text(json.dumps({"cells": [{"cell_type": "markdown", "source": source},
                                              {"cell_type": "code", "source": "1. + 2."}]}))
    assert numbered_lists(notebook) == [3, 1]
    assert ordered_list_lengths("<ol><li>a</li><li>b<ol><li>c</li></ol></li></ol>") == [1, 2]
    assert ordered_list_lengths("<ol><li>a</li></ol><p>b</p><ol start=2><li>c</li></ol>") == [1, 1]


def test_the_guides_that_install_the_tpu_extra_install_the_video_extra_too():
    """The TPU VM guides (and their Chinese twins) install the course, then write videos with
    `--out`: the mp4 writer (`imageio-ffmpeg`) is in the `video` extra, and an install of `.[tpu]`
    alone failed after the decode stage."""
    installs = [(page.relative_to(ROOT).as_posix(), set(extras.split(",")))
                for page in sorted((ROOT / "docs").rglob("*.md"))
                for extras in re.findall(r'pip install -e "\.\[([\w,]+)\]"', page.read_text(encoding="utf-8"))]
    assert {"docs/guides/tpu-vm.md", "docs/zh/guides/tpu-vm.md"} <= {page for page, _ in installs}
    assert [page for page, extras in installs if "tpu" in extras and "video" not in extras] == []
