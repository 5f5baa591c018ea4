"""`FamilySpec`: what the rest of the package needs to know about a model family, in one record.

Each family module (`tpupedia.models.<name>`) exports `SPEC`; `tpupedia.families` collects them,
and the command line, the dry-run, the plan, the docs and the tests read the registry instead of
naming a family. The spec holds what is *data*: names, the checkpoint's hub id, the sharding
tables, the attention mask's structure, the prefix of one layer's weights, the numbers the docs
quote about it (`QuotedFigure`: which results record, which value). Everything computed
(configs, shape facts read from a checkpoint, frame and size rules, FLOPs, builders) stays a
function of the family module, which `FamilySpec.facts` imports; a family whose `kind` is
`"video"` also has a pipeline, `tpupedia.pipelines.<name>` by convention.

Kinds:

* `"video"`: a text-to-video family with a staged pipeline (`generate`, `plan`, `dryrun`,
  `bench generate`);
* `"llm"`: a decoder-only language model the dry-run compiles one forward of;
* `"vae"`: a video decoder the dry-run compiles one frame batch of, with the frame and size
  rules of the video family it belongs to (`defaults_from`).

Introduced with the family registry (issue 20); notebook `plan_without_tpu` plans a run from it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

__all__ = ["FamilySpec", "QuotedFigure", "FewStepRelease", "ReleaseAdapter", "KINDS", "MASKS", "FIGURE_READS"]

KINDS = ("video", "llm", "vae")
MASKS = ("padding", "causal_padding")
"""The attention mask's structure a family hands to SDPA (`tpupedia.attention`'s `mask_structure`):
text padding only (valid(q) & valid(k)), or causal on top of it (an LLM)."""


FIGURE_READS = ("plan_peak", "plan_weights", "plan_oom", "plan_predicted", "dryrun_peak", "upstream_step", "computed")
"""What a `QuotedFigure` reads from its record: a plan stage's peak or weights per chip, what a plan's
program that did not fit asked for, a dry-run's arguments + temporaries (GiB each), a plan's
predicted seconds for its stages, or a reported step time (s); `computed`: no record, the family
module computes it (`compute`)."""


@dataclass(frozen=True)
class QuotedFigure:
    """A number the docs quote about a family, read from one record of a results file
    (`tpupedia.figures` turns it into a checked `Figure`, `{{ figure:NAME }}` in the docs)."""

    name: str
    read: str
    """One of `FIGURE_READS`."""
    match: Mapping[str, Any]
    """The fields of the one record it reads (`plan_*`: of `plans.json`, where `stages` is the
    tuple of the record's stage names; `dryrun_peak`: `dryruns.json`; `upstream_step`:
    `upstream.json`)."""
    decimals: int
    source: str
    """Where the number comes from and how it was obtained, for the docs."""
    stage: str | None = None
    """`plan_peak`, `plan_weights`: the stage whose peak or weights it is."""
    quotes: tuple[tuple[str, str], ...] = ()
    """`(glob, regex)` pairs: prose that quotes the number (the consistency test checks each)."""
    compute: Callable[[], float] | None = None
    """`computed`: the function of the family module that gives the number."""
    text: Callable[[float], str] | None = None
    """How pages print it, when `decimals` alone does not say (`113,585`, `1.26e16`, `24%`)."""

    def __post_init__(self):
        if self.read not in FIGURE_READS:
            raise ValueError(f"{self.name}: read {self.read!r} is not one of {', '.join(FIGURE_READS)}")
        if (self.read == "computed") != (self.compute is not None):
            raise ValueError(f"{self.name}: a `computed` figure, and only one, has a `compute` function")


@dataclass(frozen=True)
class ReleaseAdapter:
    """One LoRA file a few-step release fuses: where to get it (`repo` on the Hugging Face Hub,
    `filename` in it), the transformer it goes into, its rank (what the tiny preset's adapter of
    the same layout is built with) and the scale it is fused with."""

    repo: str
    filename: str
    component: str = "transformer"
    rank: int = 64
    scale: float = 1.0

    @property
    def where(self) -> str:
        return f"{self.repo}/{self.filename}"


@dataclass(frozen=True)
class FewStepRelease:
    """A step-distilled or few-step release a user selects by name (`--release NAME`), with its
    own defaults. The family module holds the table (`FamilySpec.few_step`), each value cited in
    its `sources`; `tpupedia.families.few_step` looks one up, and the command line applies it,
    flags the user gives winning, and prints what it applied."""

    name: str
    title: str
    model: str
    """The hub id of the checkpoint it runs (the full preset; the tiny preset builds a tiny
    checkpoint of the same layout, the family module's `tiny_release_checkpoint`)."""
    steps: int
    guidance: float
    fields: Mapping[str, Any] = field(default_factory=dict)
    """The family's own request fields it sets (Wan's `guidance_2`, `shift`; HunyuanVideo-1.5's `shift`)."""
    adapters: tuple[ReleaseAdapter, ...] = ()
    image_to_video: bool = False
    """It generates from a picture (`--image` is needed)."""
    sources: tuple[str, ...] = ()
    """Where each default comes from."""
    note: str = ""
    """What differs from the upstream reference run, said where it is applied."""

    def request_fields(self) -> dict[str, Any]:
        """The request fields it sets: steps, guidance and the family's own."""
        return {"steps": self.steps, "guidance": self.guidance, **self.fields}


@dataclass(frozen=True)
class FamilySpec:
    """One model family, as the registry describes it (see the module docstring)."""

    name: str
    """The command-line name (`tpupedia generate NAME`) and the `model` of stage files and records."""
    title: str
    """One line for help texts: what the family is and what its stages run."""
    module: str
    """The family module holding its facts and builders (`tpupedia.models.<...>`)."""
    kind: str = "video"
    full_id: str | None = None
    """The hub id the full preset loads (`None`: not loaded by id)."""
    sharding: Mapping[str, Sequence[tuple[str, tuple]]] = field(default_factory=dict)
    """Rule tables by strategy, written against the default axes `"tp"` / `"fsdp"`
    (`tpupedia.sharding.rules` renames them to the mesh's)."""
    mask: str = "padding"
    layer_prefix: str = "transformer_blocks.0."
    """The names of one layer's weights start with this: the dry-run adds the missing layers'
    weight shards from it."""
    dryrun_masks: tuple[str, ...] = ("vector",)
    """How the dry-run can hand the text padding to attention: `vector` (a (B, S) vector, what the
    pipelines run) and, where the stock processor differs, `matrix` (its (B, 1, S, S) matrix)."""
    defaults_from: str | None = None
    """A `"vae"` target: the video family whose default request and frame rule it uses."""
    figures: tuple[QuotedFigure, ...] = ()
    """The numbers about this family that the docs quote, each from a results record."""
    releases: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """The released checkpoints whose component configs the family module builds without a
    download: hub id -> the keyword arguments of its `full_configs` (`tpupedia plan --model ID`)."""
    few_step: Mapping[str, FewStepRelease] = field(default_factory=dict)
    """The family's step-distilled and few-step releases by name (`--release NAME`)."""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.mask not in MASKS:
            raise ValueError(f"{self.name}: mask {self.mask!r} is not one of {', '.join(MASKS)}")

    @property
    def facts(self) -> ModuleType:
        """The family module (`tpupedia.models.<...>`): configs, shape facts, rules, builders."""
        return importlib.import_module(self.module)

    @property
    def pipeline(self) -> str | None:
        """The module name of the family's staged pipeline (a `"video"` family), by convention."""
        return f"tpupedia.pipelines.{self.name}" if self.kind == "video" else None

    @property
    def strategies(self) -> tuple[str, ...]:
        return tuple(self.sharding)

    def describe(self) -> dict[str, Any]:
        """The spec as plain data (for the docs' family table)."""
        return {"name": self.name, "kind": self.kind, "title": self.title, "module": self.module,
                "full_id": self.full_id, "strategies": list(self.strategies), "mask": self.mask}
