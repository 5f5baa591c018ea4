"""The family registry (`tpupedia.families`): what it finds, what it refuses, and the rule that
keeps a family in its own files: no code outside them names it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import tpupedia
from tpupedia import cli, families, sharding

SRC = Path(tpupedia.__file__).parent
ROOT = SRC.parent.parent

# Code that names families on purpose, and why (the numbers the docs quote about a family are in
# its spec, `FamilySpec.figures`). Everything else reads the registry.
CONTENT: dict[str, str] = {
    "notebooks.py": "the course's core path names notebooks by slug (`CORE`), and one notebook's slug "
                    "starts with a family's name (`cogvideox_pipeline`)",
    "diagrams/__init__.py": "names the notebook that draws each diagram, two of whose names start with a family's",
}
"""Files (relative to `src/tpupedia`) whose code may name a family, and why."""


def test_the_registry_finds_every_family_module_with_a_spec():
    specs = {s.name: s for s in families.all_specs()}
    modules = {p.stem for p in (SRC / "models").glob("*.py")
               if re.search(r"^SPEC = FamilySpec\(", p.read_text(), re.M)}
    assert {s.module.rsplit(".", 1)[1] for s in specs.values()} == modules
    assert families.names("video") == ("cogvideox", "hunyuan", "wan")
    assert set(families.names("llm")) == {"llama"} and set(families.names("vae")) == {"cogvideox-vae"}
    for spec in families.video():  # what `generate` needs of a video family
        facts = spec.facts
        assert spec.full_id == facts.FULL_ID and spec.strategies[:1] == ("tp",)
        for name in ("default_request", "shape_facts", "check_frames", "check_size", "component_configs",
                     "model_source", "full_configs", "step_flops", "build", "step_inputs"):
            assert callable(getattr(facts, name)), (spec.name, name)


def test_an_unknown_family_is_refused_with_the_names_there_are():
    with pytest.raises(families.FamilyError, match=r"video family .llama. is not one of cogvideox, hunyuan, wan"):
        families.get("llama", "video")
    with pytest.raises(families.FamilyError, match="'wan2' is not one of"):
        families.get("wan2")


def test_the_command_line_offers_every_registered_family():
    parser = cli.build_parser()
    for spec in families.video():
        for argv in (["generate", spec.name, "--help"], ["plan", spec.name, "--help"],
                     ["bench", "generate", spec.name, "--help"]):
            with pytest.raises(SystemExit) as exit_:
                parser.parse_args(argv)
            assert exit_.value.code == 0, argv
    for name in families.names():
        assert parser.parse_args(["dryrun", name]).model == name
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "llama"])  # not a video family


def test_every_rule_of_every_family_table_matches_a_weight():
    """A dead rule (a regex that matches nothing, like upstream's `ff.net.0.weight`) would leave a
    layer replicated without a word: every pattern of every strategy must place some weight."""
    from tpupedia import devices

    mesh = devices.make_mesh((2, 4), ("dp", "tp"))
    for spec in families.video():  # (Llama's table also covers Qwen2's biases, which Llama has not)
        model = spec.facts.build(layers=1)  # the full width on `meta`: shapes only
        for strategy, table in spec.sharding.items():
            axis = ("dp", "tp") if strategy == "fsdp" else "tp"
            plan = sharding.plan(model, sharding.rules(spec, strategy, axis=axis), mesh)
            used = {p.rule for p in plan.placements}
            assert [pattern for pattern, _ in table if pattern not in used] == [], (spec.name, strategy)


def test_a_table_by_name_is_an_architecture_and_the_error_lists_them():
    assert sharding.rules("qwen2", "tp") == sharding.rules("llama", "tp")
    with pytest.raises(KeyError, match="architectures: llama, t5"):
        sharding.rules("cogvideox", "tp")  # a family's tables are its SPEC's


def _code_names(path: Path) -> set[str]:
    """Every identifier, attribute, imported name and string constant of a Python file, its
    docstrings left out (prose may cite a family as an example; code may not depend on one)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant) and isinstance(node.body[0].value.value, str)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.add(node.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found.add(node.value)
        elif isinstance(node, ast.arg):
            found.add(node.arg)
    return found


def _names_family(path: Path, name: str) -> bool:
    pattern = re.compile(rf"(?<![A-Za-z0-9]){re.escape(name)}(?![A-Za-z0-9])")
    return any(pattern.search(token) for token in _code_names(path))


def _own(path: Path, name: str) -> bool:
    """A family's own code: its model modules (`models/<name>*.py`), its pipeline, the scheduler
    steps (one module for every family's pure steps)."""
    rel = path.relative_to(SRC).as_posix()
    return (rel.startswith(f"models/{name}") or rel == f"pipelines/{name}.py" or rel == "pipelines/schedulers.py")


@pytest.mark.parametrize("name", families.names("video"))
def test_no_code_outside_a_family_s_own_files_names_it(name):
    """Adding a family is its model module, its pipeline, a scheduler step if new, its tests and
    its notebook: the command line, the dry-run, the plan, sharding, the stage runner and the docs
    hooks read the registry. Listed: every other file whose code names the family."""
    files = sorted(SRC.rglob("*.py")) + [ROOT / "docs" / "hooks.py"]
    naming = sorted(p.relative_to(ROOT).as_posix() for p in files
                    if not (p.is_relative_to(SRC) and (p.relative_to(SRC).as_posix() in CONTENT or _own(p, name)))
                    and _names_family(p, name))
    assert naming == [], f"code outside {name}'s own files names it: {naming}"


def test_the_naming_check_finds_a_name_in_code_and_not_in_prose(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('"""Works for cogvideox and hunyuan alike."""\n\n\ndef f():\n    return 1\n')
    assert not _names_family(sample, "cogvideox")
    sample.write_text('def f(kind):\n    return kind == "hunyuan"\n')
    assert _names_family(sample, "hunyuan") and not _names_family(sample, "cogvideox")
    sample.write_text("from tpupedia.pipelines import decoding\n\ndecoding.cogvideox_programs\n")
    assert _names_family(sample, "cogvideox")
