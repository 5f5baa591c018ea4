"""Image preprocessing written in plain torch, so it runs on torch CPU, CUDA and torchax alike.

The three steps of a typical video-model preprocessing pipeline, each in the form that
compiles well under `jax.jit` (through torchax's `jax_jit`):

* **crop** around a mask. `mask_bbox` finds the box with reductions and `argmax`, so its
  output has a fixed shape (four numbers) and it can be jitted; cutting the image to that box
  cannot, because the crop's shape would depend on the data. Either bring the box to the host
  (`box.tolist()`) and slice there (`crop`), or cut a fixed-size window (`window_crop`).
* **resize** the short side to a multiple of 16 (`target_size`), bilinear without antialiasing
  (`resize_bilinear`, as OpenCV does). `resize_matmul` is the same resize written as two
  matrix products, the form a TPU's matrix unit likes, with the dtype of the sampling
  coordinates as an explicit argument: in bfloat16 they are wrong by whole pixels.
* **blur** with a separable Gaussian (`gaussian_blur`), two depthwise `conv2d`s with reflect
  padding, matching torchvision's `gaussian_blur`.

Output sizes are Python integers computed from input shapes, so a jitted pipeline compiles
once per input size. Introduced in notebook `image_processing` (image processing GPU to TPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "mask_bbox",
    "expand_box",
    "crop",
    "window_crop",
    "target_size",
    "resize_bilinear",
    "interpolation_matrix",
    "resize_matmul",
    "gaussian_kernel1d",
    "gaussian_blur",
]


def _first_true(flags: torch.Tensor) -> torch.Tensor:
    return torch.argmax(flags.to(torch.int32))


def mask_bbox(mask: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    """Bounding box `(top, bottom, left, right)` (bottom/right exclusive) of `mask > threshold`.

    `mask` is `(..., H, W)`; all leading dimensions (frames, channels) are united first. The
    result is a 4-element integer tensor on `mask`'s device, computed without `nonzero`, so the
    function can be jitted. An empty mask gives `(0, H, 0, W)`, the whole image.
    """
    on = mask > threshold
    if on.dim() > 2:
        on = on.flatten(0, -3).any(0)
    rows, cols = on.any(1), on.any(0)
    h, w = on.shape
    empty = ~rows.any()
    top = torch.where(empty, 0, _first_true(rows))
    bottom = torch.where(empty, h, h - _first_true(rows.flip(0)))
    left = torch.where(empty, 0, _first_true(cols))
    right = torch.where(empty, w, w - _first_true(cols.flip(0)))
    return torch.stack([top, bottom, left, right])


def expand_box(box, image_hw: tuple[int, int], pad_ratio: float = 0.5,
               multiple: int = 2) -> tuple[int, int, int, int]:
    """Grow a `(top, bottom, left, right)` box by `pad_ratio` of its size on every side.

    Host-side arithmetic on Python integers: the box is clipped to the image, and its height
    and width are rounded down to a multiple of `multiple` (even, by default).
    """
    top, bottom, left, right = (int(v) for v in box)
    h, w = image_hw
    pad_y = int(round((bottom - top) * pad_ratio))
    pad_x = int(round((right - left) * pad_ratio))
    top, bottom = max(0, top - pad_y), min(h, bottom + pad_y)
    left, right = max(0, left - pad_x), min(w, right + pad_x)
    bottom = top + (bottom - top) // multiple * multiple
    right = left + (right - left) // multiple * multiple
    return top, bottom, left, right


def crop(image: torch.Tensor, box) -> torch.Tensor:
    """`image[..., top:bottom, left:right]` for a box of Python integers (not jittable as one
    program with the box computation: the output shape depends on the box)."""
    top, bottom, left, right = (int(v) for v in box)
    return image[..., top:bottom, left:right]


def window_crop(image: torch.Tensor, center: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """A fixed `size = (h, w)` window of `image` centred on `center = (y, x)`, kept inside.

    `center` may be a device tensor (for example from `mask_bbox`); the output shape depends
    only on `size`, so this function jits to one program for every center.
    """
    h, w = size
    height, width = image.shape[-2], image.shape[-1]
    y0 = torch.clamp(center[0] - h // 2, 0, height - h)
    x0 = torch.clamp(center[1] - w // 2, 0, width - w)
    rows = y0 + torch.arange(h, device=image.device)
    cols = x0 + torch.arange(w, device=image.device)
    return image.index_select(-2, rows).index_select(-1, cols)


def target_size(height: int, width: int, short: int = 640, max_long: int = 1280,
                multiple: int = 16) -> tuple[int, int]:
    """Output `(h, w)`: short side to `short`, long side at most `max_long`, aspect kept,
    both rounded down to a multiple of `multiple`."""
    scale = short / min(height, width)
    scale = min(scale, max_long / max(height, width))
    h = max(multiple, int(height * scale + 1e-6) // multiple * multiple)  # 1e-6: 720 * (640/720)
    w = max(multiple, int(width * scale + 1e-6) // multiple * multiple)
    return h, w


def resize_bilinear(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Bilinear resize of `(N, C, H, W)` to `size`, half-pixel centres, no antialiasing."""
    return F.interpolate(image, size=size, mode="bilinear", align_corners=False, antialias=False)


def interpolation_matrix(n_in: int, n_out: int, dtype: torch.dtype = torch.float32,
                         coord_dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The `(n_out, n_in)` matrix of bilinear weights that `resize_bilinear` applies on one axis.

    Sample positions are computed in `coord_dtype`, the weights are cast to `dtype`. Each row
    has at most two non-zero weights that sum to 1.
    """
    scale = n_in / n_out
    src = (torch.arange(n_out, dtype=coord_dtype, device=device) + 0.5) * scale - 0.5
    src = src.clamp(min=0)
    floor = src.floor()
    frac = (src - floor).to(dtype)
    i0 = floor.to(torch.int32).clamp(max=n_in - 1)
    i1 = (i0 + 1).clamp(max=n_in - 1)
    cols = torch.arange(n_in, device=device, dtype=torch.int32)
    w0 = (cols[None, :] == i0[:, None]).to(dtype) * (1 - frac)[:, None]
    w1 = (cols[None, :] == i1[:, None]).to(dtype) * frac[:, None]
    return w0 + w1


def resize_matmul(image: torch.Tensor, size: tuple[int, int],
                  coord_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`resize_bilinear` as two matrix products, `Wy @ image @ Wx.T`, in `image`'s dtype.

    `coord_dtype` is the dtype of the sampling positions; keep it `float32`.
    """
    wy = interpolation_matrix(image.shape[-2], size[0], image.dtype, coord_dtype, image.device)
    wx = interpolation_matrix(image.shape[-1], size[1], image.dtype, coord_dtype, image.device)
    return wy @ image @ wx.T


def gaussian_kernel1d(kernel_size: int, sigma: float, dtype: torch.dtype = torch.float32,
                      device=None) -> torch.Tensor:
    """Normalised 1-D Gaussian taps, the same as torchvision's `gaussian_blur` uses."""
    half = (kernel_size - 1) / 2
    x = torch.linspace(-half, half, kernel_size, dtype=dtype, device=device)
    taps = torch.exp(-0.5 * (x / sigma) ** 2)
    return taps / taps.sum()


def gaussian_blur(image: torch.Tensor, kernel_size: int = 7, sigma: float = 1.5) -> torch.Tensor:
    """Separable Gaussian blur of `(N, C, H, W)`: reflect padding, then a horizontal and a
    vertical depthwise `conv2d`, in `image`'s dtype."""
    channels = image.shape[1]
    taps = gaussian_kernel1d(kernel_size, sigma, image.dtype, image.device)
    pad = kernel_size // 2
    x = F.pad(image, (pad, pad, pad, pad), mode="reflect")
    x = F.conv2d(x, taps.view(1, 1, 1, kernel_size).expand(channels, 1, 1, kernel_size),
                 groups=channels)
    return F.conv2d(x, taps.view(1, 1, kernel_size, 1).expand(channels, 1, kernel_size, 1),
                    groups=channels)
