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


_TOC_LINK = re.compile(r'<a href="#([^"]+)" class="md-nav__link">\s*<span class="md-ellipsis">\s*(.*?)\s*</span>', re.S)


def test_notebook_pages_keep_code_in_their_table_of_contents_and_drop_the_xmode_line(docs_build):
    """Each notebook page's table of contents (issue 42) keeps the code of a heading ("1. A mesh and
    a NamedSharding", not "1. A mesh and a") and links to ids the page has; no page opens with the
    "Exception reporting mode: Minimal" its first cell's `%xmode Minimal` printed (`docs/hooks.py`:
    `notebook_toc_tokens`, `drop_xmode_output`)."""
    import nbformat

    assert docs_build.returncode == 0, docs_build.stderr[-3000:]
    coded = 0
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        rendered = (docs_build.site / "notebooks" / notebook.stem / "index.html").read_text()
        assert "Exception reporting mode" not in rendered, f"{notebook.name}: the %xmode line is on the page"
        first = next(c for c in nbformat.read(notebook, as_version=4).cells if c.cell_type == "code")
        assert "%xmode Minimal" in first.source  # what the hook removes the output of
        toc = _TOC_LINK.findall(rendered)
        assert toc, f"{notebook.name}: no table of contents"
        for anchor, _ in toc:
            assert f'id="{anchor}"' in rendered, f"{notebook.name}: the table of contents links to #{anchor}, not on the page"
        titles = " | ".join(title for _, title in toc)
        for cell in nbformat.read(notebook, as_version=4).cells:
            if cell.cell_type != "markdown":
                continue
            for heading in re.findall(r"^#{2,6} (.*`[^`\n]+`.*)$", cell.source, re.M):
                for code in re.findall(r"`([^`]+)`", heading):
                    coded += 1
                    assert code.replace("&", "&amp;").replace("<", "&lt;") in titles, (
                        f"{notebook.name}: heading {heading!r} lost `{code}` in the table of contents: {titles}")
    page = (docs_build.site / "notebooks" / "02_sharding" / "index.html").read_text()
    assert ("1-a-mesh-and-a-namedsharding", "1. A mesh and a NamedSharding") in _TOC_LINK.findall(page)
    assert coded > 5


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


# The front door (issue 42): the README and the site's home page in both editions show what the
# course is (a sentence and the picture of a run's path), the two commands, a first video and a
# table from goal to command; everything else lives on the docs page it belongs to, the flags on
# the command-line reference (docs/reference/cli.md).
PATH_STEPS = ["preset", "build", "shard", "compile", "run stages", "stage files", "video"]
_CLI_PAGE = ROOT / "docs" / "reference" / "cli.md"


def _subcommands(parser, path=()):
    """`(path, subparser)` for every subcommand of the argparse `parser`, nested ones included:
    `("plan",)`, `("plan", "wan")`, `("bench", "generate", "hunyuan")`, ..."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _subcommands(sub, (*path, name))


def _flags(parser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}


def _commands_in(text: str) -> list[str]:
    """The `tpupedia ...` command lines of a page, from its code blocks and inline code, without a
    `.venv/bin/` prefix or a trailing `# comment`; lines with a placeholder (`FAMILY`, `...`) left out."""
    lines = re.findall(r"`((?:\.venv/bin/)?tpupedia [^`\n]+)`", text)
    for block in re.findall(r"```\w*\n(.*?)```", text, re.S):
        lines += [line for line in block.splitlines() if re.match(r"\s*(?:\.venv/bin/)?tpupedia ", line)]
    commands = []
    for line in lines:
        line = re.sub(r"\s+#.*$", "", line.strip()).removeprefix(".venv/bin/")
        if not re.search(r"\.\.\.|[A-Z]{4,}", line.removeprefix("tpupedia ").split(" --help")[0]):
            commands.append(line)
    return commands


def test_the_readme_first_screen_is_a_front_door():
    """The README's first 60 lines hold the two commands, a `tpupedia generate` line that writes a
    video and the picture of the path; the home page shows the same picture in both editions; every
    `tpupedia` command the README and the home pages give parses with the real parser."""
    import shlex

    from tpupedia import cli

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first = "\n".join(readme.splitlines()[:60])
    assert "make serve" in first and "make test" in first, "the README's first screen lacks the two commands"
    assert re.search(r"^(?:\.venv/bin/)?tpupedia generate \w+ .*--out \S+\.mp4", first, re.M), (
        "the README's first screen has no `tpupedia generate ... --out VIDEO.mp4` line")
    assert re.search(r"!\[[^\]]+\]\(docs/images/path\.svg\)", first), "the README's first screen lacks docs/images/path.svg"
    assert len(readme.splitlines()) <= 100, ("the README is a front door: flags go to docs/reference/cli.md, "
                                             "everything else to the docs page it belongs to")
    for page, picture in (("index.md", "images/path.svg"), ("zh/index.md", "../images/path.svg")):
        assert f"]({picture})" in (ROOT / "docs" / page).read_text(encoding="utf-8"), f"docs/{page} lacks {picture}"

    parser = cli.build_parser()
    checked = 0
    for page in (ROOT / "README.md", ROOT / "docs" / "index.md", ROOT / "docs" / "zh" / "index.md"):
        for command in _commands_in(page.read_text(encoding="utf-8")):
            try:
                parser.parse_args(shlex.split(command)[1:])
            except SystemExit as exit:
                raise AssertionError(f"{page.relative_to(ROOT)}: `{command}` does not parse (exit {exit.code})") from None
            checked += 1
    assert checked >= 10


def test_the_path_picture_names_the_steps_in_order():
    """docs/images/path.svg is an SVG whose step titles (`class="step"`) are the path a run takes, in
    order, with the stages text, [image], denoise and decode inside `run stages`."""
    import xml.etree.ElementTree as ET

    svg = ROOT / "docs" / "images" / "path.svg"
    assert svg.exists(), "docs/images/path.svg is missing"
    root = ET.parse(svg).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"

    def texts(cls):
        return ["".join(e.itertext()).strip() for e in root.iter("{http://www.w3.org/2000/svg}text")
                if cls in e.get("class", "").split()]

    assert texts("step") == PATH_STEPS
    assert texts("stage") == ["text", "[image]", "denoise", "decode"]
    words = " ".join("".join(e.itertext()) for e in root.iter("{http://www.w3.org/2000/svg}text"))
    for fact in ("random weights", "8 simulated CPU", "real checkpoints", "(dp, tp) mesh", "jit", "tpupedia plan",
                 "written atomically", "validated when read"):
        assert fact in words, f"path.svg no longer says {fact!r}"


def test_the_cli_reference_documents_every_subcommand_and_flag():
    """docs/reference/cli.md has a `## \\`tpupedia COMMAND\\`` section for every subcommand the parser
    has (read from `tpupedia.cli.build_parser`), names each nested one (`tpupedia bench dit`, a family
    as itself or as FAMILY), and mentions every flag of a command in its section or in a section it
    links to; every flag the page mentions is one the parser has."""
    from tpupedia import cli, families

    page = _CLI_PAGE.read_text(encoding="utf-8")
    parser = cli.build_parser()
    sections = dict(re.findall(r"^## `tpupedia ([\w-]+)`\n(.*?)(?=^## |\Z)", page, re.M | re.S))
    slug = lambda title: re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", title.lower()).strip())  # noqa: E731
    anchors = {}  # a heading's id -> the command section it sits in
    for command, text in sections.items():
        anchors[f"tpupedia-{command}"] = command
        for title in re.findall(r"^#{3,} (.+)$", text, re.M):
            anchors[slug(title)] = command

    def documented(command):
        linked = {anchors[a] for a in re.findall(r"\]\(#([\w-]+)\)", sections[command]) if a in anchors}
        return set(re.findall(r"(?<![\w-])--[a-z][\w-]*", "".join(sections[c] for c in {command, *linked})))

    video = set(families.names("video"))
    subcommands = list(_subcommands(parser))
    assert {path[0] for path, _ in subcommands} == set(sections), (
        f"the parser's commands {sorted({p[0] for p, _ in subcommands})} against the page's sections {sorted(sections)}")
    everything = set()
    for path, sub in subcommands:
        text = sections[path[0]]
        if len(path) > 1:
            spelled = {" ".join(path), " ".join((*path[:-1], "FAMILY"))} if path[-1] in video else {" ".join(path)}
            assert any(f"tpupedia {s}" in text for s in spelled), f"cli.md's `tpupedia {path[0]}` section never names `tpupedia {' '.join(path)}`"
            assert path[-1] in text
        missing = _flags(sub) - documented(path[0])
        assert not missing, f"`tpupedia {' '.join(path)}` has flags cli.md does not document: {sorted(missing)}"
        everything |= _flags(sub)
    unknown = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", page)) - everything - {"--help"}
    assert not unknown, f"cli.md documents flags no command has: {sorted(unknown)}"
