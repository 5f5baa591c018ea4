"""Notebooks on Colab or Kaggle (issue 39's free-TPU track): each lesson's first code cell starts
with a setup that installs the course on a hosted runtime and does nothing elsewhere, and its
title cell carries "Open in Colab" and "Open in Kaggle" links built from the repository URL in
pyproject.toml, left out while none is set (`tpupedia.notebooks.hosted_setup`, `hosted_links`)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from tpupedia import notebooks

ROOT = Path(__file__).resolve().parents[1]
REPO = "https://github.com/example/gpu-tpu-pedia"


def _course(tmp_path: Path, url: str | None) -> Path:
    """A copy of the repository's pyproject.toml (with `url` as its repository) and first lesson pair."""
    root = tmp_path / "course"
    (root / "lessons").mkdir(parents=True)
    (root / "notebooks").mkdir()
    text = (ROOT / "pyproject.toml").read_text()
    if url is not None:
        text = text.replace("[project.urls]\n", f'[project.urls]\nRepository = "{url}"\n', 1)
    (root / "pyproject.toml").write_text(text)
    for folder, suffix in (("lessons", ".py"), ("notebooks", ".ipynb")):
        shutil.copy(ROOT / folder / f"00_start_here{suffix}", root / folder / f"00_start_here{suffix}")
    return root


def test_the_repository_setting_is_read_and_checked(tmp_path):
    assert notebooks.repository(ROOT) is None  # no public address yet: no links in the committed notebooks
    assert notebooks.repository(_course(tmp_path / "a", REPO)) == REPO
    with pytest.raises(ValueError, match=r"Repository = 'https://gitlab.com/x/y': give a GitHub https URL"):
        notebooks.repository(_course(tmp_path / "b", "https://gitlab.com/x/y"))


def test_links_are_built_from_the_setting_and_left_out_without_one():
    assert notebooks.hosted_links("02_sharding.ipynb", None) == ""
    links = notebooks.hosted_links("02_sharding.ipynb", REPO + ".git")
    assert links == ("[Open in Colab](https://colab.research.google.com/github/example/gpu-tpu-pedia/blob/main/"
                     "notebooks/02_sharding.ipynb) · [Open in Kaggle](https://www.kaggle.com/kernels/welcome?src="
                     "https://github.com/example/gpu-tpu-pedia/blob/main/notebooks/02_sharding.ipynb)")


def test_every_committed_lesson_has_the_setup_and_the_links_the_setting_gives():
    repo = notebooks.repository(ROOT)
    problems = [p for lesson, _ in notebooks.pairs(ROOT) for p in notebooks.check_hosted(lesson, repo)]
    assert problems == []


def test_setting_a_repository_adds_the_links_and_unsetting_removes_them(tmp_path):
    """`python -m tpupedia.notebooks hosted` after the setting changes: the lesson and its notebook
    get the links and the clone of that repository; the notebook's outputs stay; back without a
    setting, the links go and the setup refuses on a hosted runtime."""
    import jupytext

    root = _course(tmp_path, REPO)
    lesson, notebook = root / "lessons" / "00_start_here.py", root / "notebooks" / "00_start_here.ipynb"
    outputs = [c.get("outputs") for c in jupytext.read(notebook).cells if c.cell_type == "code"]
    assert notebooks.check_hosted(lesson, REPO)  # the committed lesson has no links: flagged
    assert notebooks.write_hosted(lesson, REPO) and not notebooks.write_hosted(lesson, REPO)  # the second: no change
    assert notebooks.check_hosted(lesson, REPO) == [] and notebooks.check_pair(lesson, notebook) == []
    assert "[Open in Colab](https://colab.research.google.com/github/example/gpu-tpu-pedia/" in lesson.read_text()
    assert f'"{REPO}", course]' in lesson.read_text()
    assert [c.get("outputs") for c in jupytext.read(notebook).cells if c.cell_type == "code"] == outputs
    assert notebooks.write_hosted(lesson, None)
    assert notebooks.check_hosted(lesson, None) == [] and "Open in Colab" not in lesson.read_text()
    assert lesson.read_text().count("Open in Colab") == 0 and notebooks.check_pair(lesson, notebook) == []


def _run_setup(repo, monkeypatch, hosted: str | None) -> list:
    """Execute `hosted_setup(repo)` as the first cell would, on a runtime that looks like `hosted`
    (`colab`, `kaggle` or `None`), with `subprocess.run`, `os.chdir` and `sys.path` recorded."""
    import subprocess

    calls: list = []
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE", raising=False)
    if hosted == "colab":
        monkeypatch.setitem(sys.modules, "google.colab", type(sys)("google.colab"))
    elif hosted == "kaggle":
        monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    monkeypatch.setattr(subprocess, "run", lambda args, check: calls.append(("run", args)))
    monkeypatch.setattr(os, "chdir", lambda path: calls.append(("chdir", path)))
    monkeypatch.setattr(os.path, "isdir", lambda path: False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    exec(compile(notebooks.hosted_setup(repo), "setup", "exec"), {})  # the cell's own code
    return calls + [("path", p) for p in sys.path if p.endswith("/src") and "gpu-tpu-pedia" in p]


def test_the_setup_does_nothing_off_a_hosted_runtime(monkeypatch):
    assert _run_setup(REPO, monkeypatch, None) == [] and _run_setup(None, monkeypatch, None) == []


@pytest.mark.parametrize("hosted, home", [("colab", "/content"), ("kaggle", "/kaggle/working")])
def test_on_a_hosted_runtime_the_setup_clones_installs_and_moves_to_the_notebooks(hosted, home, monkeypatch):
    course = f"{home}/gpu-tpu-pedia"
    assert _run_setup(REPO, monkeypatch, hosted) == [
        ("run", ["git", "clone", "--quiet", "--depth", "1", REPO, course]),
        ("run", [sys.executable, "-m", "pip", "install", "--quiet", "--extra-index-url", notebooks.TORCH_CPU_INDEX,
                 "-r", f"{course}/requirements/ci.txt", "-c", f"{course}/requirements/lock.txt", "-e", course]),
        ("chdir", f"{course}/notebooks"), ("path", f"{course}/src")]
    with pytest.raises(RuntimeError, match="names no public repository to install from"):
        _run_setup(None, monkeypatch, hosted)
