"""What every staged text-to-video pipeline shares: requests and options, validation of what is
not model-specific, meshes, the stage runner and the host <-> device conversions.

A family pipeline (`cogvideox`, notebook 06; `hunyuan`, notebook 07) is a `StagedPipeline`
subclass with three methods, `encode_text`, `denoise` and `decode`, each returning
`(tensors, timings)`; `run` drives them through the stage files of `tpupedia.pipelines.stages`
(skip what is done, read what the next stage needs, write atomically, one writer per job) and
`run_batch` drives `run` over a prompts file. Introduced in notebook 06, reused by notebook 07.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

from tpupedia.devices import default_mesh_shape
from tpupedia.errors import TpupediaError
from tpupedia.pipelines import stages

__all__ = ["PipelineError", "Request", "Options", "validate", "mesh_shape", "check_workdir", "SEED_LIMIT", "parse_mesh", "default_mesh_shape", "StageReport",
           "StagedPipeline", "run", "run_batch", "attention_backend", "torch_dtype", "to_jax_array", "to_torch",
           "timed", "config_fingerprint", "ATTENTION", "DTYPES", "SHARDINGS"]

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


@dataclass(frozen=True)
class Options:
    """How to run it: these change speed and memory, not what the video is."""

    mesh: tuple[int, int] | None = None
    """`(dp, tp)`; default `mesh_shape`: dp=2 for a guidance pair, dp=1 without guidance."""
    sharding: str = "tp"
    attention: str = "auto"
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


def config_fingerprint(config: dict) -> str:
    """A component config's fingerprint, private (`_`-prefixed) entries left out."""
    return stages.fingerprint({k: v for k, v in dict(config).items() if not k.startswith("_")})


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


class StagedPipeline:
    """Three stages over one checkpoint (`source`: a diffusers directory or hub id) on `mesh`.

    Subclasses set `family` (the model module) and `vaes`, and implement `settings`,
    `encode_text`, `denoise` and `decode`. Components load only when a stage needs them
    (`from_pretrained`, safetensors only), so running `denoise` alone never loads a text encoder.
    """

    family: ClassVar[Any]
    vaes: ClassVar[tuple[str, ...]] = ("torchax",)

    def __init__(self, source: str, source_label: str, dtype: Any, mesh: Any, options: Options,
                 configs: dict[str, dict] | None = None):
        from tpupedia import torchax_utils

        self.source, self.source_label, self.dtype, self.mesh, self.options = source, source_label, dtype, mesh, options
        self.vae = self.vae_choice(options)
        self.env = torchax_utils.default_env()
        torchax_utils.register_common_outputs()
        self.configs = configs if configs is not None else self.family.component_configs(source)
        self.shapes = self.family.shape_facts(self.configs)
        """Compression ratios, patch sizes and latent channels of this checkpoint (`tpupedia.models.shapes`)."""
        self.plans: dict[str, Any] = {}
        """The sharding plan each component was placed with (`tpupedia.sharding.ShardingPlan`)."""
        self.traces: dict[str, int] = {}
        """How many times each stage's compiled function was traced (one per distinct shape)."""

    @classmethod
    def vae_choice(cls, options: Options) -> str:
        """The VAE implementation `options` asks for, or the family's default."""
        return options.vae or cls.vaes[0]

    @classmethod
    def validate(cls, request: Request, options: Options, device_count: int | None = None,
                 configs: dict[str, dict] | None = None, *, shape_rules: bool = True) -> None:
        """Everything checkable before a model loads: the common rules, then the family's frame and
        size rules with the checkpoint's shape facts (`configs`; without them, the released
        checkpoint's, unless `shape_rules=False`: a checkpoint whose configs are not read yet), and
        the mesh against the guidance batch."""
        validate(request, options, device_count, vaes=cls.vaes)
        if shape_rules or configs is not None:
            facts = cls.family.shape_facts(configs) if configs is not None else cls.family.DEFAULT_SHAPES
            cls.family.check_frames(request.frames, facts)
            cls.family.check_size(request.width, request.height, facts)
        batch = cls.guidance_batch(request, configs)
        if batch is not None:
            mesh_shape(options, device_count or math.prod(options.mesh or (1, 1)), batch)

    @classmethod
    def guidance_batch(cls, request: Request, configs: dict[str, dict] | None = None) -> int | None:
        """Samples each transformer call carries: 2 with classifier-free guidance, else 1 (`None`:
        unknown without the checkpoint's `configs`)."""
        return 2 if request.guidance is not None and request.guidance > 1.0 else 1

    def _precision(self):
        import jax

        p = self.options.matmul_precision
        return jax.default_matmul_precision(p) if p else contextlib.nullcontext()

    def _to_jax(self, name: str, module, rules=None, *, on_mesh: bool = True):
        """Move a torch module into the torchax environment, sharded over the mesh by `rules`
        (or replicated), the plan kept in `self.plans[name]`; `on_mesh=False` leaves it on this
        process's default device (the VAE: every process decodes its own copy)."""
        from tpupedia import sharding

        with self.env:
            module.to("jax")
            if on_mesh:
                self.plans[name] = sharding.apply_rules(module, rules or [], self.mesh)
        return module

    def _rules(self, strategy: str):
        """The family's sharding rules for `strategy` (fsdp over both mesh axes, tp over `tp`)."""
        from tpupedia import sharding

        if strategy == "replicated":
            return []
        return sharding.rules(self.family.FAMILY, strategy, axis=("dp", "tp") if strategy == "fsdp" else "tp")

    @classmethod
    def settings_for(cls, source_label: str, configs: dict, request: Request, options: Options, dtype: Any,
                     stage: str) -> dict:  # pragma: no cover - abstract
        """Every setting that changes the tensors of `stage` (and of the stages before it)."""
        raise NotImplementedError

    def settings(self, stage: str, request: Request) -> dict:
        return self.settings_for(self.source_label, self.configs, request, self.options, self.dtype, stage)

    def encode_text(self, request: Request) -> tuple[dict, dict]:  # pragma: no cover - abstract
        raise NotImplementedError

    def denoise(self, request: Request, embeds: dict, on_step=None) -> tuple[dict, dict]:  # pragma: no cover
        raise NotImplementedError

    def decode(self, request: Request, latents) -> tuple[dict, dict]:  # pragma: no cover - abstract
        raise NotImplementedError


def attention_backend(choice: str) -> str:
    """`auto`: the splash kernel on a TPU, the reference elsewhere (interpret mode is for
    correctness, not speed); `splash`/`reference` as asked."""
    if choice != "auto":
        return choice
    import jax

    return "splash" if jax.default_backend() == "tpu" else "reference"


def install_attention(env, mesh, backend: str) -> None:
    """Route torchax's SDPA to splash (exact padding through segment ids, batch on `dp`, heads on
    `tp`) or, for `reference`, to torchax's own SDPA with fully masked query rows returning 0."""
    from tpupedia import torchax_utils

    if backend == "reference":
        torchax_utils.stock_ops(env)
        torchax_utils.install_masked_row_safe_sdpa(env)
        return
    import jax

    from tpupedia import attention

    attention.install_attention(env, mesh=mesh, backend="splash", interpret=jax.default_backend() != "tpu",
                                mask_structure="padding", batch_axis="dp", head_axis="tp")


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


STAGE_ORDER = stages.STAGES  # text -> denoise -> decode


def run(pipeline_cls: type[StagedPipeline], request: Request, options: Options, *, preset: Any,
        model: str | None = None, stage: str = "all", workdir: str | Path | None = None,
        out: str | Path | None = None, force: bool = False, command: str = "", log: Callable[[str], None] = print,
        collective: bool = True) -> list[StageReport]:
    """Run `stage` (or all three) for `request`, reading and writing stage files in `workdir`
    (default `tpupedia-runs/<family>`).

    Everything is validated before a model is loaded. A stage whose file exists and matches this
    request is skipped unless `force`; a stage's input is read only if its stage file is valid
    and was made for this request (`tpupedia.pipelines.stages.read`). With `out`, the mp4 is
    written from the decode stage file.

    In a multi-process job (`tpupedia.distributed`, notebook 10) every process runs the same
    stages over one global mesh; process 0 alone writes the stage files and the video, and the
    others wait for it at a barrier before reading them. `collective=False` runs this request
    in this process alone, on its own devices (how `run_batch` spreads prompts over processes).
    """
    import jax

    from tpupedia import devices, distributed, results

    family = pipeline_cls.family
    wanted = STAGE_ORDER if stage == "all" else (stage,)
    if stage != "all" and stage not in STAGE_ORDER:
        raise PipelineError(f"stage={stage!r} is not one of all, {', '.join(STAGE_ORDER)}")
    mesh_devices = jax.devices() if collective else jax.local_devices()  # every process's devices, or ours
    # A checkpoint of our own choosing has the released shape facts; a named one is checked below.
    pipeline_cls.validate(request, options, len(mesh_devices), shape_rules=not family.named_source(model))
    workdir = check_workdir(workdir or f"tpupedia-runs/{family.FAMILY}")
    source, label = family.model_source(preset, model)
    configs = family.component_configs(source)  # JSON only: the rules below use the checkpoint's facts
    pipeline_cls.validate(request, options, len(mesh_devices), configs)
    shape = mesh_shape(options, len(mesh_devices), pipeline_cls.guidance_batch(request, configs))
    mesh = devices.make_mesh(shape, ("dp", "tp"), devices=mesh_devices)
    pipe = pipeline_cls(source, label, torch_dtype(options, preset), mesh, options, configs)
    leader = distributed.is_leader() or not collective
    barrier = distributed.barrier if collective else (lambda _: None)
    if not leader:
        log = lambda _: None  # noqa: E731 - one voice per job
    reports = []
    for name in wanted:
        wanted_settings = pipe.settings(name, request)
        status = stages.status(workdir, name, wanted_settings)
        if status is None and not force:
            reports.append(StageReport(name, False, stages.path(workdir, name), reason="up to date"))
            log(f"{name}: up to date ({stages.path(workdir, name)}), skipped; --force reruns it")
            continue
        if name == "text":
            tensors, timings = pipe.encode_text(request)
        else:
            previous = STAGE_ORDER[STAGE_ORDER.index(name) - 1]
            inputs = stages.read(workdir, previous, pipe.settings(previous, request)).tensors
            if name == "denoise":
                bar = _progress(request.steps, options.quiet or not leader)
                tensors, timings = pipe.denoise(request, inputs, on_step=lambda i, x: bar.update(1))
                bar.close()
            else:
                tensors, timings = pipe.decode(request, inputs["latents"])
        extra = {"command": command, "machine": results.machine(), "timings": timings,
                 "options": dataclasses.asdict(options), "mesh": dict(mesh.shape)}
        path = stages.write(workdir, name, tensors, wanted_settings, extra=extra) if leader else stages.path(workdir, name)
        barrier(f"stage {name} written")
        reports.append(StageReport(name, True, path, timings))
        log(f"{name}: wrote {path} ({describe(timings)})")
    if out is not None and leader:
        from tpupedia import video

        frames = stages.read(workdir, "decode", pipe.settings("decode", request)).tensors["frames"]
        log(f"video: wrote {video.write_mp4(frames.numpy(), out, fps=request.fps)}")
    barrier("run done")
    return reports


def run_batch(pipeline_cls: type[StagedPipeline], prompts: str | Path, base: Request, options: Options, *,
              preset: Any, outdir: str | Path, model: str | None = None, force: bool = False,
              log: Callable[[str], None] = print) -> list[str]:
    """Generate every prompt of a prompts file into `outdir` (see `tpupedia.batch`), skipping the
    ones already done; returns the names this process generated.

    Every request is validated before a model loads. Each process takes its share of the prompts
    and runs them on its own devices (`collective=False`); each prompt's stage files live in
    `outdir/.stages/NAME`, so a prompt interrupted mid-way resumes from its last finished stage.
    """
    import jax

    from tpupedia import batch, distributed, results, video

    items = batch.read_prompts(prompts)
    requests = {item.index: batch.item_request(item, base) for item in items}
    family = pipeline_cls.family

    def check_all(configs=None):
        for item in items:
            try:
                pipeline_cls.validate(requests[item.index], options, len(jax.local_devices()), configs,
                                      shape_rules=configs is not None or not family.named_source(model))
            except TpupediaError as err:
                raise PipelineError(f"prompt {item.index} ({item.prompt[:40]!r}): {err}") from None

    check_all()  # before anything is loaded; then with the checkpoint's configs
    outdir = check_workdir(outdir, "--outdir")
    source, label = family.model_source(preset, model)
    configs = family.component_configs(source)
    check_all(configs)
    dtype = torch_dtype(options, preset)

    def decode_settings(request):  # what the decode stage file of `request` must say, no model loaded
        return pipeline_cls.settings_for(label, configs, request, options, dtype, "decode")

    process, made = jax.process_index(), []
    for item in batch.share(items, process, jax.process_count()):
        request = requests[item.index]
        fingerprint = stages.fingerprint(decode_settings(request))
        if not force and batch.is_done(outdir, item, fingerprint):
            batch.relist(outdir, item)
            log(f"{item.name}: done already, skipped")
            continue
        work = outdir / ".stages" / item.name
        start = time.perf_counter()
        reports = run(pipeline_cls, request, dataclasses.replace(options, quiet=True), preset=preset, model=model,
                      workdir=work, force=force, log=lambda _: None, collective=False)
        frames = stages.read(work, "decode", decode_settings(request)).tensors["frames"].numpy()
        timings = {r.stage: r.timings for r in reports} | {"total_s": time.perf_counter() - start}
        path = batch.record(outdir, item, fingerprint, lambda p: video.write_mp4(frames, p, fps=request.fps),
                            {"seed": request.seed, "timings": timings, "process": process,
                             "machine": results.machine()})
        made.append(item.name)
        log(f"{item.name}: wrote {path.name} ({timings['total_s']:.1f} s)")
    distributed.barrier("batch done")
    return made


def describe(timings: dict) -> str:
    """`first call 1.23 s, steady 0.045 s` for a stage's timings."""
    parts = [f"first call {timings['first_s']:.2f} s"]
    if "steady_s" in timings:
        parts.append(f"steady {timings['steady_s']:.3f} s")
    return ", ".join(parts)


def _progress(total: int, quiet: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="denoise", unit="step", disable=quiet)
