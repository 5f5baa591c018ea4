"""Weight-only quantization of a model's linear layers: int8 (or fp8) weights with one scale per
output channel, the scale applied after the matmul.

A `torch.nn.Linear` keeps a `(out_features, in_features)` weight. `quantize_weight` stores it as
8-bit values `q` and a float32 scale per output row, `w ≈ q * scale[:, None]`, the scale the row's
largest magnitude over the format's range (absmax: 127.5 for int8, whose values then fill
-128..127 as qwix's `quantize` fills them; 448 for fp8 e4m3fn). `QuantizedLinear` computes

    y = (x @ q.T) * scale + bias

with `q` cast to the activations' dtype inside the matmul and the product scaled in float32:
because each scale belongs to one output column of `x @ q.T`, multiplying after the matmul is the
same sum, and the compiler never builds the dequantized bf16 weight. Dequantizing first (`x @ (q * scale).T`) is the same
arithmetic, but compiled for a v6e it leaves temporaries the scale-after program does not (64 MiB
for an 8192 x 8192 weight, whose bf16 copy is 128 MiB; AOT here, notebook `fewer_steps`). The matmul still runs at the bf16 rate: weight-only quantization halves
the bytes a weight takes in HBM and reads from it, not the FLOPs (fp8 matmuls run faster only on a
chip with an fp8 peak, TPU7x, and only if the activations are fp8 too, which this module does
not do).

Why not qwix's model interception: qwix (0.1.8) quantizes a Flax module's `dot_general`s by
intercepting them inside the module, and outside one, as torchax's linears are, it raises
"Current module is not known". Its array functions do work on jax 0.10.2, and
`tests/test_quantize.py` checks this module's values, scales and products against its
`quantize` and `dot_general`.

`quantize_linears(module, fmt, keep)` swaps every `Linear` whose qualified name no `keep` regex
matches, on the host, before the module is sharded: the 8-bit values take the weight's name, so a
family's sharding table still places them; a scale is one float per output channel. Introduced in
notebook `fewer_steps`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from tpupedia.errors import TpupediaError

__all__ = ["FORMATS", "Format", "QuantizeError", "quantize_weight", "QuantizedLinear", "quantize_linears", "settings", "TINY_BOUNDS"]


class QuantizeError(TpupediaError, ValueError):
    """A quantization that cannot be done (an unknown format, a module with nothing to quantize)."""


@dataclass(frozen=True)
class Format:
    """A weight format: its torch dtype and the magnitude a row's absmax is scaled to."""

    name: str
    dtype: torch.dtype
    absmax: float


FORMATS = {f.name: f for f in (Format("int8", torch.int8, 127.5), Format("fp8", torch.float8_e4m3fn, 448.0))}
"""The weight formats `--quantize` takes. int8's 127.5 is qwix's absmax range (values rounded half
to even and clipped to -128..127); fp8 is e4m3fn, whose largest finite value is 448."""


TINY_BOUNDS = {"int8": {"max_abs": 0.02, "psnr_db": 50.0, "ssim": 0.999},
               "fp8": {"max_abs": 0.2, "psnr_db": 40.0, "ssim": 0.995}}
"""How far a quantized tiny run's frames (values in [0, 1]) may be from the same run unquantized,
per format: the bounds `tests/test_quantize.py` asserts for each family's tiny checkpoint, and
the results page prints beside each `tpupedia bench quantize` record. fp8's is wider: e4m3 keeps
3 mantissa bits, so a weight is off by up to 1/16 of itself, where int8's absmax scale puts every
weight of a row within 1/255 of the row's largest; the fp8 bound was set after the first
measurement here (CogVideoX's tiny run, 0.14 and 43 dB), not before it. Random tiny weights, not
the releases': quality on the real weights needs the real weights."""


def _format(fmt: str) -> Format:
    if fmt not in FORMATS:
        raise QuantizeError(f"quantize format {fmt!r}: one of {', '.join(FORMATS)}")
    return FORMATS[fmt]


def quantize_weight(weight: torch.Tensor, fmt: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """`(values, scale)` for a `(out, in)` weight: one float32 scale per output row, its absmax
    over the format's range (an all-zero row gets scale 1), and the weight over the scale rounded
    to the format (int8: half to even, clipped to -128..127)."""
    f = _format(fmt)
    w = weight.detach().to(torch.float32)
    scale = w.abs().amax(dim=1) / f.absmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scaled = w / scale[:, None]
    if f.dtype == torch.int8:
        values = scaled.round().clamp(-128, 127).to(torch.int8)
    else:
        values = scaled.to(f.dtype)
    return values, scale


class QuantizedLinear(torch.nn.Module):
    """A `Linear` with 8-bit weights and one scale per output channel, the scale applied after the
    matmul (the module docstring). `weight` holds the 8-bit values under the name the float
    weight had, `weight_scale` the scales; both are buffers, so nothing trains them."""

    def __init__(self, values: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, fmt: str):
        super().__init__()
        self.fmt = fmt
        self.in_features, self.out_features = values.shape[1], values.shape[0]
        self.register_buffer("weight", values)
        self.register_buffer("weight_scale", scale)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, fmt: str = "int8") -> "QuantizedLinear":
        values, scale = quantize_weight(linear.weight, fmt)
        return cls(values, scale, linear.bias, fmt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (torch.nn.functional.linear(x, self.weight.to(x.dtype)).to(torch.float32) * self.weight_scale).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.fmt}, scale per output channel"


def quantize_linears(module: torch.nn.Module, fmt: str = "int8", keep: Iterable[str] = ()) -> list[str]:
    """Replace, in place, every `torch.nn.Linear` of `module` whose qualified name no regex in
    `keep` fully matches by a `QuantizedLinear` of format `fmt`; return the replaced names. A
    module left with nothing to quantize is refused: a rule table that keeps every linear is a
    mistake to say, not a silent no-op."""
    _format(fmt)
    kept = [re.compile(k) for k in keep]
    names = [name for name, m in module.named_modules()
             if isinstance(m, torch.nn.Linear) and not any(k.fullmatch(name) for k in kept)]
    if not names:
        raise QuantizeError(f"{type(module).__name__}: no Linear left to quantize to {fmt} (the keep rules match all)")
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = module.get_submodule(parent) if parent else module
        setattr(owner, child, QuantizedLinear.from_linear(getattr(owner, child), fmt))
    return names


def settings(fmt: str | None) -> dict:
    """What a quantized run adds to its denoise stage's settings (the stage file's fingerprint):
    `{"quantize": fmt}`, or nothing without one, so unquantized stage files keep their fingerprint."""
    return {} if fmt is None else {"quantize": fmt}
