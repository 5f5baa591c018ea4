"""Wan 2.1 / 2.2 text-to-video in three stages, under torchax, on a mesh.

What is Wan's own, on top of what notebooks `cogvideox_pipeline` and `hunyuan_video` built (`tpupedia.pipelines.common`):

1. `encode_text`: umT5 with its attention mask, each prompt cleaned as `WanPipeline` cleans it;
   the embeddings past the prompt's last token are zeros (diffusers cuts them off and pads with
   zeros; here the same values come from multiplying by the mask, a fixed shape for jit).
2. `denoise`: UniPC, a multistep predictor-corrector, as a pure step
   (`tpupedia.pipelines.schedulers.unipc_step`): its Python state (the last sample, the last two
   predictions) becomes an argument carried from step to step by the shared loop
   (`common.denoise_loop`). Wan 2.2 A14B's two experts are two compiled steps, one per
   transformer, both resident; the host picks one per step at the checkpoint's boundary, with
   each expert's guidance scale. The guidance pair is a batch of 2 on `dp` (the stock pipeline
   calls the transformer twice).
3. `decode`: `AutoencoderKLWan` decodes one latent frame at a time through a causal cache that
   its modules write into a Python list (`feat_cache`, holding tensors, `None` or the marker
   `"Rep"`). Here that list is split into its tensors (program arguments and results) and its
   markers (static): one compiled program for the first frame, one for the second, one for all
   later frames (`decode_frames`).

Image-to-video (Wan2.1-I2V, Wan2.2-I2V-A14B; `Request.image`) adds a stage between text and denoise:

* `encode_image`: the picture resized by diffusers' `VideoProcessor`, followed by black frames up
  to the video's length, through the VAE's encoder one chunk of frames at a time (the first frame,
  then 4 at a time: `encode_frames`, the decoder's cache treatment in reverse), the posterior's
  mean normalised like the latents, and in front of it the mask channels that mark the given
  frame; for Wan 2.1 also the picture's CLIP features (the checkpoint's own image processor, the
  CLIP vision tower jitted, its penultimate hidden states) -> `image.safetensors` holding
  `condition` and `image_embeds`. Nothing is drawn (the stock pipeline takes the posterior's
  mean), so the denoise stage's noise is the text-to-video one; each step feeds the condition
  beside the latents and the features to the cross-attention.

Precision: with `dtype=bfloat16` (the full preset) the transformers and the text encoder run in
bf16, and the VAE and Wan 2.1 I2V's CLIP image encoder in float32, as diffusers' own examples load
them (`tpupedia.models.wan.FLOAT32_COMPONENTS`), unless the plan shows the float32 VAE stages do
not fit a chip: then the VAE runs in the run's dtype (`Request.vae_dtype`, resolved by
`tpupedia plan` and the pre-run check, which say so; `--vae-dtype` chooses it by hand). The flow shift is the checkpoint's scheduler's
unless `Request.shift` overrides it (`--shift`; diffusers' example uses 5.0 for 720p), which
rebuilds UniPC's tables as `UniPCMultistepScheduler.from_config(config, flow_shift=shift)` does.
`Request.solver="euler"` replaces UniPC with the Euler the Wan 2.2 Lightning adapters were
distilled with (`schedulers.uniform_euler`: evenly spaced sigmas, shifted; no solver state).

Same weights and seed as `WanPipeline(output_type="np")` (`WanImageToVideoPipeline` with a picture)
give the same frames (float32: within 1e-4, tests/test_wan.py, tests/test_wan_image_to_video.py;
a shift override within 1e-4, and bf16 against stock in bf16 within a stated bound,
tests/test_wan_precision.py).
Introduced in notebook `wan_on_tpu` (Wan on TPU); `tpupedia generate wan`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from tpupedia import lora, quantize
from tpupedia.models import checkpoints
from tpupedia.models import wan as family
from tpupedia.pipelines import common, decoding, schedulers, stepcache
from tpupedia.pipelines.common import Options, PipelineError, StageReport

__all__ = ["PipelineError", "Request", "Options", "validate", "resolve", "settings", "Wan", "run", "run_batch",
           "StageReport", "decode_frames", "decode_programs", "solver_scheduler", "stock"]


@dataclass(frozen=True)
class Request(common.Request):
    """What to generate. `guidance_2` is Wan 2.2's low-noise expert's scale (`None`: `guidance`,
    as `WanPipeline` takes it); `shift` UniPC's flow shift (`None`: the checkpoint's scheduler's
    `flow_shift`, `tpupedia.models.wan.flow_shift`); `vae_dtype` the VAE's (`None`: float32, as
diffusers' examples load it, unless the plan shows that does not fit)."""

    frames: int = 81
    guidance: float = 5.0
    fps: int = 16
    guidance_2: float | None = field(default=None, metadata={
        "type": float, "help": "two-expert checkpoints (Wan 2.2 A14B): guidance of the low-noise expert "
                               "(default: --guidance)"})
    shift: float | None = field(default=None, metadata={
        "type": float, "help": "the solver's flow shift (default: the checkpoint's scheduler; diffusers' example "
                               "uses 5.0 for 720p, 3.0 for 480p)"})
    solver: str = field(default="unipc", metadata={
        "type": str, "metavar": "|".join(schedulers.SOLVERS),
        "help": "unipc, the checkpoint's UniPC as stock WanPipeline runs it, or euler, the Euler the Wan 2.2 "
                "Lightning adapters were distilled with (uniform sigmas, shifted; --release lightning's)"})
    vae_dtype: str | None = field(default=None, metadata={
        "type": str, "metavar": "|".join(family.VAE_DTYPES),
        "help": "the VAE's dtype (default: float32 as diffusers' Wan examples load it, or the run's dtype where "
                "the plan shows float32 does not fit, which the plan and the run say)"})
    step_cache: stepcache.StepCache | None = field(default=None, metadata=stepcache.FIELD)


def validate(request: Request, options: Options, device_count: int | None = None,
             configs: dict[str, dict] | None = None) -> None:
    """Refuse what cannot run, naming the bad value and what is allowed. Loads no model; with
    `configs` (`family.component_configs`), the rules use that checkpoint's shape facts."""
    Wan.validate(request, options, device_count, configs)


def resolve(request: Request, configs: dict[str, dict]) -> Request:
    """`request` with `guidance_2` taken from `guidance` where unset and the checkpoint has two
    experts, and `shift` from the checkpoint's scheduler where unset (`family.flow_shift`)."""
    request = dataclasses.replace(request, shift=family.flow_shift(configs, request.shift))
    if request.guidance_2 is None and len(family.experts(configs)) == 2:
        return dataclasses.replace(request, guidance_2=request.guidance)
    return request


def settings(stage: str, source_label: str, configs: dict[str, dict], request: Request, *, dtype: str) -> dict:
    """Every setting that changes the tensors of `stage` (and of the stages before it), the
    dtype of each component that does not run in `dtype` (`family.component_dtype`) included."""
    request = resolve(request, configs)
    clip = ({"image_encoder": common.config_fingerprint(configs["image_encoder"]),
             "image_processor": configs["pipeline"].get("image_processor"),
             "image_encoder_dtype": family.component_dtype("image_encoder", dtype)} if "image_encoder" in configs else {})
    picture = clip | {"vae_dtype": family.component_dtype("vae", dtype, request.vae_dtype)}
    out = common.stage_settings(family.FAMILY, stage, source_label, configs, request, dtype, picture=picture)
    if stage in ("denoise", "decode"):
        out |= {name: common.config_fingerprint(configs[name]) for name in family.experts(configs)}
        out |= {"scheduler": common.config_fingerprint(configs["scheduler"]),
                "pipeline": common.config_fingerprint(configs.get("pipeline", {})),
                "frames": request.frames, "height": request.height, "width": request.width,
                "steps": request.steps, "guidance": request.guidance, "guidance_2": request.guidance_2,
                "shift": request.shift, "seed": request.seed}
        out |= {} if request.solver == "unipc" else {"solver": request.solver}  # stage files before solvers match
        out |= lora.settings(request.lora)  # each adapter's file, scale and component (none: no key)
        out |= quantize.settings(request.quantize)  # the weights' format (none: no key)
        out |= stepcache.settings(request.step_cache)  # none: no key
    if stage == "decode":
        out |= {"vae_config": common.config_fingerprint(configs["vae"]), "vae_dtype": family.component_dtype("vae", dtype, request.vae_dtype)}
    return out


class Wan(common.StagedPipeline):
    """The three Wan stages over one checkpoint (see the module docstring)."""

    family = family
    vaes = ("torchax",)
    image_to_video = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.traces = {"text": 0, "image": 0, "denoise": 0, "decode": 0}

    @classmethod
    def validate(cls, request: Request, options: Options, device_count: int | None = None,
                 configs: dict[str, dict] | None = None, *, shape_rules: bool = True, kind: bool = True) -> None:
        super().validate(request, options, device_count, configs, shape_rules=shape_rules, kind=kind)
        if request.guidance_2 is not None and (not math.isfinite(request.guidance_2) or request.guidance_2 < 0):
            raise PipelineError(f"guidance_2={request.guidance_2} must be a finite number >= 0")
        if request.shift is not None and (not math.isfinite(request.shift) or request.shift <= 0):
            raise PipelineError(f"shift={request.shift} must be a finite number > 0 (1 leaves the schedule unshifted)")
        if request.guidance_2 is not None and configs is not None and len(family.experts(configs)) == 1:
            raise PipelineError(f"guidance_2={request.guidance_2}: this checkpoint has one transformer (Wan 2.1); the "
                                "low-noise guidance is for two-expert checkpoints (Wan 2.2 A14B)")
        if request.solver not in schedulers.SOLVERS:
            raise PipelineError(f"solver={request.solver!r} is not one of {', '.join(schedulers.SOLVERS)}")
        if request.vae_dtype is not None and request.vae_dtype not in family.VAE_DTYPES:
            raise PipelineError(f"vae_dtype={request.vae_dtype!r} is not one of {', '.join(family.VAE_DTYPES)}")
        if request.vae_tiling:
            raise PipelineError("vae_tiling=on: Wan's VAE decodes untiled here (one latent frame at a time; "
                                "tiled decode is not implemented for Wan yet); use --vae-tiling off")

    @classmethod
    def check_kind(cls, request: Request, configs: dict[str, dict]) -> None:
        """The common rule, and Wan 2.2 TI2V's picture refused by name (its image-to-video puts the
        picture's latents in place of the first latent frame; not implemented here)."""
        if request.image is not None and configs.get("pipeline", {}).get("expand_timesteps"):
            raise PipelineError(f"--image {request.image}: this is a Wan 2.2 TI2V checkpoint (expand_timesteps); its "
                                "image-to-video (the picture as the first latent frame) is not implemented here, "
                                f"its text-to-video is; for a picture use an image-to-video one, e.g. {family.FULL_ID_I2V}")
        super().check_kind(request, configs)

    @classmethod
    def settings_for(cls, source_label, configs, request, options, dtype, stage) -> dict:
        return settings(stage, source_label, configs, request, dtype=str(dtype).removeprefix("torch."))

    @classmethod
    def lowered(cls, request: Request, dtype: str) -> Request | None:
        """`request` with its VAE in the run's `dtype` (a name) where it would run in float32 by
        default and `dtype` is narrower: what `tpupedia.plan` tries when the float32 VAE stages do
        not fit a chip; `None` when there is nothing to lower (a dtype chosen, a float32 run)."""
        if request.vae_dtype is not None or family.component_dtype("vae", dtype) == dtype:
            return None
        return dataclasses.replace(request, vae_dtype=dtype)

    def component_dtype(self, name: str, request: Request | None = None) -> Any:
        """The torch dtype of component `name` (`family.component_dtype`): float32 for
        `family.FLOAT32_COMPONENTS`, else the run's dtype; the VAE in `request.vae_dtype` if set."""
        import torch

        chosen = request.vae_dtype if request is not None else None
        return getattr(torch, family.component_dtype(name, str(self.dtype).removeprefix("torch."), chosen))

    def vae_dtype(self, request: Request) -> str:
        """The VAE's dtype by name for `request`: what its programs compile in, for the run and the plan."""
        return str(self.component_dtype("vae", request)).removeprefix("torch.")

    # -- stage 1 ---------------------------------------------------------------------------
    def _encode_text(self, request: Request) -> tuple[dict, dict]:
        """umT5 embeddings of the negative and the positive prompt, as `_get_t5_prompt_embeds`
        computes them (the prompt cleaned, 512 tokens, zeros after the prompt's last token)."""
        import jax
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean
        from transformers import AutoTokenizer

        tokenizer = self.held("text", "tokenizer", lambda: AutoTokenizer.from_pretrained(self.source, subfolder="tokenizer"))
        (program,) = self._text_programs(request)
        compiled = self.held("text", "jit", lambda: jax.jit(program.fn, **program.jit_kwargs))
        weights, buffers, ids_spec, mask_spec = program.args
        results, times = {}, []
        with self._precision():
            for name, text in (("negative_prompt_embeds", request.negative_prompt), ("prompt_embeds", request.prompt)):
                tokens = tokenizer([prompt_clean(text)], padding="max_length", max_length=family.TEXT_TOKENS,
                                   truncation=True, add_special_tokens=True, return_attention_mask=True,
                                   return_tensors="pt")
                ids = jax.device_put(tokens.input_ids.numpy(), ids_spec.sharding)
                mask = jax.device_put(tokens.attention_mask.numpy(), mask_spec.sharding)
                out, seconds = common.timed(lambda: compiled(weights, buffers, ids, mask), jax.block_until_ready)
                results[name] = common.to_torch(out).to(self.dtype)
                times.append(seconds)
        return results, {"first_s": times[0], "steady_s": times[1]}

    def _text_programs(self, request: Request) -> list:  # noqa: ARG002 - every family's signature
        """The umT5 encoder as the text stage compiles it: `(weights, buffers, ids, mask)`, 512
        tokens, called for the negative and the positive prompt."""
        import jax.numpy as jnp
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P
        from transformers import UMT5EncoderModel

        from tpupedia import aot, torchax_utils

        replicated = NamedSharding(self.mesh, P())

        def load():
            encoder = self._load(UMT5EncoderModel, "text_encoder")
            self._to_jax("text_encoder", encoder, self._text_rules("text_encoder"))
            fm = torchax_utils.FunctionalModule(encoder, return_dict=False)

            def embed(weights, buffers, ids, mask):
                self.traces["text"] += 1
                hidden = fm(weights, buffers, input_ids=ids, attention_mask=mask)[0]
                return hidden * mask[..., None].astype(hidden.dtype)  # zeros after the prompt, as diffusers pads

            return encoder, embed, self._state(fm, "text_encoder")

        _, embed, (weights, buffers) = self.held("text", "umt5", load)
        ids = aot.abstract((1, family.TEXT_TOKENS), jnp.int32, replicated)
        mask = aot.abstract((1, family.TEXT_TOKENS), jnp.int32, replicated)
        return [aot.Program("text", f"umT5 encoder, {family.TEXT_TOKENS} tokens", embed, (weights, buffers, ids, mask),
                            jit_kwargs={"out_shardings": replicated}, weights_bytes=self.plans["text_encoder"].bytes_per_device,
                            calls=2, component="text_encoder")]

    # -- image-to-video: the picture's condition --------------------------------------------
    def _encode_image(self, request: Request) -> tuple[dict, dict]:
        """The picture as the denoiser's condition, as `WanImageToVideoPipeline` makes it:
        `condition` (1, mask + latent channels, latent frames, h, w), float32: the picture resized
        by `VideoProcessor`, black frames after it, the VAE's posterior mean (`encode_frames`)
        normalised by the VAE's latent statistics, behind `family.condition_mask`; with an image
        encoder (Wan 2.1) also `image_embeds` (1, tokens, width): the CLIP tower's penultimate
        hidden states of the picture as the checkpoint's image processor prepares it."""
        import jax
        import torch
        from diffusers import AutoencoderKLWan
        from diffusers.video_processor import VideoProcessor

        from tpupedia import pictures

        picture = pictures.read(request.image)
        out, start = {}, time.perf_counter()
        with self._precision():
            if "image_encoder" in self.configs:
                program = self._clip_program()
                clip = self.held("image", "jit", lambda: jax.jit(program.fn, **program.jit_kwargs))
                weights, buffers, pixels_spec = program.args
                pixels = self._processor("image_processor")(images=picture, return_tensors="pt").pixel_values
                features = clip(weights, buffers, jax.device_put(pixels.numpy(), pixels_spec.sharding))
                out["image_embeds"] = common.to_torch(jax.block_until_ready(features)).to(self.dtype)
            chips = decoding.decode_mesh(self.mesh)

            dtype = self.component_dtype("vae", request)

            def load():
                vae = checkpoints.load_component(AutoencoderKLWan, self.source, "vae", dtype=dtype)
                return self._to_jax("vae", vae, mesh=chips)  # a copy on each of the host's chips

            vae = self.held("image", ("vae", dtype), load)
            first = VideoProcessor(vae_scale_factor=self.shapes.spatial).preprocess(
                picture, height=request.height, width=request.width)
            black = first.new_zeros(1, 3, request.frames - 1, request.height, request.width)
            video = torch.cat([first[:, :, None], black], dim=2).to(vae.dtype)
            moments = encode_frames(vae, video, self.env, self.held("image", ("frames", dtype), lambda: {}), self.traces)
        config = vae.config
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1)
        std = torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1)
        latents = (moments[:, :config.z_dim].float() - mean) * (1.0 / std)  # the posterior's mean (`argmax`)
        mask = family.condition_mask(request.frames, *latents.shape[-2:], self.shapes)
        out["condition"] = torch.cat([mask, latents], dim=1)
        return out, {"first_s": time.perf_counter() - start}

    def _image_programs(self, request: Request) -> list:
        """The image stage's programs: with an image encoder (Wan 2.1) the CLIP vision tower
        (`_clip_program`); then the VAE encoder's chunks (`encode_programs`) on the host's chips."""
        clip = [self._clip_program()] if "image_encoder" in self.configs else []
        return clip + encode_programs(self.configs["vae"], request.frames, request.height, request.width,
                                      decoding.decode_mesh(self.mesh), dtype=self.vae_dtype(request))

    def _clip_program(self):
        """Wan 2.1's CLIP vision tower as the image stage compiles it, `(weights, buffers, pixels)`
        -> its penultimate hidden states, a copy on every chip (one picture, 0.6B parameters:
        nothing worth splitting)."""
        import jax.numpy as jnp
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P
        from transformers import CLIPVisionModel

        from tpupedia import aot, torchax_utils

        replicated = NamedSharding(self.mesh, P())

        def load():
            tower = self._to_jax("image_encoder", self._load(CLIPVisionModel, "image_encoder"))  # a copy per chip
            fm = torchax_utils.FunctionalModule(
                tower, lambda m, pixels: m(pixel_values=pixels, output_hidden_states=True).hidden_states[-2])

            def features(weights, buffers, pixels):
                self.traces["image"] += 1
                return fm(weights, buffers, pixels)

            return tower, features, self._state(fm, "image_encoder")

        _, features, (weights, buffers) = self.held("image", "clip", load)
        side = self.configs["image_encoder"]["image_size"]
        pixels = aot.abstract((1, 3, side, side), jnp.float32, replicated)
        return aot.Program("image", f"CLIP vision tower, the picture at {side}x{side}", features,
                           (weights, buffers, pixels), jit_kwargs={"out_shardings": replicated},
                           weights_bytes=self.plans["image_encoder"].bytes_per_device, calls=1,
                           component="image_encoder")

    # -- stage 2 ---------------------------------------------------------------------------
    def _denoise(self, request: Request, embeds: dict, on_step: Callable[[int, Any], None] | None = None) -> tuple[dict, dict]:
        """All steps through one compiled step per expert. Returns `{"latents": (1, C, T, h, w)}`
        (float32, as `WanPipeline` keeps them). `on_step(i, latents)` is called after each step."""
        import jax
        import numpy as np
        import torch

        request = resolve(request, self.configs)
        setup = self._denoise_setup(request)
        programs = self._denoise_programs(request, setup)
        cache = request.step_cache
        per = 1 if cache is None else 2  # programs per expert: the step, or the full and the cached step
        key = ("steps", request.steps, request.shift, request.solver, setup.guided,  # what the compiled step closes over
               None if cache is None else (cache.method, cache.tail, cache.calibrated))
        compiled = self.held("denoise", key, lambda: [jax.jit(p.fn, **p.jit_kwargs) for p in programs])
        states = [p.args[:2] for p in programs[::per]]  # each expert's (weights, buffers)
        x_spec, text_spec = programs[0].args[2], programs[0].args[4]
        text = (torch.cat([embeds["negative_prompt_embeds"], embeds["prompt_embeds"]]) if setup.guided
                else embeds["prompt_embeds"])
        text = jax.device_put(common.to_jax_array(text), text_spec.sharding)
        scales = (request.guidance, request.guidance if request.guidance_2 is None else request.guidance_2)
        picture = [embeds["condition"]] if request.image is not None else []  # image-to-video's inputs
        if "image_embeds" in embeds:  # one copy per sample of the guidance pair, as the stock pipeline passes it
            picture.append(torch.cat([embeds["image_embeds"]] * (2 if setup.guided else 1)))
        picture = [jax.device_put(common.to_jax_array(a), spec.sharding)
                   for a, spec in zip(picture, programs[0].args[7:], strict=True)]

        def loop(full_steps=None, calibration=None):
            """All steps; `full_steps` (a set) picks each step's full or cached program;
            `calibration` records every (full) step."""
            x = jax.device_put(common.to_jax_array(setup.latents), x_spec.sharding)
            state = tuple(jax.device_put(a, x_spec.sharding) for a in schedulers.unipc_state(x_spec.shape))

            def step(i, carried):  # (latents, UniPC's (last sample, last two predictions)[, the cache, its expert])
                e = setup.expert[i]
                args = (text, np.int32(i), np.float32(scales[e]), *picture)
                if cache is None:
                    return compiled[e](*states[e], *carried, *args)
                x, state, record, made_by = carried
                if i in full_steps:
                    x, state, new = compiled[2 * e](*states[e], x, state, *args)
                    if calibration is not None:
                        calibration.record(new, record)
                    return x, state, new, e
                if made_by != e:
                    raise PipelineError(f"step_cache={cache}: step {i} is cached but the step before it that ran in "
                                        "full ran the other expert; each expert's first step must run in full")
                return (*compiled[2 * e + 1](*states[e], x, state, record, *args), record, e)

            with programs[0].context(), self._precision():
                return common.denoise_loop(step, (x, state) if cache is None else (x, state, None, None),
                                           request.steps, on_step, latents=lambda carried: carried[0])

        # a threshold's schedule runs each expert's first step in full
        firsts = frozenset(i for i in range(request.steps) if i == 0 or setup.expert[i] != setup.expert[i - 1])
        carried, timings = stepcache.run_loop(cache, request.steps, loop, always_full=firsts,
                                              identity=self.cache_identity(self.configs))
        x = carried[0]
        experts = {name: int(sum(1 for e in setup.expert if e == k)) for k, name in enumerate(family.experts(self.configs))}
        return {"latents": common.to_torch(x)}, timings | {"steps_per_expert": experts}

    def _denoise_setup(self, request: Request):
        """What the steps need from the host: the solver's tables (`request.solver`: UniPC from the
        checkpoint's scheduler, or `schedulers.uniform_euler`) with `request.shift` as its flow
        shift (the checkpoint's unless overridden), the initial
        latents drawn from `torch.Generator(seed)` in float32 as `WanPipeline` draws them, which
        expert runs each step, and whether guidance is on."""
        import types

        import jax.numpy as jnp
        import numpy as np
        import torch
        from diffusers.utils.torch_utils import randn_tensor

        scheduler = solver_scheduler(self.configs["scheduler"], request.solver, family.flow_shift(self.configs, request.shift))
        scheduler.set_timesteps(request.steps)
        tables = (schedulers.unipc_tables if request.solver == "unipc" else schedulers.flow_match_tables)(scheduler)
        boundary = family.boundary_timestep(self.configs)
        expert = np.array([0 if boundary is None or t >= boundary else 1 for t in scheduler.timesteps.tolist()])
        shape = family.latent_shape(request.frames, request.height, request.width, self.shapes)
        return types.SimpleNamespace(
            tables={k: jnp.asarray(v) for k, v in tables.items()}, expert=expert, guided=request.guidance > 1.0,
            expand=bool(self.configs.get("pipeline", {}).get("expand_timesteps")),
            latents=randn_tensor(shape, generator=torch.Generator().manual_seed(request.seed), dtype=torch.float32))

    def _denoise_programs(self, request: Request, setup) -> list:
        """The step as this stage compiles it, one per expert: the guidance pair as a batch on `dp`,
        the transformer over `tp`, the guidance and the UniPC step, latents and solver state
        donated. Arguments `(weights, buffers, latents, state, text, i, guidance)`, and for
        image-to-video the picture's `condition` (channels beside the latents) and, with an image
        encoder, its features `image_embeds` (one copy per sample, batch on `dp`). With a step cache
        (`request.step_cache`, `tpupedia.pipelines.stepcache`) two per expert: the full step, which
        also returns the cache, and the cached step, which takes it after the solver state."""
        import jax
        import jax.numpy as jnp
        import numpy as np
        from diffusers import WanTransformer3DModel
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from tpupedia import aot, torchax_utils

        backend = common.attention_backend(self.options.attention, self.mesh)
        tables, guided = setup.tables, setup.guided
        replicated = NamedSharding(self.mesh, P())
        batch = NamedSharding(self.mesh, P("dp")) if guided else replicated
        n = 2 if guided else 1
        shape = tuple(setup.latents.shape)
        tokens = shape[2] * (shape[3] // self.shapes.patch) * (shape[4] // self.shapes.patch)
        context = functools.partial(common.attention_installed, self.env, self.mesh, backend, self.block_sizes)
        names = family.experts(self.configs)

        def program(k: int, name: str):
            def load():
                transformer = self._load(WanTransformer3DModel, name)
                self._to_jax(name, transformer, self._rules(self.options.sharding))
                return transformer, torchax_utils.FunctionalModule(transformer, return_dict=False)

            transformer, fm = self.held("denoise", name, load)
            dtype = jnp.dtype(str(transformer.dtype).removeprefix("torch."))

            def forward(mode: str):
                """The transformer's forward, its blocks cached as `cache` says (`stepcache.traced`)."""
                if mode == "plain":
                    return lambda weights, buffers, cached, **kw: fm(weights, buffers, **kw)

                def method(m, cached, **kwargs):
                    with stepcache.traced(m, family, cache, mode, cached, calibrate=cache.calibrated) as record:
                        out = m(**kwargs)
                    return (out, record) if mode == "full" else out

                return torchax_utils.FunctionalModule(transformer, method, return_dict=False)

            def make_step(mode: str):
                run = forward(mode)

                def step(weights, buffers, latents, state, *rest):
                    self.traces["denoise"] += 1
                    cached, rest = (rest[0], rest[1:]) if mode == "cached" else (None, rest)
                    text, i, guidance, *picture = rest
                    x = latents.astype(dtype)  # `latents.to(transformer_dtype)`
                    if picture:  # image-to-video: the mask and the picture's latents as more channels
                        x = jnp.concatenate([x, picture[0].astype(dtype)], axis=1)
                    x = jax.lax.with_sharding_constraint(jnp.concatenate([x] * n), batch)
                    t = tables["timesteps"][i]
                    timestep = jnp.full((n, tokens), t) if setup.expand else jnp.broadcast_to(t, (n,))
                    extra = {"encoder_hidden_states_image": picture[1]} if len(picture) > 1 else {}
                    out = run(weights, buffers, cached, hidden_states=x, timestep=timestep, encoder_hidden_states=text,
                              **extra)
                    record = None
                    if mode == "full":  # (the transformer's outputs, what a cached step reuses)
                        out, record = out
                    out = out[0]
                    if guided:
                        uncond, cond = out[:1], out[1:]
                        out = uncond + guidance.astype(out.dtype) * (cond - uncond)
                    new = (schedulers.unipc_step(tables, i, latents, out, state) if request.solver == "unipc" else
                           (schedulers.flow_match_euler_step(tables, i, latents, out, keep_float32=True), state))
                    return new if record is None else (*new, record)

                return step

            text = (n, family.TEXT_TOKENS, self.configs[name]["text_dim"])
            f32 = aot.abstract(shape, jnp.float32, replicated)
            head = (*self._state(fm, name), f32, (f32, f32, f32))
            rest = (aot.abstract(text, self.dtype_jax, batch),
                    aot.abstract((), np.int32, replicated), aot.abstract((), np.float32, replicated))
            if request.image is not None:  # the condition: mask + picture latents, float32 as the stock pipeline keeps it
                channels = self.configs[name]["in_channels"] - shape[1]
                rest += (aot.abstract((1, channels, *shape[2:]), jnp.float32, replicated),)
                if self.configs[name].get("image_dim") is not None:
                    side = self.configs["image_encoder"]["image_size"]
                    patch = self.configs["image_encoder"]["patch_size"]
                    features = (n, (side // patch) ** 2 + 1, self.configs[name]["image_dim"])  # patches + class token
                    rest += (aot.abstract(features, self.dtype_jax, batch),)
            role = ("" if len(names) == 1 else ", high-noise expert" if k == 0 else ", low-noise expert")
            calls = int(sum(1 for e in setup.expert if e == k))
            latents = f"{'guidance pair, ' if guided else ''}{shape[2]}x{shape[3]}x{shape[4]} latents"
            weights = self.plans[name].bytes_per_device
            out = (replicated, (replicated,) * 3)
            if cache is None:
                return [aot.Program("denoise", f"denoising step{role} ({latents})", make_step("plain"), (*head, *rest),
                                    jit_kwargs={"donate_argnums": (2, 3), "out_shardings": out},
                                    weights_bytes=weights, calls=calls, component=name, context=context)]
            cache.check(request.steps, len(getattr(transformer, family.CACHE_BLOCKS)))
            full = make_step("full")
            record = None  # the cache's shapes (a trace of the full step) only where a plan compiles the cached step
            if self.abstract:
                with context():
                    record = jax.tree.map(lambda a: aot.abstract(a.shape, a.dtype, batch),
                                          jax.eval_shape(common.fresh_trace(full), *head, *rest)[-1])
            in_full = set(range(request.steps)) if cache.calibrated else set(cache.full_steps(request.steps))
            n_full = int(sum(1 for i, e in enumerate(setup.expert) if e == k and i in in_full))
            return [aot.Program("denoise", f"{cache.method} full step{role} ({latents})", full, (*head, *rest),
                                jit_kwargs={"donate_argnums": (2, 3), "out_shardings": (*out, batch)},
                                weights_bytes=weights, calls=n_full, component=name, context=context),
                    aot.Program("denoise", f"{cache.method} cached step{role} ({latents})", make_step("cached"),
                                (*head, record, *rest), jit_kwargs={"donate_argnums": (2, 3), "out_shardings": out},
                                weights_bytes=weights, calls=calls - n_full, component=name, context=context)]

        cache = request.step_cache
        return [p for k, name in enumerate(names) for p in program(k, name)]

    @property
    def dtype_jax(self):
        import jax.numpy as jnp

        return jnp.dtype(str(self.dtype).removeprefix("torch."))

    # -- stage 3 ---------------------------------------------------------------------------
    def _decode_programs(self, request: Request) -> list:
        """The decode stage's programs: the VAE's first, second and later latent frames, each on
        one chip with its causal cache (`decode_programs`)."""
        return decode_programs(self.configs["vae"], self.shapes.latent_frames(request.frames), request.height,
                               request.width, decoding.decode_mesh(self.mesh), dtype=self.vae_dtype(request))

    def _decode(self, request: Request, latents) -> tuple[dict, dict]:
        """Latents -> frames, float32 (F, H, W, 3) in [0, 1] (diffusers' `output_type="np"`)."""
        import torch
        from diffusers import AutoencoderKLWan
        from diffusers.video_processor import VideoProcessor

        chips, dtype = decoding.decode_mesh(self.mesh), self.component_dtype("vae", request)

        def load():
            vae = family.make_vae_jit_friendly(checkpoints.load_component(AutoencoderKLWan, self.source, "vae",
                                                                          dtype=dtype))
            self._to_jax("vae", vae, mesh=chips)  # a copy on each of the host's chips
            return vae

        vae = self.held("decode", ("vae", dtype), load)
        config = vae.config
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(vae.dtype)
        std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(vae.dtype)
        z = latents.to(vae.dtype) / std + mean  # `WanPipeline`'s de-normalisation, on the host
        start = time.perf_counter()
        with self._precision():
            video = decode_frames(vae, z, self.env, self.held("decode", ("frames", dtype), lambda: {}), self.traces)
        seconds = time.perf_counter() - start
        frames = VideoProcessor(vae_scale_factor=self.shapes.spatial).postprocess_video(video.float(), output_type="np")[0]
        return {"frames": torch.from_numpy(frames.astype("float32"))}, {"first_s": seconds}


# --- the VAE, a chunk of frames at a time, its cache as arguments -----------------------------------

def _frame(vae, x, tensors, markers, first, layouts, part="decoder"):
    """One chunk through the VAE with its causal cache rebuilt from its `tensors` and static
    `markers` ("T" a tensor, "N" `None`, "R" the string "Rep") and taken apart again after:
    `part="decoder"`, one latent frame through `post_quant_conv` and the decoder
    (`AutoencoderKLWan._decode`'s loop body); `"encoder"`, pixel frames through the encoder and
    `quant_conv` (`_encode`'s loop body; `quant_conv` is 1x1x1, so per chunk it gives what it gives
    on their concatenation). `layouts` records the markers the call leaves, by the markers it was
    given (they depend on nothing else)."""
    import torch

    it = iter(tensors)
    cache = [next(it) if m == "T" else (None if m == "N" else "Rep") for m in markers]
    if part == "decoder":
        out = vae.decoder(vae.post_quant_conv(x), feat_cache=cache, feat_idx=[0], first_chunk=first)
    else:
        out = vae.quant_conv(vae.encoder(x, feat_cache=cache, feat_idx=[0]))
    layouts[(markers, first)] = tuple("T" if torch.is_tensor(c) else ("N" if c is None else "R") for c in cache)
    return out, [c for c in cache if torch.is_tensor(c)]


def _frame_fn(vae, layouts: dict, traces: dict | None = None, part: str = "decoder"):
    """`fn(weights, buffers, x, tensors, markers, first)` of `_frame`, a pure JAX function; each
    trace counted in `traces` under the stage that runs `part` ("decode" or "image")."""
    from tpupedia import torchax_utils

    fm = torchax_utils.FunctionalModule(vae, lambda m, *a: _frame(m, *a, layouts, part))
    stage = "decode" if part == "decoder" else "image"

    def fn(weights, buffers, x, tensors, markers, first):
        if traces is not None:
            traces[stage] = traces.get(stage, 0) + 1
        return fm(weights, buffers, x, tensors, markers, first)

    return fm, fn


def _chunks(frames: int, chunk: int) -> list[tuple[int, int]]:
    """`(start, stop)` of each encoder call over `frames` pixel frames: the first frame alone, then
    `chunk` at a time (`AutoencoderKLWan._encode`; `chunk` is the VAE's temporal compression, 4)."""
    return [(0, 1)] + [(start, start + chunk) for start in range(1, frames, chunk)]


def _through_cache(vae: Any, part: str, pieces: Any, env: Any, held: dict, traces: dict | None) -> Any:
    """Each of `pieces` (jax arrays: chunks of pixel frames, or latent frames) through `_frame` in
    order, the causal cache carried from one call to the next as arguments; the outputs joined
    on the frame axis (a jax array). One jitted function per `part`, kept in `held` between calls;
    it compiles once per cache layout (three in all). What `encode_frames` and `decode_frames` share."""
    import jax
    import jax.numpy as jnp

    if "fn" not in held:
        layouts: dict = {}
        fm, fn = _frame_fn(vae, layouts, traces, part=part)
        held.update(fm=fm, layouts=layouts, fn=jax.jit(fn, static_argnums=(4, 5)))
    fm, layouts, fn = held["fm"], held["layouts"], held["fn"]
    weights, buffers = fm.state()
    markers, tensors, outs = ("N",) * vae._cached_conv_counts[part], [], []
    with env:
        for k, piece in enumerate(pieces):
            out, tensors = fn(weights, buffers, piece, tensors, markers, k == 0)
            markers = layouts[(markers, k == 0)]
            outs.append(out)
        return jnp.concatenate(outs, axis=2)


def encode_frames(vae: Any, video: Any, env: Any, held: dict, traces: dict | None = None) -> Any:
    """`AutoencoderKLWan._encode(video)` (CPU torch pixels in [-1, 1], `vae` placed in the torchax
    environment): the posterior's moments, `(1, 2 z_dim, latent frames, h, w)`, each chunk of
    frames one call of a jitted program (three programs: the first frame, the second chunk, the
    rest). `held` keeps the jitted function between calls. Returns CPU torch."""
    import jax

    if vae.config.patch_size is not None:  # Wan 2.2 TI2V's VAE folds 2x2 pixels into channels first
        from diffusers.models.autoencoders.autoencoder_kl_wan import patchify

        video = patchify(video, patch_size=vae.config.patch_size)
    pixels = common.to_jax_array(video)
    spans = _chunks(pixels.shape[2], vae.config.scale_factor_temporal or 4)
    moments = _through_cache(vae, "encoder", (pixels[:, :, a:b] for a, b in spans), env, held, traces)
    return common.to_torch(jax.block_until_ready(moments))


def decode_frames(vae: Any, z: Any, env: Any, held: dict, traces: dict | None = None) -> Any:
    """`AutoencoderKLWan.decode(z).sample` (z: de-normalised CPU torch latents, `vae` placed in
    the torchax environment), each latent frame one call of a jitted program; three programs in
    all (the first frame, the second, the rest: the cache's layout settles after two). `held`
    keeps the jitted function between calls (a batch). Returns CPU torch, clamped to [-1, 1]
    and unpatchified as diffusers returns it."""
    import jax
    import jax.numpy as jnp
    import torch

    frames = common.to_jax_array(z)
    video = _through_cache(vae, "decoder", (frames[:, :, i:i + 1] for i in range(frames.shape[2])), env, held, traces)
    video = common.to_torch(jax.block_until_ready(jnp.clip(video, -1.0, 1.0)))
    if vae.config.patch_size is not None:
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        video = torch.clamp(unpatchify(video, patch_size=vae.config.patch_size), min=-1.0, max=1.0)
    return video


def _abstract_vae(vae_config: dict, dtype: Any):
    """`AutoencoderKLWan` built on `meta` from `vae_config` in `dtype` (a jnp dtype), made jit-friendly."""
    import torch
    from diffusers import AutoencoderKLWan

    with torch.device("meta"):
        vae = AutoencoderKLWan.from_config({k: v for k, v in vae_config.items() if not k.startswith("_")})
    return family.make_vae_jit_friendly(vae.to(getattr(torch, dtype.name)).eval())


def _cache_programs(vae: Any, part: str, mesh: Any, dtype: Any, stage: str,
                    pieces: list[tuple[tuple[int, ...], str, int]]) -> list:
    """The programs `_through_cache` compiles for `part`, one per `(input shape, name, calls)` of
    `pieces` (the first, the second and the later calls: the cache's three layouts), on the chips
    of `mesh`, a copy of the VAE and of the input on each; the cache's shapes come from tracing
    each program on shapes only. What `encode_programs` and `decode_programs` share."""
    import jax

    from tpupedia import aot

    layouts: dict = {}
    fm, fn = _frame_fn(vae, layouts, part=part)
    state = decoding.replicated(mesh, fm.abstract_state())
    markers, tensors, programs = ("N",) * vae._cached_conv_counts[part], [], []
    for k, (shape, name, calls) in enumerate(pieces):
        args = (*state, decoding.replicated(mesh, jax.ShapeDtypeStruct(shape, dtype)), decoding.replicated(mesh, tensors))
        run = lambda *a, _m=markers, _f=k == 0: fn(*a, _m, _f)  # noqa: E731 - the markers fixed per program
        programs.append(aot.Program(stage, name, run, args, weights_bytes=decoding.nbytes(state), calls=calls,
                                    component="vae"))
        _, tensors = jax.eval_shape(run, *args)
        markers = layouts[(markers, k == 0)]
    return programs


def encode_programs(vae_config: dict, frames: int, height: int, width: int, mesh: Any, *,
                    dtype: Any = "bfloat16") -> list:
    """The encoder programs of Wan's `image` stage (image-to-video) for the picture and black
    frames, `frames` pixel frames of `height` x `width`, on the chips of `mesh` (a
    `decoding.decode_mesh`), a copy of the VAE and of the chunk on each: the first frame, the second
    chunk, and the later chunks (x their count), as `encode_frames` runs them. Raises
    `PipelineError` for bad frames or sizes."""
    import jax.numpy as jnp

    dtype = jnp.dtype(dtype)
    vae = _abstract_vae(vae_config, dtype)
    ratio, chunk = vae.config.scale_factor_spatial or 8, vae.config.scale_factor_temporal or 4
    if frames < 1 or (frames - 1) % chunk:
        raise PipelineError(f"frames={frames}: the VAE encodes {chunk}n+1 frames")
    decoding.check_decode("Wan", 1, height, width, ratio)
    patch = vae.config.patch_size or 1
    spans = _chunks(frames, chunk)
    pieces = []
    for k, (start, stop) in enumerate(spans[:3]):
        calls = 1 if k < 2 else len(spans) - 2
        which = ("first frame (the picture)", "second chunk of frames", "later chunks of frames")[k]
        n = stop - start
        pieces.append(((1, 3 * patch**2, n, height // patch, width // patch),
                       f"VAE encode, {which} ({n} frame{'s' if n > 1 else ''} at {width}x{height}, x {calls})", calls))
    return _cache_programs(vae, "encoder", mesh, dtype, "image", pieces)


def decode_programs(vae_config: dict, latent_frames: int, height: int, width: int, mesh: Any, *,
                    dtype: Any = "bfloat16") -> list:
    """The decoder programs of Wan's `decode` stage for a `height` x `width` video decoded from
    `latent_frames` latent frames, on the chips of `mesh` (a `decoding.decode_mesh`), a copy of the
    VAE and of the latent frame on each: the first frame, the second, and the later frames (x
    their count). The VAE is built on `meta` from `vae_config`; the cache's shapes come from
    tracing the decoder on shapes only. Raises `PipelineError` for bad frames or sizes."""
    import jax.numpy as jnp

    dtype = jnp.dtype(dtype)
    vae = _abstract_vae(vae_config, dtype)
    ratio = vae.config.scale_factor_spatial or 8
    decoding.check_decode("Wan", latent_frames, height, width, ratio)
    hw = (height // ratio, width // ratio)
    pieces = []
    for k in range(min(latent_frames, 3)):
        calls = 1 if k < 2 else latent_frames - 2
        which = ("first latent frame", "second latent frame", "later latent frames")[k]
        pieces.append(((1, vae.config.z_dim, 1, *hw), f"VAE decode, {which} ({decoding.where(mesh.size, *hw, hw)}, x {calls})",
                       calls))
    return _cache_programs(vae, "decoder", mesh, dtype, decoding.STAGE, pieces)


def solver_scheduler(config: dict, solver: str, shift: float | None) -> Any:
    """The diffusers scheduler `solver` names, from the checkpoint's scheduler `config` with `shift`
    as its flow shift (`None`: the config's): `UniPCMultistepScheduler.from_config(config,
    flow_shift=shift)` as diffusers' Wan example rebuilds it, or `schedulers.uniform_euler`."""
    from diffusers import UniPCMultistepScheduler

    config = {k: v for k, v in dict(config).items() if not k.startswith("_")}
    shift = family.flow_shift({"scheduler": config}, shift)
    if solver == "euler":
        return schedulers.uniform_euler(config.get("num_train_timesteps", 1000), shift)
    return UniPCMultistepScheduler.from_config(config, flow_shift=shift)


def stock(source: str, request: Request, dtype: Any = None) -> tuple[Any, dict[str, Any]]:
    """Stock diffusers `WanPipeline` (`WanImageToVideoPipeline` for a request with a picture, read
    as `diffusers.utils.load_image` reads it) loaded from `source` (float32 unless `dtype`;
    `family.FLOAT32_COMPONENTS` in float32 whatever `dtype`, passed in as diffusers' examples pass
    a float32 VAE, the VAE in `request.vae_dtype` where set), its scheduler rebuilt with `request.shift`
    where given (`UniPCMultistepScheduler.from_config(pipe.scheduler.config, flow_shift=shift)`,
    as the example sets it) or replaced by `request.solver`'s (`solver_scheduler`), and the keyword arguments of the call that makes `request`'s video
    from the same seed (both experts' scales), frames as `output_type="np"`: what the parity tests
    compare with and `tpupedia bench generate` times."""
    import torch
    from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanPipeline
    from transformers import CLIPVisionModel

    from tpupedia import pictures

    i2v = request.image is not None
    kept = {}  # as the examples load them: `torch_dtype=torch.float32`, passed to the bf16 pipeline
    if (dtype or torch.float32) != torch.float32:
        configs = family.component_configs(source)
        classes = {"vae": AutoencoderKLWan, "image_encoder": CLIPVisionModel}
        run = str(dtype).removeprefix("torch.")
        kept = {name: classes[name].from_pretrained(
                    source, subfolder=name, use_safetensors=True,
                    dtype=getattr(torch, family.component_dtype(name, run, request.vae_dtype)))
                for name in family.FLOAT32_COMPONENTS if name in configs}
    pipe = common.load_stock(WanImageToVideoPipeline if i2v else WanPipeline, source, dtype, **kept)
    if request.shift is not None or request.solver != "unipc":
        pipe.scheduler = solver_scheduler(pipe.scheduler.config, request.solver, request.shift)
    picture = {"image": pictures.read(request.image)} if i2v else {}
    return pipe, picture | dict(prompt=request.prompt, negative_prompt=request.negative_prompt, num_frames=request.frames,
                      height=request.height, width=request.width, num_inference_steps=request.steps,
                      guidance_scale=request.guidance, guidance_scale_2=request.guidance_2,
                      generator=torch.Generator().manual_seed(request.seed), output_type="np")

PIPELINE = Wan
run = functools.partial(common.run, Wan)
run.__doc__ = common.run.__doc__
run_batch = functools.partial(common.run_batch, Wan)
run_batch.__doc__ = common.run_batch.__doc__
