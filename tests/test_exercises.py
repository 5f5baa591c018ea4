"""Every notebook teaches with exercises whose solutions CI runs, and ends with a self-check.

The form (docs/guides/contributing.md, "Exercises and self-checks"):

* an exercise is a markdown cell headed `### Exercise N: title` that sets the task, asks for a
  prediction where one fits, and is followed by a code cell tagged `solution` and a code cell tagged
  `check` that holds the asserts proving the solution right. nbval runs both in CI, so a solution
  that stops being right fails the build; the site folds both (`docs/hooks.py`, `fold_tagged_cells`);
* the last section, `## Self-check`, asks five numbered questions, each answer folded in a
  `<details><summary>Answer</summary>` block.
"""

from __future__ import annotations

import re
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))
_EXERCISE = re.compile(r"^### Exercise (\d+): \S", re.M)
_ANSWER = "<details><summary>Answer</summary>"


def exercises(lesson: Path) -> list[tuple[int, list[str]]]:
    """Each exercise's number and the tags of the code cells between its heading and the next
    markdown cell."""
    cells, found = jupytext.read(lesson).cells, []
    for i, cell in enumerate(cells):
        m = cell.cell_type == "markdown" and _EXERCISE.search(cell.source)
        if not m:
            continue
        tags = []
        for nxt in cells[i + 1:]:
            if nxt.cell_type == "markdown":
                break
            tags.append(",".join(nxt.metadata.get("tags", [])) or "untagged")
            assert nxt.metadata.get("tags") != ["check"] or "assert" in nxt.source, (lesson.name, m.group(0))
        found.append((int(m.group(1)), tags))
    return found


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_every_notebook_has_two_exercises_each_with_a_solution_and_its_check(lesson):
    found = exercises(lesson)
    assert len(found) >= 2, f"{lesson.name}: {len(found)} exercises, the course asks for at least two"
    assert [n for n, _ in found] == list(range(1, len(found) + 1)), f"{lesson.name}: exercises numbered {found}"
    for n, tags in found:
        assert tags[:2] == ["solution", "check"], f"{lesson.name}: exercise {n} is followed by cells tagged {tags}"


@pytest.mark.parametrize("lesson", LESSONS, ids=[p.stem for p in LESSONS])
def test_every_notebook_ends_with_a_five_question_self_check(lesson):
    cells = jupytext.read(lesson).cells
    last = cells[-1]
    assert last.cell_type == "markdown" and last.source.startswith("## Self-check"), (
        f"{lesson.name}: the last cell is not the `## Self-check` section")
    questions = re.findall(r"^(\d+)\. \S", last.source, re.M)
    assert questions == ["1", "2", "3", "4", "5"], f"{lesson.name}: self-check questions numbered {questions}"
    assert last.source.count(_ANSWER) == 5 and last.source.count("</details>") == 5, (
        f"{lesson.name}: each question needs its answer folded in {_ANSWER} ... </details>")


def test_the_exercise_form_is_recognised(tmp_path):
    """The checks above can fail: an exercise with no check cell, and a self-check whose answers
    are not folded, are reported."""
    lesson = tmp_path / "99_demo.py"
    lesson.write_text('# %% [markdown]\n# ### Exercise 1: one\n\n# %% tags=["solution"]\nx = 1\n\n'
                      '# %% tags=["check"]\nassert x == 1\n\n'
                      '# %% [markdown]\n# ### Exercise 2: two\n\n# %% tags=["solution"]\ny = 2\n\n'
                      "# %% [markdown]\n# ## Self-check\n#\n# 1. Why?\n#    Because.\n", encoding="utf-8")
    assert exercises(lesson) == [(1, ["solution", "check"]), (2, ["solution"])]
    with pytest.raises(AssertionError, match="exercise 2 is followed by cells tagged"):
        test_every_notebook_has_two_exercises_each_with_a_solution_and_its_check(lesson)
    with pytest.raises(AssertionError, match="self-check questions numbered"):
        test_every_notebook_ends_with_a_five_question_self_check(lesson)
