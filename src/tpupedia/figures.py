"""Named figures: each number the site quotes, read from the one place it lives.

A figure measured, compiled or reported here lives in one place: a results file under
`docs/results/` (what `tpupedia bench`, `dryrun` and `plan` record, and the upstream figures with
their sources), a notebook's stored execution times, or `tpupedia.hardware`. A page does not copy
it: it writes `{{ figure:NAME }}` and the docs hook (`docs/hooks.py`) prints the figure there. Where
a figure is still quoted as a literal (a lesson's prose, a sentence that reads better with the
number in it), `Figure.quotes` lists the patterns that find those quotes, and
`tests/test_figures.py` fails when one of them says something else. Memory the compiler reports
is in GiB (2**30 bytes), checkpoint and vendor sizes in GB (10**9), as the glossary says.

Used by the docs hook and the tests; notebooks read the same results files directly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from tpupedia.errors import TpupediaError

__all__ = ["Figure", "FigureError", "FIGURES", "figure", "render", "notebook_seconds", "duration_text"]

_GIB = 2**30
_PLACEHOLDER = re.compile(r"\{\{ figure:([\w.\-]+) \}\}")


class FigureError(TpupediaError, KeyError):
    """A page names a figure that does not exist, or a figure's source has no such record."""


@dataclass(frozen=True)
class Figure:
    """One number: where it comes from (`value(root)`, `root` the repository), how pages print
    it (`text`), and where a literal copy of it may still be found (`quotes`: (glob relative to
    the repository, regex whose first group is the quoted number as printed))."""

    name: str
    value: Callable[[Path], float]
    text: Callable[[float], str]
    source: str
    quotes: tuple[tuple[str, str], ...] = ()

    def printed(self, root: Path) -> str:
        return self.text(self.value(root))


def notebook_seconds(notebook: Path) -> float:
    """A notebook's run time as stored: the sum of its code cells' execution times (Jupyter's
    `execution` timestamps), without kernel start-up; what the learning path's run column shows."""
    import datetime as _dt

    import nbformat

    def at(stamp: str) -> _dt.datetime:
        return _dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))

    total = 0.0
    for cell in nbformat.read(notebook, as_version=4).cells:
        times = cell.get("metadata", {}).get("execution", {})
        if cell.cell_type == "code" and "iopub.execute_input" in times and "iopub.status.idle" in times:
            total += (at(times["iopub.status.idle"]) - at(times["iopub.execute_input"])).total_seconds()
    return total


def duration_text(seconds: float) -> str:
    """`25 s`, `137 s`, `4 min`: how the learning path prints a run time."""
    return f"{seconds:.0f} s" if seconds < 180 else f"{seconds / 60:.0f} min"


def _reading(root: Path, n: int) -> float:
    from tpupedia import notebooks

    return notebooks.reading_minutes(next((root / "lessons").glob(f"{n:02d}_*.py")))


def _printed(stem: str, pattern: str) -> Callable[[Path], float]:
    """A number a notebook computed and printed, read from its stored output (`pattern`'s first
    group): the notebook is where it is computed, and nbval checks the stored output on every CI run."""
    def value(root: Path) -> float:
        import nbformat

        text = "".join(o.get("text", "") for c in nbformat.read(root / "notebooks" / f"{stem}.ipynb", as_version=4).cells
                       if c.cell_type == "code" for o in c.get("outputs", []))
        m = re.search(pattern, text)
        if m is None:
            raise FigureError(f"notebooks/{stem}.ipynb prints nothing matching {pattern!r}")
        return float(m.group(1))

    return value


def _record(file: str, **match: Any) -> Callable[[Path], dict]:
    """The one record of `docs/results/FILE` whose fields equal `match` (a field given as a
    callable is a test on the field's value)."""
    from tpupedia import results

    def find(root: Path) -> dict:
        found = [r for r in results.load(root / "docs" / "results" / file)
                 if all(v(r.get(k)) if callable(v) else r.get(k) == v for k, v in match.items())]
        if len(found) != 1:
            raise FigureError(f"{file}: {len(found)} records match {match}, expected one")
        return found[0]

    return find


def _hardware(fn: Callable[[Any], float]) -> Callable[[Path], float]:
    def value(root: Path) -> float:  # noqa: ARG001 - the table lives in code
        from tpupedia import hardware

        return fn(hardware.chip("v6e"))

    return value


def _quoted(q: Any) -> Figure:
    """A family's `QuotedFigure` (`tpupedia.models.spec`) as a `Figure`: its record found by its
    `match` (`stages`: the plan's stage names), the value its `read` names; a `computed` one is
    the family module's own function."""
    text = q.text or (lambda v: f"{v:.{q.decimals}f}")
    if q.read == "computed":
        return Figure(q.name, lambda root: q.compute(), text, q.source, quotes=q.quotes)  # no record to read
    file = {"plan_peak": "plans.json", "plan_weights": "plans.json", "plan_oom": "plans.json", "plan_predicted": "plans.json", "dryrun_peak": "dryruns.json",
            "upstream_step": "upstream.json"}[q.read]
    match = {k: (lambda s, want=v: [x["stage"] for x in s] == list(want)) if k == "stages" else v
             for k, v in q.match.items()}
    find = _record(file, **match)
    value = {
        "plan_peak": lambda root: next(s["peak"] for s in find(root)["stages"] if s["stage"] == q.stage) / _GIB,
        "plan_oom": lambda root: max(p["oom_required"] or 0 for s in find(root)["stages"] for p in s["programs"]) / _GIB,
        "plan_weights": lambda root: next(s["weights"] for s in find(root)["stages"] if s["stage"] == q.stage) / _GIB,
        "plan_predicted": lambda root: find(root)["predicted_s"],
        "dryrun_peak": lambda root: (lambda r: (r["arguments_bytes"] + r["temporaries_bytes"]) / _GIB)(find(root)),
        "upstream_step": lambda root: find(root)["step_s"],
    }[q.read]
    return Figure(q.name, value, text, q.source, quotes=q.quotes)


def _family_figures() -> list[Figure]:
    """Every registered family's quoted figures (`FamilySpec.figures`)."""
    from tpupedia import families

    return [_quoted(q) for spec in families.all_specs() for q in spec.figures]


def _first_video_figures() -> list[Figure]:
    """`first_video.FAMILY`: seconds to the README's first tiny video of each video family, the
    best first run from an empty cache that `tpupedia bench first-video FAMILY` recorded in
    `docs/results/first_video.json`; the README quotes each after the family's name (the first
    word of its registry title: `CogVideoX N s`)."""
    from tpupedia import families

    def best(family: str) -> Callable[[Path], float]:
        find = _record("first_video.json", bench="first-video", config=lambda c: c["family"] == family)
        return lambda root: find(root)["best"]["empty"]

    return [Figure(f"first_video.{spec.name}", best(spec.name), lambda v: f"{v:.0f}",
                   f"docs/results/first_video.json: tpupedia bench first-video {spec.name} (measured here, the best "
                   "first run from an empty cache, to the process's exit)",
                   quotes=(("README.md", rf"{re.escape(spec.title.split()[0])} (\d+) s\b"),))
            for spec in families.video()]


FIGURES: dict[str, Figure] = {f.name: f for f in [
    Figure("v6e.hbm_gb_per_s", _hardware(lambda c: c.hbm_bytes_per_s / 1e9), lambda v: f"{v:,.0f}",
           "tpupedia.hardware (Google's v6e page)",
           quotes=(("docs/kb/*.md", r"v6e[^.\n]{0,60}?(\d[\d,]*) GB/s of HBM"),)),
    Figure("v6e.ridge", _hardware(lambda c: c.ridge_flops_per_byte), lambda v: f"{v:.0f}",
           "tpupedia.hardware: peak bf16 FLOP/s / HBM bandwidth",
           quotes=(("docs/kb/*.md", r"(\d{3}) FLOP/byte for a v6e"), ("docs/kb/*.md", r"v6e ridge point[^\d]{0,20}(\d{3})"))),
    *_family_figures(),
    *_first_video_figures(),
    *[Figure(f"nb10.{slice_}.{what}", _printed("13_beyond_one_host", rf"{topology} mesh [^\n]*?{pattern}"), fmt,
             f"notebook `beyond_one_host`, section 4: CogVideoX 720p step compiled for {slice_} (AOT here, printed by the notebook)",
             quotes=quotes)
      for slice_, topology, what, pattern, fmt, quotes in [
          ("v6e-16", "v6e:4x4", "sent_gib", r"([\d.]+) GiB sent per chip", lambda v: f"{v:.1f}",
           (("docs/**/*.md", r"([\d.]+) GiB sent per chip[^\n]{0,80}?(?:v6e-16|ICI floor [\d.]+ s > compute floor 0\.163)"),)),
          ("v6e-16", "v6e:4x4", "ici_s", r"\n\s+floors per step: [^\n]*ICI ([\d.]+) s", lambda v: f"{v:.3f}",
           (("docs/kb/*.md", r"ICI floor ([\d.]+) s > compute floor 0\.163"), ("docs/kb/*.md", r"v6e-16[^\n]*\| [\d.]+ → ([\d.]+) s \|"))),
          ("v6e-64", "v6e:8x8", "sent_gib", r"([\d.]+) GiB sent per chip", lambda v: f"{v:.1f}",
           (("docs/kb/*.md", r"([\d.]+) GiB sent per chip per step: communication-bound \(ICI floor [\d.]+ s > compute floor 0\.041"),
            ("docs/kb/*.md", r"compiled step sends ([\d.]+) GiB per chip"))),
          ("v6e-64", "v6e:8x8", "ici_s", r"\n\s+floors per step: [^\n]*ICI ([\d.]+) s", lambda v: f"{v:.3f}",
           (("docs/kb/*.md", r"ICI floor ([\d.]+) s > compute floor 0\.041"), ("docs/kb/*.md", r"v6e-64[^\n]*\| [\d.]+ → ([\d.]+) s \|"))),
      ]],
]}
"""Every named figure, by name; besides these, each lesson's `run.NN` and `reading.NN` (`figure`)."""


def _lesson_figure(kind: str, n: int) -> Figure:
    """`run.NN`: the notebook's stored cell execution time; `reading.NN`: the lesson's reading time."""
    if kind == "run":
        return Figure(f"run.{n:02d}", lambda root: notebook_seconds(next((root / "notebooks").glob(f"{n:02d}_*.ipynb"))),
                      duration_text, f"notebooks/{n:02d}_*.ipynb: stored cell execution times (measured here, 2-core CPU)")
    return Figure(f"reading.{n:02d}", lambda root: _reading(root, n), lambda v: f"{v:.0f} min",
                  f"lessons/{n:02d}_*.py: its prose words / 200 a minute plus its code lines / 30 a minute, rounded up")


def _core_figure(kind: str) -> Figure:
    """`run.core` / `reading.core`: the sums of those figures over the core path's notebooks
    (`tpupedia.notebooks.CORE`)."""
    from tpupedia import notebooks

    def numbers(root: Path) -> list[int]:
        return [int(notebooks.lesson(slug, root).name[:2]) for slug in notebooks.CORE]

    def total(root: Path) -> float:
        return sum(_lesson_figure(kind, n).value(root) for n in numbers(root))

    what = "stored cell execution times (measured here, 2-core CPU)" if kind == "run" else "prose words / 200 plus code lines / 30 per minute"
    return Figure(f"{kind}.core", total, duration_text if kind == "run" else (lambda v: f"{v:.0f} min"),
                  f"the core path's notebooks (tpupedia.notebooks.CORE): the sum of their {what}")


def figure(name: str) -> Figure:
    lesson = re.fullmatch(r"(run|reading)\.(\d\d|core)", name)
    if lesson and lesson.group(2) == "core":
        return _core_figure(lesson.group(1))
    if lesson:
        return _lesson_figure(lesson.group(1), int(lesson.group(2)))
    if name not in FIGURES:
        raise FigureError(f"no figure named {name!r}; known: {', '.join(sorted(FIGURES))}, run.NN, reading.NN, run.core, "
                          "reading.core")
    return FIGURES[name]


def render(markdown: str, root: Path) -> str:
    """`markdown` with every `{{ figure:NAME }}` replaced by the figure as pages print it."""
    return _PLACEHOLDER.sub(lambda m: figure(m.group(1)).printed(root), markdown)
