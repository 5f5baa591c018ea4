"""CogVideoX text-to-video in three stages, under torchax, on a mesh.

The stock `diffusers.CogVideoXPipeline` is one Python loop that calls the transformer, the
scheduler and the VAE eagerly. Here the same computation is cut into three stages, each with a
compiled core and a stage file between them (`tpupedia.pipelines.stages`):

1. `encode_text`: the T5 encoder, jitted, returning only the embeddings (negative and
   positive prompt, as diffusers encodes them) -> `text.safetensors`.
2. `denoise`: one compiled function per run for *all* steps: the classifier-free-guidance pair
   as one batch of 2 on the mesh's `dp` axis, the transformer sharded over `tp`, the scheduler
   step as a pure function of the traced step index (`tpupedia.pipelines.schedulers`), the
   latents donated. Random numbers are drawn on the host from a CPU `torch.Generator(seed)` in
   the order diffusers draws them, so the same weights and seed give the same video as the stock
   pipeline on PyTorch CPU -> `denoise.safetensors`.
3. `decode`: the lesson-05 Flax NNX VAE (`vae="flax"`) or diffusers' VAE under torchax with its
   per-frame-batch decoder jitted (`vae="torchax"`) -> `decode.safetensors` holding `frames`,
   float32 (F, H, W, 3) in [0, 1], what diffusers returns with `output_type="np"`.

Introduced in notebook 06 (CogVideoX text-to-video in three stages); `tpupedia generate
cogvideox` runs the same functions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tpupedia.errors import TpupediaError
from tpupedia.models import cogvideox as family
from tpupedia.pipelines import stages

__all__ = [
    "PipelineError",
    "Request",
    "Options",
    "validate",
    "parse_mesh",
    "default_mesh_shape",
    "settings",
    "CogVideoX",
    "run",
    "StageReport",
]

ATTENTION = ("auto", "splash", "reference")
VAES = ("flax", "torchax")
DTYPES = ("auto", "bfloat16", "float32")
SHARDINGS = ("tp", "fsdp", "replicated")


class PipelineError(TpupediaError, ValueError):
    """A generation request that cannot run: bad sizes, frames, prompt, mesh or option."""


@dataclass(frozen=True)
class Request:
    """What to generate. `None` sizes take the model's defaults for the preset."""

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
    """`(dp, tp)`; default `default_mesh_shape(device count)`."""
    sharding: str = "tp"
    attention: str = "auto"
    vae: str = "flax"
    quiet: bool = False
    matmul_precision: str | None = None
    """`"highest"` for parity checks (a TPU runs float32 matmuls in bf16 passes by default)."""
    dtype: str = "auto"
    """`auto`: bfloat16 on the full preset (as the checkpoints are released), float32 on the tiny
    preset (exact parity with stock diffusers); or `bfloat16` / `float32`."""


def validate(request: Request, options: Options, device_count: int | None = None) -> None:
    """Refuse what cannot run, naming the bad value and what is allowed. Loads no model."""
    if not request.prompt or not request.prompt.strip():
        raise PipelineError("the prompt is empty; say what the video should show (--prompt TEXT)")
    family.check_frames(request.frames)
    family.check_size(request.width, request.height)
    for name in ("steps", "fps"):
        if getattr(request, name) < 1:
            raise PipelineError(f"{name}={getattr(request, name)} must be a positive integer")
    if not math.isfinite(request.guidance) or request.guidance < 0:
        raise PipelineError(f"guidance={request.guidance} must be a finite number >= 0 (1 or less turns guidance off)")
    if request.seed < 0:
        raise PipelineError(f"seed={request.seed} must be >= 0")
    if options.sharding not in SHARDINGS:
        raise PipelineError(f"sharding={options.sharding!r} is not one of {', '.join(SHARDINGS)}")
    if options.attention not in ATTENTION:
        raise PipelineError(f"attention={options.attention!r} is not one of {', '.join(ATTENTION)}")
    if options.dtype not in DTYPES:
        raise PipelineError(f"dtype={options.dtype!r} is not one of {', '.join(DTYPES)}")
    if options.vae not in VAES:
        raise PipelineError(f"vae={options.vae!r} is not one of {', '.join(VAES)}")
    if options.mesh is not None and device_count is not None and math.prod(options.mesh) != device_count:
        dp, tp = options.mesh
        raise PipelineError(f"mesh dp={dp},tp={tp} needs {dp * tp} devices, but {device_count} are available; "
                            f"choose dp*tp = {device_count}")


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


def default_mesh_shape(device_count: int) -> tuple[int, int]:
    """dp=2 (the guidance pair) when the devices split evenly, tp the rest."""
    return (2, device_count // 2) if device_count >= 2 and device_count % 2 == 0 else (1, device_count)


def _config_fingerprint(config: dict) -> str:
    return stages.fingerprint({k: v for k, v in dict(config).items() if not k.startswith("_")})


def settings(stage: str, source_label: str, configs: dict[str, dict], request: Request, *, vae: str = "flax",
             dtype: str = "float32") -> dict:
    """Every setting that changes the tensors of `stage` (and of the stages before it).

    `configs` holds the checkpoint's component configs (`text_encoder`, `transformer`,
    `scheduler`, `vae`); their fingerprints stand for the model, `source_label` for where the
    weights came from. Attention backend, sharding and mesh change speed, not the video.
    """
    out = {"model": family.FAMILY, "source": source_label, "dtype": dtype,
           "text_encoder": _config_fingerprint(configs["text_encoder"]),
           "prompt": request.prompt, "negative_prompt": request.negative_prompt}
    if stage in ("denoise", "decode"):
        out |= {"transformer": _config_fingerprint(configs["transformer"]),
                "scheduler": _config_fingerprint(configs["scheduler"]),
                "frames": request.frames, "height": request.height, "width": request.width,
                "steps": request.steps, "guidance": request.guidance, "seed": request.seed}
    if stage == "decode":
        out |= {"vae_config": _config_fingerprint(configs["vae"]), "vae": vae}
    return out


@dataclass
class StageReport:
    """What one stage did: whether it ran or was skipped, its timings, the file it wrote."""

    stage: str
    ran: bool
    path: Path
    timings: dict[str, float] = field(default_factory=dict)
    reason: str = ""


def _timed(fn: Callable[[], Any], sync: Callable[[Any], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    sync(out)
    return out, time.perf_counter() - start


class CogVideoX:
    """The three stages over one checkpoint (`source`: a diffusers directory or hub id).

    Components are loaded only when a stage needs them (`from_pretrained`, safetensors only),
    so running `denoise` alone never loads the T5 encoder.
    """

    def __init__(self, source: str, source_label: str, dtype: Any, mesh: Any, options: Options):
        from tpupedia import torchax_utils

        self.source, self.source_label, self.dtype, self.mesh, self.options = source, source_label, dtype, mesh, options
        self.env = torchax_utils.default_env()
        torchax_utils.register_common_outputs()
        self.configs = family.component_configs(source)
        self.plans: dict[str, Any] = {}
        """The sharding plan each component was placed with (`tpupedia.sharding.ShardingPlan`)."""
        self.traces = {"text": 0, "denoise": 0}
        """How many times each stage's compiled function was traced (one per distinct shape)."""

    # -- helpers ---------------------------------------------------------------------------
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

    def settings(self, stage: str, request: Request) -> dict:
        return settings(stage, self.source_label, self.configs, request, vae=self.options.vae,
                        dtype=str(self.dtype).removeprefix("torch."))

    # -- stage 1 ---------------------------------------------------------------------------
    def encode_text(self, request: Request) -> tuple[dict, dict]:
        """T5 embeddings of the negative and the positive prompt, as `_get_t5_prompt_embeds`
        computes them (padding to the checkpoint's text length, truncation, special tokens)."""
        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P
        from transformers import AutoTokenizer, T5EncoderModel

        from tpupedia import torchax_utils

        length = self.configs["transformer"]["max_text_seq_length"]
        tokenizer = AutoTokenizer.from_pretrained(self.source, subfolder="tokenizer")
        encoder = T5EncoderModel.from_pretrained(self.source, subfolder="text_encoder", dtype=self.dtype,
                                                 use_safetensors=True).eval()
        self._to_jax("text_encoder", encoder)
        fm = torchax_utils.FunctionalModule(encoder, return_dict=False)

        def embed(weights, buffers, ids):
            self.traces["text"] += 1
            return fm(weights, buffers, input_ids=ids)[0]

        replicated = NamedSharding(self.mesh, P())
        compiled = jax.jit(embed, out_shardings=replicated)  # readable by every process
        weights, buffers = fm.state()
        results, times = {}, []
        with self._precision():
            for name, text in (("negative_prompt_embeds", request.negative_prompt), ("prompt_embeds", request.prompt)):
                ids = tokenizer([text], padding="max_length", max_length=length, truncation=True,
                                add_special_tokens=True, return_tensors="pt").input_ids
                out, seconds = _timed(lambda: compiled(weights, buffers, jax.device_put(ids.numpy(), replicated)),
                                      jax.block_until_ready)
                results[name] = _to_torch(out).to(self.dtype)
                times.append(seconds)
        return results, {"first_s": times[0], "steady_s": times[1]}

    # -- stage 2 ---------------------------------------------------------------------------
    def denoise(self, request: Request, embeds: dict, on_step: Callable[[int, Any], None] | None = None) -> tuple[dict, dict]:
        """All denoising steps through one compiled step. Returns `{"latents": (1, F', C, h, w)}`
        (the padded latent frames included, as diffusers' `output_type="latent"`).
        `on_step(i, latents)` is called after each step with its output, a jax array valid only during
        the call (the next step donates its buffer)."""
        import jax
        import jax.numpy as jnp
        import numpy as np
        import torch
        from diffusers import CogVideoXDPMScheduler, CogVideoXTransformer3DModel
        from diffusers.utils.torch_utils import randn_tensor
        from jax.sharding import NamedSharding, PartitionSpec as P

        from tpupedia import sharding, torchax_utils
        from tpupedia.pipelines import schedulers

        cfg = self.configs["transformer"]
        scheduler = family.load_scheduler(self.source)
        scheduler.set_timesteps(request.steps)
        timesteps = scheduler.timesteps
        dpm = isinstance(scheduler, CogVideoXDPMScheduler)
        host_tables = schedulers.cogvideox_tables(scheduler, timesteps)
        tables = {k: jnp.asarray(v) for k, v in host_tables.items()}
        guided = request.guidance > 1.0

        generator = torch.Generator().manual_seed(request.seed)
        frames, padding = family.padded_latent_frames(request.frames, cfg.get("patch_size_t"))
        shape = (1, frames, cfg["in_channels"], request.height // family.SPATIAL_COMPRESSION,
                 request.width // family.SPATIAL_COMPRESSION)
        latents = randn_tensor(shape, generator=generator, dtype=self.dtype) * scheduler.init_noise_sigma
        cos, sin = family.rotary_embeddings(cfg, request.height, request.width, frames)

        transformer = CogVideoXTransformer3DModel.from_pretrained(
            self.source, subfolder="transformer", dtype=self.dtype, use_safetensors=True).eval()
        family.make_jit_friendly(transformer)  # RoPE without in-place writes (see its docstring)
        strategy = self.options.sharding
        axis = ("dp", "tp") if strategy == "fsdp" else "tp"
        rules = sharding.rules("cogvideox", strategy, axis=axis) if strategy != "replicated" else []
        self._to_jax("transformer", transformer, rules)
        fm = torchax_utils.FunctionalModule(transformer, return_dict=False)
        env, mesh = self.env, self.mesh
        batch = NamedSharding(mesh, P("dp")) if guided else NamedSharding(mesh, P())
        replicated = NamedSharding(mesh, P())

        text = torch.cat([embeds["negative_prompt_embeds"], embeds["prompt_embeds"]]) if guided else embeds["prompt_embeds"]
        text = jax.device_put(_to_jax_array(text), batch)
        cos, sin = (jax.device_put(_to_jax_array(a), replicated) for a in (cos, sin))
        dtype = _to_jax_array(latents).dtype

        def step(weights, buffers, latents, old_pred, text, cos, sin, i, guidance, noise):
            self.traces["denoise"] += 1
            x = jnp.concatenate([latents, latents]) if guided else latents
            x = jax.lax.with_sharding_constraint(x, batch)
            t = jnp.broadcast_to(tables["timesteps"][i], (x.shape[0],))
            out = fm(weights, buffers, hidden_states=x, encoder_hidden_states=text, timestep=t,
                     image_rotary_emb=(cos, sin))[0]
            pred = out.astype(jnp.float32)
            if guided:
                uncond, cond = pred[:1], pred[1:]
                pred = uncond + guidance * (cond - uncond)
            sample = latents.astype(jnp.float32)
            if dpm:
                new, old_pred = schedulers.dpm_step(tables, i, sample, pred, old_pred, noise)
            else:
                new = schedulers.ddim_step(tables, i, sample, pred)
            return new.astype(dtype), old_pred

        # Latents and the solver state keep one (replicated) sharding in and out, so every step
        # reuses the first step's program; they are donated, so XLA updates them in place.
        compiled = jax.jit(step, donate_argnums=(2, 3), out_shardings=(replicated, replicated))
        weights, buffers = fm.state()
        x = jax.device_put(_to_jax_array(latents), replicated)
        old = jax.device_put(jnp.zeros(shape, jnp.float32), replicated)
        noise_shape = (2, *shape) if dpm else (0,)
        step_times = []
        backend = attention_backend(self.options.attention)
        with torchax_utils.restoring_ops(env), self._precision():
            _install_attention(env, mesh, backend)
            for i in range(len(timesteps)):
                noise = (schedulers.dpm_noise(generator, shape, self.dtype, host_tables, i)
                         if dpm else np.zeros(noise_shape, np.float32))
                (x, old), seconds = _timed(  # host scalars and noise: replicated inputs on every process
                    lambda: compiled(weights, buffers, x, old, text, cos, sin, np.int32(i),
                                     np.float32(request.guidance), noise),
                    jax.block_until_ready)
                step_times.append(seconds)
                if on_step:
                    on_step(i, x)
        steady = float(np.median(step_times[1:])) if len(step_times) > 1 else step_times[0]
        return {"latents": _to_torch(x).to(self.dtype)}, {"first_s": step_times[0], "steady_s": steady,
                                                          "steps": len(step_times), "padding_frames": padding}

    # -- stage 3 ---------------------------------------------------------------------------
    def decode(self, request: Request, latents) -> tuple[dict, dict]:
        """Latents -> frames, float32 (F, H, W, 3) in [0, 1] (diffusers' `output_type="np"`)."""
        import jax
        import torch
        from diffusers import AutoencoderKLCogVideoX
        from diffusers.video_processor import VideoProcessor

        _, padding = family.padded_latent_frames(request.frames, self.configs["transformer"].get("patch_size_t"))
        vae = AutoencoderKLCogVideoX.from_pretrained(self.source, subfolder="vae", dtype=self.dtype,
                                                     use_safetensors=True).eval()
        z = latents[:, padding:].permute(0, 2, 1, 3, 4) / vae.config.scaling_factor
        start = time.perf_counter()
        with self._precision(), torch.no_grad():
            if self.options.vae == "flax":
                from tpupedia.models import cogvideox_vae_convert as convert

                flax_vae = convert.from_diffusers(vae, dtype=_to_jax_array(z).dtype)
                video = _to_torch(jax.block_until_ready(flax_vae.decode(_to_jax_array(z))))
            else:
                from tpupedia import torchax_utils

                self._to_jax("vae", vae, on_mesh=False)
                with self.env:
                    vae.decoder = torchax_utils.JitModule(vae.decoder)
                    video = vae.decode(z.to("jax")).sample
                    video = video.to("cpu")
        seconds = time.perf_counter() - start
        frames = VideoProcessor(vae_scale_factor=family.SPATIAL_COMPRESSION).postprocess_video(
            video.float(), output_type="np")[0]
        return {"frames": torch.from_numpy(frames.astype("float32"))}, {"first_s": seconds}


def attention_backend(choice: str) -> str:
    """`auto`: the splash kernel on a TPU, the reference elsewhere (interpret mode is for
    correctness, not speed); `splash`/`reference` as asked."""
    if choice != "auto":
        return choice
    import jax

    return "splash" if jax.default_backend() == "tpu" else "reference"


def _install_attention(env, mesh, backend: str) -> None:
    from tpupedia import attention, torchax_utils

    if backend == "reference":
        torchax_utils.stock_ops(env)
        return
    import jax

    attention.install_attention(env, mesh=mesh, backend="splash", interpret=jax.default_backend() != "tpu",
                                mask_structure="padding", batch_axis="dp", head_axis="tp")


def _to_jax_array(t):
    """A CPU torch tensor (bf16 included) as a jax array, or a torchax tensor's array."""
    import jax.numpy as jnp
    import torch

    elem = getattr(t, "_elem", None)
    if elem is not None:
        return elem
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16)
    return jnp.asarray(t.numpy())


def _to_torch(a):
    """A jax array (bf16 included) as a CPU torch tensor of the same dtype."""
    import jax.numpy as jnp
    import numpy as np
    import torch

    if a.dtype == jnp.bfloat16:
        return torch.from_numpy(np.array(a.astype(jnp.float32))).to(torch.bfloat16)
    return torch.from_numpy(np.array(a))


STAGE_ORDER = stages.STAGES  # text -> denoise -> decode


def run(request: Request, options: Options, *, preset: Any, model: str | None = None, stage: str = "all",
        workdir: str | Path = "tpupedia-runs/cogvideox", out: str | Path | None = None, force: bool = False,
        command: str = "", log: Callable[[str], None] = print, collective: bool = True) -> list[StageReport]:
    """Run `stage` (or all three) for `request`, reading and writing stage files in `workdir`.

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

    wanted = STAGE_ORDER if stage == "all" else (stage,)
    if stage != "all" and stage not in STAGE_ORDER:
        raise PipelineError(f"stage={stage!r} is not one of all, {', '.join(STAGE_ORDER)}")
    mesh_devices = jax.devices() if collective else jax.local_devices()  # every process's devices, or ours
    validate(request, options, len(mesh_devices))
    shape = options.mesh or default_mesh_shape(len(mesh_devices))
    source, label = family.model_source(preset, model)
    dtype = torch_dtype(options, preset)
    mesh = devices.make_mesh(shape, ("dp", "tp"), devices=mesh_devices)
    pipe = CogVideoX(source, label, dtype, mesh, options)
    workdir = Path(workdir)
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
        log(f"{name}: wrote {path} ({_describe(timings)})")
    if out is not None and leader:
        from tpupedia import video

        frames = stages.read(workdir, "decode", pipe.settings("decode", request)).tensors["frames"]
        log(f"video: wrote {video.write_mp4(frames.numpy(), out, fps=request.fps)}")
    barrier("run done")
    return reports


def run_batch(prompts: str | Path, base: Request, options: Options, *, preset: Any, outdir: str | Path,
              model: str | None = None, force: bool = False, log: Callable[[str], None] = print) -> list[str]:
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
    for item in items:
        try:
            validate(requests[item.index], options, len(jax.local_devices()))
        except TpupediaError as err:
            raise PipelineError(f"prompt {item.index} ({item.prompt[:40]!r}): {err}") from None
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    source, label = family.model_source(preset, model)
    configs = family.component_configs(source)
    dtype = str(torch_dtype(options, preset)).removeprefix("torch.")
    process, made = jax.process_index(), []
    for item in batch.share(items, process, jax.process_count()):
        request = requests[item.index]
        fingerprint = stages.fingerprint(settings("decode", label, configs, request, vae=options.vae, dtype=dtype))
        if not force and batch.is_done(outdir, item, fingerprint):
            batch.relist(outdir, item)
            log(f"{item.name}: done already, skipped")
            continue
        work = outdir / ".stages" / item.name
        start = time.perf_counter()
        reports = run(request, dataclasses.replace(options, quiet=True), preset=preset, model=model, workdir=work,
                      force=force, log=lambda _: None, collective=False)
        frames = stages.read(work, "decode", settings("decode", label, configs, request, vae=options.vae,
                                                      dtype=dtype)).tensors["frames"].numpy()
        timings = {r.stage: r.timings for r in reports} | {"total_s": time.perf_counter() - start}
        path = batch.record(outdir, item, fingerprint, lambda p: video.write_mp4(frames, p, fps=request.fps),
                            {"seed": request.seed, "timings": timings, "process": process,
                             "machine": results.machine()})
        made.append(item.name)
        log(f"{item.name}: wrote {path.name} ({timings['total_s']:.1f} s)")
    distributed.barrier("batch done")
    return made


def torch_dtype(options: Options, preset: Any):
    """The dtype the models run in: `options.dtype`, or for `auto` the preset's."""
    import torch

    return getattr(torch, preset.dtype if options.dtype == "auto" else options.dtype)


def _describe(timings: dict) -> str:
    parts = [f"first call {timings['first_s']:.2f} s"]
    if "steady_s" in timings:
        parts.append(f"steady {timings['steady_s']:.3f} s")
    return ", ".join(parts)


def _progress(total: int, quiet: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="denoise", unit="step", disable=quiet)
