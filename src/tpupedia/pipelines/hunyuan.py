"""HunyuanVideo-1.5 text-to-video in three stages, under torchax, on a mesh.

The same path as CogVideoX (`tpupedia.pipelines.common`, notebook `cogvideox_pipeline`), with what this model needs:

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

Image-to-video (`--image PICTURE`, an i2v checkpoint such as `FULL_ID_I2V`) adds an `image`
stage between text and denoise, as `HunyuanVideo15ImageToVideoPipeline` conditions: the video's
size is the bucket nearest the picture's aspect (`family.video_size`; `--width/--height` do not
apply), the picture resized and centre-cropped to it; SigLIP's last hidden state of the picture
fills the step's 729 image slots (zeros for text-to-video), and the VAE's posterior mean of the
picture, times its scaling factor, becomes the first latent frame of the condition channels,
with a mask of ones on that frame -> `image.safetensors`. A checkpoint with `use_meanflow` (the
step-distilled release) also gets the next step's timestep, `timestep_r`, as stock passes it.

Initial latents are drawn as diffusers draws them, from a CPU `torch.Generator(seed)`, so the same
weights and seed give the stock `HunyuanVideo15Pipeline`'s video (tests/test_pipeline_hunyuan.py)
and `HunyuanVideo15ImageToVideoPipeline`'s (tests/test_hunyuan_image_to_video.py).
Introduced in notebook `hunyuan_video` (image-to-video and DeepCache in notebook
`hunyuan_tuning_and_i2v`); `tpupedia generate hunyuan` runs the same functions.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from tpupedia import lora, quantize
from tpupedia.models import checkpoints
from tpupedia.models import hunyuan as family
from tpupedia.pipelines import common, decoding, stepcache
from tpupedia.pipelines.common import Options, PipelineError, StageReport
from tpupedia.pipelines.deepcache import UPSTREAM_DEFAULT, Schedule
from tpupedia.pipelines.deepcache import parse as parse_schedule

__all__ = ["Request", "Options", "PipelineError", "Hunyuan", "validate", "resolve", "settings", "text_settings",
           "prompt_defaults", "check_text_depth",
           "run", "run_batch", "stock", "StageReport"]


@dataclass(frozen=True)
class Request(common.Request):
    """What to generate. `guidance` and `shift` of `None` take the checkpoint's (its guider's
    `guidance_scale`, its scheduler's `shift`), as diffusers does; `deepcache` of `None` is off."""

    frames: int = 121
    fps: int = 24
    guidance: float | None = None
    shift: float | None = field(default=None, metadata={
        "type": float, "help": "flow-matching shift (default: the checkpoint's scheduler)"})
    deepcache: Schedule | None = field(default=None, metadata={
        "parse": parse_schedule, "metavar": "START:END:INTERVAL",
        "help": f"reuse deep features between full steps, e.g. {UPSTREAM_DEFAULT} (upstream's); off by default"})
    step_cache: stepcache.StepCache | None = field(default=None, metadata=stepcache.FIELD)


def step_cache(request: Request) -> stepcache.StepCache | None:
    """The request's step cache: `step_cache`, or `deepcache` as one (`--deepcache S:E:I` is
    `--step-cache deepcache:S:E:I`); `None` when off."""
    if request.step_cache is not None or request.deepcache is None:
        return request.step_cache
    return stepcache.StepCache("deepcache", deepcache=request.deepcache, tail=request.deepcache.tail)


def validate(request: Request, options: Options, device_count: int | None = None,
             configs: dict[str, dict] | None = None) -> None:
    """Refuse what cannot run, naming the bad value and what is allowed. Loads no model; with
    `configs` (`family.component_configs`), the rules use that checkpoint's shape facts and guider."""
    Hunyuan.validate(request, options, device_count, configs)


def resolve(request: Request, configs: dict[str, dict]) -> Request:
    """`request` with `guidance` and `shift` taken from the checkpoint's configs where unset, and
    for image-to-video its size taken from the picture (`family.video_size`), as diffusers does."""
    guidance = configs["guider"].get("guidance_scale", 7.5) if request.guidance is None else request.guidance
    shift = configs["scheduler"].get("shift", 1.0) if request.shift is None else request.shift
    request = dataclasses.replace(request, guidance=float(guidance), shift=float(shift))
    if request.image is not None and family.image_to_video(configs):
        from tpupedia import pictures

        width, height = family.video_size(*pictures.size(request.image), configs)
        request = dataclasses.replace(request, width=width, height=height)
    return request


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
    resolved (`resolve`). Attention backend, sharding and mesh change speed, not the video. With a
    picture, every stage but `text` also depends on it, the VAE (and whether its encode is tiled)
    and the image encoder; the image stage encodes the picture alone, so not on the frame count."""
    out = text_settings(source_label, configs, request, dtype) if stage != "image" else {}
    if request.image is not None and stage != "text":
        out |= common.stage_settings(family.FAMILY, "image", source_label, configs, request, dtype, picture={
            "image_encoder": common.config_fingerprint(configs.get("image_encoder", {})),
            "feature_extractor": configs.get("pipeline", {}).get("feature_extractor"),
            "encode_tiling": request.vae_tiling}, frames=False)  # the picture's encode is tiled as the decode is
    if stage in ("denoise", "decode"):
        out |= {"transformer": common.config_fingerprint(configs["transformer"]),
                "scheduler": common.config_fingerprint(configs["scheduler"]),
                "guider": common.config_fingerprint(configs["guider"]),
                "frames": request.frames, "height": request.height, "width": request.width,
                "steps": request.steps, "guidance": request.guidance, "shift": request.shift, "seed": request.seed,
                "deepcache": None if request.deepcache is None else dataclasses.asdict(request.deepcache)}
        out |= lora.settings(request.lora)  # each adapter's file, scale and component (none: no key)
        out |= quantize.settings(request.quantize)  # the weights' format (none: no key)
        out |= stepcache.settings(request.step_cache)  # none: no key
    if stage == "decode":
        out |= {"vae_config": common.config_fingerprint(configs["vae"]), "vae": vae, "vae_tiling": request.vae_tiling}
    return out


def prompt_defaults() -> dict[str, Any]:
    """diffusers' text settings for this pipeline: the system message, the 1000-token text
    length, the 108-token template crop and the layer offset, read from its own signature.
    Notebook `hunyuan_video` (section 4) counts a prompt's tokens with them."""
    from diffusers import HunyuanVideo15Pipeline

    params = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters
    byt5 = inspect.signature(HunyuanVideo15Pipeline._get_byt5_prompt_embeds).parameters
    return {name: params[name].default for name in
            ("system_message", "tokenizer_max_length", "crop_start", "num_hidden_layers_to_skip")} | {
        "byt5_length": byt5["tokenizer_max_length"].default}


def check_text_depth(configs: dict[str, dict]) -> None:
    """Refuse a Qwen2.5-VL text model too shallow for the hidden state stock diffusers keeps,
    `hidden_states[-(num_hidden_layers_to_skip + 1)]` (the embeddings and one state per layer):
    with 2 skipped, 2 layers still work (stock keeps the embeddings' state), 1 does not (stock
    fails with an IndexError). A run selects what stock selects or refuses; only a plan's
    shallow compile (`tpupedia.plan`, `layers=`) takes the last state instead (notebook `hunyuan_video`)."""
    skip = prompt_defaults()["num_hidden_layers_to_skip"]
    layers = configs["text_encoder"].get("num_hidden_layers")
    if layers is not None and layers + 1 < skip + 1:
        raise PipelineError(f"the text encoder has {layers} layer(s), so {layers + 1} hidden states; diffusers' "
                            f"HunyuanVideo-1.5 pipeline keeps hidden_states[-{skip + 1}] (num_hidden_layers_to_skip="
                            f"{skip}), which needs at least {skip} layers")


class Hunyuan(common.StagedPipeline):
    """The three HunyuanVideo-1.5 stages over one checkpoint (see the module docstring)."""

    family = family
    vaes = ("torchax",)
    image_to_video = True
    size_from_picture = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.traces = {"text": 0, "image": 0, "denoise": 0, "full": 0, "cached": 0}

    @classmethod
    def guidance_batch(cls, request: Request, configs: dict[str, dict] | None = None) -> int | None:
        """2 when the checkpoint's guider runs the guidance pair for this request, else 1; `None`
        without `configs` (the guider decides)."""
        return None if configs is None else 2 if _guidance_on(resolve(request, configs), configs) else 1

    @classmethod
    def validate(cls, request: Request, options: Options, device_count: int | None = None,
                 configs: dict[str, dict] | None = None, *, shape_rules: bool = True, kind: bool = True) -> None:
        super().validate(request, options, device_count, configs, shape_rules=shape_rules, kind=kind)
        if request.shift is not None and (not math.isfinite(request.shift) or request.shift <= 0):
            raise PipelineError(f"shift={request.shift} must be a finite number > 0 (1 leaves the schedule unshifted)")
        if request.deepcache is not None:
            request.deepcache.check(request.steps)
        if configs is not None:
            check_text_depth(configs)
        if request.deepcache is not None and request.step_cache is not None:
            raise PipelineError(f"deepcache={request.deepcache} and step_cache={request.step_cache}: one step cache "
                                f"at a time (--deepcache {request.deepcache} is --step-cache deepcache:{request.deepcache})")
        cache = step_cache(request)
        if cache is not None and configs is not None and configs["transformer"].get("use_meanflow"):
            raise PipelineError(f"step cache {cache}: this checkpoint is step-distilled (use_meanflow: "
                                "each step also embeds the next timestep); step caches are implemented for the others")

    @classmethod
    def kind_evidence(cls, configs: dict[str, dict]) -> str:
        return ("its model_index.json names an image encoder" if family.image_to_video(configs)
                else "its model_index.json names no image encoder")

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
        from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import extract_glyph_texts, format_text_input
        from transformers import AutoTokenizer

        request = resolve(request, self.configs)
        d = prompt_defaults()
        crop = d["crop_start"]
        programs = {p.name.split(",")[0]: p for p in self._text_programs(request)}
        qwen = programs["Qwen2.5-VL text model"]
        run_qwen = self.held("text", "qwen-jit", lambda: jax.jit(qwen.fn, **qwen.jit_kwargs))
        tokenizer = self.held("text", "tokenizer", lambda: AutoTokenizer.from_pretrained(self.source, subfolder="tokenizer"))
        sharding = qwen.args[2].sharding
        results, times = {}, []
        with self._precision(), qwen.context():
            for prefix, text in self._prompts(request).items():
                tokens = tokenizer.apply_chat_template(
                    format_text_input([text], d["system_message"]), add_generation_prompt=True, tokenize=True,
                    return_dict=True, padding="max_length", max_length=d["tokenizer_max_length"] + crop,
                    truncation=True, return_tensors="pt")
                ids, mask = (jax.device_put(tokens[k].numpy(), sharding) for k in ("input_ids", "attention_mask"))
                embeds, seconds = common.timed(lambda: run_qwen(*qwen.args[:2], ids, mask), jax.block_until_ready)
                times.append(seconds)
                results[f"{prefix}prompt_embeds"] = common.to_torch(embeds).to(self.dtype)
                results[f"{prefix}prompt_embeds_mask"] = tokens["attention_mask"][:, crop:].to(self.dtype)
                glyph_text = extract_glyph_texts(text)
                if glyph_text is None:
                    width = self.configs["text_encoder_2"]["d_model"]
                    results[f"{prefix}prompt_embeds_2"] = torch.zeros(1, d["byt5_length"], width, dtype=self.dtype)
                    results[f"{prefix}prompt_embeds_mask_2"] = torch.zeros(1, d["byt5_length"], dtype=self.dtype)
                    continue
                byt5 = programs["ByT5 glyph encoder"]
                run_byt5 = self.held("text", "byt5-jit", lambda: jax.jit(byt5.fn, **byt5.jit_kwargs))
                glyph_tokenizer = self.held("text", "tokenizer_2", lambda: AutoTokenizer.from_pretrained(
                    self.source, subfolder="tokenizer_2"))
                byt5_tokens = glyph_tokenizer(glyph_text, padding="max_length", max_length=d["byt5_length"],
                                              truncation=True, add_special_tokens=True, return_tensors="pt")
                out = run_byt5(*byt5.args[:2], jax.device_put(byt5_tokens.input_ids.numpy(), sharding),
                               jax.device_put(byt5_tokens.attention_mask.float().numpy(), sharding))
                results[f"{prefix}prompt_embeds_2"] = common.to_torch(out).to(self.dtype)
                results[f"{prefix}prompt_embeds_mask_2"] = byt5_tokens.attention_mask.to(self.dtype)
        return results, {"first_s": times[0], "steady_s": times[-1]}

    def _prompts(self, request: Request) -> dict[str, str]:
        """The prompts the text stage encodes, by embedding prefix: the prompt, and with guidance on
        the negative prompt."""
        prompts = {"": request.prompt}
        if _guidance_on(request, self.configs):
            prompts["negative_"] = request.negative_prompt
        return prompts

    def _text_programs(self, request: Request) -> list:
        """The text stage's programs: Qwen2.5-VL at the template's length (diffusers' 1000 tokens
        plus the 108-token system-prompt crop), keeping the one hidden state diffusers keeps, once
        per prompt; and ByT5 at its 256 bytes, only when a prompt quotes text to draw (glyphs).
        Both sharded over `tp` (`_text_rules`), with real or, on an `abstract` pipeline, abstract weights."""
        import jax.numpy as jnp
        from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import extract_glyph_texts
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P
        from transformers import Qwen2_5_VLTextModel, T5EncoderModel

        from tpupedia import aot, torchax_utils

        d = prompt_defaults()
        crop, layer = d["crop_start"], -(d["num_hidden_layers_to_skip"] + 1)
        replicated = NamedSharding(self.mesh, P())
        prompts = self._prompts(request)
        shallow = self.abstract and self.layers is not None  # a plan's cheap compile: shapes, not values

        def hidden(module, ids, mask):  # the one hidden state diffusers keeps, selected inside jit
            self.traces["text"] += 1
            out = module(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
            if shallow and len(out) <= -layer:  # the plan's shallow model may have fewer: its last has the shape
                return out[-1][:, crop:]
            return out[layer][:, crop:]  # exactly stock's `hidden_states[-(num_hidden_layers_to_skip + 1)]`

        def encoder(cls, name, forward):
            module = self._load(cls, name)
            self._to_jax(name, module, self._text_rules(name))
            fm = torchax_utils.FunctionalModule(module, forward)
            return module, fm, self._state(fm, name)

        _, qwen, state = self.held("text", "qwen", lambda: encoder(Qwen2_5_VLTextModel, "text_encoder", hidden))
        length = d["tokenizer_max_length"] + crop
        tokens = aot.abstract((1, length), jnp.int32, replicated)
        programs = [aot.Program(
            "text", f"Qwen2.5-VL text model, {length} tokens", qwen, (*state, tokens, tokens),
            jit_kwargs={"out_shardings": replicated}, weights_bytes=self.plans["text_encoder"].bytes_per_device,
            calls=len(prompts), component="text_encoder",  # masked rows -> 0, not NaN
            context=lambda: common.attention_installed(self.env, self.mesh, "reference"))]
        glyphs = sum(extract_glyph_texts(text) is not None for text in prompts.values())
        if glyphs:
            _, byt5, state = self.held("text", "byt5", lambda: encoder(
                T5EncoderModel, "text_encoder_2", lambda m, ids, mask: m(input_ids=ids, attention_mask=mask)[0]))
            length = d["byt5_length"]
            programs.append(aot.Program(
                "text", f"ByT5 glyph encoder, {length} bytes", byt5,
                (*state, aot.abstract((1, length), jnp.int32, replicated), aot.abstract((1, length), jnp.float32, replicated)),
                jit_kwargs={"out_shardings": replicated}, weights_bytes=self.plans["text_encoder_2"].bytes_per_device,
                calls=glyphs, component="text_encoder_2", context=programs[0].context))
        return programs

    # -- image-to-video: the picture's condition --------------------------------------------
    def _encode_image(self, request: Request) -> tuple[dict, dict]:
        """The picture as `HunyuanVideo15ImageToVideoPipeline` conditions on it (`request`'s size
        resolved from it): resized and centre-cropped to the video's size, then `image_embeds`
        (1, tokens, width), SigLIP's last hidden state of the picture as the checkpoint's feature
        extractor prepares it, and `image_latents` (1, C, 1, h, w), the VAE's posterior mean of
        that frame times its scaling factor, the encoder's calls (the whole frame, or with
        `vae_tiling` its tiles, as stock) side by side on the host's chips (`through_tiles`)."""
        import jax
        from diffusers import AutoencoderKLHunyuanVideo15
        from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

        from tpupedia import pictures, torchax_utils

        request = resolve(request, self.configs)
        processor = HunyuanVideo15ImageProcessor(vae_scale_factor=self.shapes.spatial, do_resize=False,
                                                 do_convert_rgb=True)  # the stock pipeline's
        picture = processor.resize(pictures.read(request.image), height=request.height, width=request.width,
                                   resize_mode="crop")
        siglip = self._siglip_program()
        features = self.held("image", "siglip-jit", lambda: jax.jit(siglip.fn, **siglip.jit_kwargs))
        chips = decoding.decode_mesh(self.mesh)

        def load():  # the VAE with its encoder jitted, a copy on each of the host's chips
            vae = checkpoints.load_component(AutoencoderKLHunyuanVideo15, self.source, "vae", dtype=self.dtype)
            family.make_vae_jit_friendly(vae)
            self._to_jax("vae", vae, mesh=chips)
            vae.encoder = torchax_utils.JitModule(vae.encoder)
            return vae, meta_vae(self.configs["vae"]).encoder

        start = time.perf_counter()
        with self._precision():
            pixels = self._processor("feature_extractor").preprocess(images=picture, do_resize=True, return_tensors="pt",
                                                          do_convert_rgb=True).pixel_values
            weights, buffers, spec = siglip.args
            embeds = features(weights, buffers, jax.device_put(common.to_jax_array(pixels.to(self.dtype)), spec.sharding))
            vae, shapes_of = self.held("image", "vae", load)
            vae.enable_tiling() if request.vae_tiling else vae.disable_tiling()
            frame = processor.preprocess(picture, height=request.height, width=request.width)[:, :, None].to(vae.dtype)
            moments = through_tiles(vae, "encoder", frame, chips, self.env, shapes_of)
        latents = moments[:, : moments.shape[1] // 2] * vae.config.scaling_factor  # the posterior's mean (`argmax`)
        return ({"image_embeds": common.to_torch(jax.block_until_ready(embeds)).to(self.dtype),
                 "image_latents": latents.to(self.dtype)}, {"first_s": time.perf_counter() - start})

    def _siglip_program(self):
        """The SigLIP vision tower as the image stage compiles it, `(weights, buffers, pixels)` ->
        its last hidden state, a copy on every chip (one picture, 0.4B parameters: nothing worth
        splitting)."""
        import jax.numpy as jnp
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P
        from transformers import SiglipVisionModel

        from tpupedia import aot, torchax_utils

        replicated = NamedSharding(self.mesh, P())

        def load():
            tower = self._to_jax("image_encoder", self._load(SiglipVisionModel, "image_encoder"))  # a copy per chip
            fm = torchax_utils.FunctionalModule(tower, lambda m, pixels: m(pixel_values=pixels).last_hidden_state)

            def features(weights, buffers, pixels):
                self.traces["image"] += 1
                return fm(weights, buffers, pixels)

            return tower, features, self._state(fm, "image_encoder")

        _, features, state = self.held("image", "siglip", load)
        side = self.configs["image_encoder"]["image_size"]
        dtype = jnp.dtype(str(self.dtype).removeprefix("torch."))
        return aot.Program("image", f"SigLIP vision tower, the picture at {side}x{side}", features,
                           (*state, aot.abstract((1, 3, side, side), dtype, replicated)),
                           jit_kwargs={"out_shardings": replicated}, calls=1, component="image_encoder",
                           weights_bytes=self.plans["image_encoder"].bytes_per_device)

    def _image_programs(self, request: Request) -> list:
        """The image stage's programs (`request` resolved): the SigLIP tower (`_siglip_program`),
        then the VAE's encoder on the picture's frame, whole or in tiles as the decode is
        (`encode_programs`), on the host's chips."""
        request = resolve(request, self.configs)
        return [self._siglip_program(), *encode_programs(
            self.configs["vae"], request.height, request.width, decoding.decode_mesh(self.mesh),
            dtype=str(self.dtype).removeprefix("torch."), tiling=request.vae_tiling)]

    # -- stage 2 ---------------------------------------------------------------------------
    def _denoise(self, request: Request, embeds: dict, on_step: Callable[[int, Any], None] | None = None) -> tuple[dict, dict]:
        """All steps through one compiled step (two with DeepCache: full and cached). Returns
        `{"latents": (1, C, T, h, w)}`. `on_step(i, latents)` is called after each step with its
        output, a jax array valid only during the call (the next step donates its buffer)."""
        import jax
        import numpy as np
        import torch

        request = resolve(request, self.configs)
        setup = self._denoise_setup(request)
        keys = ("prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2")
        text = [torch.cat([embeds[f"negative_{k}"], embeds[k]]) if setup.guided else embeds[k] for k in keys]
        # t2v: the image slot is all padding, so the valid tokens are the two text encoders';
        # i2v: the picture's tokens are valid too
        pictured = "image_embeds" in embeds
        image_tokens = family.image_tokens(self.configs)
        valid = text[1].bool().sum(1) + text[3].bool().sum(1) + (image_tokens if pictured else 0)
        kept = family.kept_text_tokens(valid.tolist(), family.slot_tokens(self.configs), video_tokens=family.video_tokens(
            request.width, request.height, request.frames, self.shapes))
        programs = self._denoise_programs(request, setup, text_tokens=kept)
        # What the programs close over: the schedule (steps, shift), guidance on or off, the text
        # tokens kept, the step cache's method and DeepCache's tail.
        cache = step_cache(request)
        key = ("steps", request.steps, request.shift, setup.guided, kept,
               None if cache is None else (cache.method, cache.tail, cache.calibrated))
        compiled = self.held("denoise", key, lambda: [jax.jit(p.fn, **p.jit_kwargs) for p in programs])
        weights, buffers, x_spec, text_specs, (image_spec, condition_spec) = programs[0].args[:5]
        text = [jax.device_put(common.to_jax_array(t), spec.sharding) for t, spec in zip(text, text_specs)]
        if pictured:  # the same picture for the prompt and the negative prompt; its latents as frame 0
            features = torch.cat([embeds["image_embeds"]] * image_spec.shape[0])
            condition = family.image_condition(embeds["image_latents"], setup.latents.shape[2])
            image = (jax.device_put(common.to_jax_array(features), image_spec.sharding),
                     jax.device_put(common.to_jax_array(condition), condition_spec.sharding))
        else:
            image = (jax.device_put(np.zeros(image_spec.shape, image_spec.dtype), image_spec.sharding), None)

        def loop(full_steps=None, calibration=None):
            """All steps; `full_steps` (a set) picks each step's full or cached program;
            `calibration` records every (full) step."""
            x = jax.device_put(common.to_jax_array(setup.latents), x_spec.sharding)

            def step(i, state):  # the state is (latents, the step cache's cache or None)
                x, record = state
                args = (np.int32(i), np.float32(request.guidance), np.bool_(setup.cfg_on[i]))
                if cache is None:
                    return compiled[0](weights, buffers, x, text, image, *args), None
                if i in full_steps:
                    x, new = compiled[0](weights, buffers, x, text, image, *args)  # (latents, new cache)
                    if calibration is not None:
                        calibration.record(new, record)
                    return x, new
                return compiled[1](weights, buffers, x, record, text, image, *args), record

            with programs[0].context(), self._precision():  # the token refiner's small masked attention
                return common.denoise_loop(step, (x, None), request.steps, on_step, latents=lambda state: state[0])

        (x, _), timings = stepcache.run_loop(cache, request.steps, loop, identity=self.cache_identity(self.configs))
        return {"latents": common.to_torch(x).to(self.dtype)}, timings | {"text_tokens": kept}

    def _denoise_setup(self, request: Request):
        """What the steps need from the host (`request` resolved): the flow-matching schedule as
        tables, the guider's per-step range, guidance on or off, the initial latents drawn from
        `torch.Generator(seed)` as diffusers draws them."""
        import types

        import jax.numpy as jnp
        import numpy as np
        import torch
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.utils.torch_utils import randn_tensor

        from tpupedia.pipelines import schedulers

        guider = self.configs["guider"]
        if guider.get("guidance_rescale", 0.0):
            raise PipelineError(f"guider guidance_rescale={guider['guidance_rescale']}: only 0 (no rescale) is "
                                "implemented; the checkpoint's guider asks for more")
        start, stop = int(guider.get("start", 0.0) * request.steps), int(guider.get("stop", 1.0) * request.steps)
        config = {k: v for k, v in self.configs["scheduler"].items() if not k.startswith("_")}
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(config | {"shift": request.shift})
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, request.steps + 1)[:-1])  # as the pipeline does
        shape = family.latent_shape(request.frames, request.height, request.width, self.shapes)
        return types.SimpleNamespace(
            tables={k: jnp.asarray(v) for k, v in schedulers.flow_match_tables(scheduler).items()},
            cfg_on=np.array([start <= i < stop for i in range(request.steps)]),  # the guider's per-step range
            guided=_guidance_on(request, self.configs), original=bool(guider.get("use_original_formulation", False)),
            latents=randn_tensor(shape, generator=torch.Generator().manual_seed(request.seed), dtype=self.dtype))

    def _denoise_programs(self, request: Request, setup, text_tokens: int | None = None) -> list:
        """The step as this stage compiles it (`request` resolved): the guidance pair as a batch on
        `dp`, the transformer over `tp` with the exact padded attention, the guider and the Euler
        step, latents donated. One program, or with DeepCache two: the full step (which also returns
        the cache) and the cached step. Arguments `(weights, buffers, latents, [cache,] text, image,
        i, guidance, cfg_on)`, `text` the four conditioning tensors, `image` the pair (SigLIP
        features, condition): zeros and `None` for text-to-video, for image-to-video the
        picture's features and its latents and mask (`family.image_condition`), which join the
        noisy latents on channels as stock's `cond_latents_concat` and `mask_concat`. `text_tokens`: how many text
        tokens the blocks see (`family.kept_text_tokens`; all of them when `None`, as a plan
        compiles the step: the most any prompt needs)."""
        import jax
        import jax.numpy as jnp
        import numpy as np
        from diffusers import HunyuanVideo15Transformer3DModel
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from tpupedia import aot, attention, torchax_utils
        from tpupedia.pipelines import schedulers

        backend = common.attention_backend(self.options.attention, self.mesh)
        mesh = self.mesh

        def load():
            transformer = self._load(HunyuanVideo15Transformer3DModel, "transformer")
            family.make_jit_friendly(transformer, attention.padded_attend(
                backend, mesh=mesh, interpret=not common.on_tpu(mesh), block_sizes=self.block_sizes))
            self._to_jax("transformer", transformer, self._rules(self.options.sharding))
            return transformer

        transformer = self.held("denoise", "transformer", load)
        schedule = step_cache(request)
        if schedule is not None:
            schedule.check(request.steps, len(getattr(transformer, family.CACHE_BLOCKS)))
        tables, guided, original = setup.tables, setup.guided, setup.original
        replicated = NamedSharding(mesh, P())
        batch = NamedSharding(mesh, P("dp")) if guided else replicated
        dtype = common.to_jax_array(setup.latents[:0]).dtype
        n = 2 if guided else 1

        steps = tables["timesteps"].shape[0]
        meanflow = bool(self.configs["transformer"].get("use_meanflow"))

        def model_input(latents, i, condition):
            if condition is None:  # text-to-video: zero condition latents and mask
                condition = jnp.zeros((*latents.shape[:1], latents.shape[1] + 1, *latents.shape[2:]), latents.dtype)
            x = jnp.concatenate([latents, condition], axis=1)
            x = jax.lax.with_sharding_constraint(jnp.concatenate([x] * n), batch)
            return x, jnp.broadcast_to(tables["timesteps"][i].astype(dtype), (n,))  # diffusers: t in the latents' dtype

        def next_timestep(i):  # step-distilled checkpoints: the next step's timestep, 0 after the last
            if not meanflow:
                return None
            r = jnp.where(i + 1 < steps, tables["timesteps"][jnp.minimum(i + 1, steps - 1)], 0.0)
            return jnp.broadcast_to(r.astype(dtype), (n,))

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
            x, t = model_input(latents, i, image[1])
            out = fm_plain(weights, buffers, x, t, text[0], text[1], next_timestep(i), text[2], text[3], image[0],
                           text_tokens=text_tokens)[0]
            return guide_and_step(latents, out, i, guidance, cfg_flag)

        def full(weights, buffers, latents, text, image, i, guidance, cfg_flag):
            self.traces["full"] += 1
            x, t = model_input(latents, i, image[1])
            if generic:
                out, cache = fm_full(weights, buffers, None, x, t, text[0], text[1], next_timestep(i), text[2],
                                     text[3], image[0], text_tokens=text_tokens)
            else:
                out, cache = fm_full(weights, buffers, x, t, text[0], text[1], text[2], text[3], image[0])
            return guide_and_step(latents, out, i, guidance, cfg_flag), cache

        def cached(weights, buffers, latents, cache, text, image, i, guidance, cfg_flag):
            self.traces["cached"] += 1
            x, t = model_input(latents, i, image[1])
            if generic:
                out = fm_cached(weights, buffers, cache, x, t, text[0], text[1], next_timestep(i), text[2], text[3],
                                image[0], text_tokens=text_tokens)
            else:
                out = fm_cached(weights, buffers, cache, x, t, text[1], text[3], image[0])
            return guide_and_step(latents, out, i, guidance, cfg_flag)

        def generic_forward(mode: str):
            """The jit-friendly forward, its blocks cached as `schedule` says (`stepcache.traced`)."""
            def method(m, cached, *args, **kwargs):
                with stepcache.traced(m, family, schedule, mode, cached, calibrate=schedule.calibrated) as record:
                    out = m(*args, **kwargs)[0]
                return (out, record) if mode == "full" else out

            return torchax_utils.FunctionalModule(transformer, method, return_dict=False)

        fm_plain = torchax_utils.FunctionalModule(transformer, return_dict=False)
        # DeepCache's own split forward (the token refiner skipped too); the other caches, and
        # DeepCache on a calibrated schedule, through the blocks (`stepcache.traced`)
        generic = schedule is not None and (schedule.method != "deepcache" or schedule.calibrated)
        if generic:
            fm_full, fm_cached = generic_forward("full"), generic_forward("cached")
        elif schedule is not None:
            tail = schedule.tail
            fm_full = torchax_utils.FunctionalModule(
                transformer, lambda m, *a: family.deepcache_full(m, tail, *a, text_tokens=text_tokens))
            fm_cached = torchax_utils.FunctionalModule(
                transformer, lambda m, *a: family.deepcache_cached(m, tail, *a, text_tokens=text_tokens))

        cfg = self.configs["transformer"]
        (qwen, _), (byt5, _), _ = family.TEXT_SLOTS.values()
        image = family.image_tokens(self.configs)
        state = self._state(fm_plain, "transformer")
        latents = aot.abstract(tuple(setup.latents.shape), dtype, replicated)
        text = [aot.abstract((n, qwen, cfg["text_embed_dim"]), dtype, batch), aot.abstract((n, qwen), dtype, batch),
                aot.abstract((n, byt5, self.configs["text_encoder_2"]["d_model"]), dtype, batch),
                aot.abstract((n, byt5), dtype, batch)]
        scalars = (aot.abstract((), np.int32, replicated), aot.abstract((), np.float32, replicated),
                   aot.abstract((), np.bool_, replicated))
        condition = None  # image-to-video: the picture's latents and mask, (1, C + 1, T, h, w)
        if request.image is not None:
            shape = setup.latents.shape
            condition = aot.abstract((1, shape[1] + 1, *shape[2:]), dtype, replicated)
        common_args = (text, (aot.abstract((n, image, cfg["image_embed_dim"]), dtype, batch), condition), *scalars)
        weights = self.plans["transformer"].bytes_per_device
        context = functools.partial(common.attention_installed, self.env, mesh, backend, self.block_sizes)
        size = "x".join(str(d) for d in setup.latents.shape[2:])
        # Latents keep one (replicated) sharding in and out, so every step reuses the first step's
        # program; they are donated, so XLA updates them in place. The cache stays split on `dp`.
        if schedule is None:
            return [aot.Program("denoise", f"denoising step ({size} latents, batch {n})", plain,
                                (*state, latents, *common_args), weights_bytes=weights, calls=request.steps, component="transformer",
                                jit_kwargs={"donate_argnums": (2,), "out_shardings": replicated}, context=context)]
        full_args = (*state, latents, *common_args)
        cache = None  # the cache's shapes (a trace of the full step) only where a plan compiles the cached step
        if self.abstract:
            with context():
                cache = jax.tree.map(lambda a: aot.abstract(a.shape, a.dtype, batch), jax.eval_shape(common.fresh_trace(full), *full_args)[1])
        n_full = request.steps if schedule.calibrated else len(schedule.full_steps(request.steps))
        name = "DeepCache" if schedule.method == "deepcache" else schedule.method
        return [aot.Program("denoise", f"{name} full step ({size} latents, batch {n})", full, full_args,
                            weights_bytes=weights, calls=n_full, context=context, component="transformer",
                            jit_kwargs={"donate_argnums": (2,), "out_shardings": (replicated, batch)}),
                aot.Program("denoise", f"{name} cached step" + (f" (last {schedule.tail} blocks)" if name == "DeepCache"
                                                                else " (the first block)" if name == "fbcache" else ""),
                            cached,
                            (*state, latents, cache, *common_args), weights_bytes=weights,
                            calls=request.steps - n_full, context=context, component="transformer",
                            jit_kwargs={"donate_argnums": (2,), "out_shardings": replicated})]

    # -- stage 3 ---------------------------------------------------------------------------
    def _decode_programs(self, request: Request) -> list:
        """The decode stage's programs, the VAE's decoder calls whole or per tile
        (`tpupedia.pipelines.decoding`), on the host's chips, one tile (or a copy of the whole latent) per chip."""
        request = resolve(request, self.configs)  # image-to-video: the picture's size
        frames = family.latent_shape(request.frames, request.height, request.width, self.shapes)[2]
        return decode_programs(self.configs["vae"], frames, request.height, request.width,
                               decoding.decode_mesh(self.mesh), dtype=str(self.dtype).removeprefix("torch."),
                               tiling=request.vae_tiling)

    def _decode(self, request: Request, latents) -> tuple[dict, dict]:
        """Latents -> frames, float32 (F, H, W, 3) in [0, 1] (diffusers' `output_type="np"`)."""
        import torch
        from diffusers import AutoencoderKLHunyuanVideo15
        from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

        from tpupedia import torchax_utils
        def load():  # (the VAE, its decoder jitted and replicated on the host's chips; the decoder on `meta`)
            vae = checkpoints.load_component(AutoencoderKLHunyuanVideo15, self.source, "vae", dtype=self.dtype)
            family.make_vae_jit_friendly(vae)
            self._to_jax("vae", vae, mesh=decoding.decode_mesh(self.mesh))
            vae.decoder = torchax_utils.JitModule(vae.decoder)
            return vae, meta_vae(self.configs["vae"]).decoder

        vae, shapes_of = self.held("decode", "vae", load)
        vae.enable_tiling() if request.vae_tiling else vae.disable_tiling()
        z = latents.to(vae.dtype) / vae.config.scaling_factor
        start = time.perf_counter()
        with self._precision():  # the tiles (or the whole latent) side by side on the host's chips
            video = through_tiles(vae, "decoder", z, decoding.decode_mesh(self.mesh), self.env, shapes_of)
        seconds = time.perf_counter() - start
        frames = HunyuanVideo15ImageProcessor(vae_scale_factor=vae.spatial_compression_ratio).postprocess_video(
            video, output_type="np")[0]
        return {"frames": torch.from_numpy(frames.astype("float32"))}, {"first_s": seconds}


# --- the VAE's tiles, spread over a host's chips, and their programs for `tpupedia.plan` -------------

def _whole(vae: Any, part: str, x: Any) -> Any:
    """What diffusers does with `x` through VAE `part`, tiling included: `vae.decode(x).sample`
    (part "decoder") or `vae._encode(x)`, the posterior's moments ("encoder")."""
    return vae.decode(x).sample if part == "decoder" else vae._encode(x)


def _part_calls(vae: Any, part: str, x: Any) -> Counter:
    """How often diffusers' `_whole(vae, part, x)` calls `vae.<part>`, per input shape, run on `meta`."""
    import torch

    calls: Counter = Counter()
    hook = getattr(vae, part).register_forward_pre_hook(lambda _module, args: calls.update([tuple(args[0].shape)]))
    try:
        with torch.no_grad():
            _whole(vae, part, x)
    finally:
        hook.remove()
    return calls


def _reference_attention(fm: Any, env: Any):
    """`fm(params, buffers, z)` traced with torchax's own SDPA (the pipeline's decode installs none;
    the environment is shared, so it is left as found)."""
    from tpupedia import torchax_utils

    def decode(params, buffers, z):
        with torchax_utils.restoring_ops(env):
            torchax_utils.stock_ops(env)
            return fm(params, buffers, z)

    return decode


def _tile_name(part: str, shape: tuple[int, ...], calls: int, whole_hw: tuple[int, int]) -> str:
    chips, _, frames, h, w = shape
    if part == "encoder":
        return f"VAE encode, the picture ({decoding.where(chips, h, w, whole_hw, unit='pixel')}, x {calls})"
    return f"VAE decode, all {frames} latent frames at once ({decoding.where(chips, h, w, whole_hw)}, x {calls})"


def _tile_programs(vae: Any, part: str, x_shape: tuple[int, ...], mesh: Any, dtype: Any, tiling: bool) -> list:
    """The programs of `part` ("decoder" or "encoder") that `through_tiles` runs for an input of
    `x_shape`: one per distinct input shape of diffusers' calls (the whole input, or each distinct
    spatial tile with `tiling`), one piece per chip of `mesh`, `calls` the waves; `vae` on `meta`
    (`meta_vae`), the part's weights abstract arguments in `dtype`, a copy on every chip."""
    import jax
    import jax.numpy as jnp
    import torch

    from tpupedia import aot, torchax_utils

    dtype = jnp.dtype(dtype)
    torch_dtype = getattr(torch, dtype.name)
    vae = vae.to(torch_dtype)
    vae.enable_tiling() if tiling else vae.disable_tiling()  # as the pipeline's stages
    x = torch.empty(x_shape, dtype=torch_dtype, device="meta")
    chips = mesh.size
    calls = {(chips, *shape[1:]): len(decoding.waves([jax.ShapeDtypeStruct(shape, dtype)] * n, chips))
             for shape, n in _part_calls(vae, part, x).items()}
    env = torchax_utils.default_env()  # imports torchax through the compatibility shim
    fm = torchax_utils.FunctionalModule(getattr(vae, part))  # what `JitModule(vae.<part>)` calls
    state = decoding.replicated(mesh, fm.abstract_state())
    weights = decoding.nbytes(state)
    run = _reference_attention(fm, env)
    stage = decoding.STAGE if part == "decoder" else "image"
    return [aot.Program(stage, _tile_name(part, shape, n, tuple(x_shape[-2:])), run,
                        (*state, decoding.spread(mesh, jax.ShapeDtypeStruct(shape, dtype))), weights_bytes=weights,
                        calls=n, component="vae")
            for shape, n in calls.items()]


def decode_programs(vae_config: dict, latent_frames: int, height: int, width: int, mesh: Any, *,
                   dtype: Any = "bfloat16", tiling: bool = False) -> list:
    """The decoder programs of HunyuanVideo-1.5's `decode` stage for a `height` x `width` video
    decoded from `latent_frames` latent frames (`latent_shape(...)[2]`), on the chips of `mesh` (a
    `decode_mesh`).

    `vae_config` is the checkpoint's VAE config dict (`AutoencoderKLHunyuanVideo15` fields; missing
    ones take diffusers' defaults, the release's: `models.hunyuan.full_configs()["vae"]`). The VAE
    is built on `meta`, its decoder's weights become abstract arguments in `dtype`, a copy on every
    chip. One program per distinct decoder input shape, one piece per chip: the whole latent
    untiled, each distinct spatial tile with `tiling` (`calls` counts the waves of tiles,
    `through_tiles`). Raises `PipelineError` for frames < 1 or sizes that are not multiples of the
    VAE's spatial compression.

    `weights_bytes` is the decoder's weights (its arguments); the pipeline also keeps the encoder
    on the chip. The mid-block attention gets the pipeline's loop-free causal mask
    (`models.hunyuan.make_vae_jit_friendly`).
    """
    vae = meta_vae(vae_config)
    ratio = vae.spatial_compression_ratio
    decoding.check_decode("HunyuanVideo-1.5", latent_frames, height, width, ratio)
    shape = (1, vae.config.latent_channels, latent_frames, height // ratio, width // ratio)
    return _tile_programs(vae, "decoder", shape, mesh, dtype, tiling)


def encode_programs(vae_config: dict, height: int, width: int, mesh: Any, *, dtype: Any = "bfloat16",
                    tiling: bool = False) -> list:
    """The encoder programs of HunyuanVideo-1.5's `image` stage (image-to-video) for the picture,
    one `height` x `width` frame, on the chips of `mesh` (a `decode_mesh`): as `decode_programs`,
    the whole frame, or with `tiling` each distinct 256-pixel tile of diffusers' `tiled_encode`,
    side by side. Raises `PipelineError` for sizes that are not multiples of the spatial compression."""
    vae = meta_vae(vae_config)
    decoding.check_decode("HunyuanVideo-1.5", 1, height, width, vae.spatial_compression_ratio)
    return _tile_programs(vae, "encoder", (1, 3, 1, height, width), mesh, dtype, tiling)


def through_tiles(vae: Any, part: str, x: Any, mesh: Any, env: Any, shapes_of: Any) -> Any:
    """HunyuanVideo-1.5's `vae.decode(x).sample` (part "decoder") or `vae._encode(x)` ("encoder",
    the posterior's moments), with the part's calls run side by side on `mesh` (`in_waves`): `x`
    CPU torch, `vae` a diffusers `AutoencoderKLHunyuanVideo15` whose `part` is jitted under torchax
    and replicated over `mesh`. Returns CPU torch. `shapes_of` is that part on PyTorch's `meta`
    device (`meta_vae`): what a tile turns into.

    diffusers' own code runs twice around the real work, so the tiling, blending and cropping are
    stock code: first with a part that only records each tile it is given (answering with an empty
    `meta` tensor of the output's shape), then, once the recorded tiles are computed in waves, with
    a part that hands back those results in order. The blending runs on the host, in the VAE's
    dtype, as diffusers runs it. Introduced in notebook `hunyuan_video` (the decode stage; notebook
    `hunyuan_tuning_and_i2v`, section 4, encodes the picture the same way)."""
    import torch
    from torchax.interop import jax_view, torch_view

    jitted, tiles = getattr(vae, part), []

    def record(tile):
        tiles.append(tile)
        dtype = next(shapes_of.parameters()).dtype
        with torch.no_grad():
            return shapes_of(torch.empty(tile.shape, dtype=dtype, device="meta"))

    def run_one(batch):
        with env:
            return jax_view(jitted(torch_view(batch)))

    try:
        setattr(vae, part, _calls(record))
        with torch.no_grad():
            _whole(vae, part, x)
        done = iter(decoding.in_waves([common.to_jax_array(t) for t in tiles], run_one, mesh))
        setattr(vae, part, _calls(lambda tile: common.to_torch(next(done))))
        with torch.no_grad():
            return _whole(vae, part, x)
    finally:
        setattr(vae, part, jitted)


def _calls(fn: Callable[[Any], Any]) -> Any:
    """A module whose forward is `fn`: what stands in for a VAE's `decoder` or `encoder` (`through_tiles`)."""
    import torch

    class Calls(torch.nn.Module):
        def forward(self, x):
            return fn(x)

    return Calls()


def meta_vae(vae_config: dict) -> Any:
    """HunyuanVideo-1.5's VAE built on PyTorch's `meta` device from the checkpoint's VAE config
    (shapes only, the config as diffusers reads it with defaults filled in, the mid-blocks'
    loop-free mask), in eval mode: its `.decoder` and `.encoder` are what `through_tiles` needs
    as `shapes_of`."""
    import torch
    from diffusers import AutoencoderKLHunyuanVideo15

    with torch.device("meta"):
        vae = AutoencoderKLHunyuanVideo15.from_config({k: v for k, v in vae_config.items() if not k.startswith("_")})
    return family.make_vae_jit_friendly(vae).eval()


def stock(source: str, request: Request, dtype: Any = None) -> tuple[Any, dict[str, Any]]:
    """Stock diffusers `HunyuanVideo15Pipeline` (with a picture `HunyuanVideo15ImageToVideoPipeline`)
    loaded from `source` (float32 unless `dtype`), its guider's scale and its scheduler's shift set
    to `request`'s (resolved against the checkpoint's configs), and the keyword arguments of the
    call that makes `request`'s video from the same seed, frames as `output_type="np"`: what the
    parity tests compare with and `tpupedia bench generate` times. Image-to-video takes the
    picture as `pictures.read` gives it and no size (stock picks it from the picture)."""
    import torch
    from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline

    from tpupedia import pictures

    cls = HunyuanVideo15Pipeline if request.image is None else HunyuanVideo15ImageToVideoPipeline
    pipe = common.load_stock(cls, source, dtype)
    request = resolve(request, family.component_configs(source))
    pipe.guider = pipe.guider.new(guidance_scale=request.guidance)
    pipe.scheduler = pipe.scheduler.from_config(pipe.scheduler.config, shift=request.shift)
    pipe.vae.enable_tiling() if request.vae_tiling else pipe.vae.disable_tiling()
    size = dict(height=request.height, width=request.width) if request.image is None else dict(
        image=pictures.read(request.image))
    return pipe, dict(prompt=request.prompt, negative_prompt=request.negative_prompt, num_frames=request.frames,
                      num_inference_steps=request.steps, generator=torch.Generator().manual_seed(request.seed),
                      output_type="np", **size)

PIPELINE = Hunyuan
run = functools.partial(common.run, Hunyuan)
run.__doc__ = common.run.__doc__
run_batch = functools.partial(common.run_batch, Hunyuan)
run_batch.__doc__ = common.run_batch.__doc__
