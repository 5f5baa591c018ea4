"""A jit-friendly forward for diffusers' `HunyuanVideo15Transformer3DModel` (diffusers 0.42.1).

The stock forward cannot be traced by `jax.jit`, for two reasons:

1. `is_t2v = torch.all(image_embeds == 0)` feeds a Python `if`, which asks a tracer for its
   truth value (`ConcretizationTypeError ... depends on the value of the argument image_embeds`);
2. the text tokens are reordered with boolean-mask indexing (`text[text_mask]`), whose output
   shape depends on the data.

`static_forward` keeps the computation and replaces the two constructs: the branch becomes a
`torch.where`, and the reorder becomes a stable argsort that puts valid tokens first in their
original order, followed by a gather, with the attention mask gathered the same way. On torch CPU
it is bit-identical to the stock forward (max abs diff 0.0, with and without padded tokens;
verified in the stack probe). Use it as `module.forward = types.MethodType(static_forward,
module)` or pass it to `JittableModule.functional_call`.

Introduced for the dry-run planner of notebook 09; the HunyuanVideo-1.5 lesson explains it.
"""

from __future__ import annotations

import types

import torch

__all__ = ["static_forward", "make_static"]


def static_forward(self, hidden_states, timestep, encoder_hidden_states, encoder_attention_mask,
                   timestep_r=None, encoder_hidden_states_2=None, encoder_attention_mask_2=None,
                   image_embeds=None, attention_kwargs=None, return_dict=True):
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
