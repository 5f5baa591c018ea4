"""Keeping the paired notebooks honest: execute lessons, and check what is committed.

Each lesson is a jupytext py:percent file, `lessons/NN_slug.py`, paired with an executed
notebook, `notebooks/NN_slug.ipynb`, which is what nbval re-runs and the site renders.
`execute` regenerates a notebook from its lesson (`make notebooks`); the `check_*`
functions are what `make test` enforces on every committed notebook:

* the lesson and the notebook hold the same cells (`check_pair`);
* every code cell ran, in order, in one session, and errors appear only in cells tagged
  `raises-exception` (`check_executed`);
* no stored output holds a token-like string or a path from the machine that ran it
  (`check_outputs_clean`);
* no compared output prints a measured error raw, whose digits would differ on the next machine
  (`check_measured`);
* the header's reading time is the one its prose implies (`check_reading_time`).

Usage: `python -m tpupedia.notebooks execute lessons/00_start_here.py`,
`python -m tpupedia.notebooks check` or `python -m tpupedia.notebooks nbval`.
"""

from __future__ import annotations

import functools
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

from tpupedia import files
from tpupedia.results import MEASURED_AFTER

__all__ = [
    "SECRET_PATTERNS",
    "MACHINE_PATH_PATTERNS",
    "pairs",
    "execute",
    "check_pair",
    "check_executed",
    "check_outputs_clean",
    "check_measured",
    "raw_measured_errors",
    "WORDS_PER_MINUTE",
    "CODE_LINES_PER_MINUTE",
    "reading_minutes",
    "check_reading_time",
    "check_all",
    "only_asserts",
    "check_folded",
    "CORE",
    "lesson",
    "REPOSITORY_KEY",
    "repository",
    "hosted_links",
    "hosted_setup",
    "check_hosted",
    "write_hosted",
]

SECRET_PATTERNS: dict[str, re.Pattern[str]] = {
    "Hugging Face token": re.compile(r"\bhf_[A-Za-z0-9]{30,}"),
    "GitHub token": re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})"),
    "OpenAI-style key": re.compile(r"\bsk-[A-Za-z0-9_-]{20,}"),
    "AWS access key": re.compile(r"\bAKIA[0-9A-Z]{16}\b"),
    "Google OAuth token": re.compile(r"\bya29\.[A-Za-z0-9_-]{20,}"),
    "private key": re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
}

MACHINE_PATH_PATTERNS: dict[str, re.Pattern[str]] = {
    "home directory": re.compile(r"(?:/home/[^/\s'\"]+|/Users/[^/\s'\"]+|/root)(?:/|\b)"),
    "Windows user directory": re.compile(r"[A-Za-z]:\\\\?Users\\\\?", re.IGNORECASE),
    "temporary directory": re.compile(r"(?<![\w.])/(?:tmp|private/var/folders|var/folders)/"),
    "workspace path": re.compile(r"(?<![\w.])/work/"),
    "installed package path": re.compile(r"(?:site|dist)-packages/"),
}

CORE = ("start_here", "hf_model_in_jax", "sharding", "image_processing", "cogvideox_pipeline", "plan_without_tpu")
"""The core path, by slug: from a Hugging Face model in JAX to one family's video planned for a
TPU slice and run on a TPU VM (the learning path's afternoon). It uses splash attention and the
Flax VAE as finished parts; the other notebooks open them, and go deeper (profiling, two more
families, several hosts)."""


def lesson(slug: str, root: Path | None = None) -> Path:
    """The lesson file of notebook `slug` (`lessons/NN_slug.py`), whatever its number."""
    found = sorted((root or _root()).glob(f"lessons/[0-9][0-9]_{slug}.py"))
    if len(found) != 1:
        raise FileNotFoundError(f"notebook {slug!r}: {len(found)} lessons match lessons/NN_{slug}.py")
    return found[0]


REPOSITORY_KEY = "Repository"
"""The `[project.urls]` entry of pyproject.toml naming the course's public git repository (a
GitHub https URL): what the notebooks' "Open in Colab" and "Open in Kaggle" links and their
hosted-runtime setup are built from. None is set while the repository has no public address:
the notebooks then carry no links, and on a hosted runtime their setup says there is nothing to
install from."""
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
"""Where the hosted setup finds the pinned torch as a CPU wheel: from PyPI alone, pip would fetch
the CUDA build, gigabytes a TPU runtime never uses."""
_GITHUB = re.compile(r"https://github\.com/([\w.-]+)/([\w.-]+?)(?:\.git)?/?")
_SETUP_FIRST = "# On Colab or Kaggle: fetch and install the course once, then work in its notebooks/ folder;"
_SETUP_LAST = "# (end of the hosted-runtime setup: python -m tpupedia.notebooks hosted writes the lines above)"


def repository(root: Path | None = None) -> str | None:
    """The repository URL `pyproject.toml` names under `[project.urls]` (`REPOSITORY_KEY`), or `None`.
    Raises `ValueError` for one that is not a GitHub https URL (Colab opens notebooks from GitHub)."""
    import tomllib

    urls = tomllib.loads(((root or _root()) / "pyproject.toml").read_text())["project"].get("urls", {})
    url = (urls.get(REPOSITORY_KEY) or "").strip()
    if url and not _GITHUB.fullmatch(url):
        raise ValueError(f"[project.urls] {REPOSITORY_KEY} = {url!r}: give a GitHub https URL, "
                         "https://github.com/OWNER/REPO (Colab and Kaggle open notebooks from GitHub)")
    return url or None


def hosted_links(notebook: str, repo: str | None) -> str:
    """The markdown line of "Open in Colab" and "Open in Kaggle" links to `notebooks/NOTEBOOK` of
    `repo` (its main branch), or "" without a repository."""
    m = _GITHUB.fullmatch(repo or "")
    if not m:
        return ""
    path = f"{m.group(1)}/{m.group(2)}/blob/main/notebooks/{notebook}"
    return (f"[Open in Colab](https://colab.research.google.com/github/{path}) · "
            f"[Open in Kaggle](https://www.kaggle.com/kernels/welcome?src=https://github.com/{path})")


def hosted_setup(repo: str | None) -> str:
    """The lines a notebook's first code cell starts with: on Colab or Kaggle (found by the
    `google.colab` module or Kaggle's `KAGGLE_KERNEL_RUN_TYPE` variable), clone `repo` once,
    install it as `make test` does (`requirements/ci.txt` with `requirements/lock.txt`; torch as
    its CPU wheel, `TORCH_CPU_INDEX`), put its
    `src` on the path (a running kernel does not see a new editable install) and move to its
    `notebooks/` folder, where the notebooks' relative paths point; anywhere else, nothing.
    Without a repository, a hosted runtime stops here with what to do instead. The last line
    marks the setup's end (what `write_hosted` replaces, what the preset-gate test leaves out)."""
    lines = [_SETUP_FIRST, "# anywhere else this does nothing.", "import os", "import sys", "",
             'if "google.colab" in sys.modules or "KAGGLE_KERNEL_RUN_TYPE" in os.environ:']
    if repo is None:
        lines += ['    raise RuntimeError("this copy of the course names no public repository to install from: clone the "',
                  '                       "course yourself, install it as its README says, and open its notebooks/ folder")']
    else:
        lines += ['    import subprocess',
                  f'    TORCH_CPU = "{TORCH_CPU_INDEX}"  # the pinned torch as its CPU wheel, not a CUDA one',
                  '    course = os.path.join("/content" if "google.colab" in sys.modules else "/kaggle/working", '
                  '"gpu-tpu-pedia")',
                  '    if not os.path.isdir(course):',
                  f'        subprocess.run(["git", "clone", "--quiet", "--depth", "1", "{repo}", course], check=True)',
                  '        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--extra-index-url", TORCH_CPU,',
                  '                        "-r", f"{course}/requirements/ci.txt", "-c", f"{course}/requirements/lock.txt",',
                  '                        "-e", course], check=True)',
                  '    sys.path.insert(0, os.path.join(course, "src"))',
                  '    os.chdir(os.path.join(course, "notebooks"))']
    return "\n".join([*lines, _SETUP_LAST])


def _first_cells(nb) -> tuple[Any, Any]:
    markdown = next(c for c in nb.cells if c.cell_type == "markdown")
    code = next(c for c in nb.cells if c.cell_type == "code")
    return markdown, code


def check_hosted(lesson: Path, repo: str | None) -> list[str]:
    """The lesson's title cell carries `hosted_links` for its notebook (no link without a
    repository) and its first code cell starts with `hosted_setup` (after `%xmode`)."""
    import jupytext

    markdown, code = _first_cells(jupytext.read(lesson))
    problems, links = [], hosted_links(f"{Path(lesson).stem}.ipynb", repo)
    found = [line for line in markdown.source.splitlines() if "[Open in Colab]" in line]
    if found != ([links] if links else []):
        problems.append(f"{Path(lesson).name}: the title cell's Colab/Kaggle links are {found or 'absent'}, the "
                        f"repository setting gives {links or 'none'} (python -m tpupedia.notebooks hosted)")
    body = "\n".join(line for line in code.source.splitlines() if not line.startswith("%xmode"))
    if not body.startswith(hosted_setup(repo) + "\n"):
        problems.append(f"{Path(lesson).name}: its first code cell does not start with the hosted-runtime setup "
                        "(python -m tpupedia.notebooks hosted)")
    return problems


def write_hosted(lesson: Path, repo: str | None) -> bool:
    """Rewrite `lesson` (and its paired notebook's same cells, outputs kept) so that
    `check_hosted` passes; returns whether anything changed. Off a hosted runtime the setup does
    nothing, so the notebook's stored outputs stay what the cells print."""
    import jupytext

    lesson = Path(lesson)
    notebook = lesson.parents[1] / "notebooks" / f"{lesson.stem}.ipynb"
    changed = False
    for path, fmt in ((lesson, "py:percent"), (notebook, "ipynb")):
        if not path.exists():
            continue
        nb = jupytext.read(path)
        markdown, code = _first_cells(nb)
        title = [line for line in markdown.source.splitlines() if "[Open in Colab]" not in line]
        while len(title) > 2 and title[1] == "" and title[2] == "":  # the blank line a removed link leaves
            del title[1]
        links = hosted_links(f"{lesson.stem}.ipynb", repo)
        if links:
            title[1:1] = ["", links]
        source = "\n".join(title)
        lines = code.source.splitlines()
        magics = [line for line in lines if line.startswith("%xmode")]
        rest = "\n".join(line for line in lines if not line.startswith("%xmode"))
        if rest.startswith(_SETUP_FIRST):  # an older setup: up to its end marker
            rest = rest.split(_SETUP_LAST + "\n", 1)[1].lstrip("\n") if _SETUP_LAST in rest else ""
        setup = "\n".join([*magics, hosted_setup(repo), "", rest])
        if (source, setup) != (markdown.source, code.source):
            markdown.source, code.source, changed = source, setup, True
            files.write_atomic(path, lambda tmp, nb=nb, fmt=fmt: jupytext.write(nb, tmp, fmt=fmt), suffix=path.suffix)
    return changed


TAG_RAISES = "raises-exception"

# How `make test` runs nbval: strict output comparison (`--nbval`, not `--nbval-lax`), the
# kernel of this environment, a generous per-cell timeout, and one sanitizer for memory addresses.
# Cells whose output is inherently variable (timings) carry `# NBVAL_IGNORE_OUTPUT` and still run.
NBVAL_ARGS = (
    "--nbval",
    "--nbval-current-env",
    "--nbval-cell-timeout=900",
    "--nbval-sanitize-with",
    "tests/nbval_sanitize.cfg",
)


def _root() -> Path:
    return Path(__file__).resolve().parents[2]


def pairs(root: Path | None = None) -> list[tuple[Path, Path]]:
    """`(lesson, notebook)` paths for every lesson, whether or not the notebook exists yet."""
    root = root or _root()
    return [(py, root / "notebooks" / f"{py.stem}.ipynb") for py in sorted((root / "lessons").glob("[0-9][0-9]_*.py"))]


def _cells(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


def check_pair(lesson: Path, notebook: Path) -> list[str]:
    """Problems that make `lesson` and `notebook` differ in their cells (empty: in sync)."""
    import jupytext

    if not notebook.exists():
        return [f"{notebook.name}: missing; run `make notebooks`"]
    py, ipynb = _cells(jupytext.read(lesson)), _cells(jupytext.read(notebook))
    if py == ipynb:
        return []
    for i, (a, b) in enumerate(zip(py, ipynb)):
        if a != b:
            return [f"{notebook.name}: cell {i} differs from {lesson.name}; run `make notebooks`"]
    return [f"{notebook.name}: {len(ipynb)} cells but {lesson.name} has {len(py)}; run `make notebooks`"]


def _tags(cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def check_executed(notebook: Path) -> list[str]:
    """Problems with how `notebook` was executed (empty: every code cell ran, in order)."""
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    problems = []
    expected = 1
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if cell.execution_count is None:
            problems.append(f"{notebook.name}: code cell {i} was never executed")
            continue
        if cell.execution_count != expected:
            problems.append(
                f"{notebook.name}: code cell {i} has execution count {cell.execution_count}, "
                f"expected {expected} (execute the whole notebook top to bottom)"
            )
        expected = cell.execution_count + 1
        errors = [o for o in cell.outputs if o.output_type == "error"]
        raises = TAG_RAISES in _tags(cell)
        if errors and not raises:
            problems.append(f"{notebook.name}: code cell {i} stored an unexpected error: {errors[0].ename}")
        if raises and not errors:
            problems.append(f"{notebook.name}: code cell {i} is tagged {TAG_RAISES} but raised nothing")
    return problems


def _output_texts(nb):
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                yield i, out.text
            elif out.output_type == "error":
                yield i, "\n".join([out.ename, out.evalue, *out.traceback])
            else:
                for mime, data in out.get("data", {}).items():
                    if mime.startswith("text/") or mime.endswith("json"):
                        yield i, data if isinstance(data, str) else str(data)


def check_outputs_clean(notebook: Path) -> list[str]:
    """Stored outputs that hold a token-like string or a machine path (empty: clean)."""
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    problems = []
    for i, text in _output_texts(nb):
        for label, pattern in {**SECRET_PATTERNS, **MACHINE_PATH_PATTERNS}.items():
            m = pattern.search(text)
            if m:
                problems.append(f"{notebook.name}: cell {i} output holds a {label}: {m.group(0)!r}")
    return problems


WORDS_PER_MINUTE = 200
"""Prose, read closely: technical English at 200 words a minute."""
CODE_LINES_PER_MINUTE = 30
"""Code, read to follow it (not to type it): 30 non-blank lines a minute, two seconds a line.
Every code cell counts, an exercise's solution and check included."""
_READING = re.compile(r"\*Reading time: about (\d+) minutes\.\*")


def _prose_words(lesson: Path) -> list[str]:
    """The words of a lesson's markdown cells, in order."""
    import jupytext

    return [w for c in jupytext.read(lesson).cells if c.cell_type == "markdown" for w in "".join(c.source).split()]


def _code_lines(lesson: Path) -> int:
    """The non-blank lines of a lesson's code cells."""
    import jupytext

    return sum(1 for c in jupytext.read(lesson).cells if c.cell_type == "code"
               for line in "".join(c.source).splitlines() if line.strip())


def reading_minutes(lesson: Path) -> int:
    """Minutes to read a lesson, prose and code, by one rule: its markdown words /
    `WORDS_PER_MINUTE` plus its code cells' non-blank lines / `CODE_LINES_PER_MINUTE`, rounded up
    (the learning path states it). Counted once per version of the file (the docs build asks for
    each lesson's several times)."""
    lesson = Path(lesson)
    stat = lesson.stat()
    return _reading_minutes(str(lesson.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=None)
def _reading_minutes(path: str, mtime_ns: int, size: int) -> int:  # noqa: ARG001 - the file's version is the key
    lesson = Path(path)
    return _minutes(len(_prose_words(lesson)), _code_lines(lesson))


def _minutes(words: int, code_lines: int) -> int:
    return math.ceil(words / WORDS_PER_MINUTE + code_lines / CODE_LINES_PER_MINUTE)


def check_reading_time(lesson: Path) -> list[str]:
    """The header states `*Reading time: about N minutes.*` with N = `reading_minutes`."""
    stated = _READING.findall(" ".join(_prose_words(lesson)))
    computed = reading_minutes(lesson)
    if stated != [str(computed)]:
        return [f"{Path(lesson).name}: header states reading time {stated or 'nowhere'}; its prose and code imply "
                f"*Reading time: about {computed} minutes.*"]
    return []


def only_asserts(source: str) -> bool:
    """Whether a code cell does nothing but check: every statement an `assert`, an
    `np.testing.assert_*` call, or a `for`/`if` holding only such statements."""
    import ast

    def checks(node: ast.stmt) -> bool:
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            name = ast.unparse(node.value.func)
            return name.split(".")[-1].startswith("assert_")
        if isinstance(node, (ast.For, ast.If)):
            return all(checks(n) for n in node.body + node.orelse)
        return False

    try:
        body = ast.parse("\n".join(line for line in source.splitlines() if not line.startswith("%"))).body
    except SyntaxError:
        return False
    return bool(body) and all(checks(n) for n in body)


def check_folded(lesson: Path) -> list[str]:
    """Every code cell that only asserts is tagged `check`, so the site folds it behind a summary
    line (`docs/hooks.py`) while CI still runs it."""
    import jupytext

    return [f"{Path(lesson).name}: code cell {i} only asserts; tag it check (# %% tags=[\"check\"])"
            for i, c in enumerate(jupytext.read(lesson).cells)
            if c.cell_type == "code" and only_asserts(c.source) and "check" not in c.metadata.get("tags", [])]


_ERROR_WORDS = re.compile(r"(?i)\b(?:errors?|err|diffs?|differences?|deviations?|psnr|ssim|ulps?|units of the last "
                          r"place|mismatch)\b|\|[^|]*(?:diff|err| - )[^|]*\|")
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d+\.\d+(?:e[-+]?\d+)?|\d+e[-+]?\d+)(?![\w.])")
_BOUND_BEFORE = re.compile(r"(?i)(?:[<>≤≥]=?|\bbounds?|\babove|\bbelow|\bunder|\btolerance)\W{0,3}$")
_MEASURED_AFTER = re.compile("^" + MEASURED_AFTER)
IGNORE_OUTPUT = "NBVAL_IGNORE_OUTPUT"


def raw_measured_errors(line: str) -> list[str]:
    """The numbers in one output line that follow a word naming an error (an error, a difference,
    `|a - b|`, PSNR, SSIM, units in the last place) and are printed raw: not zero, not a bound
    (after `<`, `≤`, `bound`, ...) and not a measured value against its bound
    (`tpupedia.results.measured_text`). Numbers before the word are the setting measured (`eps=1e-5,
    input x 0.001: max abs err ...`); a figure from elsewhere (a line that says `reported` or
    `upstream`) is a constant, not a measurement."""
    first = _ERROR_WORDS.search(line)
    if not first or re.search(r"(?i)\b(?:reported|upstream)\b", line):
        return []
    raw = []
    for m in _NUMBER.finditer(line, first.end()):
        if float(m.group(0)) == 0.0 or _BOUND_BEFORE.search(line[: m.start()]) or _MEASURED_AFTER.match(line[m.end():]):
            continue
        raw.append(m.group(0))
    return raw


def check_measured(notebook: Path) -> list[str]:
    """Compared cells (no `# NBVAL_IGNORE_OUTPUT`) whose stored output prints a measured error
    raw: its digits follow the machine's floating-point order, and strict nbval compares them
    character by character. Print it against its bound (`tpupedia.results.error_text`,
    `measured_text`) or mark the cell variable while its assert keeps the proof."""
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    problems = []
    for i, text in _output_texts(nb):
        if IGNORE_OUTPUT in nb.cells[i].source:
            continue
        for line in text.splitlines():
            raw = raw_measured_errors(line)
            if raw:
                problems.append(f"{notebook.name}: cell {i} prints a measured error raw ({', '.join(raw)}) in a "
                                f"compared output: {line.strip()[:100]!r}; print it with results.error_text(value, "
                                f"bound) or mark the cell {IGNORE_OUTPUT}")
    return problems


def check_all(root: Path | None = None) -> list[str]:
    """Every hygiene problem in the repository's lessons and notebooks."""
    problems = []
    try:
        repo = repository(root)
    except ValueError as err:
        return [str(err)]
    for lesson, notebook in pairs(root):
        problems += (check_pair(lesson, notebook) + check_reading_time(lesson) + check_hosted(lesson, repo)
                     + check_folded(lesson))
        if notebook.exists():
            problems += check_executed(notebook) + check_outputs_clean(notebook) + check_measured(notebook)
    return problems


def execute(lesson: Path | str, timeout: int = 900) -> Path:
    """Execute `lesson` with the tiny preset and write its paired, executed notebook."""
    import jupytext
    from nbclient import NotebookClient

    lesson = Path(lesson).resolve()
    notebook = lesson.parents[1] / "notebooks" / f"{lesson.stem}.ipynb"
    nb = jupytext.read(lesson)
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    os.environ.setdefault("TPUPEDIA_PRESET", "tiny")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(notebook.parent)}},
    )
    client.execute()
    files.write_atomic(notebook, lambda tmp: jupytext.write(nb, tmp, fmt="ipynb"), suffix=".ipynb")
    problems = check_executed(notebook) + check_outputs_clean(notebook)
    if problems:
        raise RuntimeError("\n".join(problems))
    return notebook


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["execute"] and len(argv) > 1:
        for path in argv[1:]:
            print(f"executed {execute(path).name}")
        return 0
    if argv[:1] == ["nbval"]:
        import pytest

        return int(pytest.main(["-p", "no:cacheprovider", "-q", *NBVAL_ARGS, *(argv[1:] or ["notebooks"])]))
    if argv[:1] == ["hosted"]:
        repo = repository()
        changed = [lesson.name for lesson, _ in pairs() if write_hosted(lesson, repo)]
        print(f"hosted-runtime setup and links ({repo or 'no repository set'}): "
              + (", ".join(changed) if changed else "every lesson already has them"))
        return 0
    if argv[:1] == ["check"]:
        problems = check_all()
        print("\n".join(problems) or "notebooks: all clean")
        return 1 if problems else 0
    print("usage: python -m tpupedia.notebooks execute LESSON.py [...] | check | hosted | nbval [PATH ...]",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
