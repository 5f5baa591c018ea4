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

Image-to-video (CogVideoX1.5-5B-I2V, `Request.image`) adds a stage between text and denoise:

* `encode_image`: the picture resized and normalised by diffusers' own `VideoProcessor` (what
  the stock `CogVideoXImageToVideoPipeline` calls), the VAE's encoder jitted on one frame, the
  posterior sampled on the host from `torch.Generator(seed)` (the stock pipeline's first draw),
  scaled and padded with zero frames -> `image.safetensors` holding `image_latents`, shaped like
  the latents. The denoise stage skips that first draw, so its noise is the stock pipeline's,
  and feeds the image latents beside the noisy latents (twice the channels) with the `ofs`
  embedding the 1.5 release adds.

Introduced in notebook `cogvideox_pipeline` (CogVideoX text-to-video in three stages); `tpupedia generate
cogvideox` runs the same functions.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tpupedia import lora, quantize
from tpupedia.models import checkpoints
from tpupedia.models import cogvideox as family
from tpupedia.pipelines import common, decoding, stepcache
from tpupedia.pipelines.common import (  # this family's public names, shared by every family
    Options,
    PipelineError,
    StageReport,
    attention_backend,
    default_mesh_shape,
    parse_mesh,
    torch_dtype,
)

__all__ = ["PipelineError", "Request", "Options", "validate", "parse_mesh", "default_mesh_shape", "settings",
           "CogVideoX", "run", "run_batch", "stock", "StageReport", "attention_backend", "torch_dtype"]

VAES = ("flax", "torchax")


@dataclass(frozen=True)
class Request(common.Request):
    """What to generate; `step_cache` of `None` is off (`tpupedia.pipelines.stepcache`)."""

    step_cache: stepcache.StepCache | None = field(default=None, metadata=stepcache.FIELD)
    dynamic_cfg: bool = field(default=False, metadata={
        "parse": lambda text: parse_switch(text, "--dynamic-cfg"), "metavar": "on|off",
        "help": "stock's use_dynamic_cfg: the guidance scale changes with the timestep (off by default, as in "
                "stock; the CogVideoX authors sample with it on)"})


def parse_switch(text: str, flag: str) -> bool:
    """`on` or `off` as a bool, or a `PipelineError` naming `flag` and the value."""
    if text not in ("on", "off"):
        raise common.PipelineError(f"{flag} {text!r}: give on or off")
    return text == "on"


def validate(request: Request, options: Options, device_count: int | None = None,
             configs: dict[str, dict] | None = None) -> None:
    """Refuse what cannot run, naming the bad value and what is allowed. Loads no model; with
    `configs` (`family.component_configs`), the rules use that checkpoint's shape facts."""
    CogVideoX.validate(request, options, device_count, configs)


def settings(stage: str, source_label: str, configs: dict[str, dict], request: Request, *, vae: str = "flax",
             dtype: str = "float32") -> dict:
    """Every setting that changes the tensors of `stage` (and of the stages before it).

    `configs` holds the checkpoint's component configs (`text_encoder`, `transformer`,
    `scheduler`, `vae`); their fingerprints stand for the model, `source_label` for where the
    weights came from. Attention backend, sharding and mesh change speed, not the video.
    """
    out = common.stage_settings(family.FAMILY, stage, source_label, configs, request, dtype,
                                picture={"seed": request.seed})  # the posterior is sampled
    if stage in ("denoise", "decode"):
        out |= {"transformer": common.config_fingerprint(configs["transformer"]),
                "scheduler": common.config_fingerprint(configs["scheduler"]),
                "frames": request.frames, "height": request.height, "width": request.width,
                "steps": request.steps, "guidance": request.guidance, "seed": request.seed}
        if request.dynamic_cfg:  # off keeps the fingerprints of earlier runs
            out["dynamic_cfg"] = True
        out |= lora.settings(request.lora)  # each adapter's file, scale and component (none: no key)
        out |= quantize.settings(request.quantize)  # the weights' format (none: no key)
        out |= stepcache.settings(getattr(request, "step_cache", None))  # none: no key
    if stage == "decode":
        out |= {"vae_config": common.config_fingerprint(configs["vae"]), "vae": vae}
        if request.vae_tiling:  # tiles change pixels; untiled keeps the fingerprints of earlier runs
            out["vae_tiling"] = True
    return out


class CogVideoX(common.StagedPipeline):
    """The three CogVideoX stages over one checkpoint (see the module docstring)."""

    family = family
    vaes = VAES
    image_to_video = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.traces = {"text": 0, "image": 0, "denoise": 0}

    @classmethod
    def settings_for(cls, source_label, configs, request, options, dtype, stage) -> dict:
        return settings(stage, source_label, configs, request, vae=cls.vae_choice(options),
                        dtype=str(dtype).removeprefix("torch."))

    # -- stage 1 ---------------------------------------------------------------------------
    def _encode_text(self, request: Request) -> tuple[dict, dict]:
        """T5 embeddings of the negative and the positive prompt, as `_get_t5_prompt_embeds`
        computes them (padding to the checkpoint's text length, truncation, special tokens)."""
        import jax
        from transformers import AutoTokenizer

        length = self.configs["transformer"]["max_text_seq_length"]
        tokenizer = self.held("text", "tokenizer", lambda: AutoTokenizer.from_pretrained(self.source, subfolder="tokenizer"))
        (program,) = self._text_programs(request)
        compiled = self.held("text", "jit", lambda: jax.jit(program.fn, **program.jit_kwargs))
        weights, buffers, ids_spec = program.args
        results, times = {}, []
        with self._precision():
            for name, text in (("negative_prompt_embeds", request.negative_prompt), ("prompt_embeds", request.prompt)):
                ids = tokenizer([text], padding="max_length", max_length=length, truncation=True,
                                add_special_tokens=True, return_tensors="pt").input_ids
                ids = jax.device_put(ids.numpy(), ids_spec.sharding)
                out, seconds = common.timed(lambda: compiled(weights, buffers, ids), jax.block_until_ready)
                results[name] = common.to_torch(out).to(self.dtype)
                times.append(seconds)
        return results, {"first_s": times[0], "steady_s": times[1]}

    def _text_programs(self, request: Request) -> list:  # noqa: ARG002 - every family's signature
        """The T5 encoder as the text stage compiles it: `(weights, buffers, ids)` with ids of the
        checkpoint's text length (226 for the releases), called for the negative and the positive
        prompt. Real weights, or abstract ones on an `abstract` pipeline (`tpupedia.plan`)."""
        import jax.numpy as jnp
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P
        from transformers import T5EncoderModel

        from tpupedia import aot, torchax_utils

        length = self.configs["transformer"]["max_text_seq_length"]
        replicated = NamedSharding(self.mesh, P())

        def load():
            encoder = self._load(T5EncoderModel, "text_encoder")
            self._to_jax("text_encoder", encoder, self._text_rules("text_encoder"))
            fm = torchax_utils.FunctionalModule(encoder, return_dict=False)

            def embed(weights, buffers, ids):
                self.traces["text"] += 1
                return fm(weights, buffers, input_ids=ids)[0]

            return encoder, embed, self._state(fm, "text_encoder")

        _, embed, (weights, buffers) = self.held("text", "t5", load)
        ids = aot.abstract((1, length), jnp.int32, replicated)
        return [aot.Program("text", f"T5 encoder, {length} tokens", embed, (weights, buffers, ids),
                            jit_kwargs={"out_shardings": replicated},  # readable by every process
                            weights_bytes=self.plans["text_encoder"].bytes_per_device, calls=2,
                            component="text_encoder")]

    # -- image-to-video: the picture's latents --------------------------------------------
    def _encode_image(self, request: Request) -> tuple[dict, dict]:
        """The picture as the denoiser's condition, `{"image_latents": (1, F', C, h, w)}`, as
        `CogVideoXImageToVideoPipeline.prepare_latents` makes it: diffusers' `VideoProcessor`
        resize and normalisation, the VAE's encoder (`_image_programs`) on that one frame, the
        posterior sampled with the first draws of `torch.Generator(seed)`, scaled, then zero
        latent frames up to the video's padded length."""
        import jax
        import torch
        from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
        from diffusers.video_processor import VideoProcessor

        from tpupedia import pictures

        (program,) = self._image_programs(request)
        encode = self.held("image", "jit", lambda: jax.jit(program.fn, **program.jit_kwargs))
        weights, buffers, pixels_spec = program.args
        pixels = VideoProcessor(vae_scale_factor=self.shapes.spatial).preprocess(
            pictures.read(request.image), height=request.height, width=request.width).to(self.dtype)
        start = time.perf_counter()
        with self._precision():
            frame = jax.device_put(common.to_jax_array(pixels[:, :, None]), pixels_spec.sharding)  # (1, 3, 1, H, W)
            moments = common.to_torch(jax.block_until_ready(encode(weights, buffers, frame)))
        seconds = time.perf_counter() - start
        sample = DiagonalGaussianDistribution(moments).sample(torch.Generator().manual_seed(request.seed))  # the first draw
        config = self.configs["vae"]
        scale = config.get("scaling_factor", 1.0)
        latents = sample.to(self.dtype).permute(0, 2, 1, 3, 4)  # (1, 1, C, h, w)
        latents = latents / scale if config.get("invert_scale_latents") else latents * scale
        frames, _ = family.padded_latent_frames(request.frames, self.shapes)
        zeros = torch.zeros((1, frames - 1, *latents.shape[2:]), dtype=self.dtype)
        return {"image_latents": torch.cat([latents, zeros], dim=1)}, {"first_s": seconds}

    def _image_programs(self, request: Request) -> list:
        """The VAE's encoder on the picture's one frame, as the image stage compiles it:
        `(weights, buffers, pixels)` with pixels `(1, 3, 1, H, W)`, the VAE a copy on each of the
        host's chips; returns the posterior's moments (mean and log-variance)."""
        import jax.numpy as jnp
        from diffusers import AutoencoderKLCogVideoX
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from tpupedia import aot, torchax_utils

        chips = decoding.decode_mesh(self.mesh)

        def load():  # the encoder as a pure function of the VAE's weights
            vae = self._to_jax("vae", self._load(AutoencoderKLCogVideoX, "vae"), mesh=chips)
            fm = torchax_utils.FunctionalModule(vae, lambda m, x: m._encode(x))

            def encode(weights, buffers, pixels):
                self.traces["image"] += 1
                return fm(weights, buffers, pixels)

            return vae, encode, self._state(fm, "vae")

        _, encode, (weights, buffers) = self.held("image", "vae", load)
        dtype = jnp.dtype(str(self.dtype).removeprefix("torch."))
        pixels = aot.abstract((1, 3, 1, request.height, request.width), dtype, NamedSharding(chips, P()))
        return [aot.Program("image", f"VAE encoder, the picture at {request.width}x{request.height}", encode,
                            (weights, buffers, pixels), weights_bytes=self.plans["vae"].bytes_per_device, calls=1,
                            component="vae")]

    # -- stage 2 ---------------------------------------------------------------------------
    def _denoise(self, request: Request, embeds: dict, on_step: Callable[[int, Any], None] | None = None) -> tuple[dict, dict]:
        """All denoising steps through one compiled step. Returns `{"latents": (1, F', C, h, w)}`
        (the padded latent frames included, as diffusers' `output_type="latent"`).
        `on_step(i, latents)` is called after each step with its output, a jax array valid only during
        the call (the next step donates its buffer)."""
        import jax
        import jax.numpy as jnp
        import numpy as np
        import torch

        from tpupedia.pipelines import schedulers

        setup = self._denoise_setup(request)
        programs = self._denoise_programs(request, setup)
        program = programs[0]
        cache = getattr(request, "step_cache", None)
        # The step depends on the schedule (steps) and on guidance being on (and the step cache's
        # method); a batch keeps one per pair.
        key = ("step", request.steps, setup.guided, None if cache is None else (cache.method, cache.tail, cache.calibrated))
        compiled = self.held("denoise", key, lambda: [jax.jit(p.fn, **p.jit_kwargs) for p in programs])
        weights, buffers, x_spec, old_spec, text_spec, cos_spec, sin_spec = program.args[:7]
        image = () if request.image is None else (jax.device_put(common.to_jax_array(embeds["image_latents"]),
                                                                 program.args[10].sharding),)
        text = (torch.cat([embeds["negative_prompt_embeds"], embeds["prompt_embeds"]]) if setup.guided
                else embeds["prompt_embeds"])
        text = jax.device_put(common.to_jax_array(text), text_spec.sharding)
        cos, sin = (jax.device_put(common.to_jax_array(a), spec.sharding)
                    for a, spec in ((setup.cos, cos_spec), (setup.sin, sin_spec)))

        guidance = [family.dynamic_guidance(request.guidance, request.steps, t) if request.dynamic_cfg
                    else request.guidance for t in setup.timesteps]  # each step's scale, as stock's

        def loop(setup, full_steps=None, calibration=None):
            """All steps from `setup`'s latents; `full_steps` (a set) picks the full program per
            step, the others cached; `calibration` records every (full) step."""
            x = jax.device_put(common.to_jax_array(setup.latents), x_spec.sharding)
            old = jax.device_put(jnp.zeros(old_spec.shape, old_spec.dtype), old_spec.sharding)

            def step(i, state):  # the state is (latents, the DPM solver's previous prediction[, the cache])
                noise = (schedulers.dpm_noise(setup.generator, x_spec.shape, self.dtype, setup.host_tables, i)
                         if setup.dpm else np.zeros((), np.float32))  # DDIM draws no noise
                # host scalars and noise: replicated inputs on every process
                args = (text, cos, sin, np.int32(i), np.float32(guidance[i]), noise, *image)
                if cache is None:
                    return compiled[0](weights, buffers, *state, *args)
                x, old, record = state
                if i in full_steps:
                    x, old, new_record = compiled[0](weights, buffers, x, old, *args)
                    if calibration is not None:
                        calibration.record(new_record, record)
                    return x, old, new_record
                return (*compiled[1](weights, buffers, x, old, record, *args), record)

            with program.context(), self._precision():
                return common.denoise_loop(step, (x, old) if cache is None else (x, old, None),
                                           len(setup.timesteps), on_step, latents=lambda state: state[0])

        setups = [setup]  # the DPM solver's noise comes from the setup's generator: another pass needs a new one
        state, timings = stepcache.run_loop(cache, request.steps, lambda full, calibration: loop(
            setups.pop() if setups else self._denoise_setup(request), full, calibration),
            identity=self.cache_identity(self.configs))
        x = state[0]
        return {"latents": common.to_torch(x).to(self.dtype)}, timings | {"padding_frames": setup.padding}

    def _denoise_setup(self, request: Request):
        """What the step needs from the host: the schedule as tables, the initial latents drawn
        from `torch.Generator(seed)` as diffusers draws them (the generator then draws the DPM
        noise), the RoPE tables, and whether guidance and the DPM solver are on."""
        import types

        import jax.numpy as jnp
        import torch
        from diffusers import CogVideoXDPMScheduler
        from diffusers.utils.torch_utils import randn_tensor

        from tpupedia.pipelines import schedulers

        scheduler = self._scheduler()
        scheduler.set_timesteps(request.steps)
        host_tables = schedulers.cogvideox_tables(scheduler, scheduler.timesteps)
        generator = torch.Generator().manual_seed(request.seed)
        facts = self.shapes
        frames, padding = family.padded_latent_frames(request.frames, facts)
        shape = (1, frames, facts.latent_channels, *facts.latent_size(request.height, request.width))
        if request.image is not None:  # the image stage drew the posterior's noise first: skip those draws
            randn_tensor((1, facts.latent_channels, 1, *shape[3:]), generator=generator, dtype=self.dtype)
        latents = randn_tensor(shape, generator=generator, dtype=self.dtype) * scheduler.init_noise_sigma
        cos, sin = family.rotary_embeddings(self.configs["transformer"], request.height, request.width, frames, facts)
        return types.SimpleNamespace(
            timesteps=scheduler.timesteps, host_tables=host_tables,
            tables={k: jnp.asarray(v) for k, v in host_tables.items()},
            dpm=isinstance(scheduler, CogVideoXDPMScheduler), guided=request.guidance > 1.0,
            generator=generator, latents=latents, padding=padding, cos=cos, sin=sin)

    def _scheduler(self):
        """The checkpoint's scheduler (DPM or DDIM, as its `model_index.json` says), or on an
        `abstract` pipeline the one its scheduler config names."""
        if not self.abstract:
            return family.load_scheduler(self.source)
        import diffusers

        config = self.configs["scheduler"]
        return getattr(diffusers, config["_class_name"]).from_config(config)

    def _denoise_programs(self, request: Request, setup) -> list:
        """The one denoising step every step runs, as this stage compiles it: the guidance pair as a
        batch on `dp`, the transformer over `tp`, the scheduler step, latents and solver state donated.
        Arguments `(weights, buffers, latents, old_pred, text, cos, sin, i, guidance, noise)`. With
        a step cache (`request.step_cache`, `tpupedia.pipelines.stepcache`) two programs: the full
        step, which also returns the cache, and the cached step, which takes it after `old_pred`."""
        import jax
        import jax.numpy as jnp
        import numpy as np
        from diffusers import CogVideoXTransformer3DModel
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from tpupedia import aot, torchax_utils
        from tpupedia.pipelines import schedulers

        def load():
            transformer = self._load(CogVideoXTransformer3DModel, "transformer")
            family.make_jit_friendly(transformer)  # RoPE without in-place writes (see its docstring)
            self._to_jax("transformer", transformer, self._rules(self.options.sharding))
            return transformer, torchax_utils.FunctionalModule(transformer, return_dict=False)

        _, fm = self.held("denoise", "transformer", load)
        backend = attention_backend(self.options.attention, self.mesh)
        tables, guided, dpm = setup.tables, setup.guided, setup.dpm
        batch = NamedSharding(self.mesh, P("dp")) if guided else NamedSharding(self.mesh, P())
        replicated = NamedSharding(self.mesh, P())
        dtype = common.to_jax_array(setup.latents[:0]).dtype

        i2v = request.image is not None
        ofs = self.configs["transformer"].get("ofs_embed_dim") is not None  # the 1.5 release's image-to-video input
        # CogVideoX 1.0 (2b) adds sinusoidal positions in its patch embedding and takes no RoPE: diffusers'
        # pipeline passes image_rotary_emb=None for it (the config's default is False, as diffusers reads it)
        rope = bool(self.configs["transformer"].get("use_rotary_positional_embeddings", False))

        cache = getattr(request, "step_cache", None)
        transformer = fm.module
        if cache is not None:
            cache.check(request.steps, len(getattr(transformer, family.CACHE_BLOCKS)))

        def forward(mode: str):
            """The transformer's forward, its blocks cached as `cache` says (`stepcache.traced`)."""
            if mode == "plain":
                return fm
            calibrate = cache.calibrated

            def method(m, cached, **kwargs):
                with stepcache.traced(m, family, cache, mode, cached, calibrate=calibrate) as record:
                    out = m(**kwargs)
                return (out, record) if mode == "full" else out

            cached_fm = torchax_utils.FunctionalModule(transformer, method, return_dict=False)
            return lambda weights, buffers, cached, **kw: cached_fm(weights, buffers, cached, **kw)

        def make_step(mode: str):
            run = forward(mode)

            def step(weights, buffers, latents, old_pred, *rest):
                self.traces["denoise"] += 1
                cached, rest = (rest[0], rest[1:]) if mode == "cached" else (None, rest)
                text, cos, sin, i, guidance, noise, *image = rest
                x = jnp.concatenate([latents, image[0]], axis=2) if i2v else latents  # the picture's latents as channels
                x = jnp.concatenate([x, x]) if guided else x
                x = jax.lax.with_sharding_constraint(x, batch)
                t = jnp.broadcast_to(tables["timesteps"][i], (x.shape[0],))
                extra = {"ofs": jnp.full((1,), 2.0, x.dtype)} if i2v and ofs else {}  # as the stock pipeline passes it
                kwargs = dict(hidden_states=x, encoder_hidden_states=text, timestep=t,
                              image_rotary_emb=(cos, sin) if rope else None, **extra)
                if mode == "plain":
                    out, record = run(weights, buffers, **kwargs)[0], None
                elif mode == "full":  # (the transformer's outputs, what a cached step reuses)
                    (out, *_), record = run(weights, buffers, None, **kwargs)
                else:
                    out, record = run(weights, buffers, cached, **kwargs)[0], None
                pred = out.astype(jnp.float32)
                if guided:
                    uncond, cond = pred[:1], pred[1:]
                    pred = uncond + guidance * (cond - uncond)
                sample = latents.astype(jnp.float32)
                if dpm:
                    new, old_pred = schedulers.dpm_step(tables, i, sample, pred, old_pred, noise)
                else:
                    new = schedulers.ddim_step(tables, i, sample, pred)
                return (new.astype(dtype), old_pred) if record is None else (new.astype(dtype), old_pred, record)

            return step

        shape = tuple(setup.latents.shape)
        text = (2 if guided else 1, self.configs["transformer"]["max_text_seq_length"],
                self.configs["transformer"]["text_embed_dim"])
        state = self._state(fm, "transformer")
        head = (aot.abstract(shape, dtype, replicated), aot.abstract(shape, jnp.float32, replicated))
        rest = (aot.abstract(text, dtype, batch),
                aot.abstract(tuple(setup.cos.shape), common.to_jax_array(setup.cos[:0]).dtype, replicated),
                aot.abstract(tuple(setup.sin.shape), common.to_jax_array(setup.sin[:0]).dtype, replicated),
                aot.abstract((), np.int32, replicated), aot.abstract((), np.float32, replicated),
                aot.abstract(shape if dpm else (), np.float32, replicated),
                *([aot.abstract(shape, dtype, replicated)] if i2v else []))
        args = (*state, *head, *rest)
        latents = f"{'guidance pair, ' if guided else ''}{shape[1]}x{shape[3]}x{shape[4]} latents"
        context = lambda: common.attention_installed(self.env, self.mesh, backend, self.block_sizes)  # noqa: E731
        weights = self.plans["transformer"].bytes_per_device
        # Latents and the solver state keep one (replicated) sharding in and out, so every step
        # reuses the first step's program; they are donated, so XLA updates them in place.
        if cache is None:
            return [aot.Program("denoise", f"denoising step ({latents})", make_step("plain"), args,
                                jit_kwargs={"donate_argnums": (2, 3), "out_shardings": (replicated, replicated)},
                                weights_bytes=weights, calls=len(setup.timesteps), component="transformer",
                                context=context)]
        full = make_step("full")
        record = None  # the cache's shapes (a trace of the full step) only where a plan compiles the cached step
        if self.abstract:
            with context():
                record = jax.tree.map(lambda a: aot.abstract(a.shape, a.dtype, batch), jax.eval_shape(common.fresh_trace(full), *args)[2])
        n_full = len(cache.full_steps(request.steps)) if not cache.calibrated else len(setup.timesteps)
        return [aot.Program("denoise", f"{cache.method} full step ({latents})", full, args,
                            jit_kwargs={"donate_argnums": (2, 3), "out_shardings": (replicated, replicated, batch)},
                            weights_bytes=weights, calls=n_full, component="transformer", context=context),
                aot.Program("denoise", f"{cache.method} cached step ({latents})", make_step("cached"),
                            (*state, *head, record, *rest),
                            jit_kwargs={"donate_argnums": (2, 3), "out_shardings": (replicated, replicated)},
                            weights_bytes=weights, calls=len(setup.timesteps) - n_full, component="transformer",
                            context=context)]

    # -- stage 3 ---------------------------------------------------------------------------
    def _decode_programs(self, request: Request) -> list:
        """The decode stage's programs, the Flax NNX VAE's frame batches (`tpupedia.pipelines.decoding`),
        on the host's chips, one tile (or a copy of the whole latent) per chip. Only the Flax VAE is planned:
        diffusers' decoder under torchax carries its causal cache in another form."""
        if self.vae != "flax":
            raise PipelineError(f"vae={self.vae!r}: the decode programs are planned for the Flax VAE only; "
                                "plan with Options(vae='flax'), the default, or run unplanned (plan='off')")
        return decode_programs(self.configs["vae"], family.latent_frames(request.frames, self.shapes),
                               request.height, request.width, decoding.decode_mesh(self.mesh),
                               dtype=str(self.dtype).removeprefix("torch."), tiling=request.vae_tiling)

    def _decode(self, request: Request, latents) -> tuple[dict, dict]:
        """Latents -> frames, float32 (F, H, W, 3) in [0, 1] (diffusers' `output_type="np"`)."""
        import jax
        import torch
        from diffusers import AutoencoderKLCogVideoX
        from diffusers.video_processor import VideoProcessor

        _, padding = family.padded_latent_frames(request.frames, self.shapes)
        chips = decoding.decode_mesh(self.mesh)

        def load():  # (the decoder this run uses, the VAE's scaling factor)
            vae = checkpoints.load_component(AutoencoderKLCogVideoX, self.source, "vae", dtype=self.dtype)
            if self.vae == "flax":
                import jax.numpy as jnp
                from flax import nnx
                from jax.sharding import NamedSharding
                from jax.sharding import PartitionSpec as P

                from tpupedia.models import cogvideox_vae_convert as convert

                dtype = jnp.dtype(str(self.dtype).removeprefix("torch."))
                flax_vae = convert.from_diffusers(vae, dtype=dtype)
                nnx.update(flax_vae, jax.device_put(nnx.state(flax_vae), NamedSharding(chips, P())))  # every chip a copy
                return flax_vae, vae.config.scaling_factor
            from tpupedia import torchax_utils

            self._to_jax("vae", vae, mesh=chips)
            vae.decoder = torchax_utils.JitModule(vae.decoder)
            return vae, vae.config.scaling_factor

        vae, scaling = self.held("decode", self.vae, load)
        vae.enable_tiling() if request.vae_tiling else vae.disable_tiling()
        z = latents[:, padding:].permute(0, 2, 1, 3, 4) / scaling
        start = time.perf_counter()
        with self._precision(), torch.no_grad():
            if self.vae == "flax":  # the host's chips share the decode: tiles side by side, or each a strip
                spread = functools.partial(decoding.in_waves, mesh=chips)
                split = decoding.activation_sharding(chips, tuple(z.shape[-2:]))
                video = common.to_torch(jax.block_until_ready(vae.decode(common.to_jax_array(z), tiles=spread,
                                                                         spatial=split)))
            else:
                with self.env:
                    video = vae.decode(z.to("jax")).sample
                    video = video.to("cpu")
        seconds = time.perf_counter() - start
        frames = VideoProcessor(vae_scale_factor=self.shapes.spatial).postprocess_video(
            video.float(), output_type="np")[0]
        return {"frames": torch.from_numpy(frames.astype("float32"))}, {"first_s": seconds}


# --- the decode programs, for `tpupedia.plan` (the Flax NNX VAE, frame batch by frame batch) --------

def _chunk_calls(graphdef: Any, state: Any, latents: Any, chips: int, spatial: Any) -> dict[tuple, list]:
    """Every `decode_chunk` call of the model's own `decode` on `latents` (channels-first, abstract)
    with its pieces in waves of `chips` (`in_waves`, as the pipeline runs it), grouped by abstract
    arguments: `{key: [calls, chunk latents, cache]}` in order of first call.

    `decode` runs under `jax.eval_shape` with its runner swapped for one that records each
    call's arguments and then calls the model's jitted `_jit_apply`, so repeated shapes trace once.
    """
    import jax
    from flax import nnx

    from tpupedia.models import cogvideox_vae

    calls: dict[tuple, list] = {}

    def decode(st, z):
        def runner(method, jit, split=None):  # noqa: ARG001 - `_runner`'s signature
            def run(chunk, cache):
                args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (chunk, cache))
                key = (jax.tree.structure(args), tuple(jax.tree.leaves(args)))
                calls.setdefault(key, [0, *args, split])[0] += 1
                return cogvideox_vae._jit_apply(graphdef, "decode_chunk", st, chunk, cache, spatial=split)

            return run

        model = nnx.merge(graphdef, st)
        model._runner = runner
        return model.decode(z, tiles=functools.partial(decoding.in_waves, chips=chips), spatial=spatial)

    jax.eval_shape(decode, state, latents)
    return calls


def _chunk_name(chunk: Any, cached: bool, calls: int, latent_hw: tuple[int, int], split: Any, chips: int) -> str:
    _, frames, h, w, _ = chunk.shape  # channels-last inside the NNX VAE
    batch = "later frame batches, with the causal cache" if cached else "first frame batch"
    return f"VAE decode, {batch} ({frames} latent frames, {decoding.where(chips, h, w, latent_hw, split)}, x {calls})"


def decode_programs(vae_config: dict, latent_frames: int, height: int, width: int, mesh: Any, *,
                   dtype: Any = "bfloat16", tiling: bool = False) -> list:
    """The decoder programs of CogVideoX's `decode` stage (`vae="flax"`) for a `height` x `width`
    video decoded from `latent_frames` latent frames (the padding frames already dropped), on the
    chips of `mesh` (a `decoding.decode_mesh`).

    `vae_config` is the checkpoint's VAE config dict (diffusers' `AutoencoderKLCogVideoX` fields);
    the weights are abstract, in `dtype`, a copy on every chip. One program per distinct
    `decode_chunk` call: the first frame batch, the later ones with the cache, per tile shape with
    `tiling` (diffusers' `enable_tiling` defaults), each taking one piece per chip; `calls` counts
    each (waves of tiles times frame batches). Raises `PipelineError` for frames < 1 or sizes that
    are not multiples of the VAE's spatial compression.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tpupedia import aot
    from tpupedia.models import cogvideox_vae
    from tpupedia.models import cogvideox_vae_convert as convert

    config = cogvideox_vae.CogVideoXVAEConfig.from_dict(vae_config)
    ratio = config.spatial_compression_ratio
    decoding.check_decode("CogVideoX", latent_frames, height, width, ratio)
    dtype = jnp.dtype(dtype)
    model = convert.abstract_vae(config, dtype=dtype, param_dtype=dtype)
    model.enable_tiling() if tiling else model.disable_tiling()
    graphdef, state = nnx.split(model)
    latent_hw = (height // ratio, width // ratio)
    latents = jax.ShapeDtypeStruct((1, config.latent_channels, latent_frames, *latent_hw), dtype)
    calls = _chunk_calls(graphdef, state, latents, mesh.size, decoding.activation_sharding(mesh, latent_hw))
    state = decoding.replicated(mesh, state)
    weights = decoding.nbytes(state)

    def arguments(chunk, cache, split):  # a wave of tiles: one per chip; a whole latent: on every chip
        if split is None and chunk.shape[0] == mesh.size:
            return decoding.spread(mesh, chunk), decoding.spread(mesh, cache)
        cached = split if split is not None else NamedSharding(mesh, P())  # the cache as the last call left it
        return decoding.replicated(mesh, chunk), jax.tree.map(lambda a: aot.abstract(a.shape, a.dtype, cached), cache)

    return [aot.Program(decoding.STAGE, _chunk_name(chunk, cache is not None, n, latent_hw, split, mesh.size),
                        functools.partial(cogvideox_vae._jit_apply, graphdef, "decode_chunk", spatial=split),  # `_runner`'s
                        (state, *arguments(chunk, cache, split)), weights_bytes=weights, calls=n, component="vae")
            for n, chunk, cache, split in calls.values()]



def stock(source: str, request: Request, dtype: Any = None) -> tuple[Any, dict[str, Any]]:
    """Stock diffusers `CogVideoXPipeline` (`CogVideoXImageToVideoPipeline` for a request with a
    picture, read as `diffusers.utils.load_image` reads it) loaded from `source` (float32 unless
    `dtype`) and the keyword arguments of the call that makes `request`'s video from the same
    seed, frames as `output_type="np"`: what the parity tests compare with and `tpupedia bench
    generate` times."""
    import torch
    from diffusers import CogVideoXImageToVideoPipeline, CogVideoXPipeline

    from tpupedia import pictures

    i2v = request.image is not None
    pipe = common.load_stock(CogVideoXImageToVideoPipeline if i2v else CogVideoXPipeline, source, dtype)
    pipe.vae.enable_tiling() if request.vae_tiling else pipe.vae.disable_tiling()
    picture = {"image": pictures.read(request.image)} if i2v else {}
    return pipe, picture | dict(prompt=request.prompt, negative_prompt=request.negative_prompt, num_frames=request.frames,
                      height=request.height, width=request.width, num_inference_steps=request.steps,
                      guidance_scale=request.guidance, use_dynamic_cfg=request.dynamic_cfg,
                      generator=torch.Generator().manual_seed(request.seed), output_type="np",
                      max_sequence_length=pipe.transformer.config.max_text_seq_length)

PIPELINE = CogVideoX
run = functools.partial(common.run, CogVideoX)
run.__doc__ = common.run.__doc__
run_batch = functools.partial(common.run_batch, CogVideoX)
run_batch.__doc__ = common.run_batch.__doc__
