"""Full-size work in the video lessons sits behind a preset gate (issue 18).

On the full preset, notebooks `cogvideox_pipeline`, `hunyuan_video`, `hunyuan_tuning_and_i2v` and `beyond_one_host` hold the released checkpoints: a stock diffusers
pipeline run end to end on the host CPU takes hours to days, an unsharded 8.3B transformer fills
half a chip (two do not fit), and a local CPU process running the CLI runs the real model on the
CPU. Each of these belongs to the tiny preset only, so it must sit under a *preset gate*: an
`if` statement or a conditional expression whose test mentions the name `preset` (the lessons
use `preset.host_runs_whole_models`). Both branches of a gate are gated: the gate is where a
reader sees what each preset does instead. The lessons are parsed with `ast`, never executed.

Outside a gate, a lesson may not:

1. **Run a stock pipeline**: call a name ever bound to a diffusers pipeline (an expression rooted in
   a class whose name ends in `Pipeline`: `CogVideoXPipeline.from_pretrained(...)`,
   `HunyuanVideo15Pipeline(...)`), or call such an expression directly. Its methods
   (`stock.encode_prompt(...)`, one text-encoder forward) are not runs of the pipeline.
2. **Start a process**: call `subprocess.run`, `Popen`, `call`, `check_call`, `check_output`,
   `getoutput`, `getstatusoutput`, `os.system` or `os.popen`, or a *subprocess helper*: a
   function of the lesson that makes such a call (or calls another helper) outside a gate in its
   own body, like notebook `beyond_one_host`'s `tpupedia(...)`. Calls of a helper are checked, not its body.
3. **Move a module to a device whole**: call `X.to("jax")` unless `X` is
   - *preset-sized*: a name every binding of which is made inside a gate, or from an expression
     that contains a gate or uses a preset-sized name, or a function whose body does (notebook
     09's `load_transformer`, which reads two blocks of the checkpoint on the full preset, and
     whatever is bound from calling it); or
   - a *tensor the lesson builds*: an expression rooted in a call of a `torch.` function
     (`torch.randn(...).to(dtype)`, `(torch.arange(n) < m).to(dtype)`), or a name every binding
     of which is one; moving small input tensors is not the concern; or
   - a parameter of the enclosing function (or a loop variable over one): then every call of that
     function must pass preset-sized names or built tensors, or be gated.

Names are tracked per lesson, not per scope: a rule this coarse is meant for lessons, where a
name means one thing throughout. `find_problems` is the rule; the tests below apply it to the
lessons above and show that it reports each kind of ungated call in small synthetic sources.
It is applied to these three only: earlier lessons move one model to one device on purpose
(notebook `hf_model_in_jax`'s Llama-2-7B fits a chip), which no syntactic rule can tell from the moves it is for.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tpupedia import presets

ROOT = Path(__file__).resolve().parents[1]
LESSONS = ("07_cogvideox_pipeline.py", "10_hunyuan_video.py", "11_hunyuan_tuning_and_i2v.py", "13_beyond_one_host.py")

SUBPROCESS_CALLS = {("subprocess", name) for name in
                    ("run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput")}
SUBPROCESS_CALLS |= {("os", "system"), ("os", "popen")}


def _mentions(node: ast.AST | None, names: set[str] | frozenset[str]) -> bool:
    """Whether `node` reads any of `names`."""
    return node is not None and any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(node))


def _is_gate_test(test: ast.AST) -> bool:
    return _mentions(test, {"preset"})


def _contains_gate(node: ast.AST) -> bool:
    """Whether `node` holds a preset gate (an `if` or conditional expression on `preset`)."""
    return any(isinstance(n, (ast.If, ast.IfExp)) and _is_gate_test(n.test) for n in ast.walk(node))


def _root(node: ast.AST) -> ast.AST:
    """The innermost object an expression starts from: `a.b(c).d(e)` -> `a`, `(f(x) < y).to(z)` -> `f(x)`'s `f`."""
    while True:
        if isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        elif isinstance(node, ast.Compare):
            node = node.left
        elif isinstance(node, ast.BinOp):
            node = node.left
        elif isinstance(node, ast.UnaryOp):
            node = node.operand
        else:
            return node


def _rooted_in_torch_call(node: ast.AST) -> bool:
    """`torch.randn(...)`, `torch.tensor(...).to(dtype)`, `(torch.arange(n) < m).to(dtype)`."""
    while True:
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "torch":
                return True
            node = func.value if isinstance(func, ast.Attribute) else func
        elif isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        elif isinstance(node, (ast.Compare,)):
            node = node.left
        elif isinstance(node, ast.BinOp):
            node = node.left
        else:
            return False


def _pipeline_class(node: ast.AST) -> bool:
    """An expression rooted in a name ending in `Pipeline` (a diffusers pipeline class)."""
    root = _root(node)
    return isinstance(root, ast.Name) and root.id.endswith("Pipeline") and root.id != "Pipeline"


def _subprocess_call(call: ast.Call) -> bool:
    func = call.func
    return (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
            and (func.value.id, func.attr) in SUBPROCESS_CALLS)


def _to_jax_receiver(call: ast.Call) -> ast.AST | None:
    """`X` of `X.to("jax")` or `X.to(device="jax")`, else None."""
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr == "to"):
        return None
    args = list(call.args[:1]) + [k.value for k in call.keywords if k.arg == "device"]
    if any(isinstance(a, ast.Constant) and a.value == "jax" for a in args):
        return func.value
    return None


@dataclass
class _Binding:
    value: ast.AST | None  # the bound expression (a function's body: the FunctionDef)
    gated: bool


@dataclass
class _Site:
    call: ast.Call
    gated: bool
    function: ast.FunctionDef | None  # the innermost enclosing function


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    gated: dict[str, int] = field(default_factory=lambda: {"pipeline": 0, "subprocess": 0, "to_jax": 0})
    """How many calls of each kind the rule found under a gate (proof that it sees them)."""
    sized_moves: int = 0
    """`.to("jax")` calls outside a gate on preset-sized names."""


class _Collector(ast.NodeVisitor):
    """Every binding of every name, and every call with its gate state and enclosing function."""

    def __init__(self):
        self.bindings: dict[str, list[_Binding]] = {}
        self.calls: list[_Site] = []
        self.functions: dict[str, ast.FunctionDef] = {}
        self.loop_vars: dict[ast.FunctionDef, dict[str, str]] = {}  # function -> loop var -> iterated name
        self._gated = [False]
        self._function: list[ast.FunctionDef | None] = [None]

    def _bind(self, target: ast.AST, value: ast.AST | None):
        """Bind the names `target` assigns: `a`, `a, *b`; not `a.x = ...` or `a[i] = ...`, which change `a`."""
        if isinstance(target, ast.Name):
            self.bindings.setdefault(target.id, []).append(_Binding(value, self._gated[-1]))
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self._bind(element, value)
        elif isinstance(target, ast.Starred):
            self._bind(target.value, value)

    def _loop(self, target: ast.AST, iterable: ast.AST):
        function = self._function[-1]
        if function is not None and isinstance(target, ast.Name) and isinstance(iterable, ast.Name):
            self.loop_vars.setdefault(function, {})[target.id] = iterable.id

    def visit_If(self, node: ast.If):
        if _is_gate_test(node.test):
            self.visit(node.test)
            self._gated.append(True)
            for child in node.body + node.orelse:
                self.visit(child)
            self._gated.pop()
        else:
            self.generic_visit(node)

    def visit_IfExp(self, node: ast.IfExp):
        if _is_gate_test(node.test):
            self._gated.append(True)
            self.generic_visit(node)
            self._gated.pop()
        else:
            self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef):
        self.functions[node.name] = node
        self.bindings.setdefault(node.name, []).append(_Binding(node, self._gated[-1]))
        self._function.append(node)
        self._gated.append(False)  # a function's body is judged on its own; its calls carry the gate
        for child in node.body:
            self.visit(child)
        self._gated.pop()
        self._function.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node: ast.Assign):
        for target in node.targets:
            self._bind(target, node.value)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign):
        self._bind(node.target, node.value)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign):
        self._bind(node.target, node)
        self.generic_visit(node)

    def visit_NamedExpr(self, node: ast.NamedExpr):
        self._bind(node.target, node.value)
        self.generic_visit(node)

    def visit_With(self, node: ast.With):
        for item in node.items:
            if item.optional_vars is not None:
                self._bind(item.optional_vars, item.context_expr)
        self.generic_visit(node)

    def visit_For(self, node: ast.For):
        self._bind(node.target, node.iter)
        self._loop(node.target, node.iter)
        self.generic_visit(node)

    def visit_comprehension(self, node: ast.comprehension):
        self._bind(node.target, node.iter)
        self._loop(node.target, node.iter)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call):
        self.calls.append(_Site(node, self._gated[-1], self._function[-1]))
        self.generic_visit(node)


def _preset_sized(c: _Collector) -> set[str]:
    """Names every binding of which depends on a preset gate (see the module docstring)."""
    sized: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, bindings in c.bindings.items():
            if name in sized:
                continue
            if all(b.gated or (b.value is not None and (_contains_gate(b.value) or _mentions(b.value, sized)))
                   for b in bindings):
                sized.add(name)
                changed = True
    return sized


def _built_tensors(c: _Collector) -> set[str]:
    return {name for name, bindings in c.bindings.items()
            if all(b.value is not None and _rooted_in_torch_call(b.value) for b in bindings)}


def _parameters(function: ast.FunctionDef) -> set[str]:
    a = function.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
    return set(names)


def _without_hosted_setup(source: str) -> str:
    """`source` with the hosted-runtime setup's lines blanked (line numbers kept)."""
    from tpupedia import notebooks

    lines, out, inside = source.split("\n"), [], False
    for line in lines:
        inside = inside or line == notebooks._SETUP_FIRST
        out.append("" if inside else line)
        inside = inside and line != notebooks._SETUP_LAST
    return "\n".join(out)


def find_problems(source: str, name: str = "<lesson>") -> Report:
    """Apply the module docstring's rule to the Python source of one lesson. The hosted-runtime
    setup that opens every lesson (`tpupedia.notebooks.hosted_setup`: on Colab or Kaggle it clones
    and installs the course, on any preset) is not full-size work, and is left out."""
    c = _Collector()
    c.visit(ast.parse(_without_hosted_setup(source), name))
    report = Report()
    sized, tensors = _preset_sized(c), _built_tensors(c)
    pipelines = {n for n, bs in c.bindings.items()  # any binding: rebinding a pipeline does not excuse it
                 if any(b.value is not None and not isinstance(b.value, ast.FunctionDef) and _pipeline_class(b.value)
                        for b in bs)}

    def where(call: ast.Call) -> str:
        return f"{name}:{call.lineno}: `{ast.unparse(call)[:90]}`"

    # Subprocess helpers: functions making a process call (or a helper call) ungated in their body.
    helpers: set[str] = set()
    changed = True
    while changed:
        changed = False
        for site in c.calls:
            f = site.function
            if f is None or f.name in helpers or site.gated:
                continue
            func = site.call.func
            if _subprocess_call(site.call) or (isinstance(func, ast.Name) and func.id in helpers):
                helpers.add(f.name)
                changed = True

    # Functions that move one of their parameters: their call sites are checked instead.
    movers: dict[str, ast.FunctionDef] = {}

    for site in c.calls:
        call, func = site.call, site.call.func
        # 1. stock pipeline runs
        runs = (isinstance(func, ast.Name) and func.id in pipelines) or (
            isinstance(func, ast.Call) and _pipeline_class(func))
        if runs:
            if site.gated:
                report.gated["pipeline"] += 1
            else:
                report.problems.append(f"{where(call)} runs a stock diffusers pipeline outside a preset gate")
        # 2. processes
        spawns = _subprocess_call(call) or (isinstance(func, ast.Name) and func.id in helpers)
        if spawns and site.gated:
            report.gated["subprocess"] += 1
        elif spawns and site.function is None:  # inside a function, the function is a helper: its calls count
            report.problems.append(f"{where(call)} starts a process outside a preset gate")
        # 3. whole modules to one device
        receiver = _to_jax_receiver(call)
        if receiver is None:
            continue
        if site.gated:
            report.gated["to_jax"] += 1
            continue
        if _rooted_in_torch_call(receiver):  # `torch.zeros(2).to("jax")`: a tensor built right here
            continue
        if isinstance(receiver, ast.Name):
            if receiver.id in sized:
                report.sized_moves += 1
                continue
            if receiver.id in tensors:
                continue
            f = site.function
            if f is not None:
                params = _parameters(f)
                iterated = c.loop_vars.get(f, {}).get(receiver.id)
                if receiver.id in params or iterated in params:
                    movers[f.name] = f
                    continue
        report.problems.append(f"{where(call)} moves a module that is not preset-sized to one device, "
                               "outside a preset gate")

    for site in c.calls:
        func = site.call.func
        if not (isinstance(func, ast.Name) and func.id in movers) or site.gated:
            continue
        args = [a.value if isinstance(a, ast.Starred) else a for a in site.call.args]
        args += [k.value for k in site.call.keywords]
        bad = [ast.unparse(a) for a in args
               if not (isinstance(a, ast.Name) and (a.id in sized or a.id in tensors))]
        if bad:
            report.problems.append(f"{where(site.call)} hands {', '.join(bad)} to `{func.id}`, which moves its "
                                   "arguments to one device, outside a preset gate")
    return report


# --- the lessons -------------------------------------------------------------------------------

@pytest.mark.parametrize("lesson", LESSONS)
def test_full_size_work_is_gated(lesson):
    path = ROOT / "lessons" / lesson
    report = find_problems(path.read_text(), f"lessons/{lesson}")
    assert report.problems == [], "\n".join(report.problems)


def test_the_rule_sees_the_gated_calls():
    """The gated stock runs and process launches are found, so a pass above is not a rule that
    looks past them."""
    reports = {lesson: find_problems((ROOT / "lessons" / lesson).read_text()) for lesson in LESSONS}
    assert reports["07_cogvideox_pipeline.py"].gated["pipeline"] >= 2  # the whole video, one step
    assert reports["10_hunyuan_video.py"].gated["pipeline"] >= 2
    assert reports["10_hunyuan_video.py"].sized_moves >= 3  # the transformers of sections 2 and 3
    assert reports["13_beyond_one_host.py"].gated["subprocess"] >= 5  # every `tpupedia(...)` launch


def test_the_hosted_setup_is_not_full_size_work_but_the_same_call_elsewhere_is():
    """With a repository set, every lesson's first cell runs `git clone` and `pip install` on
    Colab or Kaggle (`tpupedia.notebooks.hosted_setup`): not a gate's business. The same call
    after the setup's end marker is reported."""
    from tpupedia import notebooks

    setup = notebooks.hosted_setup("https://github.com/example/gpu-tpu-pedia") + "\n"
    assert not find_problems(setup).problems
    assert len(find_problems(setup + 'subprocess.run(["tpupedia", "generate"], check=True)\n').problems) == 1


def test_the_gate_follows_the_weights():
    assert presets.get("tiny").host_runs_whole_models and not presets.get("full").host_runs_whole_models


# --- the rule bites --------------------------------------------------------------------------------

def _problems(source: str) -> list[str]:
    return find_problems(source).problems


def test_ungated_subprocess_is_reported():
    problems = _problems("import subprocess\nsubprocess.run(['tpupedia', 'generate', 'cogvideox'])\n")
    assert len(problems) == 1 and "starts a process" in problems[0] and ":2:" in problems[0]
    assert _problems("import subprocess\nif preset.host_runs_whole_models:\n    subprocess.run(['ls'])\n") == []
    assert len(_problems("import os\nos.system('tpupedia launch')\n")) == 1


def test_subprocess_helper_calls_are_reported_unless_gated():
    helper = ("import subprocess\n\n"
              "def cli(*args):\n    return subprocess.run(['tpupedia', *args], check=True)\n\n"
              "def twice(*args):\n    cli(*args)\n    cli(*args)\n\n")
    assert len(_problems(helper + "cli('distributed-check')\n")) == 1
    assert len(_problems(helper + "twice('distributed-check')\n")) == 1  # a helper of a helper
    assert _problems(helper + "if preset.host_runs_whole_models:\n    cli('distributed-check')\n"
                     "else:\n    print('on every host: tpupedia distributed-check')\n") == []
    gated_inside = ("import subprocess\n\ndef cli(*args):\n    if preset.name == 'tiny':\n"
                    "        subprocess.run(args)\n\ncli('x')\n")
    assert _problems(gated_inside) == []  # the helper gates itself


def test_stock_pipeline_run_is_reported():
    source = ("stock = CogVideoXPipeline.from_pretrained(source)\n"
              "positive = stock.encode_prompt('a panda')\n"  # one text-encoder forward: allowed
              "video = stock(prompt='a panda', num_inference_steps=50)\n")
    problems = _problems(source)
    assert len(problems) == 1 and "stock diffusers pipeline" in problems[0] and ":3:" in problems[0]
    assert len(_problems("HunyuanVideo15Pipeline.from_pretrained(source)(prompt='p')\n")) == 1
    guided = source.replace("video =", "stock.guider = stock.guider.new(guidance_scale=1.0)\nvideo =")
    assert len(_problems(guided)) == 1  # changing an attribute does not rebind `stock`
    gated = source.replace("video = stock(", "if preset.host_runs_whole_models:\n    video = stock(")
    assert _problems(gated) == []


def test_whole_module_to_jax_is_reported():
    whole = ("model = Transformer.from_pretrained(source)\n"
             "with env:\n    model.to('jax')\n")
    assert len(_problems(whole)) == 1
    sized = ("blocks = {} if preset.host_runs_whole_models else {'num_layers': 2}\n\n"
             "def load():\n    return Transformer.from_pretrained(source, **blocks)\n\n"
             "model = load()\nwith env:\n    model.to('jax')\n")
    assert _problems(sized) == []
    tensor = "x = torch.randn(2, 16).to(dtype)\nwith env:\n    y = x.to('jax')\n    z = torch.zeros(3).to('jax')\n"
    assert _problems(tensor) == []
    mover = ("def to_jax(*tensors):\n    return [t.to('jax') for t in tensors]\n\n"
             "x = torch.zeros(2)\nbig = Transformer.from_pretrained(source)\n")
    assert _problems(mover + "to_jax(x)\n") == []
    problems = _problems(mover + "to_jax(x, big)\n")
    assert len(problems) == 1 and "hands big" in problems[0]
    rebound = whole.replace("with env:", "model = Transformer.from_pretrained(source, num_layers=2)\nwith env:")
    assert len(_problems("blocks = 2 if preset.name == 'tiny' else 1\n" + rebound)) == 1  # one binding unsized
