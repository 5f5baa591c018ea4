"""The committed notebooks are paired, executed and clean; nbval strict really compares outputs."""

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from tpupedia import notebooks

ROOT = Path(__file__).resolve().parents[1]


def test_every_lesson_has_an_executed_clean_notebook():
    assert notebooks.pairs(ROOT), "no lessons found"
    assert notebooks.check_all(ROOT) == []


def test_no_orphan_notebooks():
    lessons = {p.stem for p, _ in notebooks.pairs(ROOT)}
    assert {p.stem for p in (ROOT / "notebooks").glob("*.ipynb")} <= lessons


# --- the checks themselves catch what they claim to ------------------------------------------

def _code(source, outputs=(), count=None, tags=()):
    cell = nbformat.v4.new_code_cell(source, execution_count=count, outputs=list(outputs))
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def _write(tmp_path, cells, name="x.ipynb"):
    nb = nbformat.v4.new_notebook(cells=cells)
    path = tmp_path / name
    nbformat.write(nb, path)
    return path


def _stream(text):
    return nbformat.v4.new_output("stream", name="stdout", text=text)


def test_unexecuted_cell_is_caught(tmp_path):
    path = _write(tmp_path, [_code("1 + 1", count=1), _code("2 + 2", count=None)])
    assert "never executed" in " ".join(notebooks.check_executed(path))


def test_out_of_order_execution_is_caught(tmp_path):
    path = _write(tmp_path, [_code("a = 1", count=2), _code("a", count=1)])
    assert "execution count 2, expected 1" in " ".join(notebooks.check_executed(path))


def test_unexpected_error_is_caught_and_tagged_error_is_allowed(tmp_path):
    err = nbformat.v4.new_output("error", ename="ValueError", evalue="boom", traceback=[])
    bad = _write(tmp_path, [_code("raise ValueError", [err], count=1)], "bad.ipynb")
    ok = _write(tmp_path, [_code("raise ValueError", [err], count=1, tags=["raises-exception"])], "ok.ipynb")
    silent = _write(tmp_path, [_code("pass", count=1, tags=["raises-exception"])], "silent.ipynb")
    assert "unexpected error: ValueError" in " ".join(notebooks.check_executed(bad))
    assert notebooks.check_executed(ok) == []
    assert "raised nothing" in " ".join(notebooks.check_executed(silent))


@pytest.mark.parametrize(
    "text, label",
    [
        ("token=hf_" + "a" * 34, "Hugging Face token"),
        ("ghp_" + "B" * 36, "GitHub token"),
        ("AKIA" + "ABCDEFGHIJKLMNOP", "AWS access key"),
        ("saved to /home/alice/cache/model.safetensors", "home directory"),
        ("File /root/.cache/x.py, line 3", "home directory"),
        ("wrote /tmp/tmpab12cd/out.mp4", "temporary directory"),
        ("/opt/venv/lib/python3.11/site-packages/jax/_src/core.py", "installed package path"),
        ("C:\\Users\\bob\\model", "Windows user directory"),
    ],
)
def test_secrets_and_machine_paths_in_outputs_are_caught(tmp_path, text, label):
    path = _write(tmp_path, [_code("print(x)", [_stream(text)], count=1)])
    problems = notebooks.check_outputs_clean(path)
    assert any(label in p for p in problems), problems


def test_ordinary_outputs_are_not_flagged(tmp_path):
    text = "8 devices, platform 'cpu'\nP('data', 'model')\nv6e:2x4 is a v6e-8\n1/2 of the tokens"
    path = _write(tmp_path, [_code("print(x)", [_stream(text)], count=1)])
    assert notebooks.check_outputs_clean(path) == []


def test_pair_mismatch_is_caught(tmp_path):
    lesson_dir, nb_dir = tmp_path / "lessons", tmp_path / "notebooks"
    lesson_dir.mkdir()
    nb_dir.mkdir()
    lesson = lesson_dir / "99_demo.py"
    lesson.write_text("# %%\nx = 1\n\n# %%\nx + 1\n")
    nbformat.write(nbformat.v4.new_notebook(cells=[_code("x = 1", count=1), _code("x + 2", count=2)]),
                   nb_dir / "99_demo.ipynb")
    assert "cell 1 differs" in " ".join(notebooks.check_pair(lesson, nb_dir / "99_demo.ipynb"))
    assert "missing" in " ".join(notebooks.check_pair(lesson, nb_dir / "00_none.ipynb"))


# --- nbval in strict mode fails on a changed stored output ---------------------------------

def _run_nbval(path):
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *notebooks.NBVAL_ARGS, str(path)]
    env = {**os.environ, "TPUPEDIA_PRESET": "tiny"}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)


def test_nbval_strict_fails_when_a_stored_output_is_changed(tmp_path):
    """nbval with the project's arguments and sanitize config fails a real notebook cell whose
    stored output was changed (00_start_here's "ridge point: 560" made 561), and names both
    texts. The tampered copy ends with that cell: the cells after it (TPU compiles) are not
    needed to show a changed output caught, and the ones before it set it up as in the notebook."""
    source = ROOT / "notebooks" / "00_start_here.ipynb"
    nb = nbformat.read(source, as_version=4)
    tampered = copy.deepcopy(nb)
    index, target = next(
        (i, c) for i, c in enumerate(tampered.cells)
        if c.cell_type == "code" and any("ridge point: 560" in o.get("text", "") for o in c.outputs)
    )
    del tampered.cells[index + 1:]
    for out in target.outputs:
        if out.output_type == "stream":
            out.text = out.text.replace("ridge point: 560", "ridge point: 561")
    path = tmp_path / "00_tampered.ipynb"
    nbformat.write(tampered, path)
    shutil.copy(ROOT / "tests" / "nbval_sanitize.cfg", tmp_path / "nbval_sanitize.cfg")
    result = _run_nbval(path)
    assert result.returncode != 0, result.stdout[-2000:]
    assert "ridge point: 560" in result.stdout and "ridge point: 561" in result.stdout
    assert "1 failed" in result.stdout


def test_reading_time_is_computed_from_the_prose_and_the_code_and_a_wrong_one_is_caught(tmp_path):
    lesson = tmp_path / "00_x.py"
    prose = " ".join(["word"] * 401)
    code = "\n".join(f"x{i} = {i}" for i in range(45))
    lesson.write_text(f"# %% [markdown]\n# {prose}\n#\n# *Reading time: about 4 minutes.*\n\n# %%\n{code}\n\n\n# %%\n\ny = 1\n")
    # 406 words / 200 + 46 code lines / 30 = 2.03 + 1.53, rounded up; blank lines are not counted
    assert notebooks.reading_minutes(lesson) == 4
    assert notebooks.check_reading_time(lesson) == []
    lesson.write_text(lesson.read_text().replace("about 4 minutes", "about 3 minutes"))
    assert "about 4 minutes" in notebooks.check_reading_time(lesson)[0]


@pytest.mark.parametrize("page", ["learning-path.md", "zh/learning-path.md"])
def test_learning_path_times_are_rendered_from_the_lessons(page):
    """The learning path's reading and run columns are not copies: each row renders the
    lesson's reading time and the notebook's stored run time (`tpupedia.figures`), which are the
    numbers each notebook's header is checked against (above, and `tests/test_figures.py`)."""
    import re

    from tpupedia import figures

    text = (ROOT / "docs" / page).read_text()
    rows = re.findall(r"^\| (\d\d) \| \{\{ figure:reading\.(\d\d) \}\} \| \{\{ figure:run\.(\d\d) \}\} \|", text,
                      flags=re.M)
    lessons = sorted(lesson.stem[:2] for lesson, _ in notebooks.pairs())
    assert [r[0] for r in rows] == lessons and all(a == b == c for a, b, c in rows), rows
    rendered = figures.render(text, ROOT)
    for n in lessons:
        lesson = next((ROOT / "lessons").glob(f"{n}_*.py"))
        assert f"| {n} | {notebooks.reading_minutes(lesson)} min |" in rendered


# --- a measured error: compared by its bound, never by digits that follow the float order --------

@pytest.mark.parametrize("line, raw", [
    ("frames vs stock diffusers with the adapter fused: max abs error 3.1e-06", ["3.1e-06"]),
    ("reference rounded to bfloat16: max |diff| 0.00152 (bound 0.0517)", ["0.00152"]),
    ("quality against the uncached video: PSNR 53.9 dB, 1 - SSIM = 1.0e-04", ["53.9", "1.0e-04"]),
    ("max |unipc - euler| after each step: ['2.7e-04', '1.5e-01']", ["2.7e-04", "1.5e-01"]),
    ("frames vs stock diffusers: max abs error 3.1e-06 ≤ 1.0e-04", []),
    ("PSNR 53.9 dB ≥ 30.0 dB", []),
    ("online vs direct softmax attention: max abs diff < 1e-05", []),
    ("max abs difference from schedulers.unipc_step: 0.0", []),
    ("eps=1e-5, input x 0.001: max abs err 1.6e+00 ≥ 1.0e-04", []),  # the setting, then the value
    ("CogVideoX 720p: 2,414 padded keys (5.7%), upstream rel. error 3.5%", []),  # a figure from elsewhere
    ("step FLOPs 2.395e+15 (attention 68%)", []),  # no error named
])
def test_a_raw_measured_error_is_found_in_an_output_line(line, raw):
    assert notebooks.raw_measured_errors(line) == raw


def test_a_compared_cell_printing_a_raw_error_fails_the_check_and_a_variable_one_does_not(tmp_path):
    printed = "max abs error 3.1e-06\n"
    compared = _write(tmp_path, [_code("print(err)", [_stream(printed)], count=1)])
    variable = _write(tmp_path, [_code("# NBVAL_IGNORE_OUTPUT\nprint(err)", [_stream(printed)], count=1)], "v.ipynb")
    assert notebooks.check_measured(compared) == [
        "x.ipynb: cell 0 prints a measured error raw (3.1e-06) in a compared output: 'max abs error 3.1e-06'; "
        "print it with results.error_text(value, bound) or mark the cell NBVAL_IGNORE_OUTPUT"]
    assert notebooks.check_measured(variable) == []


def test_the_sanitizer_compares_a_measured_value_by_its_bound(tmp_path):
    """Strict nbval with the project's sanitize config (`results.MEASURED_PATTERN`): another
    machine's digits of a measured error pass, a changed bound or a broken bound fails. The stored
    outputs are this host's; the cells print what another host printed (notebook `fewer_steps`:
    3.1e-06 here, 4.7e-06 there)."""
    from tpupedia import results

    config = (ROOT / "tests" / "nbval_sanitize.cfg").read_text()
    assert f"regex: {results.MEASURED_PATTERN}\nreplace: MEASURED" in config  # one pattern, two places

    def cell(source, stored):
        return _code(f"print({source!r})", [_stream(stored + "\n")], count=1)

    other_digits = _write(tmp_path, [cell(f"max abs error {results.error_text(4.7e-6, 1e-4)}",
                                          f"max abs error {results.error_text(3.1e-6, 1e-4)}")], "a.ipynb")
    other_bound = _write(tmp_path, [cell("max abs error 4.7e-06 ≤ 1.0e-05", "max abs error 3.1e-06 ≤ 1.0e-04")],
                         "b.ipynb")
    broken = _write(tmp_path, [cell(f"max abs error {results.error_text(2e-4, 1e-4)}",
                                    f"max abs error {results.error_text(3.1e-6, 1e-4)}")], "c.ipynb")
    raw = _write(tmp_path, [cell("max abs error 4.7e-06", "max abs error 3.1e-06")], "d.ipynb")
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *notebooks.NBVAL_ARGS,
           *(str(p) for p in (other_digits, other_bound, broken, raw))]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "TPUPEDIA_PRESET": "tiny"})
    progress = result.stdout.split()[0]  # one mark per notebook, in the order given
    assert progress == ".FFF" and "3 failed, 1 passed" in result.stdout, result.stdout[-3000:]
