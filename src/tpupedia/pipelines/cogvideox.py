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

import functools
import time
from typing import Any, Callable

from tpupedia.models import cogvideox as family
from tpupedia.pipelines import common
from tpupedia.pipelines.common import (  # this family's public names, shared by every family
    Options, PipelineError, Request, StageReport, attention_backend, default_mesh_shape, parse_mesh, torch_dtype)

__all__ = ["PipelineError", "Request", "Options", "validate", "parse_mesh", "default_mesh_shape", "settings",
           "CogVideoX", "run", "run_batch", "StageReport", "attention_backend", "torch_dtype"]

VAES = ("flax", "torchax")


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
    out = {"model": family.FAMILY, "source": source_label, "dtype": dtype,
           "text_encoder": common.config_fingerprint(configs["text_encoder"]),
           "prompt": request.prompt, "negative_prompt": request.negative_prompt}
    if stage in ("denoise", "decode"):
        out |= {"transformer": common.config_fingerprint(configs["transformer"]),
                "scheduler": common.config_fingerprint(configs["scheduler"]),
                "frames": request.frames, "height": request.height, "width": request.width,
                "steps": request.steps, "guidance": request.guidance, "seed": request.seed}
    if stage == "decode":
        out |= {"vae_config": common.config_fingerprint(configs["vae"]), "vae": vae}
    return out


class CogVideoX(common.StagedPipeline):
    """The three CogVideoX stages over one checkpoint (see the module docstring)."""

    family = family
    vaes = VAES

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.traces = {"text": 0, "denoise": 0}

    @classmethod
    def settings_for(cls, source_label, configs, request, options, dtype, stage) -> dict:
        return settings(stage, source_label, configs, request, vae=cls.vae_choice(options),
                        dtype=str(dtype).removeprefix("torch."))

    # -- stage 1 ---------------------------------------------------------------------------
    def _encode_text(self, request: Request) -> tuple[dict, dict]:
        """T5 embeddings of the negative and the positive prompt, as `_get_t5_prompt_embeds`
        computes them (padding to the checkpoint's text length, truncation, special tokens)."""
        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P
        from transformers import AutoTokenizer, T5EncoderModel

        from tpupedia import torchax_utils

        length = self.configs["transformer"]["max_text_seq_length"]
        replicated = NamedSharding(self.mesh, P())

        def load():
            tokenizer = AutoTokenizer.from_pretrained(self.source, subfolder="tokenizer")
            encoder = T5EncoderModel.from_pretrained(self.source, subfolder="text_encoder", dtype=self.dtype,
                                                     use_safetensors=True).eval()
            self._to_jax("text_encoder", encoder, self._text_rules("text_encoder"))
            fm = torchax_utils.FunctionalModule(encoder, return_dict=False)

            def embed(weights, buffers, ids):
                self.traces["text"] += 1
                return fm(weights, buffers, input_ids=ids)[0]

            return tokenizer, encoder, jax.jit(embed, out_shardings=replicated), fm.state()  # readable by every process

        tokenizer, _, compiled, (weights, buffers) = self.held("text", "t5", load)
        results, times = {}, []
        with self._precision():
            for name, text in (("negative_prompt_embeds", request.negative_prompt), ("prompt_embeds", request.prompt)):
                ids = tokenizer([text], padding="max_length", max_length=length, truncation=True,
                                add_special_tokens=True, return_tensors="pt").input_ids
                out, seconds = common.timed(lambda: compiled(weights, buffers, jax.device_put(ids.numpy(), replicated)),
                                      jax.block_until_ready)
                results[name] = common.to_torch(out).to(self.dtype)
                times.append(seconds)
        return results, {"first_s": times[0], "steady_s": times[1]}

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
        from diffusers import CogVideoXDPMScheduler, CogVideoXTransformer3DModel
        from diffusers.utils.torch_utils import randn_tensor
        from jax.sharding import NamedSharding, PartitionSpec as P

        from tpupedia import torchax_utils
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
        facts = self.shapes
        frames, padding = family.padded_latent_frames(request.frames, facts)
        shape = (1, frames, facts.latent_channels, *facts.latent_size(request.height, request.width))
        latents = randn_tensor(shape, generator=generator, dtype=self.dtype) * scheduler.init_noise_sigma
        cos, sin = family.rotary_embeddings(cfg, request.height, request.width, frames, facts)

        def load():
            transformer = CogVideoXTransformer3DModel.from_pretrained(
                self.source, subfolder="transformer", dtype=self.dtype, use_safetensors=True).eval()
            family.make_jit_friendly(transformer)  # RoPE without in-place writes (see its docstring)
            self._to_jax("transformer", transformer, self._rules(self.options.sharding))
            return transformer, torchax_utils.FunctionalModule(transformer, return_dict=False)

        _, fm = self.held("denoise", "transformer", load)
        env, mesh = self.env, self.mesh
        batch = NamedSharding(mesh, P("dp")) if guided else NamedSharding(mesh, P())
        replicated = NamedSharding(mesh, P())

        text = torch.cat([embeds["negative_prompt_embeds"], embeds["prompt_embeds"]]) if guided else embeds["prompt_embeds"]
        text = jax.device_put(common.to_jax_array(text), batch)
        cos, sin = (jax.device_put(common.to_jax_array(a), replicated) for a in (cos, sin))
        dtype = common.to_jax_array(latents).dtype

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
        # reuses the first step's program; they are donated, so XLA updates them in place. The
        # step depends on the schedule (steps) and on guidance being on; a batch keeps one per pair.
        compiled = self.held("denoise", ("step", request.steps, guided), lambda: jax.jit(
            step, donate_argnums=(2, 3), out_shardings=(replicated, replicated)))
        weights, buffers = fm.state()
        x = jax.device_put(common.to_jax_array(latents), replicated)
        old = jax.device_put(jnp.zeros(shape, jnp.float32), replicated)
        step_times = []
        backend = attention_backend(self.options.attention)
        with torchax_utils.restoring_ops(env), self._precision():
            common.install_attention(env, mesh, backend)
            for i in range(len(timesteps)):
                noise = (schedulers.dpm_noise(generator, shape, self.dtype, host_tables, i)
                         if dpm else np.zeros((), np.float32))  # DDIM draws no noise
                (x, old), seconds = common.timed(  # host scalars and noise: replicated inputs on every process
                    lambda: compiled(weights, buffers, x, old, text, cos, sin, np.int32(i),
                                     np.float32(request.guidance), noise),
                    jax.block_until_ready)
                step_times.append(seconds)
                if on_step:
                    on_step(i, x)
        steady = float(np.median(step_times[1:])) if len(step_times) > 1 else step_times[0]
        return {"latents": common.to_torch(x).to(self.dtype)}, {"first_s": step_times[0], "steady_s": steady,
                                                          "steps": len(step_times), "padding_frames": padding}

    # -- stage 3 ---------------------------------------------------------------------------
    def _decode(self, request: Request, latents) -> tuple[dict, dict]:
        """Latents -> frames, float32 (F, H, W, 3) in [0, 1] (diffusers' `output_type="np"`)."""
        import jax
        import torch
        from diffusers import AutoencoderKLCogVideoX
        from diffusers.video_processor import VideoProcessor

        _, padding = family.padded_latent_frames(request.frames, self.shapes)

        def load():  # (the decoder this run uses, the VAE's scaling factor)
            vae = AutoencoderKLCogVideoX.from_pretrained(self.source, subfolder="vae", dtype=self.dtype,
                                                         use_safetensors=True).eval()
            if self.vae == "flax":
                import jax.numpy as jnp

                from tpupedia.models import cogvideox_vae_convert as convert

                dtype = jnp.dtype(str(self.dtype).removeprefix("torch."))
                return convert.from_diffusers(vae, dtype=dtype), vae.config.scaling_factor
            from tpupedia import torchax_utils

            self._to_jax("vae", vae, on_mesh=False)
            vae.decoder = torchax_utils.JitModule(vae.decoder)
            return vae, vae.config.scaling_factor

        vae, scaling = self.held("decode", self.vae, load)
        z = latents[:, padding:].permute(0, 2, 1, 3, 4) / scaling
        start = time.perf_counter()
        with self._precision(), torch.no_grad():
            if self.vae == "flax":
                video = common.to_torch(jax.block_until_ready(vae.decode(common.to_jax_array(z))))
            else:
                with self.env:
                    video = vae.decode(z.to("jax")).sample
                    video = video.to("cpu")
        seconds = time.perf_counter() - start
        frames = VideoProcessor(vae_scale_factor=self.shapes.spatial).postprocess_video(
            video.float(), output_type="np")[0]
        return {"frames": torch.from_numpy(frames.astype("float32"))}, {"first_s": seconds}


PIPELINE = CogVideoX
run = functools.partial(common.run, CogVideoX)
run.__doc__ = common.run.__doc__
run_batch = functools.partial(common.run_batch, CogVideoX)
run_batch.__doc__ = common.run_batch.__doc__
