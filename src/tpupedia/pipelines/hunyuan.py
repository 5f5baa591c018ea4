"""HunyuanVideo-1.5 text-to-video in three stages, under torchax, on a mesh.

The same path as CogVideoX (`tpupedia.pipelines.common`, notebook 06), with what this model needs:

1. `encode_text`: the Qwen2.5-VL text model over diffusers' chat template, jitted and returning
   only the hidden state diffusers uses (the third from last, the template's first 108 tokens
   cropped), and the ByT5 glyph encoder only when the prompt quotes text (otherwise zeros and
   an all-false mask, as diffusers does) -> `text.safetensors` (8 tensors: embeddings and masks
   of both encoders, for the prompt and the negative prompt).
2. `denoise`: flow-matching Euler steps as a pure function of the traced step index (tables from
   the checkpoint's own `FlowMatchEulerDiscreteScheduler`, shift included); the guidance pair as
   one batch of 2 on `dp` (diffusers' guider runs two batch-1 forwards); the transformer's
   jit-friendly forward with the padding mask kept as a vector (`tpupedia.models.hunyuan`);
   optional DeepCache (`tpupedia.pipelines.deepcache`): two compiled programs, full and cached,
   picked per step on the host -> `denoise.safetensors`.
3. `decode`: the HunyuanVideo-1.5 VAE under torchax with its decoder jitted (each spatial tile
   with `vae_tiling`) -> `decode.safetensors` holding `frames`, float32 (F, H, W, 3) in [0, 1].

Initial latents are drawn as diffusers draws them, from a CPU `torch.Generator(seed)`, so the same
weights and seed give the stock `HunyuanVideo15Pipeline`'s video (tests/test_pipeline_hunyuan.py).
Introduced in notebook 07; `tpupedia generate hunyuan` runs the same functions.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

from tpupedia.models import hunyuan as family
from tpupedia.pipelines import common
from tpupedia.pipelines.deepcache import Schedule
from tpupedia.pipelines.common import Options, PipelineError, StageReport  # noqa: F401 - public names

__all__ = ["Request", "Options", "PipelineError", "Hunyuan", "validate", "resolve", "settings", "text_settings",
           "run", "run_batch", "StageReport"]


@dataclass(frozen=True)
class Request(common.Request):
    """What to generate. `guidance` and `shift` of `None` take the checkpoint's (its guider's
    `guidance_scale`, its scheduler's `shift`), as diffusers does; `deepcache` of `None` is off."""

    frames: int = 121
    fps: int = 24
    guidance: float | None = None
    shift: float | None = None
    deepcache: Schedule | None = None
    vae_tiling: bool = False
    """Decode in overlapping spatial tiles (diffusers' `enable_tiling`: 256-pixel tiles blended over
    a quarter): what fits 720p into one chip's memory; the blend changes pixels slightly."""


def validate(request: Request, options: Options, device_count: int | None = None,
             configs: dict[str, dict] | None = None) -> None:
    """Refuse what cannot run, naming the bad value and what is allowed. Loads no model; with
    `configs` (`family.component_configs`), the rules use that checkpoint's shape facts and guider."""
    Hunyuan.validate(request, options, device_count, configs)


def resolve(request: Request, configs: dict[str, dict]) -> Request:
    """`request` with `guidance` and `shift` taken from the checkpoint's configs where unset."""
    guidance = configs["guider"].get("guidance_scale", 7.5) if request.guidance is None else request.guidance
    shift = configs["scheduler"].get("shift", 1.0) if request.shift is None else request.shift
    return dataclasses.replace(request, guidance=float(guidance), shift=float(shift))


def _guidance_on(request: Request, configs: dict) -> bool:
    """Whether the guider runs the guidance pair (`ClassifierFreeGuidance._is_cfg_enabled` at
    encode time): enabled and the scale not the identity (1, or 0 with the original formulation)."""
    guider = configs["guider"]
    identity = 0.0 if guider.get("use_original_formulation", False) else 1.0
    return bool(guider.get("enabled", True)) and not math.isclose(request.guidance, identity)


def text_settings(source_label: str, configs: dict[str, dict], request: Request, dtype: str) -> dict:
    """What the text stage's tensors depend on."""
    return {"model": family.FAMILY, "source": source_label, "dtype": dtype,
            "text_encoder": common.config_fingerprint(configs["text_encoder"]),
            "text_encoder_2": common.config_fingerprint(configs["text_encoder_2"]),
            "prompt": request.prompt, "negative_prompt": request.negative_prompt,
            "guided": _guidance_on(request, configs)}


def settings(stage: str, source_label: str, configs: dict[str, dict], request: Request, *, dtype: str,
             vae: str = "torchax") -> dict:
    """Every setting that changes the tensors of `stage` (and of the stages before it); `request`
    resolved (`resolve`). Attention backend, sharding and mesh change speed, not the video."""
    out = text_settings(source_label, configs, request, dtype)
    if stage in ("denoise", "decode"):
        out |= {"transformer": common.config_fingerprint(configs["transformer"]),
                "scheduler": common.config_fingerprint(configs["scheduler"]),
                "guider": common.config_fingerprint(configs["guider"]),
                "frames": request.frames, "height": request.height, "width": request.width,
                "steps": request.steps, "guidance": request.guidance, "shift": request.shift, "seed": request.seed,
                "deepcache": None if request.deepcache is None else dataclasses.asdict(request.deepcache)}
    if stage == "decode":
        out |= {"vae_config": common.config_fingerprint(configs["vae"]), "vae": vae, "vae_tiling": request.vae_tiling}
    return out


def _prompt_defaults() -> dict[str, Any]:
    """diffusers' text settings for this pipeline: the system message, the 1000-token text
    length, the 108-token template crop and the layer offset, read from its own signature."""
    from diffusers import HunyuanVideo15Pipeline

    params = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters
    byt5 = inspect.signature(HunyuanVideo15Pipeline._get_byt5_prompt_embeds).parameters
    return {name: params[name].default for name in
            ("system_message", "tokenizer_max_length", "crop_start", "num_hidden_layers_to_skip")} | {
        "byt5_length": byt5["tokenizer_max_length"].default}


class Hunyuan(common.StagedPipeline):
    """The three HunyuanVideo-1.5 stages over one checkpoint (see the module docstring)."""

    family = family
    vaes = ("torchax",)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.traces = {"text": 0, "denoise": 0, "full": 0, "cached": 0}

    @classmethod
    def guidance_batch(cls, request: Request, configs: dict[str, dict] | None = None) -> int | None:
        """2 when the checkpoint's guider runs the guidance pair for this request, else 1; `None`
        without `configs` (the guider decides)."""
        return None if configs is None else 2 if _guidance_on(resolve(request, configs), configs) else 1

    @classmethod
    def validate(cls, request: Request, options: Options, device_count: int | None = None,
                 configs: dict[str, dict] | None = None, *, shape_rules: bool = True) -> None:
        super().validate(request, options, device_count, configs, shape_rules=shape_rules)
        if request.shift is not None and (not math.isfinite(request.shift) or request.shift <= 0):
            raise PipelineError(f"shift={request.shift} must be a finite number > 0 (1 leaves the schedule unshifted)")
        if request.deepcache is not None:
            request.deepcache.check(request.steps)

    @classmethod
    def settings_for(cls, source_label, configs, request, options, dtype, stage) -> dict:
        return settings(stage, source_label, configs, resolve(request, configs), dtype=str(dtype).removeprefix("torch."),
                        vae=cls.vae_choice(options))

    # -- stage 1 ---------------------------------------------------------------------------
    def _encode_text(self, request: Request) -> tuple[dict, dict]:
        """Qwen2.5-VL and ByT5 embeddings with their masks, for the prompt and (with guidance)
        the negative prompt, as `HunyuanVideo15Pipeline.encode_prompt` computes them."""
        import jax
        import torch
        from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import (extract_glyph_texts,
                                                                                  format_text_input)
        from jax.sharding import NamedSharding, PartitionSpec as P
        from transformers import AutoTokenizer, Qwen2_5_VLTextModel, T5EncoderModel

        from tpupedia import torchax_utils

        request = resolve(request, self.configs)
        d = _prompt_defaults()
        crop, layer = d["crop_start"], -(d["num_hidden_layers_to_skip"] + 1)
        replicated = NamedSharding(self.mesh, P())

        def load():
            tokenizer = AutoTokenizer.from_pretrained(self.source, subfolder="tokenizer")
            encoder = Qwen2_5_VLTextModel.from_pretrained(self.source, subfolder="text_encoder", dtype=self.dtype,
                                                          use_safetensors=True).eval()
            self._to_jax("text_encoder", encoder, self._text_rules("text_encoder"))

            def hidden(module, ids, mask):  # the one hidden state diffusers keeps, selected inside jit
                self.traces["text"] += 1
                out = module(input_ids=ids, attention_mask=mask, output_hidden_states=True)
                return out.hidden_states[layer][:, crop:]

            fm = torchax_utils.FunctionalModule(encoder, hidden)
            return tokenizer, encoder, jax.jit(fm, out_shardings=replicated), fm.state()

        tokenizer, _, qwen, qwen_state = self.held("text", "qwen", load)
        glyph = None  # the ByT5 encoder loads only for a prompt that quotes text
        prompts = {"": request.prompt}
        if _guidance_on(request, self.configs):
            prompts["negative_"] = request.negative_prompt
        results, times = {}, []
        with self._precision(), torchax_utils.restoring_ops(self.env):
            common.install_attention(self.env, self.mesh, "reference")  # masked rows -> 0, not NaN
            for prefix, text in prompts.items():
                tokens = tokenizer.apply_chat_template(
                    format_text_input([text], d["system_message"]), add_generation_prompt=True, tokenize=True,
                    return_dict=True, padding="max_length", max_length=d["tokenizer_max_length"] + crop,
                    truncation=True, return_tensors="pt")
                ids, mask = (jax.device_put(tokens[k].numpy(), replicated) for k in ("input_ids", "attention_mask"))
                embeds, seconds = common.timed(lambda: qwen(*qwen_state, ids, mask), jax.block_until_ready)
                times.append(seconds)
                results[f"{prefix}prompt_embeds"] = common.to_torch(embeds).to(self.dtype)
                results[f"{prefix}prompt_embeds_mask"] = tokens["attention_mask"][:, crop:].to(self.dtype)
                glyph_text = extract_glyph_texts(text)
                if glyph_text is None:
                    width = self.configs["text_encoder_2"]["d_model"]
                    results[f"{prefix}prompt_embeds_2"] = torch.zeros(1, d["byt5_length"], width, dtype=self.dtype)
                    results[f"{prefix}prompt_embeds_mask_2"] = torch.zeros(1, d["byt5_length"], dtype=self.dtype)
                    continue
                if glyph is None:
                    glyph = self.held("text", "byt5", lambda: self._glyph_encoder(T5EncoderModel, replicated))
                byt5_tokens = glyph[0](glyph_text, padding="max_length", max_length=d["byt5_length"], truncation=True,
                                       add_special_tokens=True, return_tensors="pt")
                out = glyph[1](*glyph[2], jax.device_put(byt5_tokens.input_ids.numpy(), replicated),
                               jax.device_put(byt5_tokens.attention_mask.float().numpy(), replicated))
                results[f"{prefix}prompt_embeds_2"] = common.to_torch(out).to(self.dtype)
                results[f"{prefix}prompt_embeds_mask_2"] = byt5_tokens.attention_mask.to(self.dtype)
        return results, {"first_s": times[0], "steady_s": times[-1]}

    def _glyph_encoder(self, cls, replicated):
        """`(tokenizer, jitted T5 encoder, its state, the encoder)` for the quoted text of a prompt."""
        import jax
        from transformers import AutoTokenizer

        from tpupedia import torchax_utils

        tokenizer = AutoTokenizer.from_pretrained(self.source, subfolder="tokenizer_2")
        encoder = cls.from_pretrained(self.source, subfolder="text_encoder_2", dtype=self.dtype,
                                      use_safetensors=True).eval()
        self._to_jax("text_encoder_2", encoder, self._text_rules("text_encoder_2"))
        fm = torchax_utils.FunctionalModule(encoder, lambda m, ids, mask: m(input_ids=ids, attention_mask=mask)[0])
        return tokenizer, jax.jit(fm, out_shardings=replicated), fm.state(), encoder

    # -- stage 2 ---------------------------------------------------------------------------
    def _denoise(self, request: Request, embeds: dict, on_step: Callable[[int, Any], None] | None = None) -> tuple[dict, dict]:
        """All steps through one compiled step (two with DeepCache: full and cached). Returns
        `{"latents": (1, C, T, h, w)}`. `on_step(i, latents)` is called after each step with its
        output, a jax array valid only during the call (the next step donates its buffer)."""
        import jax
        import jax.numpy as jnp
        import numpy as np
        import torch
        from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideo15Transformer3DModel
        from diffusers.utils.torch_utils import randn_tensor
        from jax.sharding import NamedSharding, PartitionSpec as P

        from tpupedia import attention, torchax_utils
        from tpupedia.pipelines import schedulers

        request = resolve(request, self.configs)
        guider = self.configs["guider"]
        if guider.get("guidance_rescale", 0.0):
            raise PipelineError(f"guider guidance_rescale={guider['guidance_rescale']}: only 0 (no rescale) is "
                                "implemented; the checkpoint's guider asks for more")
        guided = _guidance_on(request, self.configs)
        original = bool(guider.get("use_original_formulation", False))
        start, stop = int(guider.get("start", 0.0) * request.steps), int(guider.get("stop", 1.0) * request.steps)
        cfg_on = np.array([start <= i < stop for i in range(request.steps)])  # the guider's per-step range

        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(self.source, subfolder="scheduler",
                                                                    shift=request.shift)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, request.steps + 1)[:-1])  # as the pipeline does
        tables = {k: jnp.asarray(v) for k, v in schedulers.flow_match_tables(scheduler).items()}

        cfg = self.configs["transformer"]
        shape = family.latent_shape(request.frames, request.height, request.width, self.shapes)
        latents = randn_tensor(shape, generator=torch.Generator().manual_seed(request.seed), dtype=self.dtype)

        backend = common.attention_backend(self.options.attention)
        mesh, env = self.mesh, self.env

        def load():
            transformer = HunyuanVideo15Transformer3DModel.from_pretrained(
                self.source, subfolder="transformer", dtype=self.dtype, use_safetensors=True).eval()
            padded = jax.jit(functools.partial(
                attention.padded_attention, backend=backend, mesh=mesh if backend == "splash" else None,
                interpret=jax.default_backend() != "tpu", batch_axis="dp", head_axis="tp"))

            def attend(q, k, v, valid):  # torchax tensors in, torchax tensor out
                from torchax.interop import call_jax

                return call_jax(padded, q, k, v, valid)

            family.make_jit_friendly(transformer, attend)
            self._to_jax("transformer", transformer, self._rules(self.options.sharding))
            return transformer

        transformer = self.held("denoise", "transformer", load)
        if request.deepcache is not None:
            request.deepcache.check(request.steps, len(transformer.transformer_blocks))
        replicated = NamedSharding(mesh, P())
        batch = NamedSharding(mesh, P("dp")) if guided else replicated
        keys = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")
        text = [torch.cat([embeds[f"negative_{k}"], embeds[k]]) if guided else embeds[k] for k in keys]
        text = [jax.device_put(common.to_jax_array(t), batch) for t in text]
        dtype = common.to_jax_array(latents).dtype
        n = 2 if guided else 1
        image = jax.device_put(jnp.zeros((n, family.TEXT_SLOTS["image"][0], cfg["image_embed_dim"]), dtype), batch)

        def model_input(latents, i):
            x = jnp.concatenate([latents, jnp.zeros_like(latents), jnp.zeros_like(latents[:, :1])], axis=1)
            x = jax.lax.with_sharding_constraint(jnp.concatenate([x] * n), batch)
            return x, jnp.broadcast_to(tables["timesteps"][i].astype(dtype), (n,))  # diffusers: t in the latents' dtype

        def guide_and_step(latents, out, i, guidance, cfg_flag):
            if guided:
                uncond, cond = out[:1], out[1:]
                base = cond if original else uncond
                pred = (base.astype(jnp.float32) + guidance * (cond - uncond).astype(jnp.float32)).astype(out.dtype)
                pred = jnp.where(cfg_flag, pred, cond)
            else:
                pred = out
            return schedulers.flow_match_euler_step(tables, i, latents, pred)

        def plain(weights, buffers, latents, text, image, i, guidance, cfg_flag):
            self.traces["denoise"] += 1
            x, t = model_input(latents, i)
            out = fm_plain(weights, buffers, x, t, text[0], text[1], None, text[2], text[3], image)[0]
            return guide_and_step(latents, out, i, guidance, cfg_flag)

        def full(weights, buffers, latents, text, image, i, guidance, cfg_flag):
            self.traces["full"] += 1
            x, t = model_input(latents, i)
            out, cache = fm_full(weights, buffers, x, t, text[0], text[1], text[2], text[3], image)
            return guide_and_step(latents, out, i, guidance, cfg_flag), cache

        def cached(weights, buffers, latents, cache, text, image, i, guidance, cfg_flag):
            self.traces["cached"] += 1
            x, t = model_input(latents, i)
            out = fm_cached(weights, buffers, cache, x, t, text[1], text[3], image)
            return guide_and_step(latents, out, i, guidance, cfg_flag)

        fm_plain = torchax_utils.FunctionalModule(transformer, return_dict=False)
        schedule = request.deepcache
        if schedule is not None:
            tail = schedule.tail
            fm_full = torchax_utils.FunctionalModule(transformer, lambda m, *a: family.deepcache_full(m, tail, *a))
            fm_cached = torchax_utils.FunctionalModule(transformer, lambda m, *a: family.deepcache_cached(m, tail, *a))

        def programs():
            # Latents keep one (replicated) sharding in and out, so every step reuses the first step's
            # program; they are donated, so XLA updates them in place. The cache stays split on `dp`.
            return (jax.jit(plain, donate_argnums=(2,), out_shardings=replicated),
                    jax.jit(full, donate_argnums=(2,), out_shardings=(replicated, batch)),
                    jax.jit(cached, donate_argnums=(2,), out_shardings=replicated))

        # What the programs close over: the schedule (steps, shift), guidance on or off, DeepCache's tail.
        key = ("steps", request.steps, request.shift, guided, schedule.tail if schedule else None)
        compiled_plain, compiled_full, compiled_cached = self.held("denoise", key, programs)
        weights, buffers = fm_plain.state()
        x = jax.device_put(common.to_jax_array(latents), replicated)
        full_steps = set(schedule.full_steps(request.steps)) if schedule else set(range(request.steps))
        step_times, cache = [], None
        with torchax_utils.restoring_ops(env), self._precision():
            common.install_attention(env, mesh, backend)  # the token refiner's small masked attention
            for i in range(request.steps):
                args = (np.int32(i), np.float32(request.guidance), np.bool_(cfg_on[i]))
                if schedule is None:
                    call = functools.partial(compiled_plain, weights, buffers, x, text, image, *args)
                elif i in full_steps:
                    call = functools.partial(compiled_full, weights, buffers, x, text, image, *args)
                else:
                    call = functools.partial(compiled_cached, weights, buffers, x, cache, text, image, *args)
                out, seconds = common.timed(call, jax.block_until_ready)
                x, cache = out if (schedule is not None and i in full_steps) else (out, cache)
                step_times.append(seconds)
                if on_step:
                    on_step(i, x)
        steady = float(np.median(step_times[1:])) if len(step_times) > 1 else step_times[0]
        timings = {"first_s": step_times[0], "steady_s": steady, "steps": len(step_times),
                   "full_steps": len(full_steps), "step_s": [round(s, 6) for s in step_times]}
        return {"latents": common.to_torch(x).to(self.dtype)}, timings

    # -- stage 3 ---------------------------------------------------------------------------
    def _decode(self, request: Request, latents) -> tuple[dict, dict]:
        """Latents -> frames, float32 (F, H, W, 3) in [0, 1] (diffusers' `output_type="np"`)."""
        import torch
        from diffusers import AutoencoderKLHunyuanVideo15
        from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

        from tpupedia import torchax_utils

        def load():
            vae = AutoencoderKLHunyuanVideo15.from_pretrained(self.source, subfolder="vae", dtype=self.dtype,
                                                              use_safetensors=True).eval()
            self._to_jax("vae", vae, on_mesh=False)
            vae.decoder = torchax_utils.JitModule(vae.decoder)
            return vae

        vae = self.held("decode", "vae", load)
        vae.enable_tiling() if request.vae_tiling else vae.disable_tiling()
        z = latents.to(vae.dtype) / vae.config.scaling_factor
        start = time.perf_counter()
        with self._precision(), torch.no_grad(), self.env:
            video = vae.decode(z.to("jax")).sample.to("cpu")
        seconds = time.perf_counter() - start
        frames = HunyuanVideo15ImageProcessor(vae_scale_factor=vae.spatial_compression_ratio).postprocess_video(
            video, output_type="np")[0]
        return {"frames": torch.from_numpy(frames.astype("float32"))}, {"first_s": seconds}


PIPELINE = Hunyuan
run = functools.partial(common.run, Hunyuan)
run.__doc__ = common.run.__doc__
run_batch = functools.partial(common.run_batch, Hunyuan)
run_batch.__doc__ = common.run_batch.__doc__
