"""The package's layering: no module imports a layer above its own, no import cycle anywhere in
`src/tpupedia`, every error class derives from the one base the CLI catches, and each model fact
has one home. (import-linter would state the layers as contracts; it is not on this machine's
package index, so the contract is this test.)"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import tpupedia
from tpupedia.errors import TpupediaError

SRC = Path(tpupedia.__file__).parent


def _imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        name = ".".join(path.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__")
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                base = node.module if node.level == 0 else ".".join(name.split(".")[: -node.level] + [node.module])
                deps.add(base)
                deps.update(f"{base}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = deps
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


LAYERS = (
    ("tpupedia.cli", "tpupedia.rehearse"),
    ("tpupedia.tune", "tpupedia.bench", "tpupedia.doctor", "tpupedia.figures", "tpupedia.diagrams"),
    ("tpupedia.pipelines", "tpupedia.plan", "tpupedia.dryrun", "tpupedia.predict", "tpupedia.llm"),
    ("tpupedia.families",),
    ("tpupedia.models",),
    ("tpupedia.sharding", "tpupedia.attention", "tpupedia.torchax_utils", "tpupedia.compat", "tpupedia.aot",
     "tpupedia.devices", "tpupedia.hardware", "tpupedia.presets", "tpupedia.session", "tpupedia.results",
     "tpupedia.batch", "tpupedia.video", "tpupedia.image", "tpupedia.pictures", "tpupedia.notebooks", "tpupedia.distributed",
     "tpupedia.files", "tpupedia.metrics", "tpupedia.lora", "tpupedia.quantize", "tpupedia.traces", "tpupedia.errors",
     "tpupedia.rehearsal"),
)
"""The package's layers, top first (DESIGN.md's module map): the command line; the tools built on
runs (benchmarks, tuning, doctor, the docs' figures and diagrams); the pipelines with the plan
they check before they load (every way in plans: `run`, `run_batch`, the stage methods), the
dry-run and the LLM loader; the family registry; the family modules; the core every layer uses. A module imports its own
layer and those below, never one above, at the top of the file or inside a function."""


def _layer(module: str) -> int:
    found = [i for i, layer in enumerate(LAYERS) for prefix in layer
             if module == prefix or module.startswith(prefix + ".")]
    assert found, f"{module} is in no layer of LAYERS"
    return found[0]


def test_no_module_imports_a_layer_above_its_own():
    graph = _imports()
    upward = sorted(f"{m} imports {d}" for m, deps in graph.items() if m != "tpupedia"
                    for d in deps if d != "tpupedia" and _layer(d) < _layer(m))
    assert upward == []


def test_the_layer_check_sees_an_upward_import():
    assert _layer("tpupedia.models.cogvideox") > _layer("tpupedia.families") > _layer("tpupedia.pipelines.common")
    assert _layer("tpupedia.plan") == _layer("tpupedia.pipelines.common") > _layer("tpupedia.bench")
    assert _layer("tpupedia.files") == len(LAYERS) - 1


def test_no_import_cycle_in_the_package():
    graph = _imports()
    assert "tpupedia.families" in graph and "tpupedia.models.spec" in graph["tpupedia.families"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_every_error_class_derives_from_the_one_base():
    errors = []
    for info in pkgutil.walk_packages(tpupedia.__path__, "tpupedia."):
        module = importlib.import_module(info.name)
        errors += [cls for _, cls in inspect.getmembers(module, inspect.isclass)
                   if issubclass(cls, Exception) and not issubclass(cls, Warning) and cls.__module__ == module.__name__]
    assert len(errors) >= 15, [e.__name__ for e in errors]
    assert [e.__name__ for e in errors if not issubclass(e, TpupediaError)] == []


def test_the_latent_frame_rule_is_written_only_in_the_model_modules():
    pattern = re.compile(r"\(frames - 1\) //")
    places = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if pattern.search(p.read_text()))
    assert places == ["models/shapes.py"], places  # ShapeFacts.latent_frames, with each checkpoint's ratio
