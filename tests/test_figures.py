"""One number, one source (`tpupedia.figures`): every `{{ figure:NAME }}` on a page names a figure
that renders; every literal quote of a figure in the docs and lessons says what its source says;
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
    return {str(p.relative_to(ROOT)): p.read_text() for p in [*PAGES, *LESSONS]}


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
