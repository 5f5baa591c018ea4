"""What every staged text-to-video pipeline shares: requests and options, validation of what is
not model-specific, meshes, the stage runner and the host <-> device conversions.

A family pipeline (`cogvideox`, notebook `cogvideox_pipeline`; `hunyuan`, notebook `hunyuan_video`) is a `StagedPipeline`
subclass with three stages, `encode_text`, `denoise` and `decode`, each returning
`(tensors, timings)`; `run` drives them through the stage files of `tpupedia.pipelines.stages`
(skip what is done, read what the next stage needs, write atomically, one writer per job) and
`run_batch` drives them over a prompts file with one pipeline per process.

Memory comes back: every weight is built on its devices straight from host memory, each device
receiving only its shards (`tpupedia.sharding.place`), and a stage frees the models it loaded
when it ends, so the text encoders are gone before the transformer loads. A `resident` pipeline
(batch mode) keeps them, and its compiled programs, from one prompt to the next.
Introduced in notebook `cogvideox_pipeline`, reused by notebook `hunyuan_video`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

from tpupedia import lora as lora_adapters
from tpupedia import quantize as quantizing
from tpupedia.devices import default_mesh_shape
from tpupedia.errors import TpupediaError
from tpupedia.models.checkpoints import DEPTH_FIELDS, depth
from tpupedia.pipelines import stages
from tpupedia.pipelines.stages import config_fingerprint

__all__ = ["PipelineError", "Request", "Options", "validate", "mesh_shape", "check_workdir", "SEED_LIMIT", "parse_mesh", "default_mesh_shape", "StageReport", "fresh_trace",
           "StagedPipeline", "run", "run_batch", "PLAN", "plans", "check_plan", "attention_backend", "torch_dtype", "to_jax_array", "to_torch",
           "timed", "load_stock", "step_times", "denoise_loop", "STAGE_INPUTS", "request_stages", "batch_requests", "stage_settings", "config_fingerprint", "ATTENTION", "DTYPES", "SHARDINGS",
           "DEPTH_FIELDS", "depth"]

ATTENTION = ("auto", "splash", "reference")
DTYPES = ("auto", "bfloat16", "float32")
SHARDINGS = ("tp", "fsdp", "replicated")
class PipelineError(TpupediaError, ValueError):
    """A generation request that cannot run: bad sizes, frames, prompt, mesh or option."""


@dataclass(frozen=True)
class Request:
    """What to generate (every field changes the video). Families add their own fields."""

    prompt: str
    negative_prompt: str = ""
    frames: int = 81
    height: int = 720
    width: int = 1280
    steps: int = 50
    guidance: float = 6.0
    seed: int = 42
    fps: int = 16
    vae_tiling: bool = False
    """Decode in overlapping spatial tiles (diffusers' `enable_tiling`): what fits a large frame into
    one chip's memory (`tpupedia plan` says when); the blend changes pixels slightly."""
    image: str | None = None
    """Image-to-video: the path of the picture the video starts from (`tpupedia.pictures`), for a
    family and checkpoint that take one; `None` for text-to-video."""
    lora: tuple[lora_adapters.Adapter, ...] = ()
    """LoRA adapters fused into the transformers before the denoise stage (`tpupedia.lora`: each
    file, scale and component; `--lora PATH[:SCALE][@COMPONENT]`), in order."""
    quantize: str | None = None
    """Weight-only quantization of the transformers' linears (`tpupedia.quantize`: `int8` or `fp8`,
    one scale per output channel, applied after the matmul), on the host after any LoRA fuse and
    before sharding; the layers the family keeps in bf16 are its `QUANTIZE_KEEP` table, each with
    its reason (`--quantize`). It changes the frames, slightly: part of the denoise stage's settings."""


@dataclass(frozen=True)
class Options:
    """How to run it: these change speed and memory, not what the video is."""

    mesh: tuple[int, int] | None = None
    """`(dp, tp)`; default `mesh_shape`: dp=2 for a guidance pair, dp=1 without guidance."""
    sharding: str = "tp"
    attention: str = "auto"
    block_sizes: tuple[int, int, int] | None = None
    """Splash `(block_q, block_kv, block_kv_compute)`, upper bounds capped to each sequence;
    `None`: the family's `SPLASH_BLOCK_SIZES` (`tpupedia.models.<family>`)."""
    vae: str | None = None
    """Which VAE implementation decodes; `None`: the family's first (`StagedPipeline.vaes`)."""
    quiet: bool = False
    matmul_precision: str | None = None
    """`"highest"` for parity checks (a TPU runs float32 matmuls in bf16 passes by default)."""
    dtype: str = "auto"
    """`auto`: bfloat16 on the full preset (as the checkpoints are released), float32 on the tiny
    preset (exact parity with stock diffusers); or `bfloat16` / `float32`."""


SEED_LIMIT = 2**64
"""Seeds are what `torch.Generator.manual_seed` takes: 0 <= seed < 2^64."""


def validate(request: Request, options: Options, device_count: int | None = None, *,
             vaes: tuple[str, ...] = ("flax", "torchax"), shardings: tuple[str, ...] = SHARDINGS) -> None:
    """Refuse what no family can run, naming the bad value and what is allowed. Loads no model.
    Frame and size rules are the family's (`tpupedia.models.<family>.check_frames/check_size`)."""
    if not request.prompt or not request.prompt.strip():
        raise PipelineError("the prompt is empty; say what the video should show (--prompt TEXT)")
    for name in ("steps", "fps"):
        value = getattr(request, name)
        if not isinstance(value, int) or value < 1:
            raise PipelineError(f"{name}={value} must be a positive integer")
    if request.guidance is not None and (not math.isfinite(request.guidance) or request.guidance < 0):
        raise PipelineError(f"guidance={request.guidance} must be a finite number >= 0 (1 or less turns guidance off)")
    if not isinstance(request.seed, int) or not 0 <= request.seed < SEED_LIMIT:
        raise PipelineError(f"seed={request.seed} must be an integer with 0 <= seed < 2^64 "
                            f"(what torch.Generator.manual_seed takes)")
    for name, value, allowed in (("sharding", options.sharding, shardings), ("attention", options.attention, ATTENTION),
                                 ("dtype", options.dtype, DTYPES), ("vae", options.vae or vaes[0], vaes)):
        if value not in allowed:
            raise PipelineError(f"{name}={value!r} is not one of {', '.join(allowed)}")
    if request.quantize is not None and request.quantize not in quantizing.FORMATS:
        raise PipelineError(f"quantize={request.quantize!r} is not one of {', '.join(quantizing.FORMATS)} "
                            "(or none: the checkpoint's own dtype)")
    if options.block_sizes is not None:  # splash's rules (AttentionError names the value)
        from tpupedia import attention

        attention.check_block_rules(options.block_sizes)
    if request.image is not None:  # the picture itself: readable, a picture, not too large
        from tpupedia import pictures

        pictures.check(request.image)
    if options.mesh is not None and device_count is not None and math.prod(options.mesh) != device_count:
        dp, tp = options.mesh
        raise PipelineError(f"mesh dp={dp},tp={tp} needs {dp * tp} devices, but {device_count} are available; "
                            f"choose dp*tp = {device_count}")


def mesh_shape(options: Options, device_count: int, guidance_batch: int) -> tuple[int, int]:
    """`(dp, tp)` for a run: `options.mesh` if given, which `dp` must divide the guidance batch
    (2 with classifier-free guidance, the negative and positive prompt; 1 without), or else
    `default_mesh_shape`, with dp=1 when there is no pair to split."""
    if options.mesh is not None:
        dp, tp = options.mesh
        if guidance_batch % dp:
            allowed = " or ".join(f"dp={d}" for d in range(1, guidance_batch + 1) if guidance_batch % d == 0)
            raise PipelineError(f"mesh dp={dp},tp={tp}: the data-parallel axis splits the guidance batch of "
                                f"{guidance_batch} ({'negative and positive prompt' if guidance_batch == 2 else 'guidance off'}), "
                                f"so dp must divide it: {allowed}")
        return options.mesh
    if guidance_batch == 1:
        return 1, device_count
    return default_mesh_shape(device_count)


PLAN = ("auto", "on", "off")
"""When a run checks its plan before loading (`check_plan`): `auto` under a full-size preset
(`preset.pretrained`; the tiny preset keeps its seconds), `on` always (what `tpupedia generate`
asks for a checkpoint it was given, which may be of any size), `off` never (`--no-plan`)."""


def plans(plan: str, preset: Any) -> bool:
    """Whether a run under `preset` checks its plan (`PLAN`), or a `PipelineError` naming a bad
    `plan`."""
    if plan not in PLAN:
        raise PipelineError(f"plan={plan!r} is not one of {', '.join(PLAN)}")
    return plan == "on" or (plan == "auto" and bool(getattr(preset, "pretrained", False)))


def check_plan(pipeline_cls: type[StagedPipeline], request: Request, options: Options, configs: dict[str, dict],
               run_devices: list, dtype: Any, *, tiling: str | None = None, resident: bool = False,
               log: Callable[[str], None] = print) -> Request:
    """`request` as the plan resolves it for `run_devices`, before any weight loads: every
    program of the run compiled one layer deep (`tpupedia.plan.preflight`, notebook
    `plan_without_tpu`; cached per shape), a run that will not fit refused with the stage and the
    fix (`tpupedia.plan.PlanError`), the VAE tiling switched on when the untiled decode does not
    fit and, for a family whose stock VAE is float32 (Wan), the VAE's dtype lowered only when
    float32 does not fit; both said in the log. `tiling`: `auto`, `on` or `off` (default: `on`
    for a request that asks for tiling, else `auto`). Every way in calls this: `run`,
    `run_batch` (each request, models `resident`), the stage methods of a pipeline built by
    hand (`StagedPipeline.planned`) and so `tpupedia generate`."""
    from tpupedia import plan
    from tpupedia.models import checkpoints

    return plan.preflight(pipeline_cls.family.SPEC.name, request, options, configs, list(run_devices),
                          cache_dir=checkpoints.cache_dir() / "plans",
                          tiling=tiling or ("on" if request.vae_tiling else "auto"), resident=resident,
                          dtype=str(dtype).removeprefix("torch."), log=log)


def check_workdir(path: str | Path, flag: str = "--workdir") -> Path:
    """`path` created if missing and writable, or a `PipelineError` naming it (before any model loads)."""
    import os

    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise PipelineError(f"{flag} {path}: cannot be created ({err.strerror or err}); "
                            "give a folder you can write to") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise PipelineError(f"{flag} {path}: not writable; give a folder you can write to")
    return path


def parse_mesh(text: str) -> tuple[int, int]:
    """`"dp=2,tp=4"` -> `(2, 4)`. Both axes, positive integers, nothing else."""
    parts = dict(p.split("=", 1) for p in text.replace(" ", "").split(",") if "=" in p)
    if set(parts) != {"dp", "tp"} or len(text.split(",")) != 2:
        raise PipelineError(f"mesh {text!r}: expected dp=N,tp=M (for example dp=2,tp=4)")
    try:
        shape = int(parts["dp"]), int(parts["tp"])
    except ValueError:
        raise PipelineError(f"mesh {text!r}: dp and tp must be integers") from None
    if min(shape) < 1:
        raise PipelineError(f"mesh {text!r}: dp and tp must be positive")
    return shape


def stage_settings(family_name: str, stage: str, source_label: str, configs: dict[str, dict], request: Request,
                   dtype: str, *, picture: dict | None = None, frames: bool = True) -> dict:
    """The settings a stage of a one-text-encoder family starts from: the model, the checkpoint's
    label and the dtype; the text encoder and the prompts for every stage but `image`; and with a
    picture, for every stage but `text`, its SHA-256, the VAE config and the video's size (the
    picture is cropped to it) and, unless `frames` is false (an image stage that encodes the
    picture alone), its frame count, plus `picture` (what else the family's image stage depends on)."""
    out = {"model": family_name, "source": source_label, "dtype": dtype}
    if stage != "image":
        out |= {"text_encoder": config_fingerprint(configs["text_encoder"]),
                "prompt": request.prompt, "negative_prompt": request.negative_prompt}
    if request.image is not None and stage != "text":
        from tpupedia import pictures

        out |= {"image": pictures.fingerprint(request.image), "vae_config": config_fingerprint(configs["vae"]),
                "height": request.height, "width": request.width} | (picture or {})
        if frames:
            out["frames"] = request.frames
    return out


@dataclass
class StageReport:
    """What one stage did: whether it ran or was skipped, its timings, the file it wrote."""

    stage: str
    ran: bool
    path: Path
    timings: dict[str, float] = field(default_factory=dict)
    reason: str = ""


def timed(fn: Callable[[], Any], sync: Callable[[Any], Any]) -> tuple[Any, float]:
    """`(fn(), seconds)`, the clock stopped after `sync(result)` (e.g. `jax.block_until_ready`)."""
    start = time.perf_counter()
    out = fn()
    sync(out)
    return out, time.perf_counter() - start


def load_stock(pipeline_class: Any, source: str, dtype: Any = None, **components: Any) -> Any:
    """Stock diffusers `pipeline_class` from `source` (safetensors only; float32 unless `dtype`),
    progress bar off: what each family's `stock` (the parity tests' and `tpupedia bench
    generate`'s reference) starts from. `components`: modules loaded apart and passed in, as
    diffusers' examples pass a float32 VAE to a bf16 pipeline."""
    import torch

    pipe = pipeline_class.from_pretrained(source, dtype=dtype or torch.float32, use_safetensors=True, **components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


_PER_STEP = [False]


@contextlib.contextmanager
def step_times():
    """Within it, `denoise_loop` waits for each step's device work and records every step's
    seconds (`step_s`): what `tpupedia bench deepcache` reads to leave out each program's
    compiling step. A run outside it waits only where it needs a value."""
    before, _PER_STEP[0] = _PER_STEP[0], True
    try:
        yield
    finally:
        _PER_STEP[0] = before


def denoise_loop(step: Callable[[int, Any], Any], state: Any, steps: int,
                 on_step: Callable[[int, Any], None] | None = None, *,
                 latents: Callable[[Any], Any] = lambda state: state) -> tuple[Any, dict]:
    """Every family's denoising loop: `state = step(i, state)` for `i` in `range(steps)`,
    `on_step(i, latents(state))` after each. `state` is whatever the family's compiled step
    carries from one step to the next (the latents; with a multistep solver its previous
    prediction; with DeepCache the cached features), `latents` picks the latents out of it.

    JAX dispatches a compiled call and returns before the device has run it, so the host waits
    only twice: after the first call (it compiles; `first_s`) and after the last. In between it
    prepares and dispatches step `i + 1` (its inputs, and any noise the family draws on the host
    as stock draws it) while the chips still run step `i`, so they never wait for Python;
    `steady_s` is the mean of the other steps. Inside `step_times()` it waits after every step
    and records each (`step_s`; `steady_s` their median). Returns `(state, timings)`.
    Introduced in notebook `cogvideox_pipeline`."""
    import jax
    import numpy as np

    if _PER_STEP[0] or steps < 2:
        seconds = []
        for i in range(steps):
            state, t = timed(lambda: step(i, state), jax.block_until_ready)
            seconds.append(t)
            if on_step:
                on_step(i, latents(state))
        steady = float(np.median(seconds[1:])) if len(seconds) > 1 else seconds[0]
        return state, {"first_s": seconds[0], "steady_s": steady, "steps": len(seconds),
                       "step_s": [round(t, 6) for t in seconds]}
    state, first = timed(lambda: step(0, state), jax.block_until_ready)
    if on_step:
        on_step(0, latents(state))
    start = time.perf_counter()
    for i in range(1, steps):
        state = step(i, state)
        if on_step:
            on_step(i, latents(state))
    jax.block_until_ready(state)
    return state, {"first_s": first, "steady_s": (time.perf_counter() - start) / (steps - 1), "steps": steps}


class StagedPipeline:
    """Three stages over one checkpoint (`source`: a diffusers directory or hub id) on `mesh`.

    Subclasses set `family` (the model module) and `vaes`, and implement `settings_for`,
    `_encode_text`, `_denoise` and `_decode`. Components load only when a stage needs them
    (`from_pretrained`, safetensors only), so running `denoise` alone never loads a text encoder.
    Under a full-size preset each stage method checks its request's plan first (`planned`), so a
    pipeline built by hand, as the notebooks build them, refuses a run that will not fit before it
    loads a weight, and decodes tiled where the untiled decode does not fit.
    """

    family: ClassVar[Any]
    vaes: ClassVar[tuple[str, ...]] = ("torchax",)
    image_to_video: ClassVar[bool] = False
    """Whether the family generates from a picture (`Request.image`, the `image` stage)."""
    size_from_picture: ClassVar[bool] = False
    """Whether image-to-video takes the video's width and height from the picture (HunyuanVideo-1.5:
    the size bucket nearest its aspect), so a width or height given with a picture is refused
    (`check_size_given`) rather than ignored."""

    def __init__(self, source: str, source_label: str, dtype: Any, mesh: Any, options: Options,
                 configs: dict[str, dict] | None = None):
        from tpupedia import torchax_utils

        self.source, self.source_label, self.dtype, self.mesh, self.options = source, source_label, dtype, mesh, options
        self.vae = self.vae_choice(options)
        self.env = torchax_utils.default_env()
        torchax_utils.register_common_outputs()
        self.configs = configs if configs is not None else self.checkpoint_configs(source)
        self.shapes = self.family.shape_facts(self.configs)
        """Compression ratios, patch sizes and latent channels of this checkpoint (`tpupedia.models.shapes`)."""
        self.components: dict[str, tuple[type, list]] = {}
        """Each placed component's class and sharding rules (what a plan rebuilds at full depth)."""
        self.plans: dict[str, Any] = {}
        """The sharding plan each component was placed with (`tpupedia.sharding.ShardingPlan`)."""
        self.traces: dict[str, int] = {}
        """How many times each stage's compiled function was traced (one per distinct shape)."""
        self.resident = False
        """Keep every stage's models and compiled programs between requests (`run_batch`: load
        once, reuse the compiled step for every prompt). Otherwise `release` frees a stage's
        models as soon as it ends, so the next stage has the chips to itself."""
        self._held: dict[tuple[str, Any], Any] = {}
        self.abstract = False
        """Build models on PyTorch's `meta` device from `configs` and plan their shardings without
        placing anything (`tpupedia.plan`): the stages' `_*_programs` then describe, with abstract
        weights, the programs a real run compiles."""
        self.block_sizes: tuple[int, int, int] = tuple(options.block_sizes or family_block_sizes(self.family, mesh))
        """The splash kernel's block sizes for the long sequences (capped per call to shorter ones):
        the ones asked, else the family's as this mesh's chip fits them (`family_block_sizes`)."""
        self.layers: int | None = None
        """With `abstract`: build transformers and text encoders this many layers deep (a cheaper
        compile; `tpupedia.plan` adds the missing layers' weight shards from their shapes)."""
        self.adapters: tuple[lora_adapters.Adapter, ...] = ()
        """The LoRA adapters fused into the transformers the denoise stage holds (`Request.lora`):
        another set means other weights, so `denoise` releases what that stage holds first."""
        self.quantized: str | None = None
        """The weight format of the transformers the denoise stage holds (`Request.quantize`), as
        `adapters`: another format means other weights, so `denoise` releases them first."""
        self.plan = "auto"
        """Whether the stage methods check a request's plan before they load anything (`PLAN`;
        `auto`: under a full-size preset, `tpupedia.presets.current()`): a pipeline a notebook
        builds by hand plans as `run` does. `run` and `run_batch` plan before they build their
        pipeline and set this to `off`."""
        self._planned: list[tuple[Request, Request]] = []  # (asked, as planned), once per request

    def planned(self, request: Request, caller: str = "a stage") -> Request:
        """`request` as its plan resolves it on this pipeline's mesh (`check_plan`: refused if it
        will not fit, the VAE tiling and dtype resolved), planned once per request; `request`
        itself where this pipeline does not plan (`plan`; `abstract`, a plan's own pipeline). Under
        a rehearsal (`tpupedia.rehearsal`) the plan is for the rehearsal's slice (this pipeline's
        mesh shape where it has as many devices, else the run's default) and the stage method
        `caller` stops there (`Rehearsed`)."""
        from tpupedia import presets, rehearsal

        rehearsing = rehearsal.target() is not None
        if self.abstract or not (rehearsing or plans(self.plan, presets.current())):
            return request
        for asked, resolved in self._planned:
            if request in (asked, resolved):
                return resolved
        run_devices = rehearsal.devices() if rehearsing else list(self.mesh.devices.flat)
        shape = tuple(self.mesh.shape.get(a, 1) for a in ("dp", "tp"))
        options = dataclasses.replace(self.options, mesh=shape if self.mesh.devices.size == len(run_devices) else None)
        resolved = check_plan(type(self), request, options, self.configs, run_devices, self.dtype,
                              resident=self.resident, log=(lambda _: None) if self.options.quiet else print)
        rehearsal.stop(f"{type(self).__name__}.{caller}", self.family.SPEC.name, resolved)
        self._planned.append((request, resolved))
        return resolved

    def held(self, stage: str, key: Any, build: Callable[[], Any]) -> Any:
        """What `build()` returns (a placed model, a compiled program), built once for `(stage,
        key)` and kept until `release(stage)`. `key` holds whatever the built object depends on
        besides the checkpoint (steps, guidance on or off), so a batch reuses it exactly when it can."""
        if (stage, key) not in self._held:
            self._held[(stage, key)] = build()
        return self._held[(stage, key)]

    def release(self, stage: str, *, force: bool = False) -> int:
        """Free what `stage` holds (the device buffers of its models deleted now) unless the
        pipeline is `resident` and not `force`d. Returns the bytes freed on this process's devices."""
        if self.resident and not force:
            return 0
        freed = 0
        for key in [k for k in self._held if k[0] == stage]:
            freed += _free(self._held.pop(key))
        return freed

    @classmethod
    def cache_identity(cls, configs: dict[str, dict]) -> dict[str, str]:
        """The model a step cache's saved calibration belongs to: the family and its (first)
        transformer's config fingerprint (`tpupedia.pipelines.stepcache.read_calibration`)."""
        return {"family": cls.family.FAMILY, "transformer": config_fingerprint(configs["transformer"])}

    @classmethod
    def vae_choice(cls, options: Options) -> str:
        """The VAE implementation `options` asks for, or the family's default."""
        return options.vae or cls.vaes[0]

    @classmethod
    def validate(cls, request: Request, options: Options, device_count: int | None = None,
                 configs: dict[str, dict] | None = None, *, shape_rules: bool = True, kind: bool = True) -> None:
        """Everything checkable before a model loads: the common rules, then the family's frame and
        size rules with the checkpoint's shape facts (`configs`; without them, the released
        checkpoint's, unless `shape_rules=False`: a checkpoint whose configs are not read yet), the
        mesh against the guidance batch, and (`kind`, with `configs`) that the request has a picture
        exactly when the checkpoint is image-to-video (`check_kind`; a batch's shared request
        leaves that to each of its lines)."""
        if request.image is not None and not cls.image_to_video:
            raise PipelineError(f"--image {request.image}: image-to-video is not implemented for "
                                f"{cls.family.FAMILY} yet; its pipeline generates from text only")
        validate(request, options, device_count, vaes=cls.vaes)
        if getattr(request, "step_cache", None) is not None:  # its schedule against the steps (the blocks: at load)
            request.step_cache.check(request.steps)
            if configs is not None:  # a saved calibration made on another model
                request.step_cache.saved_calibration(cls.cache_identity(configs))
        if request.lora:  # the files; with `configs`, their keys and shapes against the transformers (no weights)
            lora_adapters.check(request.lora, cls.family, configs)
        if kind and configs is not None and cls.image_to_video:  # the request and the checkpoint agree on a picture
            cls.check_kind(request, configs)
        if shape_rules or configs is not None:
            facts = cls.family.shape_facts(configs) if configs is not None else cls.family.DEFAULT_SHAPES
            cls.family.check_frames(request.frames, facts)
            cls.family.check_size(request.width, request.height, facts)
        batch = cls.guidance_batch(request, configs)
        if batch is not None:
            mesh_shape(options, device_count or math.prod(options.mesh or (1, 1)), batch)

    @classmethod
    def check_kind(cls, request: Request, configs: dict[str, dict]) -> None:
        """A picture for an image-to-video checkpoint (`family.image_to_video(configs)`), none for
        a text-to-video one; the error says how the checkpoint shows its kind (`kind_evidence`)."""
        i2v = cls.family.image_to_video(configs)
        if request.image is not None and not i2v:
            raise PipelineError(f"--image {request.image}: this checkpoint is text-to-video ({cls.kind_evidence(configs)}); "
                                f"give an image-to-video one, e.g. {cls.family.FULL_ID_I2V}")
        if request.image is None and i2v:
            raise PipelineError(f"this checkpoint is image-to-video ({cls.kind_evidence(configs)}): give --image PICTURE")

    @classmethod
    def check_size_given(cls, request: Request, given: list[str]) -> None:
        """Refuse a size the user gave (`given`: the flags or fields, e.g. `--width`) for a
        picture whose video size the family takes from the picture (`size_from_picture`)."""
        if request.image is not None and cls.size_from_picture and given:
            raise PipelineError(f"{' and '.join(given)}: {cls.family.FAMILY} image-to-video takes the video's size "
                                "from the picture (the size bucket nearest its aspect, as the stock pipeline picks "
                                "it); leave the size out and crop the picture to the aspect you want")

    @classmethod
    def kind_evidence(cls, configs: dict[str, dict]) -> str:
        """How the checkpoint shows its kind, in words: by default its transformer's input
        channels (image-to-video adds the picture's latents beside the noisy ones)."""
        transformer = configs.get("transformer") or configs["transformer_2"]
        extra = "the picture's latents beside the noisy ones" if cls.family.image_to_video(configs) else "the noisy latents' only"
        return f"its transformer takes {transformer['in_channels']} input channels, {extra}"

    @classmethod
    def guidance_batch(cls, request: Request, configs: dict[str, dict] | None = None) -> int | None:
        """Samples each transformer call carries: 2 with classifier-free guidance, else 1 (`None`:
        unknown without the checkpoint's `configs`)."""
        return 2 if request.guidance is not None and request.guidance > 1.0 else 1

    @classmethod
    def run_mesh_shape(cls, request: Request, options: Options, device_count: int,
                       configs: dict[str, dict] | None = None) -> tuple[int, int]:
        """`(dp, tp)` for `request` on `device_count` devices (`mesh_shape` with this family's
        `guidance_batch`): what a run and its plan both build their mesh from."""
        return mesh_shape(options, device_count, cls.guidance_batch(request, configs))

    def _precision(self):
        import jax

        p = self.options.matmul_precision
        return jax.default_matmul_precision(p) if p else contextlib.nullcontext()

    @classmethod
    def lowered(cls, request: Request, dtype: str) -> Request | None:
        """`request` with the components stock keeps wider than the run's `dtype` (a name) lowered
        to it, for `tpupedia.plan` to try when they do not fit; `None`: nothing to lower (Wan's
        VAE is the one case, `tpupedia.pipelines.wan.Wan.lowered`)."""
        return None

    def component_dtype(self, name: str) -> Any:  # noqa: ARG002 - a family may keep a component in another dtype
        """The torch dtype component `name` loads in: `self.dtype`, unless the family keeps it in
        another as stock's documented usage does (Wan: the VAE and the image encoder in float32,
        `tpupedia.models.wan.FLOAT32_COMPONENTS`). What the run loads and the plan compiles."""
        return self.dtype

    def _load(self, cls, subfolder: str):
        """Component `subfolder` of the checkpoint as a torch module in its dtype
        (`component_dtype`), in eval mode: `cls.from_pretrained` (safetensors only; refused when the
        checkpoint's weights do not match `cls`, `checkpoints.load_component`), the `adapters` for
        it fused in on the host (`tpupedia.lora.fuse`: module names and shapes unchanged, so it is
        sharded as the stock weights are); or with `abstract` built on `meta` from its config."""
        dtype = self.component_dtype(subfolder)
        if not self.abstract:
            from tpupedia.models import checkpoints

            module = checkpoints.load_component(cls, self.source, subfolder, dtype=dtype)
            mine = [a for a in self.adapters if a.component == subfolder]
            return self._quantized(lora_adapters.fuse(module, mine, self.family) if mine else module, subfolder)
        import torch

        config = dict(self.configs[subfolder])
        if self.layers is not None:
            for key in DEPTH_FIELDS:
                if key in config:
                    config[key] = min(self.layers, config[key])
                    if isinstance(config.get("layer_types"), list):  # transformers checks one entry per layer
                        config["layer_types"] = config["layer_types"][:config[key]]
        with torch.device("meta"):
            if hasattr(cls, "from_config"):  # diffusers
                module = cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})
            else:  # transformers: its config class, then the model class
                module = cls(cls.config_class(**config))
        return self._quantized(module.to(dtype).eval(), subfolder)

    def _quantized(self, module, subfolder: str):
        """`module` with its linears quantized to `quantized` (`tpupedia.quantize.quantize_linears`)
        when it is a transformer of the denoise stage and a format is set, but those the family's
        `QUANTIZE_KEEP` table names; on `meta` too, so a plan compiles what a run holds."""
        if self.quantized is None or subfolder not in lora_adapters.components(self.configs):
            return module
        quantizing.quantize_linears(module, self.quantized, keep=[rule for rule, _ in self.family.QUANTIZE_KEEP])
        return module

    def _state(self, fm, name: str) -> tuple[dict, dict]:
        """`(weights, buffers)` of a placed component's `FunctionalModule`, or with `abstract` their
        `jax.ShapeDtypeStruct`s sharded as planned."""
        return fm.abstract_state(self.plans[name]) if self.abstract else fm.state()

    def _to_jax(self, name: str, module, rules=None, *, mesh=None):
        """Place a CPU torch module in the torchax environment, each device built straight from
        host memory with only its shards (`tpupedia.sharding.place`), sharded over the mesh by
        `rules` (or replicated), the plan kept in `self.plans[name]`. `mesh` places it on other
        chips than the pipeline's mesh (the VAE: a copy on each of the host's chips,
        `decoding.decode_mesh`)."""
        from tpupedia import sharding

        self.components[name] = (type(module), list(rules or []))
        mesh = self.mesh if mesh is None else mesh
        if self.abstract:
            self.plans[name] = sharding.plan(module, rules or [], mesh)
            return module
        self.plans[name] = sharding.place(module, rules or [], mesh, self.env)
        return module

    def indivisible_note(self, exclude: Any = ()) -> str:
        """One line naming the tensors its components' rules split but their mesh axis does not
        divide, replicated instead, and what that costs in GiB per chip ("" if none;
        `tpupedia.sharding.indivisible_note`); `exclude`: components to leave out."""
        from tpupedia import sharding

        return sharding.indivisible_note({n: p for n, p in self.plans.items() if n not in exclude})

    def _text_rules(self, name: str):
        """The sharding rules of text encoder `name` (`family.TEXT_ENCODERS`): split over `tp`
        like a transformer, unless the run asks for everything replicated."""
        from tpupedia import sharding

        if self.options.sharding == "replicated":
            return []
        return sharding.rules(self.family.TEXT_ENCODERS[name], "tp", axis="tp")

    def _rules(self, strategy: str):
        """The family's sharding rules for `strategy` (fsdp over both mesh axes, tp over `tp`)."""
        from tpupedia import sharding

        if strategy == "replicated":
            return []
        return sharding.rules(self.family.SPEC, strategy, axis=("dp", "tp") if strategy == "fsdp" else "tp")

    @classmethod
    def settings_for(cls, source_label: str, configs: dict, request: Request, options: Options, dtype: Any,
                     stage: str) -> dict:  # pragma: no cover - abstract
        """Every setting that changes the tensors of `stage` (and of the stages before it)."""
        raise NotImplementedError

    def settings(self, stage: str, request: Request) -> dict:
        return self.settings_for(self.source_label, self.configs, request, self.options, self.dtype, stage)

    # The three stages. Each runs the family's `_encode_text`, `_denoise` or `_decode` and then,
    # even when it fails, frees the models it loaded, unless the pipeline is `resident`.
    def encode_text(self, request: Request) -> tuple[dict, dict]:
        """Stage 1: the prompt's embeddings, `(tensors, timings)`."""
        request = self.planned(request, "encode_text")
        with self._freeing("text"):
            return self._encode_text(request)

    @classmethod
    def release_id(cls, request: Request) -> str:
        """The hub id the full preset loads for `request` (a family with image-to-video: its
        image-to-video release for a request with a picture)."""
        return cls.family.FULL_ID_I2V if cls.image_to_video and request.image is not None else cls.family.FULL_ID

    @classmethod
    def release_request(cls, model: str | None, image: str | None = None) -> dict:
        """The request fields a built-in release runs by default where they differ from the full
        preset's (`family.RELEASE_REQUESTS`: CogVideoX-2b's 720x480 and 49 frames, Wan 1.3B's
        832x480, Wan's authors' steps, flow shift and guidance), so `tpupedia plan` and `tpupedia
        generate` run the video that release makes; `model` `None`: the full preset's own release
        (`release_id`, its image-to-video one with an `image`); `{}` for any other model."""
        if model is None:
            model = cls.release_id(Request(prompt="", image=image))
        return dict(getattr(cls.family, "RELEASE_REQUESTS", {}).get(model, {}))

    @classmethod
    def checkpoint_configs(cls, source: str) -> dict[str, dict]:
        """The component configs of the checkpoint at `source` (`family.component_configs`: JSON
        only, no weights); under a rehearsal (`tpupedia.rehearsal`), a release the family builds
        in (`FamilySpec.releases`) from its own configs, with no download."""
        from tpupedia import rehearsal

        built_in = cls.family.SPEC.releases.get(source)
        if built_in is not None and rehearsal.target() is not None:
            return cls.family.full_configs(**built_in)
        return cls.family.component_configs(source)

    @classmethod
    def plan_configs(cls, request: Request, model: str) -> dict[str, dict]:
        """The component configs `tpupedia.plan` plans for `request` from `model` (a hub id or
        folder; `plan.make` defaults it to `release_id`). A release the family builds in
        (`FamilySpec.releases`, from `family.full_configs`) needs no download; any other hub id or
        checkpoint folder is read (`family.component_configs`: configs only, no weights)."""
        from tpupedia.models import checkpoints

        built_in = cls.family.SPEC.releases.get(model)
        if built_in is not None:
            return cls.family.full_configs(**built_in)
        checkpoints.check_source(model, "--model", cls.release_id(request))  # a wrong one: one line, not a download
        return cls.family.component_configs(model)

    @classmethod
    def source(cls, preset: Any, model: str | None, request: Request) -> tuple[str, str]:
        """`(where to load from, label)` for `request`: the family's `model_source` (a family
        with image-to-video picks its image-to-video checkpoint for a request with a picture)."""
        if cls.image_to_video:
            return cls.family.model_source(preset, model, image_to_video=request.image is not None)
        return cls.family.model_source(preset, model)

    def _processor(self, component: str) -> Any:
        """The checkpoint's picture preprocessing for image-to-video: the class its
        `model_index.json` names for `component` (read into `configs["pipeline"]` by the family's
        `component_configs`), loaded from that subfolder, as the stock pipeline loads it. Held by
        the image stage."""
        import importlib

        library, name = self.configs["pipeline"][component]
        cls = getattr(importlib.import_module(library), name)
        return self.held("image", "processor", lambda: cls.from_pretrained(self.source, subfolder=component))

    def encode_image(self, request: Request) -> tuple[dict, dict]:
        """Image-to-video's stage: the picture encoded as the denoiser's condition, `(tensors, timings)`."""
        request = self.planned(request, "encode_image")
        with self._freeing("image"):
            return self._encode_image(request)

    def denoise(self, request: Request, embeds: dict, on_step=None) -> tuple[dict, dict]:
        """Stage 2: the denoised latents from stage 1's embeddings (and the `image` stage's
        condition, for image-to-video), `(tensors, timings)`."""
        request = self.planned(request, "denoise")
        if tuple(request.lora) != self.adapters or request.quantize != self.quantized:  # other weights
            self.release("denoise", force=True)
            self.adapters, self.quantized = tuple(request.lora), request.quantize
        with self._freeing("denoise"):
            return self._denoise(request, embeds, on_step)

    def decode(self, request: Request, latents) -> tuple[dict, dict]:
        """Stage 3: frames from stage 2's latents, `(tensors, timings)`."""
        request = self.planned(request, "decode")
        with self._freeing("decode"):
            return self._decode(request, latents)

    @contextlib.contextmanager
    def _freeing(self, stage: str):
        try:
            yield
        finally:
            self.release(stage)

    def _encode_text(self, request: Request) -> tuple[dict, dict]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _encode_image(self, request: Request) -> tuple[dict, dict]:  # pragma: no cover - image-to-video families
        raise NotImplementedError

    def _denoise(self, request: Request, embeds: dict, on_step=None) -> tuple[dict, dict]:  # pragma: no cover
        raise NotImplementedError

    def _decode(self, request: Request, latents) -> tuple[dict, dict]:  # pragma: no cover - abstract
        raise NotImplementedError


def _free(value: Any) -> int:
    """Delete the device buffers of the torch and Flax NNX modules in `value` (a module, or a
    tuple, list or dict holding some). Returns the bytes freed on this process's devices."""
    import torch

    from tpupedia import sharding

    if isinstance(value, torch.nn.Module):
        return sharding.free(value)
    if isinstance(value, (tuple, list)):
        return sum(_free(v) for v in value)
    if isinstance(value, dict):
        return sum(_free(v) for v in value.values())
    nnx = sys.modules.get("flax.nnx")  # a Flax NNX module (the lesson-05 VAE), if Flax is in use
    if nnx is not None and isinstance(value, nnx.Module):
        import jax

        freed = 0
        for leaf in jax.tree.leaves(nnx.state(value)):
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                freed += sum(s.data.nbytes for s in leaf.addressable_shards)
                leaf.delete()
        return freed
    return 0


def family_block_sizes(family: Any, mesh: Any = None) -> tuple[int, int, int]:
    """A family's splash blocks (`SPLASH_BLOCK_SIZES`, tuned on a v6e) as the TPU chip of `mesh`
    (default: this process's devices) fits them in its scoped VMEM
    (`tpupedia.attention.chip_block_sizes`: smaller on a v5e); off a TPU, as they are."""
    if not on_tpu(mesh):
        return tuple(family.SPLASH_BLOCK_SIZES)
    import jax

    from tpupedia import attention

    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    return attention.chip_block_sizes(device, family.SPLASH_BLOCK_SIZES)


def on_tpu(mesh=None) -> bool:
    """Whether `mesh` (default: this process's backend) is made of TPU chips: what decides the
    attention kernel and whether Pallas kernels run compiled or interpreted. A topology mesh
    (`tpupedia.plan`) is a TPU even on a CPU host."""
    import jax

    return (mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()) == "tpu"


def attention_backend(choice: str, mesh=None) -> str:
    """`splash` or `reference` for `choice` on the chips of `mesh` (default: this process's):
    `tpupedia.attention.resolve_backend`, the one meaning of `auto` (splash on a TPU only)."""
    from tpupedia import attention

    return attention.resolve_backend(choice, "tpu" if on_tpu(mesh) else "other")


def install_attention(env, mesh, backend: str, block_sizes=None) -> None:
    """Route torchax's SDPA to splash (exact padding through segment ids, batch on `dp`, heads on
    `tp`, `block_sizes` as upper bounds) or, for `reference`, to torchax's own SDPA with fully
    masked query rows returning 0."""
    from tpupedia import torchax_utils

    if backend == "reference":
        torchax_utils.stock_ops(env)
        torchax_utils.install_masked_row_safe_sdpa(env)
        return
    from tpupedia import attention

    attention.install_attention(env, mesh=mesh, backend="splash", interpret=not on_tpu(mesh),
                                mask_structure="padding", batch_axis="dp", head_axis="tp",
                                block_sizes=block_sizes)


@contextlib.contextmanager
def attention_installed(env, mesh, backend: str, block_sizes=None):
    """`install_attention` for the duration of a `with` block, the environment's ops restored after."""
    from tpupedia import torchax_utils

    with torchax_utils.restoring_ops(env):
        install_attention(env, mesh, backend, block_sizes)
        yield


def fresh_trace(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` behind a new function object, for a `jax.eval_shape` of a step that a plan later
    compiles: JAX keeps a function's trace by the function, so shapes read from `fn` itself would
    leave the compile without a trace of its own, and without the splash calls a plan records while
    the step is traced (`tpupedia.attention.recording`; a DeepCache full step planned with no
    attention time until tests/test_tune.py caught it)."""
    return lambda *args: fn(*args)


def to_jax_array(t):
    """A CPU torch tensor (bf16 included) as a jax array, or a torchax tensor's array."""
    import jax.numpy as jnp
    import torch

    elem = getattr(t, "_elem", None)
    if elem is not None:
        return elem
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16)
    return jnp.asarray(t.numpy())


def to_torch(a):
    """A jax array (bf16 included) as a CPU torch tensor of the same dtype."""
    import jax.numpy as jnp
    import numpy as np
    import torch

    if a.dtype == jnp.bfloat16:
        return torch.from_numpy(np.array(a.astype(jnp.float32))).to(torch.bfloat16)
    return torch.from_numpy(np.array(a))


def torch_dtype(options: Options, preset: Any):
    """The dtype the models run in: `options.dtype`, or for `auto` the preset's."""
    import torch

    return getattr(torch, preset.dtype if options.dtype == "auto" else options.dtype)


STAGE_ORDER = stages.STAGES  # text -> image -> denoise -> decode
STAGE_INPUTS = {"text": (), "image": (), "denoise": ("text", "image"), "decode": ("denoise",)}
"""The stages whose tensors each stage takes (those the request runs)."""


def request_stages(request: Request) -> tuple[str, ...]:
    """The stages `request` runs, in order: the `image` stage only with a picture."""
    return tuple(s for s in STAGE_ORDER if s != "image" or request.image is not None)


def run(pipeline_cls: type[StagedPipeline], request: Request, options: Options, *, preset: Any,
        model: str | None = None, stage: str = "all", workdir: str | Path | None = None,
        out: str | Path | None = None, force: bool = False, command: str = "", log: Callable[[str], None] = print,
        collective: bool = True, plan: str = "auto", vae_tiling: str | None = None) -> list[StageReport]:
    """Run `stage` (or all three) for `request`, reading and writing stage files in `workdir`
    (default `tpupedia-runs/<family>`).

    Everything is validated before a model is loaded, and under a full-size preset (`plan`,
    `PLAN`) the run's plan is checked too (`check_plan`, with `vae_tiling` `auto`, `on` or `off`):
    a run that will not fit the chips stops here with the stage and the fix, and the VAE tiling
    and dtype the plan resolves are the ones the stages run with. A stage whose file exists and matches this
    request is skipped unless `force`; a stage takes its input from the stage before it in memory
    when that ran in this call, else from its stage file, read only if valid and made for this
    request (`tpupedia.pipelines.stages.read`). With `out`, the mp4 is written from the frames:
    the encoder is checked before any stage runs (`video.check_encoder`), the frames before the mp4
    is written (`video.check_frames`: NaN or flat frames are refused, naming the decode stage).

    In a multi-process job (`tpupedia.distributed`, notebook `beyond_one_host`) every process runs the same
    stages over one global mesh, and the hosts need not share a disk: process 0 decides, every
    process gets the tensors. Process 0 alone looks at `workdir` (what is up to date, the files a
    skipped stage left) and writes the stage files and the video; what it decides and reads is
    broadcast, a stage's output goes to the next stage in memory, and an error on process 0
    stops every process (`run_stages`). `collective=False` runs this request
    in this process alone, on its own devices (how `run_batch` spreads prompts over processes).
    """
    import jax

    from tpupedia import devices, rehearsal

    family = pipeline_cls.family
    if stage != "all" and stage not in request_stages(request):
        raise PipelineError(f"stage={stage!r} is not one of all, {', '.join(request_stages(request))}"
                            + (" (the image stage needs a picture: --image)" if stage == "image" else ""))
    rehearsing = rehearsal.target() is not None  # planned for the rehearsal's slice, then stopped
    mesh_devices = rehearsal.devices() if rehearsing else jax.devices() if collective else jax.local_devices()
    # A checkpoint of our own choosing has the released shape facts; a named one is checked below.
    pipeline_cls.validate(request, options, len(mesh_devices), shape_rules=not family.named_source(model))
    workdir = check_workdir(workdir or f"tpupedia-runs/{family.FAMILY}")
    if out is not None:  # a missing encoder is found now, not after the decode stage
        from tpupedia import video

        video.check_encoder()
    planning = rehearsing or plans(plan, preset)
    source, label, configs = _checkpoint(pipeline_cls, preset, model, request, planning)
    pipeline_cls.validate(request, options, len(mesh_devices), configs)
    dtype = torch_dtype(options, preset)
    if planning:
        request = check_plan(pipeline_cls, request, options, configs, mesh_devices, dtype, tiling=vae_tiling, log=log)
    rehearsal.stop("run", family.SPEC.name, request)
    mesh = devices.make_mesh(pipeline_cls.run_mesh_shape(request, options, len(mesh_devices), configs), ("dp", "tp"),
                             devices=mesh_devices)
    pipe = pipeline_cls(source, label, dtype, mesh, options, configs)
    pipe.plan = "off"  # planned above, or not to be: its stage methods do not plan again
    return run_stages(pipe, request, stage=stage, workdir=workdir, out=out, force=force, command=command, log=log,
                      collective=collective)


def _checkpoint(pipeline_cls: type[StagedPipeline], preset: Any, model: str | None, request: Request,
                planning: bool) -> tuple[str, str, dict[str, dict]]:
    """`(source, label, configs)` of the checkpoint `request` loads (`StagedPipeline.source`): when
    `planning`, a hub checkpoint's download held against its disk first (`checkpoints.check_disk`;
    the configs are small), then its configs read (JSON only: the rules and the plan use the
    checkpoint's facts), then its label made: a hub checkpoint's names the revision they were
    read from (`checkpoints.source_label`), so the first run of a hub id, which finds nothing
    cached before it reads them, and every later one agree; a preset's own label stays."""
    from tpupedia import rehearsal
    from tpupedia.models import checkpoints

    source, label = pipeline_cls.source(preset, model, request)
    if planning and rehearsal.target() is None:  # a rehearsal downloads nothing
        checkpoints.check_disk(source)
    configs = pipeline_cls.checkpoint_configs(source)
    return source, label if label.startswith("preset:") else checkpoints.source_label(source), configs


def pinned(request: Request) -> Request:
    """`request` with its step cache's saved calibration pinned as the file is now
    (`stepcache.StepCache.pinned`), so that all of a run's stage settings agree."""
    cache = getattr(request, "step_cache", None)
    return request if cache is None else dataclasses.replace(request, step_cache=cache.pinned())


def run_stages(pipe: StagedPipeline, request: Request, *, stage: str = "all", workdir: Path,
               out: str | Path | None = None, force: bool = False, command: str = "",
               log: Callable[[str], None] = print, collective: bool = True,
               tensors: dict | None = None) -> list[StageReport]:
    """`run` on a pipeline already built for this process (`run_batch` keeps one per process):
    `request` and `workdir` already checked. With `tensors` (a dict), the tensors of each stage
    that ran in this call are put in it by stage name (`run_batch` writes the video from the
    decode stage's frames in memory, not from its file).

    In a job (`collective`) process 0 decides, every process gets the tensors: the hosts of a
    slice need not share a disk, so only process 0 looks at `workdir`. It decides which stages
    are up to date and tells the others (`_skipped`); a stage that ran hands its tensors, which
    every process holds, to the next stage in memory; a skipped stage's tensors are read by
    process 0 and broadcast (`_stage_tensors`); process 0 alone writes the stage files and the
    video, and an error there stops every process (`distributed.on_leader`). Without
    `collective` this process does all of that on its own."""
    from tpupedia import distributed, results

    options, mesh = pipe.options, pipe.mesh
    request = pinned(request)  # a saved calibration as it is now, for every stage
    runs = request_stages(request)
    wanted = runs if stage == "all" else (stage,)
    leader = distributed.is_leader() or not collective
    once = _on_leader(collective)
    if not leader:
        log = lambda _: None  # noqa: E731 - one voice per job
    reports, held = [], {} if tensors is None else tensors  # held: the tensors of the stages that ran here
    told: set[str] = set()  # components whose replicated (indivisible) tensors were already logged
    checked: dict = {}  # the skipped stages' files, as process 0 read and checked them: not read again
    for name, skipped in zip(wanted, _skipped(pipe, request, wanted, workdir, force, collective, checked)):
        wanted_settings = pipe.settings(name, request)
        if skipped:
            reports.append(StageReport(name, False, stages.path(workdir, name), reason="up to date"))
            log(f"{name}: up to date ({stages.path(workdir, name)}), skipped; --force reruns it")
            continue
        inputs = {}  # the tensors of the stages this one takes: in memory if they ran here, else their files
        for previous in (s for s in STAGE_INPUTS[name] if s in runs):
            inputs |= held[previous] if previous in held else _stage_tensors(
                workdir, previous, pipe.settings(previous, request), collective, checked.pop(previous, None))
        if name == "text":
            made, timings = pipe.encode_text(request)
        elif name == "image":
            made, timings = pipe.encode_image(request)
        elif name == "denoise":
            bar = _progress(request.steps, options.quiet or not leader)
            made, timings = pipe.denoise(request, inputs, on_step=lambda i, x: bar.update(1))
            bar.close()
        else:
            made, timings = pipe.decode(request, inputs["latents"])
        held[name] = made
        extra = {"command": command, "machine": results.machine(), "timings": timings,
                 "options": dataclasses.asdict(options), "mesh": dict(mesh.shape)}
        path = once(lambda: stages.write(workdir, name, made, wanted_settings, extra=extra))
        path = path or stages.path(workdir, name)
        reports.append(StageReport(name, True, path, timings))
        log(f"{name}: wrote {path} ({describe(timings)})")
        note = pipe.indivisible_note(exclude=told)
        if note:
            log(f"{name}: {note}")
        told |= set(pipe.plans)
    if "decode" in checked and (out is not None or tensors is not None):  # a skipped decode's frames, once
        held["decode"] = stages.read(workdir, "decode", pipe.settings("decode", request), checked.pop("decode")).tensors
    checked.clear()
    if out is not None:
        written = once(lambda: _write_video(pipe, request, workdir, out, held.get("decode")))
        log(f"video: wrote {written}")
    if collective:
        distributed.barrier("run done")
    return reports


def _on_leader(collective: bool) -> Callable[[Callable[[], Any]], Any]:
    """How `run_stages` does what only one process may do (write a file): in a job, on process 0
    with its errors raised everywhere (`distributed.on_leader`); alone, just call it."""
    from tpupedia import distributed

    return distributed.on_leader if collective else (lambda fn: fn())


def _skipped(pipe: StagedPipeline, request: Request, wanted: tuple[str, ...], workdir: Path, force: bool,
             collective: bool, checked: dict) -> list[bool]:
    """Which of the `wanted` stages to skip: those whose stage file exists and was made for
    `request` (`stages.status`), none with `force`; their checked bytes go in `checked` (on
    process 0), so that a skipped stage whose tensors are needed is not read from disk again. In a
    job process 0 decides from its own disk and tells the others: they may not have its files,
    and a process that runs a stage process 0 skips waits in that stage's collectives forever."""
    from tpupedia import distributed

    def decide() -> list[bool]:
        return [not force and stages.status(workdir, name, pipe.settings(name, request), keep=checked) is None
                for name in wanted]

    if not collective:
        return decide()
    return [bool(v) for v in distributed.leader_decides(distributed.on_leader(decide) or [0] * len(wanted))]


def _stage_tensors(workdir: Path, stage: str, settings: dict, collective: bool, verified: Any = None) -> Any:
    """The tensors of a stage skipped in this run, which the next stage needs: from its stage
    file (`stages.read` refuses a damaged or foreign one; `verified`, the bytes `_skipped` already
    checked); in a job read by process 0 alone and broadcast (bit-exact, bf16 included), every
    process failing if the read fails."""
    from tpupedia import distributed

    read = lambda: stages.read(workdir, stage, settings, verified).tensors  # noqa: E731
    return distributed.broadcast_tensors(distributed.on_leader(read)) if collective else read()


def _write_video(pipe: StagedPipeline, request: Request, workdir: Path, out: str | Path, decoded: Any) -> Path:
    """The mp4 of `request` at `out`: from the frames in memory when decode ran in this run,
    else from the decode stage file."""
    from tpupedia import video

    if decoded is None:
        decoded = stages.read(workdir, "decode", pipe.settings("decode", request)).tensors
    frames = decoded["frames"].numpy()
    video.check_frames(frames, f"the decode stage's frames ({stages.path(workdir, 'decode')})")
    return video.write_mp4(frames, out, fps=request.fps)


def batch_requests(pipeline_cls: type[StagedPipeline], items: list, base: Request, options: Options,
                   device_count: int | None = None, configs: dict[str, dict] | None = None, *,
                   model: str | None = None) -> dict[int, Request]:
    """Each prompt's request (`base` with the line's fields, `tpupedia.batch.Item`), by index,
    every one validated (its picture checked; with the checkpoint's `configs`, its shape facts and
    kind), the first failure naming its prompt. A batch runs one checkpoint: either every request
    has a picture (image-to-video: a line's `image` field, or `--image` for all) or none does."""
    from tpupedia import batch

    requests = {item.index: batch.item_request(item, base) for item in items}
    pictures = [k for k, r in requests.items() if r.image is not None]
    if pictures and len(pictures) < len(requests):
        without = next(k for k, r in requests.items() if r.image is None)
        raise PipelineError(f"prompt {without} has no picture but {len(pictures)} of the batch's {len(requests)} "
                            "prompts have one: a batch runs one checkpoint, image-to-video (a picture for every "
                            "line: an \"image\" field, or --image for all) or text-to-video (none)")
    for item in items:
        try:
            pipeline_cls.check_size_given(requests[item.index], [f'"{k}"' for k, _ in item.overrides
                                                                 if k in ("width", "height")])
            pipeline_cls.validate(requests[item.index], options, device_count, configs,
                                  shape_rules=configs is not None or not pipeline_cls.family.named_source(model))
        except TpupediaError as err:
            raise PipelineError(f"prompt {item.index} ({item.prompt[:40]!r}): {err}") from None
    return requests


def run_batch(pipeline_cls: type[StagedPipeline], prompts: str | Path, base: Request, options: Options, *,
              preset: Any, outdir: str | Path, model: str | None = None, force: bool = False,
              plan: str = "auto", vae_tiling: str | None = None, log: Callable[[str], None] = print) -> list[str]:
    """Generate every prompt of a prompts file into `outdir` (see `tpupedia.batch`), skipping the
    ones already done; returns the names this process generated.

    Every request is validated before a model loads and, under a full-size preset (`plan`,
    `PLAN`), planned (`check_plan` for one process's own chips, every model resident: each
    request's shapes planned, its VAE tiling resolved; a request that cannot fit refuses the batch,
    naming its line, before anything loads). Each process takes its share of the prompts
    and runs them on its own devices (`collective=False`); each prompt's stage files live in
    `outdir/.stages/NAME` until its video and record are written, then are removed (a finished
    prompt leaves its mp4 and JSON, nothing else), so a prompt interrupted mid-way resumes from
    its last finished stage. The video is written from the decoded frames in memory; only a
    decode stage finished by an earlier, interrupted run is read from its file. In a job each
    process lists what it made in its own `index.<process>.jsonl`; at the end process 0 alone
    writes `index.jsonl` from every process's lines (`batch.gather_manifest`).
    Each process builds one `resident` pipeline, at its first prompt that is not done: the models
    load once and every prompt of the same shape reuses the compiled step. Lines with LoRA adapters
    (`Request.lora`) run grouped by adapter set, the sets in order of first use: an adapter is
    fused into the transformer's weights, so each set loads the transformer once. The log ends with the
    first prompt's time and the mean of the others (what staying resident saves).
    """
    import jax

    from tpupedia import batch, devices, distributed, rehearsal, results, video

    video.check_encoder()  # every prompt ends in an mp4: a missing encoder stops the batch before it starts
    rehearsing = rehearsal.target() is not None  # planned for the rehearsal's slice, then stopped
    run_devices = rehearsal.devices() if rehearsing else jax.local_devices()
    items = batch.read_prompts(prompts)
    requests = batch_requests(pipeline_cls, items, base, options, len(run_devices), model=model)
    outdir = check_workdir(outdir, "--outdir")
    planning = rehearsing or plans(plan, preset)
    source, label, configs = _checkpoint(pipeline_cls, preset, model, requests[0], planning)  # i2v picks its own
    batch_requests(pipeline_cls, items, base, options, len(run_devices), configs)
    dtype = torch_dtype(options, preset)
    resident = True  # every model and program kept between prompts, where the plan says that fits
    if planning:
        planned = {}
        for item in items:
            try:
                planned[item.index] = _batch_plan(pipeline_cls, requests[item.index], options, configs,
                                                  run_devices, dtype, vae_tiling, log)
            except TpupediaError as err:
                raise PipelineError(f"prompt {item.index} ({item.prompt[:40]!r}): {err}") from None
        resident = all(kept for _, kept in planned.values())
        requests = {k: r for k, (r, _) in planned.items()} if resident else {
            k: _batch_plan(pipeline_cls, requests[k], options, configs, run_devices, dtype, vae_tiling, log,
                           resident=False)[0] for k in planned}  # one pipeline: every prompt planned as it runs
        if not resident:
            log("batch: the models do not all stay resident (they would not fit beside each other, or the VAE would "
                "lose its precision): each stage frees its models for the next, as a single run does, and they load "
                "again for every prompt")
    rehearsal.stop(f"run_batch ({len(items)} prompts)", pipeline_cls.family.SPEC.name, requests[items[0].index])

    def decode_settings(request):  # what the decode stage file of `request` must say, no model loaded
        return pipeline_cls.settings_for(label, configs, pinned(request), options, dtype, "decode")

    local = jax.local_devices()
    quiet = dataclasses.replace(options, quiet=True)
    process, made, totals, pipe = jax.process_index(), [], [], None
    told: set[str] = set()  # components whose replicated (indivisible) tensors were logged
    processes = jax.process_count()
    mine = batch.share(items, process, processes)
    sets: dict[tuple, int] = {}  # adapter sets in order of first use: fused weights mean a reload per set
    for item in mine:
        sets.setdefault(tuple(requests[item.index].lora), len(sets))
    for item in sorted(mine, key=lambda item: sets[tuple(requests[item.index].lora)]):  # stable: file order within a set
        request = requests[item.index]
        fingerprint = stages.fingerprint(decode_settings(request))
        work = outdir / ".stages" / item.name
        if not force and batch.is_done(outdir, item, fingerprint):
            batch.relist(outdir, item, process=process, processes=processes)
            shutil.rmtree(work, ignore_errors=True)  # a kill between its record and this clean-up
            log(f"{item.name}: done already, skipped")
            continue
        start = time.perf_counter()
        if pipe is None:  # one pipeline per process, its models and programs kept between prompts
            shape = pipeline_cls.run_mesh_shape(request, options, len(local), configs)
            pipe = pipeline_cls(source, label, dtype, devices.make_mesh(shape, ("dp", "tp"), devices=local),
                                quiet, configs)
            pipe.resident, pipe.plan = resident, "off"  # every request was planned above (or is not to be)
        held: dict = {}
        reports = run_stages(pipe, request, workdir=check_workdir(work), force=force, log=lambda _: None,
                             collective=False, tensors=held)
        note = pipe.indivisible_note(exclude=told)  # the models load once: said at the first prompt that loads them
        if note:
            log(f"{item.name}: {note}")
        told |= set(pipe.plans)
        frames = held["decode"]["frames"].numpy()  # decoded now, or read once by a resumed prompt's check
        del held
        video.check_frames(frames, f"prompt {item.index} ({item.prompt[:40]!r}): the decode stage's frames")
        timings = {r.stage: r.timings for r in reports} | {"total_s": time.perf_counter() - start}
        totals.append(timings["total_s"])
        path = batch.record(outdir, item, fingerprint, lambda p: video.write_mp4(frames, p, fps=request.fps),
                            {"seed": request.seed, "timings": timings, "process": process,
                             "machine": results.machine()} | ({"image": request.image} if request.image else {}),
                            process=process, processes=processes)
        shutil.rmtree(work)  # done: its video and record are all a finished prompt keeps
        made.append(item.name)
        log(f"{item.name}: wrote {path.name} ({timings['total_s']:.1f} s)")
    if pipe is not None:
        for stage in STAGE_ORDER:
            pipe.release(stage, force=True)
    if len(totals) > 1:
        log(f"prompt 1: {totals[0]:.2f} s (loads and compiles); prompts 2..{len(totals)}: "
            f"mean {sum(totals[1:]) / (len(totals) - 1):.2f} s (resident)")
    distributed.barrier("batch done")
    if processes > 1:  # one writer for index.jsonl: process 0, from every process's own lines
        own = outdir / batch.manifest_file(process, processes)
        lines = distributed.gather_bytes(own.read_bytes() if own.is_file() else b"")
        distributed.on_leader(lambda: batch.gather_manifest(outdir, [b.decode() for b in lines]))
        own.unlink(missing_ok=True)  # its lines are in index.jsonl now (on_leader waited for process 0)
    with contextlib.suppress(OSError):
        (outdir / ".stages").rmdir()  # only if empty: an unfinished prompt keeps its stage files
    return made


def _batch_plan(pipeline_cls: type[StagedPipeline], request: Request, options: Options, configs: dict[str, dict],
                run_devices: list, dtype: Any, tiling: str | None, log: Callable[[str], None], *,
                resident: bool | None = None) -> tuple[Request, bool]:
    """`(request as planned, whether its models stay resident)` for one prompt of a batch: resident
    (the batch's speed) where that fits without lowering the VAE's precision (Wan's float32 VAE),
    else as a single run plans it, each stage freeing its models for the next (HunyuanVideo-1.5 at
    720p on a v6e-8); `resident` given: planned that way only."""
    from tpupedia import plan

    if resident is not None:
        return check_plan(pipeline_cls, request, options, configs, run_devices, dtype, tiling=tiling,
                          resident=resident, log=log), resident
    lowered = lambda r: getattr(r, "vae_dtype", None) != getattr(request, "vae_dtype", None)  # noqa: E731
    try:
        kept = check_plan(pipeline_cls, request, options, configs, run_devices, dtype, tiling=tiling, resident=True,
                          log=log)
        if not lowered(kept):
            return kept, True
    except plan.PlanError:
        kept = None
    try:
        single = check_plan(pipeline_cls, request, options, configs, run_devices, dtype, tiling=tiling,
                            resident=False, log=log)
    except plan.PlanError:
        if kept is None:
            raise
        return kept, True
    if kept is not None and lowered(single):
        return kept, True  # the VAE lowered either way: resident keeps the batch's speed
    return single, False


def describe(timings: dict) -> str:
    """`first call 1.23 s, steady 0.045 s` for a stage's timings; with a step cache, the steps that
    ran in full and the `--step-cache` value that replays them without a calibration run."""
    parts = [f"first call {timings['first_s']:.2f} s"]
    if "steady_s" in timings:
        parts.append(f"steady {timings['steady_s']:.3f} s")
    if "replay" in timings:
        full = timings["full_steps"]
        parts.append(f"step cache {timings['step_cache']}: {len(full)} of {timings['steps']} steps in full"
                     + (f" after a {timings['calibration_s']:.1f} s calibration run" if "calibration_s" in timings else "")
                     + (f" (calibration saved to {timings['calibration_written']})" if "calibration_written" in timings else "")
                     + (f" (calibration read from {timings['calibration_read']})" if "calibration_read" in timings else "")
                     + f"; --step-cache {timings['replay']} replays them")
    return ", ".join(parts)


def _progress(total: int, quiet: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="denoise", unit="step", disable=quiet)
