"""One number, one source (`tpupedia.figures`): every `{{ figure:NAME }}` on a page names a figure
that renders; every literal quote of a figure in the docs, lessons and README says what its source says;
each lesson's header states a run time within a factor of two of the one its notebook stored."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tpupedia import figures

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").rglob("*.md"))
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))


def disagreements(fig: figures.Figure, texts: dict[str, str]) -> tuple[list[str], int]:
    """Quotes of `fig` in `texts` ({file: text}) that print another number, and how many quotes were found."""
    want, bad, found = fig.printed(ROOT), [], 0
    for glob, pattern in fig.quotes:
        for name, text in texts.items():
            if not Path(name).match(glob) and not _globbed(name, glob):
                continue
            for m in re.finditer(pattern, text):
                found += 1
                if m.group(1) != want:
                    bad.append(f"{name}: quotes {fig.name} as {m.group(1)!r}; {fig.source} says {want!r}")
    return bad, found


def _globbed(name: str, glob: str) -> bool:
    return name in {str(p.relative_to(ROOT)) for p in ROOT.glob(glob)}


def _texts() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in [*PAGES, *LESSONS, ROOT / "README.md"]}


def test_every_figure_a_page_names_exists_and_renders():
    for page in PAGES:
        figures.render(page.read_text(), ROOT)  # raises FigureError naming the unknown figure or record


@pytest.mark.parametrize("name", [n for n, f in figures.FIGURES.items() if f.quotes])
def test_literal_quotes_say_what_the_source_says(name):
    bad, found = disagreements(figures.FIGURES[name], _texts())
    assert found, f"no quote of {name} found: a pattern in tpupedia.figures has gone stale"
    assert bad == [], "\n".join(bad)


def test_a_quote_that_disagrees_is_caught():
    fig = figures.FIGURES["upstream.hunyuan.step_s.tp_fc2"]
    right = f"TP + fc2 replicated: {fig.printed(ROOT)} s/step"
    bad, found = disagreements(fig, {"docs/kb/x.md": right + "\n" + right.replace(fig.printed(ROOT), "7.00")})
    assert found == 2 and len(bad) == 1 and "'7.00'" in bad[0]


_HEADER_RUN = re.compile(r"\| `tiny`[^\n]*\|[^|\n]*\|[^|\n]*\| (?:about )?([\d.]+)(?:[–-]([\d.]+))? (s|minutes?)\b[^|\n]*"
                         r"measured here")


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_each_lesson_header_states_the_run_time_its_notebook_stored(lesson):
    m = _HEADER_RUN.search(lesson.read_text())
    assert m, f"{lesson.name}: no '| `tiny` ... | about N s|minutes, measured here ...' run time in its header"
    unit = 60 if m.group(3).startswith("minute") else 1
    claimed = [float(m.group(1)) * unit] + ([float(m.group(2)) * unit] if m.group(2) else [])
    stored = figures.notebook_seconds(ROOT / "notebooks" / f"{lesson.stem}.ipynb")
    assert min(claimed) / 2 <= stored <= max(claimed) * 2, (
        f"{lesson.name}: the header says {m.group(0).split('|')[-1].strip()!r}, its notebook stored "
        f"{stored:.0f} s of cell execution (update the header)")


def test_the_core_path_is_notebooks_that_exist_and_its_figures_are_their_sums():
    """`tpupedia.notebooks.CORE` names lessons by slug, in course order; `reading.core` and
    `run.core` are the sums of their lessons' own figures (the learning path's afternoon)."""
    from tpupedia import notebooks

    numbers = [int(notebooks.lesson(slug, ROOT).name[:2]) for slug in notebooks.CORE]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers) and numbers[0] == 0
    for kind in ("reading", "run"):
        parts = [figures.figure(f"{kind}.{n:02d}").value(ROOT) for n in numbers]
        assert figures.figure(f"{kind}.core").value(ROOT) == pytest.approx(sum(parts)) and all(p > 0 for p in parts)
    with pytest.raises(FileNotFoundError, match="'no_such_notebook': 0 lessons match"):
        notebooks.lesson("no_such_notebook", ROOT)


def _paragraphs(text: str) -> list[str]:
    return re.split(r"\n[ \t]*\n", text)


def test_hunyuan_sequence_is_the_family_count_or_labelled_upstream():
    """HunyuanVideo-1.5 at 720p and 121 frames (issue 42): a page quotes the sequence the splash
    kernel runs, `hunyuan.sequence_tokens` (the video and every conditioning slot, the 729 image
    slots included), or upstream's count without the image slots, and then says so and names the
    upstream file in the same paragraph. The floor a page quotes is computed from the first
    (`hunyuan.720p_121f.floor_s`, checked with the other literal quotes above)."""
    from tpupedia.models import hunyuan

    kernel = hunyuan.sequence_tokens(1280, 720, 121)
    upstream = hunyuan.video_tokens(1280, 720, 121) + hunyuan.UPSTREAM_TEXT_TOKENS
    assert kernel == hunyuan.step_flops(1280, 720, 121)["tokens"] == 111_600 + 1000 + 256 + 729
    assert upstream == 112_856 and figures.figure("hunyuan.720p_121f.tokens").printed(ROOT) == f"{kernel:,}"
    floor = figures.figure("hunyuan.720p_121f.floor_s").value(ROOT)
    assert floor == pytest.approx(hunyuan.step_flops(1280, 720, 121)["total"] / (8 * 918e12))
    bad, found = [], 0
    for page in PAGES:
        for para in _paragraphs(page.read_text()):
            for m in re.finditer(r"(?<![\d,.])(11[23],\d{3})(?![\d,])", para):
                found += 1
                n = int(m.group(1).replace(",", ""))
                labelled = (re.search(r"[Uu]pstream|上游", para)
                            and re.search(r"`[^`\n]*HunyuanVideo[^`\n]*\.md`|`generate_hunyuan_gpu_staged/README\.md`", para))
                if n != kernel and not (n == upstream and labelled):
                    bad.append(f"{page.relative_to(ROOT)}: {m.group(1)} is neither the kernel's sequence ({kernel:,}, "
                               f"hunyuan.sequence_tokens) nor upstream's {upstream:,} labelled with its source file")
    assert found >= 8 and bad == [], "\n".join(bad)


def _notebook_outputs(stem: str) -> str:
    import nbformat

    nb = nbformat.read(ROOT / "notebooks" / f"{stem}.ipynb", as_version=4)
    return "\n".join(str(o.get("text", "")) + "".join(str(v) for v in o.get("data", {}).values())
                     for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_splash_page_quotes_only_recorded_kernel_memory():
    """Every MiB figure on the splash-attention pages is one a record holds (issue 42): an HBM
    figure is the one notebook `splash_attention`'s sweep table stores for a block-size row the
    same paragraph names, a VMEM figure is in `docs/results/kernels.json`."""
    from tpupedia import results

    rows = {tuple(map(int, m.groups()[:3])): m.group(4) for m in re.finditer(
        r"\| (\d+) \| (\d+) \| (\d+) \| [^|\n]*\| yes \| ([\d.]+) MiB \|", _notebook_outputs("05_splash_attention"))}
    assert rows[(1024, 1024, 512)] and rows[(3328, 2816, 256)]
    kernels = " ".join(r["summary"] for r in results.load(ROOT / "docs" / "results" / "kernels.json"))
    checked = 0
    for page in (ROOT / "docs" / "kb" / "splash-attention.md", ROOT / "docs" / "zh" / "kb" / "splash-attention.md"):
        for para in _paragraphs(page.read_text()):
            quoted = re.findall(r"(\d+\.\d\d)\**\s*MiB", para)
            if not quoted:
                continue
            named = {rows.get(tuple(map(int, t))) for t in re.findall(r"\b(\d{3,4}) / (\d{3,4}) / (\d{3,4})\b", para)}
            for mib in quoted:
                checked += 1
                assert mib in named or f"{mib} MiB" in kernels, (
                    f"{page.relative_to(ROOT)}: {mib} MiB is neither the sweep table's HBM for a block-size row the "
                    f"paragraph names nor a kernels.json figure:\n{para}")
    assert checked >= 8
