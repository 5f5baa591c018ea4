"""Sharding a torchax module over a mesh with rule tables: regex -> PartitionSpec, as data.

A *rule table* is a list of `(regex, spec)` pairs. The first regex that `re.fullmatch`-es a
parameter's (or buffer's) qualified name decides its `PartitionSpec`; a name no rule matches
is replicated and reported, never silently guessed. A model family's tables are in its module
(`tpupedia.models.<family>.SHARDING`, its `SPEC`); the text encoders' architectures (Llama's
names, shared by Qwen2 and Mistral; T5) are in `RULES` here, keyed by `(architecture,
strategy)`. Tables are written against a default axis name that `rules(...)` renames to the
mesh axis (or axes) you pass.

Strategies, for PyTorch's `Linear.weight` of shape `(out_features, in_features)`:

* `"tp"`: Megatron tensor parallelism. The first matmul of a pair is *column-parallel*: shard
  the output features, which is **dim 0** of a torch weight (`P("tp", None)`), biases too.
  The second is *row-parallel*: shard the input features, **dim 1** (`P(None, "tp")`). One
  all-reduce per pair; attention needs none when heads split cleanly (the compiler may still
  gather small attention inputs: notebook `sharding` shows it). The Llama table splits the embedding
  and `lm_head` over the vocabulary, as Megatron does (one all-reduce sums the lookups).
* `"tp_transposed"`: the same pairs with the dims swapped: the layout some upstream CogVideoX
  scripts label "TP (Megatron column-row)". For torch's `(out, in)` weights it is the
  opposite of Megatron; kept so the notebook can measure what it costs.
* `"fsdp"`: every weight matrix sharded on dim 0 over the data axis (or axes); the compiler
  all-gathers each weight where it is used.
* `"replicated"`: every tensor on every device.
* `"tp_fc2_replicated"` (HunyuanVideo-1.5's table only): `"tp"` with the row-parallel layers replicated, the
  upstream default for HunyuanVideo-1.5, described upstream as having no row-parallel
  all-reduce. It does not remove the communication: the column-parallel layer leaves its
  activations split over `tp`, and a replicated fc2 needs the whole hidden vector. The
  compiler either all-gathers the activations (every chip then does the whole fc2 matmul) or,
  what GSPMD chooses in notebook `sharding`'s measurement, multiplies each chip's slice by the matching
  columns of its replicated weight and all-reduces the partial outputs: the same all-reduce as
  `"tp"`, with 4x the fc2 weight memory on a 4-way `tp` axis.

A rule may also say what to do with a dimension its spec does not divide: `Rule(regex, spec,
indivisible="replicate")` keeps that dimension whole on every device. The embedding rules say
so: a checkpoint's vocabulary is whatever its tokenizer needed (HunyuanVideo-1.5's ByT5 glyph
encoder has 1510 rows, 384 bytes plus the colour and font tokens its glyph tokenizer adds; a
fine-tune resized to its tokenizer has 151,665), and a lookup table gives the same rows whether
it is split or not. Replication, rather than padding the table with zero rows to a multiple of
the axis (exact for lookups too), because it leaves the tensor the checkpoint's own (no copy, no
shape a tied head or a resize would see) and costs rows x width bytes per chip: 4.2 MiB for
ByT5's 1510 x 1472 in bf16, 1.0 GiB for a 151,665-row Qwen2.5-VL table, 0.76 GiB more than a
4-way split; the plan says which tensors and how much (`ShardingPlan.indivisible`). Every other
rule refuses (`"refuse"`, the default): a large matmul weight that does not divide stays a
`ShardingError`, which names the axis sizes that would divide it.

`apply_rules(module, rules, mesh)` validates every spec against the tensor's shape first (a
spec that does not divide a dimension raises `ShardingError` naming the tensor, the dimension,
the mesh axis and the sizes that would divide it, unless its rule replicates it), then places
parameters and buffers in place. `describe(module)` reads
back where every tensor actually lives, with bytes per device.

Introduced in notebook `sharding` (distributed sharding).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tpupedia.errors import TpupediaError

__all__ = [
    "ShardingError",
    "Rule",
    "INDIVISIBLE",
    "RULES",
    "ARCHITECTURES",
    "rules",
    "architecture_tables",
    "spec_for",
    "Placement",
    "ShardingPlan",
    "plan",
    "apply_rules",
    "place",
    "free",
    "describe",
    "indivisible_note",
]

SpecTuple = tuple[Any, ...]
INDIVISIBLE = ("refuse", "replicate")
"""What a rule does with a dimension its spec does not divide: stop with `ShardingError`, or keep
that dimension whole on every device (the plan records it)."""


class Rule(tuple):
    """A rule: `(regex, spec)`, unpacking as that pair, with `indivisible`, what to do with a
    dimension `spec` does not divide (`INDIVISIBLE`; default `"refuse"`). A plain `(regex, spec)`
    pair, or a triple `(regex, spec, indivisible)`, is read as a rule too; a rule prints as its
    pair. Introduced in notebook `sharding`."""

    indivisible: str

    def __new__(cls, pattern: str, spec: Any, indivisible: str = "refuse"):
        if indivisible not in INDIVISIBLE:
            raise ShardingError(f"rule {pattern!r}: indivisible={indivisible!r} is not one of {', '.join(INDIVISIBLE)}")
        rule = super().__new__(cls, (pattern, spec))
        rule.indivisible = indivisible
        return rule

    def __getnewargs__(self):
        return (*self, self.indivisible)


def _as_rule(entry: Any) -> Rule:
    if isinstance(entry, Rule):
        return entry
    return Rule(*entry)


_COL_LLAMA = r"(q_proj|k_proj|v_proj|gate_proj|up_proj)"
_ROW_LLAMA = r"(o_proj|down_proj)"
_LLAMA_MATRICES = r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"

_EMBEDDING = "replicate"  # a lookup table's rows are exact split or whole: replicate what does not divide

RULES: dict[tuple[str, str], list[Rule]] = {
    # Llama naming, shared by Qwen2 and Mistral (Qwen2 adds q/k/v biases).
    ("llama", "tp"): [
        (rf".*\.{_COL_LLAMA}\.weight", ("tp", None)),  # column-parallel: out features (dim 0)
        (rf".*\.{_COL_LLAMA}\.bias", ("tp",)),
        (rf".*\.{_ROW_LLAMA}\.weight", (None, "tp")),  # row-parallel: in features (dim 1)
        # (vocab, hidden): vocabulary-parallel, as Megatron's VocabParallelEmbedding: each device
        # looks up the ids in its rows, zeros the rest, and one all-reduce sums the lookups
        Rule(r"(model\.)?embed_tokens\.weight", ("tp", None), _EMBEDDING),
        (r"lm_head\.weight", ("tp", None)),  # (vocab, hidden): vocab-parallel logits, a matmul: refused
    ],
    ("llama", "tp_transposed"): [
        (rf".*\.{_COL_LLAMA}\.weight", (None, "tp")),
        (rf".*\.{_ROW_LLAMA}\.weight", ("tp", None)),
        Rule(r"(model\.)?embed_tokens\.weight", ("tp", None), _EMBEDDING),
        (r"lm_head\.weight", (None, "tp")),
    ],
    ("llama", "fsdp"): [
        (rf".*\.{_LLAMA_MATRICES}\.weight", ("fsdp", None)),
        Rule(r"(model\.)?embed_tokens\.weight", ("fsdp", None), _EMBEDDING),
        (r"lm_head\.weight", ("fsdp", None)),
    ],
    ("llama", "replicated"): [],
    # T5 encoders (transformers T5EncoderModel: CogVideoX's T5-XXL, HunyuanVideo-1.5's ByT5).
    # q, k, v and the gated FFN's wi_0/wi_1 are the column-parallel half of their pairs, o and wo
    # the row-parallel half; the (vocab, d_model) embedding is vocabulary-parallel as Llama's.
    # The relative-position bias, (buckets, heads), is small and stays replicated.
    ("t5", "tp"): [
        (r".*\.SelfAttention\.(q|k|v)\.weight", ("tp", None)),
        (r".*\.SelfAttention\.o\.weight", (None, "tp")),
        (r".*\.DenseReluDense\.(wi|wi_0|wi_1)\.weight", ("tp", None)),
        (r".*\.DenseReluDense\.wo\.weight", (None, "tp")),
        # (vocab, d_model): ByT5's released glyph encoder has 1510 rows, which no tp of 4 or 8 divides
        Rule(r"(shared|encoder\.embed_tokens)\.weight", ("tp", None), _EMBEDDING),
    ],
    ("t5", "replicated"): [],
}

ARCHITECTURES: tuple[str, ...] = tuple(dict.fromkeys(a for a, _ in RULES))
_DEFAULT_AXIS = {"tp": "tp", "tp_transposed": "tp", "tp_fc2_replicated": "tp", "fsdp": "fsdp"}
_FAMILY_ALIASES = {"qwen2": "llama", "mistral": "llama"}


class ShardingError(TpupediaError, ValueError):
    """A spec that cannot be applied: it does not divide a dimension, names an unknown mesh
    axis, or has more entries than the tensor has dimensions."""


def rules(table: str | Mapping[str, Sequence[Rule]] | Any, strategy: str,
          axis: str | Sequence[str] | None = None) -> list[tuple[str, Any]]:
    """The rule table for `strategy`, as `Rule`s: `(regex, PartitionSpec)` pairs that keep what
    each does with a dimension it does not divide (`Rule.indivisible`).

    `table` is a family's tables by strategy (a mapping, or anything with a `sharding` mapping:
    a family's `SPEC`, `tpupedia.families`) or the name of an architecture table here:
    `"llama"` (also `"qwen2"`, `"mistral"`, which use Llama's names) or `"t5"`.
    `axis` renames the table's default axis (`"tp"` or `"fsdp"`) to a mesh axis name, or to a
    tuple of names to shard one dimension over several axes (`("dp", "tp")`).
    """
    from jax.sharding import PartitionSpec as P

    if isinstance(table, str):
        name = _FAMILY_ALIASES.get(table, table)
        tables = architecture_tables(name)
        if not tables:
            raise KeyError(f"no rule tables for architecture {table!r}; architectures: {', '.join(ARCHITECTURES)} "
                           "(a model family's tables are its SPEC.sharding: tpupedia.families)")
    else:
        name, tables = getattr(table, "name", "this family"), getattr(table, "sharding", table)
    if strategy not in tables:
        raise KeyError(f"no rule table for {name!r} and strategy {strategy!r}; "
                       f"strategies for {name!r}: {', '.join(tables) or 'none'}")
    default = _DEFAULT_AXIS.get(strategy)
    new = tuple(axis) if isinstance(axis, (list, tuple)) else axis

    def rename(entry):
        return new if (axis is not None and entry == default) else entry

    return [Rule(rule[0], P(*(rename(e) for e in rule[1])), rule.indivisible)
            for rule in map(_as_rule, tables[strategy])]


QUANTIZED_SCALES = r".*\.weight_scale"
"""The per-output-channel scales `tpupedia.quantize` keeps beside an 8-bit weight (which keeps the
weight's name, so the table's own rule places it): one float32 per output channel, replicated on
every device ahead of every table's rules (`spec_for`), 4 bytes a channel (a 5120 x 5120 projection's scales are 20 KiB
next to its 25 MiB of int8)."""


def architecture_tables(name: str) -> dict[str, list[Rule]]:
    """The tables of architecture `name` (`"llama"`, `"t5"`) in `RULES`, by strategy."""
    return {s: table for (a, s), table in RULES.items() if a == _FAMILY_ALIASES.get(name, name)}


def spec_for(name: str, rule_table: Iterable[tuple[str, Any]]) -> tuple[Any, str | None]:
    """`(spec, pattern)` of the first rule whose regex fullmatches `name`; `(P(), None)` if none."""
    spec, rule = _rule_for(name, rule_table)
    return spec, rule and rule[0]


def _rule_for(name: str, rule_table: Iterable[Any]) -> tuple[Any, Rule | None]:
    """`(spec, rule)` of the first rule whose regex fullmatches `name`; `(P(), None)` if none. A
    quantized weight's scales (`QUANTIZED_SCALES`) are replicated whatever the table says."""
    from jax.sharding import PartitionSpec as P

    if re.fullmatch(QUANTIZED_SCALES, name):
        return P(), Rule(QUANTIZED_SCALES, P())
    for entry in rule_table:
        rule = _as_rule(entry)
        if re.fullmatch(rule[0], name):
            spec = rule[1]
            return (spec if isinstance(spec, P) else P(*spec)), rule
    return P(), None


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _dividing(size: int, most: int) -> list[int]:
    """The axis sizes up to `most` (the mesh's devices) that divide `size`."""
    return [n for n in range(1, max(most, 1) + 1) if size % n == 0]


def _check(name: str, shape: tuple[int, ...], spec: Any, mesh: Any, indivisible: str = "refuse") -> tuple[Any, list[int]]:
    """`(spec, dims)`: `spec` validated against `shape` on `mesh`, with the dimensions it does not
    divide replicated (`dims`) when the rule says `indivisible="replicate"`; otherwise such a
    dimension raises `ShardingError` naming the axis sizes that would divide it."""
    from jax.sharding import PartitionSpec as P

    if len(spec) > len(shape):
        raise ShardingError(
            f"{name}: spec {spec} has {len(spec)} entries but the tensor has shape {shape} "
            f"({len(shape)} dimensions)"
        )
    sizes = dict(mesh.shape)
    entries, relaxed = list(spec), []
    for dim, entry in enumerate(spec):
        axes = _axes(entry)
        for a in axes:
            if a not in sizes:
                raise ShardingError(
                    f"{name}: spec {spec} names mesh axis {a!r}, but the mesh has axes "
                    f"{tuple(sizes)}"
                )
        n = math.prod(sizes[a] for a in axes)
        if n > 1 and shape[dim] % n:
            if indivisible == "replicate":
                entries[dim], relaxed = None, [*relaxed, dim]
                continue
            where = " x ".join(f"{a!r} (size {sizes[a]})" for a in axes)
            fits = _dividing(shape[dim], math.prod(sizes.values()))
            options = " or ".join([", ".join(map(str, fits[:-1])), str(fits[-1])] if len(fits) > 1 else [str(fits[0])])
            label = f"{axes[0]}=" if len(axes) == 1 else f"{' x '.join(axes)} = "
            raise ShardingError(
                f"{name}: dimension {dim} has size {shape[dim]}, which mesh axis {where} does not "
                f"divide (spec {spec}, shape {shape}); {label}{options} divide{'s' if len(fits) == 1 else ''} "
                f"{shape[dim]}: choose a mesh with such a {'size' if len(axes) == 1 else 'product'}, or "
                "replicate this dimension"
            )
    return (P(*entries) if relaxed else spec), relaxed


@dataclass(frozen=True)
class Placement:
    """Where one tensor goes: its spec and what each device holds."""

    name: str
    kind: str  # "param" or "buffer"
    shape: tuple[int, ...]
    dtype: str
    spec: Any  # PartitionSpec, or None for a tensor not on a mesh
    shard_shape: tuple[int, ...]
    itemsize: int
    rule: str | None = None  # the regex that matched; None: replicated by default
    asked: Any = None  # the rule's spec when a dimension it did not divide was replicated instead
    mesh_shape: tuple[tuple[str, int], ...] = ()  # the mesh's axes and sizes (for `bytes_split`)

    @property
    def bytes_total(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def bytes_per_device(self) -> int:
        return math.prod(self.shard_shape) * self.itemsize

    @property
    def sharded(self) -> bool:
        return self.shard_shape != self.shape

    @property
    def indivisible(self) -> bool:
        """Whether a dimension its rule splits was replicated because the axis does not divide it."""
        return self.asked is not None

    @property
    def bytes_split(self) -> int:
        """Bytes per device had the rule's spec divided the tensor (each split dimension rounded up)."""
        if self.asked is None or self.spec is None:
            return self.bytes_per_device
        sizes = dict(self.mesh_shape)
        entries = [*self.asked, *[None] * (len(self.shape) - len(self.asked))]
        shard = [-(-n // math.prod(sizes[a] for a in _axes(e))) for n, e in zip(self.shape, entries)]
        return math.prod(shard) * self.itemsize


def _spec_text(spec: Any) -> str:
    if spec is None:
        return "(not on a mesh)"
    return "P(" + ", ".join(repr(e) for e in spec) + ")"


@dataclass
class ShardingPlan:
    """Every parameter and buffer of a module with its spec and bytes per device.

    `unmatched` lists the names no rule matched (they are replicated). Displays as a Markdown
    table in a notebook; `table(pattern)` shows only names that `re.search` `pattern`.
    """

    placements: list[Placement]
    mesh: Any = None
    rule_table: list[tuple[str, Any]] = field(default_factory=list)
    from_rules: bool = True  # False: read back by `describe`, no rules involved

    @property
    def unmatched(self) -> list[str]:
        """Names no rule matched (replicated); empty for a plan read back by `describe`."""
        return [p.name for p in self.placements if p.rule is None] if self.from_rules else []

    @property
    def indivisible(self) -> list[str]:
        """Names a rule would split but whose axis does not divide them, replicated instead
        (`Rule.indivisible`); `replicated_bytes` is what that costs."""
        return [p.name for p in self.placements if p.indivisible]

    @property
    def replicated_bytes(self) -> int:
        """Bytes per device the `indivisible` tensors cost beyond the split their rules asked for."""
        return sum(p.bytes_per_device - p.bytes_split for p in self.placements if p.indivisible)

    def indivisible_note(self, label: str = "") -> str:
        """One line naming the `indivisible` tensors and their cost in GiB per chip ("" if none);
        `label` (a component's name) prefixes each tensor (`indivisible_note`)."""
        return indivisible_note({label: self})

    @property
    def bytes_per_device(self) -> int:
        """Bytes of parameters and buffers one device holds."""
        return sum(p.bytes_per_device for p in self.placements)

    @property
    def bytes_total(self) -> int:
        """Bytes of all parameters and buffers, counted once."""
        return sum(p.bytes_total for p in self.placements)

    def __getitem__(self, name: str) -> Placement:
        for p in self.placements:
            if p.name == name:
                return p
        raise KeyError(name)

    def specs(self) -> dict[str, Any]:
        """`{name: PartitionSpec}` for every tensor."""
        return {p.name: p.spec for p in self.placements}

    def rows(self, pattern: str | None = None) -> list[dict[str, Any]]:
        return [
            {
                "name": p.name,
                "shape": p.shape,
                "spec": _spec_text(p.spec),
                "bytes per device": p.bytes_per_device,
                "rule": p.rule if p.rule is not None else "(none: replicated)",
            }
            for p in self.placements
            if pattern is None or re.search(pattern, p.name)
        ]

    def table(self, pattern: str | None = None) -> str:
        """A Markdown table (name, shape, spec, bytes per device) and a total line."""
        lines = ["| name | shape | spec | bytes per device |", "|---|---|---|---:|"]
        for r in self.rows(pattern):
            shape = "(" + ", ".join(str(s) for s in r["shape"]) + ")"
            lines.append(f"| `{r['name']}` | {shape} | `{r['spec']}` | {r['bytes per device']:,} |")
        lines.append(
            f"| **total, all {len(self.placements)} tensors** | | | **{self.bytes_per_device:,}** |"
        )
        return "\n".join(lines)

    def _repr_markdown_(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        tail = f", {len(self.unmatched)} unmatched" if self.from_rules else ""
        tail += f", {len(self.indivisible)} replicated as indivisible" if self.indivisible else ""
        return (
            f"ShardingPlan({len(self.placements)} tensors, {self.bytes_per_device:,} bytes per "
            f"device of {self.bytes_total:,}{tail})"
        )


def indivisible_note(plans: Mapping[str, ShardingPlan]) -> str:
    """One line naming every tensor of `plans` (by component) replicated because its mesh axis
    does not divide it, and what that costs per chip beyond the split its rule asked for; "" if
    none. What `tpupedia plan` and `tpupedia generate` print (notebook `sharding` introduces the rule)."""
    found = [(label, p) for label, plan_ in plans.items() for p in plan_.placements if p.indivisible]
    if not found:
        return ""
    names = ", ".join(f"{label}{' ' if label else ''}{p.name} {p.shape}" for label, p in found)
    extra = sum(p.bytes_per_device - p.bytes_split for _, p in found)
    return f"replicated, as their mesh axis does not divide them: {names}; {_gib(extra)} GiB more per chip than split"


def _gib(n: int) -> str:
    """`n` bytes in GiB, two decimals, or two significant digits below 0.01."""
    g = n / 2**30
    return f"{g:.2f}" if g >= 0.01 or g == 0 else f"{g:.2g}"


def _named_tensors(module: torch.nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    out = [(n, "param", t) for n, t in module.named_parameters()]
    return out + [(n, "buffer", t) for n, t in module.named_buffers()]


def _itemsize(t: torch.Tensor) -> int:
    return torch.empty((), dtype=t.dtype, device="meta").element_size()


def plan(module: torch.nn.Module, rule_table: Iterable[tuple[str, Any]], mesh: Any) -> ShardingPlan:
    """Decide (without moving data) every tensor's spec, and validate it against its shape.

    Works on any module, including one built on the `meta` device. Raises `ShardingError` for
    a spec that does not fit its tensor, unless its rule replicates a dimension the mesh axis does
    not divide (`Rule.indivisible`): the plan lists those (`ShardingPlan.indivisible`).
    """
    from jax.sharding import NamedSharding

    rule_table = list(rule_table)
    placements = []
    for name, kind, t in _named_tensors(module):
        asked, rule = _rule_for(name, rule_table)
        shape = tuple(t.shape)
        spec, relaxed = _check(name, shape, asked, mesh, rule.indivisible if rule is not None else "refuse")
        shard = tuple(NamedSharding(mesh, spec).shard_shape(shape))
        placements.append(
            Placement(name, kind, shape, str(t.dtype).removeprefix("torch."), spec, shard,
                      _itemsize(t), rule and rule[0], asked if relaxed else None, tuple(dict(mesh.shape).items()))
        )
    return ShardingPlan(placements, mesh, rule_table)


def _jax_array(t: torch.Tensor):
    elem = getattr(t, "_elem", None)
    import jax

    return elem if isinstance(elem, jax.Array) else None


def apply_rules(module: torch.nn.Module, rule_table: Iterable[tuple[str, Any]], mesh: Any) -> ShardingPlan:
    """Shard `module`'s parameters and buffers in place by `rule_table`; return the plan.

    The module must already live on torchax's `"jax"` device (`module.to("jax")` inside
    `with env:`). Every spec is validated before anything moves, so an error leaves the
    module as it was. Tensors no rule matches are replicated and listed in `plan.unmatched`.
    """
    import jax
    from jax.sharding import NamedSharding

    the_plan = plan(module, rule_table, mesh)
    tensors = {name: t for name, _, t in _named_tensors(module)}
    not_jax = [n for n, t in tensors.items() if _jax_array(t) is None]
    if not_jax:
        raise TypeError(
            f"apply_rules needs torchax tensors, but {not_jax[0]!r} (and {len(not_jax) - 1} more) "
            f"live on {tensors[not_jax[0]].device}; run `module.to('jax')` inside `with env:` first"
        )
    for p in the_plan.placements:
        tensors[p.name].apply_jax_(jax.device_put, NamedSharding(mesh, p.spec))
    return the_plan


def _host_view(t: torch.Tensor):
    """A CPU tensor's data as a NumPy array without a copy (bf16 and fp8, which NumPy lacks, as
    JAX's NumPy types of the same bits: `ml_dtypes`)."""
    import jax.numpy as jnp

    t = t.detach()
    bits = {torch.bfloat16: (torch.int16, jnp.bfloat16), torch.float8_e4m3fn: (torch.int8, jnp.float8_e4m3fn)}
    if t.dtype in bits:
        raw, dtype = bits[t.dtype]
        return t.contiguous().view(raw).numpy().view(dtype)
    return t.contiguous().numpy()


def place(module: torch.nn.Module, rule_table: Iterable[tuple[str, Any]], mesh: Any, env: Any = None) -> ShardingPlan:
    """Move a CPU `module` onto `mesh` by `rule_table`, each device receiving only its shards.

    `module.to("jax")` followed by `apply_rules` first puts every whole tensor on the default
    device (chip 0) and then reshards it: for a 16.6 GB transformer that is 16.6 GB on one
    31.25 GiB chip before anything is split. Here each parameter and buffer becomes a
    `jax.make_array_from_callback` array whose callback hands each device the slice of host
    memory its shard covers, so no device ever holds more than its planned shard, and in a
    multi-process job each process builds only the shards of its own devices. Every spec is
    validated first (`plan`), so an error moves nothing. The module's tensors become torchax
    tensors (as after `module.to("jax")`), for `env` (default: torchax's default environment).

    Used by the pipelines of notebooks `cogvideox_pipeline` and `hunyuan_video`; notebook `sharding` shows the per-device bytes.
    """
    import jax
    from jax.sharding import NamedSharding

    from tpupedia import compat

    torchax = compat.import_torchax()
    env = env or torchax.default_env()
    the_plan = plan(module, rule_table, mesh)
    specs = {p.name: p.spec for p in the_plan.placements}
    hosts = {}  # id(tensor) -> (host view, sharding), read before entering torchax's mode
    for name, _, t in _named_tensors(module):
        if _jax_array(t) is not None or t.device.type != "cpu":
            raise TypeError(f"place needs a module on the CPU, but {name!r} lives on {t.device}; "
                            "use apply_rules for a module already on torchax's device")
        hosts[id(t)] = (_host_view(t), NamedSharding(mesh, specs[name]))

    def build(t: torch.Tensor) -> torch.Tensor:
        host, where = hosts[id(t)]
        array = jax.make_array_from_callback(host.shape, where, lambda index: host[index])
        return torchax.tensor.Tensor(array, env)

    with env:
        module._apply(build)
    return the_plan


def free(module: torch.nn.Module) -> int:
    """Delete the device buffers of `module`'s parameters and buffers now, instead of whenever
    Python drops its last reference (a jitted closure or a traceback can keep one alive for a
    whole run). Returns the bytes freed, summed over this process's devices (a replicated tensor
    counts once per device); the module cannot run afterwards."""
    freed = 0
    for _, _, t in _named_tensors(module):
        array = _jax_array(t)
        if array is not None and not array.is_deleted():
            freed += sum(shard.data.nbytes for shard in array.addressable_shards)
            array.delete()
    return freed


def describe(module: torch.nn.Module) -> ShardingPlan:
    """Where every parameter and buffer of `module` actually lives, read from its arrays.

    Tensors that are not torchax tensors (still on CPU or `meta`) are reported with spec
    `None` and their full size.
    """
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    placements, mesh = [], None
    for name, kind, t in _named_tensors(module):
        arr, shape = _jax_array(t), tuple(t.shape)
        if arr is None:
            spec, shard = None, shape
        else:
            sharding = arr.sharding
            if isinstance(sharding, NamedSharding):
                spec, mesh = sharding.spec, mesh or sharding.mesh
            else:  # a single-device array
                spec = P()
            shard = tuple(sharding.shard_shape(shape))
        placements.append(
            Placement(name, kind, shape, str(t.dtype).removeprefix("torch."), spec, shard,
                      _itemsize(t), rule=None)
        )
    return ShardingPlan(placements, mesh, from_rules=False)
