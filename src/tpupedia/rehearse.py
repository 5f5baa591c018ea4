"""`make rehearse`: every full-size way in, run as on a TPU slice, on a host without one.

Each rehearsal is a `tpupedia generate` command line (`ways`, from the family registry: text and
image to video for each family, its releases, a LoRA, a step cache, a batch) or a notebook's
full-preset calls into the library (`notebooks`), run under `TPUPEDIA_PRESET=full` with `TPUPEDIA_REHEARSE=TOPOLOGY`
(`tpupedia.rehearsal`): each way in reads its checkpoint's configs from those the family builds
in, checks its plan by compiling every program of the run ahead of time for the slice (one layer
per model, scaled, as `tpupedia plan` does; kept compiles are read back, `tpupedia.aot`), and
stops before a weight loads. A way in whose plan does not fit fails the rehearsal with the
plan's own error (the stage, its need, the fix) and the caller's name: the command line, or the
notebook and cell. Of a notebook (its Python file, `lessons/NN_slug.py`) the cells that call a
pipeline run, with the cells that bind the names they read (`needed_cells`); a cell that needs
what only a TPU VM has (weights from the Hub, a stage's output) is reported as not reached and the
next one runs, and a notebook none of whose calls was rehearsed fails.

Introduced in notebook `plan_without_tpu` (plan without a TPU); `make rehearse` runs it after
`make test` in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Way", "ways", "notebooks", "RECORDED", "recorded", "rehearse_way", "rehearse_notebook", "needed_cells", "python", "command_outcome",
           "main"]

PROMPT = 'A neon sign that says "OPEN" flickers on a rainy street at night.'
"""A prompt that quotes a word, so HunyuanVideo-1.5's glyph encoder is planned too."""


@dataclass(frozen=True)
class Way:
    """One `tpupedia generate` command line a reader runs on a TPU VM (`args`, after `generate`;
    `{picture}`, `{lora}`, `{prompts}` and `{work}` are filled in by `rehearse_way`)."""

    name: str
    args: tuple[str, ...]


def ways() -> list[Way]:
    """Every `generate` path, from the family registry: each video family's text-to-video run,
    its image-to-video run where it has one, each built-in release it plans from its own configs
    (`FamilySpec.releases`, with a picture where the release takes one) and each few-step
    `--release`; and on the first family, `--lora`, `--step-cache` and `--prompts`."""
    import importlib

    from tpupedia import families

    out: list[Way] = []
    for spec in families.video():
        pipe = importlib.import_module(spec.pipeline).PIPELINE
        picture = ("--image", "{picture}")
        out.append(Way(f"{spec.name} t2v", (spec.name,)))
        if pipe.image_to_video:
            out.append(Way(f"{spec.name} i2v", (spec.name, *picture)))
        for model, built in spec.releases.items():
            if model not in (pipe.family.FULL_ID, getattr(pipe.family, "FULL_ID_I2V", None)):
                out.append(Way(f"{spec.name} --model {model}", (spec.name, "--model", model)
                               + (picture if built.get("image_to_video") else ())))
        for name, release in spec.few_step.items():
            out.append(Way(f"{spec.name} --release {name}", (spec.name, "--release", name)
                           + (picture if release.image_to_video else ())))
    first = families.video()[0].name
    out += [Way(f"{first} --lora", (first, "--lora", "{lora}")),
            Way(f"{first} --step-cache", (first, "--step-cache", "fbcache:0.1")),
            Way(f"{first} --prompts", (first, "--prompts", "{prompts}", "--outdir", "{work}/batch"))]
    return out


def notebooks(lessons: Path = Path("lessons")) -> list[str]:
    """The lessons that call a pipeline (`run`, `run_batch`, a stage method: `_CALL`), by slug."""
    return [p.stem for p in sorted(lessons.glob("[0-9][0-9]_*.py")) if _CALL.search(p.read_text(encoding="utf-8"))]


RECORDED = "recorded.json"
"""The file in the kept-compiles folder (`--keep`) naming the ways in and notebooks whose
compiles a passing rehearsal kept there, so `make rehearse` (and CI) reruns them in minutes; the
others run with `--all`, compiling what is not kept (a full-size tiled VAE decode or picture
encode takes the TPU compiler 5 to 20 minutes per program on a 2-core host)."""


def recorded(folder: str | Path | None) -> set[str]:
    """The names `RECORDED` in `folder` lists (none without a folder, or a file that does not parse)."""
    try:
        return set(json.loads((Path(folder) / RECORDED).read_text())["recorded"]) if folder else set()
    except (OSError, ValueError, KeyError, TypeError):
        return set()


_CALL = re.compile(r"\b(?:pipeline\.run|run_batch|\.encode_text|\.encode_image|\.denoise|pipe\w*\.decode)\(")


@dataclass
class Outcome:
    """What one rehearsal found: the calls that planned (`Rehearsed` lines), a failure, what was
    not reached, and its time."""

    name: str
    rehearsed: list[str] = field(default_factory=list)
    failed: str = ""
    not_reached: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed and bool(self.rehearsed)


def _inputs(work: Path) -> dict[str, str]:
    """The files the command lines name: a picture, a LoRA adapter, a prompts file."""
    import numpy as np
    from PIL import Image

    picture = work / "picture.png"
    Image.fromarray(np.linspace(0, 255, 720 * 1280 * 3).reshape(720, 1280, 3).astype("uint8")).save(picture)
    prompts = work / "prompts.txt"
    prompts.write_text(f"{PROMPT}\nA red fox runs through snow.\n", encoding="utf-8")
    return {"picture": str(picture), "lora": str(_lora(work)), "prompts": str(prompts), "work": str(work)}


def _lora(work: Path) -> Path:
    """A rank-4 adapter on the first block's attention projections of the first family's release
    transformer (built on PyTorch's `meta` device from its config: shapes only), in the layout
    diffusers' `save_lora_weights` writes."""
    import diffusers
    import torch
    from safetensors.torch import save_file

    from tpupedia import families

    facts = families.video()[0].facts
    config = {k: v for k, v in facts.full_configs()["transformer"].items() if not k.startswith("_")} | {"num_layers": 1}
    with torch.device("meta"):
        model = getattr(diffusers, facts.TRANSFORMER_CLASS).from_config(config)
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in ("to_q", "to_k", "to_v"):
            tensors[f"transformer.{name}.lora_A.weight"] = torch.zeros(4, module.in_features)
            tensors[f"transformer.{name}.lora_B.weight"] = torch.zeros(module.out_features, 4)
    path = work / "style.safetensors"
    save_file(tensors, str(path))
    return path


def _env(topology: str, preset: str = "full") -> dict[str, str]:
    """A rehearsal's environment: the preset (`full`; the tests rehearse `tiny`), the slice,
    offline (nothing is fetched), on the host's CPU, which lists as many devices as the slice has,
    so that a mesh a notebook builds by hand over the VM's devices builds here too."""
    from tpupedia import hardware

    return dict(os.environ, TPUPEDIA_PRESET=preset, TPUPEDIA_REHEARSE=topology, HF_HUB_OFFLINE="1",
                JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false",
                JAX_NUM_CPU_DEVICES=str(hardware.parse_topology(topology).num_devices))


def rehearse_way(path: Way, topology: str, work: Path, inputs: dict[str, str]) -> Outcome:
    """Run `path`'s command line in a fresh process under the rehearsal; its last line says what
    was planned, or the error that stopped it."""
    args = ["generate", *[a.format(**inputs) for a in path.args], "--quiet"]  # the preset: $TPUPEDIA_PRESET
    if "--prompts" not in args:
        args += ["--prompt", PROMPT, "--workdir", str(work / "run")]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tpupedia.cli", *args], cwd=work, env=_env(topology),
                          capture_output=True, text=True)
    return command_outcome(path.name, args, done.returncode, done.stdout, done.stderr, time.perf_counter() - start)


def command_outcome(name: str, args: list[str], returncode: int, stdout: str, stderr: str,
                    seconds: float = 0.0) -> Outcome:
    """What a `tpupedia generate` run under a rehearsal said: the rehearsal's line (stdout, exit
    0), else its one-line error (stderr), else the last line it printed (a traceback's); warnings
    on stderr change neither."""
    out = Outcome(name, seconds=seconds)
    said = [line for line in stdout.splitlines() if line.startswith("tpupedia generate: rehearsed ")]
    if returncode == 0 and said:
        out.rehearsed.append(said[-1].removeprefix("tpupedia generate: "))
        return out
    errors = [line for line in stderr.splitlines() if line.startswith("tpupedia generate: ")]
    lines = errors or [line for line in (stdout + stderr).splitlines() if line.strip()]
    out.failed = f"tpupedia {' '.join(args)}: " + (lines[-1] if lines else f"exit {returncode}, nothing printed")
    return out


def python(source: str) -> str:
    """A code cell as plain Python: its IPython magics and shell lines (`%xmode`, `!pip`) left out."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


def _names(source: str) -> tuple[set[str], set[str]]:
    """`(defined, used)`: the names a cell binds (assignments, imports, definitions, loop and
    `with` targets, anywhere in it) and those it reads. A cell that does not parse (an IPython
    magic) binds and reads nothing."""
    import ast

    try:
        tree = ast.parse(python(source))
    except SyntaxError:
        return set(), set()
    defined, used = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (defined if isinstance(node.ctx, (ast.Store, ast.Del)) else used).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
    return defined, used


def needed_cells(cells: list[str]) -> list[int]:
    """The code cells a rehearsal of a notebook runs, in order: each cell that calls a pipeline
    (`_CALL`) and, for every name such a cell reads, the last cell before it that binds the name,
    and so on back (the notebook's compiles, plots and checks that no call needs are left out)."""
    names = [_names(c) for c in cells]
    wanted, todo = set(), [i for i, c in enumerate(cells) if _CALL.search(c)]
    while todo:
        i = todo.pop()
        if i in wanted:
            continue
        wanted.add(i)
        for name in names[i][1]:
            before = [j for j in range(i) if name in names[j][0]]
            if before:
                todo.append(before[-1])
    return sorted(wanted)


_NOTEBOOK_DRIVER = r"""
import json, sys, traceback
import jupytext
from tpupedia import plan, rehearsal
from tpupedia.errors import clean_message
from tpupedia.rehearse import python
path, chosen = sys.argv[1], json.loads(sys.argv[2])
cells = [c for c in jupytext.read(path).cells if c.cell_type == "code"]
found = {"rehearsed": [], "failed": "", "not_reached": []}
space = {"__name__": "__main__"}
for i in chosen:
    cell, i = cells[i], i + 1
    try:
        exec(compile(python(cell.source), f"{path} cell {i}", "exec"), space)
    except rehearsal.Rehearsed as done:
        found["rehearsed"].append(f"cell {i}: {done}")
    except plan.PlanError as err:
        found["failed"] = f"cell {i}: {err}"
        break
    except BaseException as err:  # noqa: BLE001 - what a CPU host without the weights cannot do
        found["not_reached"].append(f"cell {i}: {clean_message(err, 1)}")
print("REHEARSAL " + json.dumps(found))
"""


def rehearse_notebook(slug: str, topology: str, work: Path, lessons: Path = Path("lessons"),
                      preset: str = "full") -> Outcome:
    """Execute lesson `slug`'s code cells that its calls into a pipeline need (`needed_cells`),
    in order, under the rehearsal, in a fresh process in `work`."""
    import jupytext

    source = (lessons / f"{slug}.py").resolve()
    chosen = needed_cells([c.source for c in jupytext.read(source).cells if c.cell_type == "code"])
    out = Outcome(f"notebook {slug}")
    if not chosen:
        out.failed = f"notebook {slug}: no cell calls a pipeline"
        return out
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _NOTEBOOK_DRIVER, str(source), json.dumps(chosen)], cwd=work,
                          env=_env(topology, preset), capture_output=True, text=True)
    out.seconds = time.perf_counter() - start
    found = next((json.loads(line.removeprefix("REHEARSAL ")) for line in done.stdout.splitlines()
                  if line.startswith("REHEARSAL ")), None)
    if found is None:
        tail = (done.stdout + done.stderr).strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        out.failed = f"notebook {slug}: the rehearsal did not finish: {tail[0]}"
        return out
    out.rehearsed, out.not_reached = found["rehearsed"], found["not_reached"]
    out.failed = f"notebook {slug}, {found['failed']}" if found["failed"] else (
        "" if out.rehearsed else f"notebook {slug}: none of its calls into a pipeline was reached")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tpupedia.rehearse", description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v6e:2x4", help="the slice every way in is planned for")
    parser.add_argument("--only", default=None, help="a regular expression: rehearse the paths and notebooks it matches")
    parser.add_argument("--record", default=None, help="write what was rehearsed to this JSON file")
    parser.add_argument("--all", action="store_true",
                        help="also the ways in whose compiles are not kept yet (hours on a 2-core host)")
    parser.add_argument("--keep", default=None, metavar="DIR",
                        help="read and keep the slice's compiles in DIR ($TPUPEDIA_AOT_CACHE); after a whole rehearsal (--all, no --only) "
                             "only those it read or wrote stay (`make rehearse`: tests/rehearse-kept)")
    args = parser.parse_args(argv)
    if args.keep:
        os.environ["TPUPEDIA_AOT_CACHE"] = str(Path(args.keep).resolve())
    kept = recorded(args.keep)
    chosen = lambda name: (args.all or name in kept) and (args.only is None or re.search(args.only, name))  # noqa: E731
    everything = [w.name for w in ways()] + [f"notebook {n}" for n in notebooks()]
    outcomes, start, started = [], time.perf_counter(), time.time()
    with tempfile.TemporaryDirectory(prefix="tpupedia-rehearse-") as tmp:
        work = Path(tmp)
        os.environ["TPUPEDIA_CACHE"] = str(work / "cache")  # every plan checked anew (a compile kept is read back)
        inputs = _inputs(work)
        for path in (p for p in ways() if chosen(p.name)):
            outcomes.append(rehearse_way(path, args.topology, work, inputs))
            _say(outcomes[-1])
        for slug in (s for s in notebooks() if chosen(f"notebook {s}")):
            outcomes.append(rehearse_notebook(slug, args.topology, work))
            _say(outcomes[-1])
    failed = [o for o in outcomes if not o.ok]
    print(f"rehearse: {len(outcomes) - len(failed)} of {len(outcomes)} ways in planned for {args.topology} "
          f"in {time.perf_counter() - start:.0f} s; nothing was loaded")
    left = [n for n in everything if n not in kept and not any(o.name == n for o in outcomes)]
    if left and not args.all:
        print(f"rehearse: {len(left)} ways in have no kept compiles yet and were not rehearsed ({', '.join(left)}): "
              "make rehearse REHEARSE=--all records them (hours on a 2-core host)")
    if args.keep:  # what passed now has its compiles kept: listed for the next rehearsal
        passed = kept | {o.name for o in outcomes if o.ok}
        from tpupedia import results as _results

        _results.write_json_atomic(Path(args.keep) / RECORDED, {"topology": args.topology, "recorded": sorted(
            n for n in passed if n in everything)})
    if args.keep and args.only is None and args.all:  # a whole rehearsal read every kept compile a way in uses
        from tpupedia import aot

        print(f"rehearse: {aot.prune(args.keep, since=started)} kept compiles no way in used were removed from {args.keep}")
    if args.record:
        from tpupedia import results

        results.write_json_atomic(Path(args.record), {"topology": args.topology, "outcomes": [
            o.__dict__ | {"seconds": round(o.seconds, 1)} for o in outcomes]})
    return 1 if failed else 0


def _say(o: Outcome) -> None:
    print(f"{'ok  ' if o.ok else 'FAIL'} {o.name} ({o.seconds:.0f} s)", flush=True)
    for line in o.rehearsed:
        print(f"     {line}")
    if o.failed:
        print(f"     {o.failed}")
    for line in o.not_reached:
        print(f"     not reached: {line}")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
