"""The learning path's promise, checked: a notebook imports from `tpupedia` only what it or a
notebook before it adds (the table's "adds to `tpupedia`" column), except the few early uses the
learning path names (`EARLY`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))

EARLY = {
    ("sharding", "dryrun"): "reads the recorded HunyuanVideo-1.5 dry-runs (notebook plan_without_tpu makes them)",
    ("cogvideox_vae_flax", "dryrun"): "reads the recorded full-size VAE compile; with the full preset, makes it",
    ("cogvideox_vae_flax", "models.cogvideox"): "the frame rule, read from the family's module, its one home",
    ("plan_without_tpu", "models.hunyuan"): "plans the second family from the facts its module holds (depth, widths)",
}
"""(notebook slug, module): why the notebook uses a module a later notebook adds. The learning
path names each of these."""


def added() -> dict[str, int]:
    """Each module (or `pkg.*` prefix) the learning path's table says a notebook adds, by number."""
    out: dict[str, int] = {}
    for line in (ROOT / "docs" / "learning-path.md").read_text(encoding="utf-8").splitlines():
        if re.match(r"\| \d\d \|", line):
            cells = [c.strip() for c in line.split("|")]
            for module in re.findall(r"`([\w.*]+)`", cells[4]):
                out.setdefault(module.removeprefix("tpupedia."), int(cells[1]))
    return out


def introduced(module: str, table: dict[str, int]) -> int | None:
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        for key in (head, head + ".*"):
            if key in table:
                return table[key]
    return None


def imported(lesson: Path) -> set[str]:
    """The `tpupedia` modules a lesson's code imports, as dotted names below `tpupedia`."""
    code = "\n".join(c.source for c in jupytext.read(lesson).cells if c.cell_type == "code")
    code = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("%", "!")))
    found = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tpupedia":
            base = node.module.removeprefix("tpupedia").lstrip(".")
            for alias in node.names:
                name = f"{base}.{alias.name}" if base else alias.name
                found.add(name if (ROOT / "src" / "tpupedia" / (name.replace(".", "/") + ".py")).exists()
                          or (ROOT / "src" / "tpupedia" / name.replace(".", "/")).is_dir() else base)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("tpupedia.") for a in node.names if a.name.startswith("tpupedia.")}
    return found


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem)
def test_a_notebook_imports_only_what_it_or_an_earlier_one_adds(lesson):
    table, number, slug = added(), int(lesson.name[:2]), lesson.stem[3:]
    late = {m: introduced(m, table) for m in imported(lesson)}
    late = {m: n for m, n in late.items() if (n is None or n > number) and (slug, m) not in EARLY}
    assert not late, (f"{lesson.name} imports {late} (module: the notebook that adds it, None for none): add it to "
                      "this notebook's row of docs/learning-path.md, or name the early use in EARLY and the learning path")


def test_the_learning_path_names_every_early_use():
    text = (ROOT / "docs" / "learning-path.md").read_text(encoding="utf-8")
    for slug, module in EARLY:  # one list item of the learning path names both
        assert re.search(rf"^- [^\n]*`{slug}`[^\n]*`{module}`", text, re.M), f"docs/learning-path.md: no item on `{slug}` using `{module}`"
    used = {(lesson.stem[3:], m) for lesson in LESSONS for m in imported(lesson)}
    assert set(EARLY) <= used, f"EARLY names uses no notebook makes any more: {set(EARLY) - used}"
