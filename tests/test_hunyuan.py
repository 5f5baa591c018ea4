"""The jit-friendly HunyuanVideo-1.5 forward is the stock forward, op for op, on torch CPU."""

import pytest
import torch
from diffusers import HunyuanVideo15Transformer3DModel

from tpupedia.models.hunyuan import make_static, static_forward, tiny_transformer_config


def _tiny():
    torch.manual_seed(0)
    return HunyuanVideo15Transformer3DModel(**tiny_transformer_config()).eval()


@pytest.mark.parametrize("padded", [False, True])
def test_static_forward_equals_stock_forward(padded):
    model = _tiny()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 9, 3, 4, 4, generator=g)
    t = torch.tensor([500.0])
    text, text_2 = torch.randn(1, 6, 16, generator=g), torch.randn(1, 5, 32, generator=g)
    mask, mask_2 = torch.ones(1, 6, dtype=torch.long), torch.ones(1, 5, dtype=torch.long)
    if padded:
        mask[:, 4:] = 0
        mask_2[:, 3:] = 0
    image = torch.zeros(1, 4, 12)  # text-to-video: no image conditioning
    kwargs = dict(encoder_hidden_states_2=text_2, encoder_attention_mask_2=mask_2, image_embeds=image, return_dict=False)
    with torch.no_grad():
        stock = model(x, t, text, mask, **kwargs)[0]
        static = static_forward(model, x, t, text, mask, **kwargs)[0]
        via_method = make_static(model)(x, t, text, mask, **kwargs)[0]
    assert torch.equal(static, stock)
    assert torch.equal(via_method, stock)
