"""HunyuanVideo-1.5: the family's facts and a jit-friendly transformer forward.

Facts: the 720p text-to-video checkpoint's transformer (54 dual-stream blocks, 16 heads of 128),
its frame rule (4n+1: the VAE compresses time by 4 and keeps the first frame), latent shapes,
the text slots every step carries (1000 Qwen2.5-VL tokens, 256 ByT5 glyph tokens, 729 image
tokens, zeros for text-to-video), FLOPs of a step, tiny configs for CPU, and how the dry-run
builds and calls it.

The forward: diffusers' `HunyuanVideo15Transformer3DModel.forward` (diffusers 0.42.1) cannot be
traced by `jax.jit`, for two reasons:

1. `is_t2v = torch.all(image_embeds == 0)` feeds a Python `if`, which asks a tracer for its
   truth value (`ConcretizationTypeError ... depends on the value of the argument image_embeds`);
2. the text tokens are reordered with boolean-mask indexing (`text[text_mask]`), whose output
   shape depends on the data.

`static_forward` keeps the computation and replaces the two constructs: the branch becomes a
`torch.where`, and the reorder becomes a stable argsort that puts valid tokens first in their
original order, followed by a gather, with the attention mask gathered the same way. On torch CPU
it is bit-identical to the stock forward, with and without padded tokens (tests/test_hunyuan.py).
Use it as `make_static(module)` or pass it to `JittableModule.functional_call`.

Introduced for the dry-run planner of notebook 09; the HunyuanVideo-1.5 lesson (07) explains it.
"""

from __future__ import annotations

import types
from typing import Any

__all__ = ["FAMILY", "FULL_ID", "FULL_LAYERS", "TEMPORAL_COMPRESSION", "SPATIAL_COMPRESSION", "TEXT_SLOTS",
           "full_transformer_config", "tiny_transformer_config", "tiny_vae_config", "latent_frames",
           "step_flops", "build", "step_inputs", "static_forward", "make_static"]

FAMILY = "hunyuan"
FULL_ID = "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v"
FULL_LAYERS = 54
TEMPORAL_COMPRESSION = 4
SPATIAL_COMPRESSION = 16  # the VAE (16x) times patch size 1: one token per latent pixel
TEXT_SLOTS = {"qwen": (1000, 3584), "byt5": (256, 1472), "image": (729, 1152)}
"""Tokens and width of each conditioning slot of a step (text-to-video passes a zero image)."""


def full_transformer_config(layers: int | None = None) -> dict[str, Any]:
    """The 720p t2v transformer: diffusers' defaults (54 layers, 16 heads of 128, MLP ratio 4,
    Qwen2.5-VL text width 3584, ByT5 width 1472), task `t2v`."""
    return dict(num_layers=FULL_LAYERS if layers is None else layers, task_type="t2v")


def tiny_transformer_config() -> dict[str, Any]:
    """2 blocks, 2 heads of 8, patch 1 (its 2048-wide glyph projection is hard-coded upstream)."""
    return dict(in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
                num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16,
                text_embed_2_dim=32, image_embed_dim=12, rope_axes_dim=(2, 2, 4), target_size=16, task_type="t2v")


def tiny_vae_config() -> dict[str, Any]:
    """A 2-level `AutoencoderKLHunyuanVideo15`, 16 channels wide (4x spatial, 2x temporal)."""
    return dict(latent_channels=4, block_out_channels=(16, 16), layers_per_block=1, spatial_compression_ratio=4,
                temporal_compression_ratio=2, downsample_match_channel=False, upsample_match_channel=False)


def latent_frames(frames: int) -> int:
    """Latent frames for `frames` (4n+1) video frames."""
    return (frames - 1) // TEMPORAL_COMPRESSION + 1


def step_flops(width: int, height: int, frames: int, layers: int = FULL_LAYERS, batch: int = 2,
               heads: int = 16, head_dim: int = 128, text_tokens: int = 1256, mlp_ratio: float = 4.0) -> dict[str, float]:
    """Matmul FLOPs of one step: dual-stream blocks, so every token (video and text) goes through
    q, k, v, out (4 d^2) and the MLP (2 * mlp_ratio * d^2) once per layer."""
    d = heads * head_dim
    s = latent_frames(frames) * (height // SPATIAL_COMPRESSION) * (width // SPATIAL_COMPRESSION) + text_tokens
    linear = batch * layers * 2 * s * (4 + 2 * mlp_ratio) * d * d
    attention = batch * layers * 4 * s * s * d
    return {"tokens": s, "linear": float(linear), "attention": float(attention), "total": float(linear + attention)}


def build(layers: int | None = None, device: str = "meta", dtype: Any = None):
    """The full transformer (shapes only on `meta`), bf16 by default."""
    import torch
    from diffusers import HunyuanVideo15Transformer3DModel

    with torch.device(device):
        return HunyuanVideo15Transformer3DModel(**full_transformer_config(layers)).to(dtype or torch.bfloat16)


def step_inputs(width: int, height: int, frames: int, batch: int = 2) -> tuple[list, Any]:
    """`(input specs, call)` for the dry-run: latents with the transformer's 65 input channels
    (32 latent + 32 condition + 1 mask), the timestep and the three conditioning slots, batch on `dp`."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    (qwen, qwen_w), (byt5, byt5_w), (image, image_w) = TEXT_SLOTS.values()
    t = latent_frames(frames)
    specs = [
        ((batch, 65, t, height // SPATIAL_COMPRESSION, width // SPATIAL_COMPRESSION), jnp.bfloat16, P("dp")),
        ((batch,), jnp.int32, P("dp")),
        ((batch, qwen, qwen_w), jnp.bfloat16, P("dp")),
        ((batch, qwen), jnp.int32, P("dp")),
        ((batch, byt5, byt5_w), jnp.bfloat16, P("dp")),
        ((batch, byt5), jnp.int32, P("dp")),
        ((batch, image, image_w), jnp.bfloat16, P("dp")),
    ]

    def call(fm, w, b, x, ts, text, mask, text2, mask2, img):
        return fm(w, b, x, ts, text, mask, encoder_hidden_states_2=text2, encoder_attention_mask_2=mask2,
                  image_embeds=img, return_dict=False)[0]

    return specs, call


def static_forward(self, hidden_states, timestep, encoder_hidden_states, encoder_attention_mask,
                   timestep_r=None, encoder_hidden_states_2=None, encoder_attention_mask_2=None,
                   image_embeds=None, attention_kwargs=None, return_dict=True):
    import torch
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    batch_size, _, num_frames, height, width = hidden_states.shape
    p_t, p_h, p_w = self.config.patch_size_t, self.config.patch_size, self.config.patch_size
    post_t, post_h, post_w = num_frames // p_t, height // p_h, width // p_w
    image_rotary_emb = self.rope(hidden_states)
    temb = self.time_embed(timestep, timestep_r=timestep_r)
    hidden_states = self.x_embedder(hidden_states)

    text = self.context_embedder(encoder_hidden_states, timestep, encoder_attention_mask)
    text = text + self.cond_type_embed(torch.zeros_like(text[:, :, 0], dtype=torch.long))
    text_2 = self.context_embedder_2(encoder_hidden_states_2)
    text_2 = text_2 + self.cond_type_embed(torch.ones_like(text_2[:, :, 0], dtype=torch.long))
    image = self.image_embedder(image_embeds)
    is_t2v = torch.all(image_embeds == 0)
    image = torch.where(is_t2v, image * 0.0, image)  # was a Python `if is_t2v:`
    image_mask = (~is_t2v).expand(batch_size, image.shape[1])
    image = image + self.cond_type_embed(2 * torch.ones_like(image[:, :, 0], dtype=torch.long))

    mask_1, mask_2 = encoder_attention_mask.bool(), encoder_attention_mask_2.bool()
    tokens = torch.cat([image, text_2 * mask_2[..., None], text * mask_1[..., None]], dim=1)
    valid = torch.cat([image_mask, mask_2, mask_1], dim=1)
    order = torch.argsort((~valid).to(torch.int32), dim=1, stable=True)  # valid first, order kept
    encoder_hidden_states = torch.gather(tokens, 1, order[..., None].expand_as(tokens))
    encoder_attention_mask = torch.gather(valid, 1, order)

    for block in self.transformer_blocks:
        hidden_states, encoder_hidden_states = block(hidden_states, encoder_hidden_states, temb,
                                                     encoder_attention_mask, image_rotary_emb)
    hidden_states = self.proj_out(self.norm_out(hidden_states, temb))
    hidden_states = hidden_states.reshape(batch_size, post_t, post_h, post_w, -1, p_t, p_h, p_w)
    hidden_states = hidden_states.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3)
    return (hidden_states,) if not return_dict else Transformer2DModelOutput(sample=hidden_states)


def make_static(module):
    """Replace `module.forward` with `static_forward`. Returns `module`."""
    module.forward = types.MethodType(static_forward, module)
    return module
