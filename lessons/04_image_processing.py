# ---
# jupyter:
#   jupytext:
#     formats: notebooks///ipynb,lessons///py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · Image processing, GPU → TPU: crop, resize, blur
#
# Before a video model sees a frame, the frame is usually cropped around a subject, resized so
# its sides are multiples of 16 (the model's patch grid) and sometimes blurred. On a GPU this is
# a handful of torch calls that nobody thinks about. Moved to a TPU through torchax, the same
# calls raise three questions, and this notebook answers each with a measurement:
#
# 1. **Shapes.** A crop whose size depends on the mask cannot be compiled as one program. Why,
#    and the two ways around it.
# 2. **Speed.** Eager torchax runs one small JAX program per torch op; `jax_jit` fuses the
#    whole pipeline. How big is the gap, and when does it recompile?
# 3. **Precision.** Is bfloat16 good enough for preprocessing? We measure the error against a
#    float32 CPU reference and find which part of the pipeline has to stay in float32.
#
# The third answer is why this notebook comes before the attention kernel, the VAE and the
# pipelines: it sets the precision rules they all apply. What bfloat16 breaks and what stays in
# float32 (section 7), and how a parity check asks a TPU for full-precision matmuls while a
# timed path keeps the fast default (section 6).
#
# The functions live in `tpupedia.image`; they are plain torch, so the same code runs on torch
# CPU (our reference), on CUDA, and through torchax on a TPU.
#
# | preset | loads | memory | compute time |
# |---|---|---|---|
# | `tiny` (CPU, CI) | a synthetic 360×640 clip drawn in code | about 1.5 GB of host RAM | about 20 s, measured here on a 2-core CPU |
# | `full` (TPU v6e-8) | the same clip drawn at 1080×1920 | tens of MB on one chip | seconds (reported upstream for these steps on a v6e-8: well under a second each after compiling; not measured here) |
#
# *Reading time: about 26 minutes.*

# %% [markdown]
# ## 0. Set-up
#
# As in every notebook: read the preset, then fix the device set-up before JAX starts. The
# preset also picks the frame size: a 360×640 frame on `tiny`, a full-HD 1080×1920 frame on
# `full` (the size the upstream experiments used).

# %%
# %xmode Minimal
# On Colab or Kaggle: fetch and install the course once, then work in its notebooks/ folder;
# anywhere else this does nothing.
import os
import sys

if "google.colab" in sys.modules or "KAGGLE_KERNEL_RUN_TYPE" in os.environ:
    raise RuntimeError("this copy of the course names no public repository to install from: clone the "
                       "course yourself, install it as its README says, and open its notebooks/ folder")
# (end of the hosted-runtime setup: python -m tpupedia.notebooks hosted writes the lines above)

from tpupedia import session

preset = session.start()  # preset, simulated devices, known warnings silenced (notebook `hf_model_in_jax`)
FRAME_HW = preset.frame_size
print(preset.name, FRAME_HW)

# %% [markdown]
# torchax is imported only through `tpupedia.compat` (it patches an incompatibility with
# PyTorch 2.13), and all torchax work happens inside one `with env:` block per cell.

# %%
import time

import jax
import numpy as np
import torch
import torch.nn.functional as F

from tpupedia import image
from tpupedia.torchax_utils import default_env

env = default_env()  # imports torchax through the shim; only then import from torchax
from torchax.interop import jax_jit  # noqa: E402

print(jax.device_count(), "devices,", jax.devices()[0].platform)

# %% [markdown]
# ## 1. A synthetic frame and its mask
#
# No downloads: we draw a frame with NumPy. Smooth colour gradients, a fine sinusoidal texture
# (the kind of detail a resize can get wrong) and two sharp-edged shapes. The frame is `uint8`,
# as a decoded video frame would be, and the *mask* marks the subject: a disc, a little larger
# than the red ball it covers. A second frame moves and shrinks the subject, which will matter
# for compilation.

# %%
def draw_frame(hw, center, radius):
    h, w = hw
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    rgb = np.stack([xx / w, yy / h, 0.5 + 0.4 * np.sin(xx / 5.0) * np.cos(yy / 7.0)], axis=-1)
    rgb[(yy > 0.6 * h) & (xx < 0.3 * w)] = (0.1, 0.3, 0.9)  # a blue block
    cy, cx = center[0] * h, center[1] * w
    r = radius * h
    ball = (yy - cy) ** 2 + (xx - cx) ** 2 < r**2
    rgb[ball] = (0.9, 0.15, 0.1)
    mask = ((yy - cy) ** 2 + (xx - cx) ** 2 < (1.15 * r) ** 2).astype(np.float32)
    frame = np.round(rgb * 255).astype(np.uint8).transpose(2, 0, 1)  # (3, H, W)
    return torch.from_numpy(frame)[None], torch.from_numpy(mask)[None, None]


frame, mask = draw_frame(FRAME_HW, center=(0.45, 0.62), radius=0.17)
frame2, mask2 = draw_frame(FRAME_HW, center=(0.35, 0.30), radius=0.12)
print(tuple(frame.shape), frame.dtype, tuple(mask.shape), mask.dtype)

# %%
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, 3, figsize=(12, 2.6))
axes[0].imshow(frame[0].permute(1, 2, 0).numpy())
axes[0].set_title("frame")
axes[1].imshow(mask[0, 0].numpy(), cmap="gray")
axes[1].set_title("mask")
axes[2].imshow(frame2[0].permute(1, 2, 0).numpy())
axes[2].set_title("frame 2 (smaller subject)")
for ax in axes:
    ax.axis("off")
plt.show()

# %% tags=["check"]
assert frame.dtype == torch.uint8 and frame.shape == (1, 3, *FRAME_HW)
assert set(mask.unique().tolist()) == {0.0, 1.0} and 0 < mask.mean() < 0.5

# %% [markdown]
# The models want floats in [-1, 1]. One 8-bit step of the input is then `2/255 ≈ 0.0078`;
# we will measure errors in those steps, because a preprocessing error smaller than one input
# step is invisible, and one larger than it is not.

# %%
LEVEL = 2 / 255


def normalise(frame_u8, dtype=torch.float32):
    return frame_u8.to(dtype) / 127.5 - 1


x = normalise(frame)
print(f"range [{x.min().item():.0f}, {x.max().item():.0f}], one 8-bit level = {LEVEL:.4f}")

# %% [markdown]
# ## 2. Crop: a shape that depends on the data
#
# The GPU recipe: find the mask's bounding box, pad it by half its size on each side, cut. On a
# GPU the box is read back with `.tolist()` and nobody notices. Under `jax.jit`, though, every
# array shape must be known when the program is compiled, *before* the data exists, and the
# size of this crop is a property of the data. Here is the straightforward torch version,
# jitted:

# %%
def naive_crop(x, mask):
    ys, xs = torch.nonzero(mask[0, 0] > 0.5, as_tuple=True)
    return x[..., ys.min() : ys.max() + 1, xs.min() : xs.max() + 1]


with env:
    print("eager torchax:", tuple(naive_crop(x.to("jax"), mask.to("jax")).shape))

# %% [markdown]
# The error message ends with the path of the torchax file being traced, which differs from
# machine to machine, so this cell catches the error and prints its first two lines:

# %%
try:
    with env:
        jax_jit(naive_crop)(x.to("jax"), mask.to("jax"))
except jax.errors.ConcretizationTypeError as err:
    jit_error = err
    print(f"{type(err).__name__}:", "\n".join(str(err).splitlines()[:2]))
assert isinstance(jit_error, jax.errors.ConcretizationTypeError) and "nonzero" in str(jit_error)

# %% [markdown]
# The error is JAX refusing to trace `nonzero`: its output length is the number of masked
# pixels, unknown at compile time. (Eager torchax got away with it because, op by op, each
# result is concrete before the next op runs.) The box itself, though, is just four numbers.
# `image.mask_bbox` computes it with `any` and `argmax`, which have fixed output shapes, so
# *that* part compiles. What cannot compile is slicing with those numbers. Two fixes:
#
# * **Box on the device, cut on the host.** Jit the box, bring four integers back with
#   `.tolist()` (one small device→host sync), then slice. Later steps compile once per crop
#   size.
# * **Fixed-size window.** If the model accepts a fixed crop size, cut a window of that size
#   centred on the box. Only the *position* depends on the data, and a position can be traced,
#   so the box and the cut compile into one program for every frame.

# %%
with env:
    jit_bbox = jax_jit(image.mask_bbox)
    box = jit_bbox(mask.to("jax")).cpu().tolist()  # the host sync: four integers
crop_box = image.expand_box(box, FRAME_HW, pad_ratio=0.5)
crop = image.crop(x, crop_box)
print("mask box (top, bottom, left, right):", box)
print("padded crop box:", crop_box, "-> crop", tuple(crop.shape))


# %%
WINDOW = (crop.shape[-2], crop.shape[-2])  # a fixed square window, here the first crop's height


def window_crop(x, mask):
    top, bottom, left, right = image.mask_bbox(mask)
    return image.window_crop(x, torch.stack([(top + bottom) // 2, (left + right) // 2]), WINDOW)


with env:
    jit_window = jax_jit(window_crop)
    windows = [jit_window(normalise(f).to("jax"), m.to("jax")).cpu() for f, m in ((frame, mask), (frame2, mask2))]
print("window crops:", [tuple(w.shape) for w in windows])

# %% [markdown]
# Both fixes agree with a CPU reference that uses `nonzero`, the way the GPU code did.

# %%
ys, xs = torch.nonzero(mask[0, 0] > 0.5, as_tuple=True)
assert box == [ys.min().item(), ys.max().item() + 1, xs.min().item(), xs.max().item() + 1]
assert crop.shape[-2] % 2 == 0 and crop.shape[-1] % 2 == 0
cy, cx = (box[0] + box[1]) // 2, (box[2] + box[3]) // 2
expected = x[..., cy - WINDOW[0] // 2 : cy - WINDOW[0] // 2 + WINDOW[0], cx - WINDOW[1] // 2 : cx - WINDOW[1] // 2 + WINDOW[1]]
assert torch.equal(windows[0], expected)
assert windows[0].shape == windows[1].shape  # one shape, so one compiled program, for every frame

# %% [markdown]
# ## 3. Resize: short side to a multiple of 16
#
# Patch-based models need both sides divisible by 16. `image.target_size` scales the short
# side to 640, caps the long side at 1280 and rounds both down to a multiple of 16. The output
# size is computed in Python from the input *shape*, so it is a compile-time constant: a
# jitted resize is compiled once per distinct input size. We resize bilinearly without
# antialiasing (what OpenCV's `INTER_LINEAR` does, and what the upstream pipeline used);
# torchax implements `F.interpolate` for that case, and, through `jax.image`, with
# `antialias=True` too.

# %%
size = image.target_size(*crop.shape[-2:])
size2 = image.target_size(*image.crop(normalise(frame2), image.expand_box(
    image.mask_bbox(mask2).tolist(), FRAME_HW)).shape[-2:])
print("crop", tuple(crop.shape[-2:]), "->", size, "| frame 2 crop ->", size2)

# %% [markdown]
# To see recompilation, the resize below counts how often it is *traced*. Python code inside a
# jitted function runs only while JAX traces it, so the counter counts compilations. The size
# is a static argument (a Python tuple, part of the compile key).

# %%
traces = []


def resize_counted(x, size):
    traces.append(tuple(x.shape))
    return image.resize_bilinear(x, size)


with env, jax.default_matmul_precision("highest"):  # parity checks ask for full fp32 (section 6)
    jit_resize = jax_jit(resize_counted, kwargs_for_jax_jit={"static_argnums": (1,)})
    for _ in range(3):
        jit_resize(crop.to("jax"), size)
    jit_resize(crop[..., :, :-16].to("jax"), size)  # a different input width, same output size
    resized = jit_resize(crop.to("jax"), size).cpu()
print(f"5 calls, {len(traces)} compilations, for input shapes {traces}")

# %% tags=["check"]
assert len(traces) == 2  # one per distinct input shape; repeated shapes reuse the program
assert resized.shape[-2:] == size and size[0] % 16 == 0 and size[1] % 16 == 0
torch.testing.assert_close(resized, image.resize_bilinear(crop, size), atol=1e-5, rtol=0)

# %% [markdown]
# ### Exercise 1: which calls recompile the resize
#
# `jit_resize` has been traced twice so far. Call it four more times, under the same precision
# context: the same crop and size again; the crop flipped left to right, same size; the crop
# with half the output size, `(size[0] // 2, size[1] // 2)`; and the crop 16 rows shorter, same
# size. **Predict** which of the four calls trace again (the counter `traces` grows by one per
# trace), remembering what is part of the compile key: input shapes and dtypes, and static
# arguments, never values. Then open the solution, run it, and compare.

# %% tags=["solution"]
calls = {
    "same crop, same size": (crop, size),
    "flipped crop (new values)": (crop.flip(-1), size),
    "half the size (new static argument)": (crop, (size[0] // 2, size[1] // 2)),
    "16 rows shorter (new shape)": (crop[..., :-16, :], size),
}
retraced = {}
with env, jax.default_matmul_precision("highest"):  # the context is part of the key as well
    for name, (image_in, out_size) in calls.items():
        before = len(traces)
        jit_resize(image_in.to("jax"), out_size)
        retraced[name] = len(traces) - before
for name, n in retraced.items():
    print(f"{name:36s} traced again: {n}")

# %% tags=["check"]
assert retraced == {"same crop, same size": 0, "flipped crop (new values)": 0,
                    "half the size (new static argument)": 1, "16 rows shorter (new shape)": 1}
assert len(traces) == 4

# %% [markdown]
# In a real pipeline every crop has its own size, and every new size costs a compilation. The
# fixed-size window of section 2 avoids that; so does rounding crop sizes up to a few
# *buckets* and padding.
#
# ## 4. Blur: a separable Gaussian as two convolutions
#
# A 7×7 Gaussian (σ = 1.5, the upstream setting) is the outer product of a 7-tap 1-D Gaussian
# with itself, so one 49-tap convolution can be replaced by a horizontal and a vertical 7-tap
# pass. `image.gaussian_blur` does that with two depthwise `F.conv2d` calls
# (`groups=channels`) after reflect padding, as torchvision does. Both convolutions map onto
# XLA's convolution, which the TPU runs natively.

# %%
taps = image.gaussian_kernel1d(7, 1.5)
print("taps:", [round(t, 4) for t in taps.tolist()])
with env, jax.default_matmul_precision("highest"):  # a parity check: full fp32 convolutions (section 6)
    blurred = jax_jit(image.gaussian_blur)(resized.to("jax")).cpu()

# %%
kernel2d = (taps[:, None] * taps[None, :]).expand(3, 1, 7, 7)
direct = F.conv2d(F.pad(resized, (3, 3, 3, 3), mode="reflect"), kernel2d, groups=3)
assert blurred.shape == resized.shape
torch.testing.assert_close(blurred, direct, atol=1e-5, rtol=0)
assert blurred.std() < resized.std()  # it smooths

# %% [markdown]
# ## 5. Eager vs jit
#
# The whole per-frame pipeline, after the host-side crop: normalise, resize, blur. Eager
# torchax runs each torch op as its own small JAX computation and hands the result back to
# Python; `jax_jit` traces the function once and runs it as a single compiled XLA program.
# We warm both up (the first eager call also compiles each op), then time the steady state,
# waiting for the result with `block_until_ready`.

# %%
def pipeline(crop_u8, size):
    return image.gaussian_blur(image.resize_bilinear(normalise(crop_u8), size))


crop_u8 = image.crop(frame, crop_box)


def steady_state(fn, *args, repeats=3):
    fn(*args).jax().block_until_ready()  # warm-up: compile
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args).jax().block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def resize_stage(x, size):
    return image.resize_bilinear(normalise(x), size)


static_size = {"static_argnums": (1,)}
with env:
    crop_j = crop_u8.to("jax")
    jit_pipeline = jax_jit(pipeline, kwargs_for_jax_jit=static_size)
    start = time.perf_counter()
    out_jit = jit_pipeline(crop_j, size).cpu()
    first = time.perf_counter() - start
    out_eager = pipeline(crop_j, size).cpu()
    resized_j = resize_stage(crop_j, size)
    timings = {
        "resize": (steady_state(resize_stage, crop_j, size),
                   steady_state(jax_jit(resize_stage, kwargs_for_jax_jit=static_size), crop_j, size)),
        "blur": (steady_state(image.gaussian_blur, resized_j),
                 steady_state(jax_jit(image.gaussian_blur), resized_j)),
    }

# %%
# NBVAL_IGNORE_OUTPUT
kind = "simulated " if preset.simulated_devices else ""  # real chips on a TPU VM
print(f"measured here: {jax.devices()[0].platform}, {jax.device_count()} {kind}devices, "
      f"{tuple(crop_u8.shape[-2:])} -> {size}")
print(f"  whole pipeline, jit, first call (trace + compile + run): {first * 1e3:.0f} ms")
for stage, (eager_s, jit_s) in timings.items():
    print(f"  {stage:6s} steady state: eager {eager_s * 1e3:6.1f} ms, jit {jit_s * 1e3:6.1f} ms "
          f"({eager_s / jit_s:.1f}x)")

# %% [markdown]
# Measured here, on a 2-core CPU with simulated devices and other jobs running, the figures
# move from run to run, so no cell asserts on them. When this notebook was written the
# resize ran about ten times faster jitted: eager, its handful of small ops each pay a
# dispatch and a round trip through Python. The blur did *not* get faster: nearly all its time
# is two grouped (depthwise) convolutions, which XLA's CPU backend executes slowly, and jit
# cannot remove time spent inside one op. That is a CPU artefact; the lesson is that jit
# removes per-op overhead, and only that.
#
# For scale, reported upstream (TPU v6e-8, eager torchax, no jit, full-HD frames): the first
# run took 0.33 s for the crop, 0.34 s for the resize and 0.19 s for the blur, because every op
# compiled on first use; later runs took about 0.015 / 0.043 / 0.013 s, which is per-op
# dispatch, the cost jit removes. On a B200 GPU the same steps took 0.046 / 0.042 / 0.185 s.
#
# Only correctness is asserted: eager and jit agree with the torch CPU run of the same code.
# The timings above ran at JAX's default matmul precision, as a speed path should; the check
# below recomputes both outputs asking for full float32 convolutions, because on a TPU the
# default would already cost more than the 1e-5 it asserts (section 6 shows why).

# %%
with env, jax.default_matmul_precision("highest"):
    out_jit = jax_jit(pipeline, kwargs_for_jax_jit=static_size)(crop_j, size).cpu()
    out_eager = pipeline(crop_j, size).cpu()
reference = pipeline(crop_u8, size)  # torch on the CPU, float32
assert out_jit.shape == (1, 3, *size)
torch.testing.assert_close(out_eager, reference, atol=1e-5, rtol=0)
torch.testing.assert_close(out_jit, reference, atol=1e-5, rtol=0)

# %% [markdown]
# ## 6. Precision: bfloat16 preprocessing
#
# bfloat16 keeps float32's range but only 8 significant bits (float32 has 24): neighbouring
# values are 2⁻⁷ ≈ 0.8 % apart (its machine epsilon), so rounding to the nearest errs by at most
# 2⁻⁸ ≈ 0.4 %. It is the TPU's native matmul type, so it is tempting to run
# everything in it. Upstream, switching preprocessing to bf16 raised the maximum error from
# 0.0078 (one 8-bit level) to 1.71 (reported upstream, TPU v6e; the comparison was against an
# 8-bit OpenCV result), about 218 times worse.
#
# We compare against the float32 torch CPU run, `reference`. Four variants:
#
# * **torchax fp32**: the jitted pipeline above;
# * **torchax bf16** and **torch CPU bf16**: the same code with the pixels in bf16;
# * **bf16 coordinates**: the resize written as two matrix products (`image.resize_matmul`, the
#   form that uses the TPU's matrix unit), with the *sampling positions* computed in bf16 too,
#   which is what any hand-written resize does once the working dtype is bf16.
#
# We also measure the error of rounding the reference to 8 bits, the precision the frame came in.

# %%
def pipeline_bf16(crop_u8, size):
    return image.gaussian_blur(image.resize_bilinear(normalise(crop_u8, torch.bfloat16), size))


def pipeline_bf16_coords(crop_u8, size):
    x = normalise(crop_u8, torch.bfloat16)
    return image.gaussian_blur(image.resize_matmul(x, size, coord_dtype=torch.bfloat16))


with env:
    results = {
        "torchax fp32": out_jit,
        "torchax bf16": jax_jit(pipeline_bf16, kwargs_for_jax_jit=static_size)(crop_j, size).cpu(),
        "torchax bf16 coordinates": jax_jit(pipeline_bf16_coords, kwargs_for_jax_jit=static_size)(crop_j, size).cpu(),
    }
results["torch CPU bf16"] = pipeline_bf16(crop_u8, size)
results["torch CPU bf16 coordinates"] = pipeline_bf16_coords(crop_u8, size)
results["8-bit rounding of reference"] = torch.round((reference + 1) * 127.5) / 127.5 - 1

def fmt(value, floor=1e-5):
    """One significant digit; values below `floor` (float32 noise) as an upper bound."""
    return f"< {floor:.0e}" if value < floor else f"{value:.0e}"


errors = {name: (out.float() - reference).abs() for name, out in results.items()}
lines = [f"{'variant':30s} {'max |err|':>10s} {'mean |err|':>11s} {'max, in 8-bit levels':>21s}"]
for name, err in errors.items():
    worst = err.max().item()
    lines.append(f"{name:30s} {fmt(worst):>10s} {fmt(err.mean().item()):>11s} {fmt(worst / LEVEL, 1e-2):>21s}")
print("\n".join(lines))

# %% [markdown]
# (Errors are printed to one significant digit, and float32 noise only as an upper bound: the
# digits beyond that depend on the machine's floating-point details, the order of magnitude
# does not.)
#
# Reading the table:
#
# * **fp32 on torchax matches the CPU** to about 1e-7, float32 rounding noise, far below one
#   8-bit level.
# * **bf16 pixels cost about one 8-bit level**, on torchax and on the CPU alike: this is a
#   property of bf16, not of the TPU. Values in [0.5, 1) are stored with a step of 2⁻⁸ ≈ 0.004
#   (2⁻⁷ from 1 to 2), and every op rounds again.
# * **bf16 coordinates are about two orders of magnitude worse still.** Sampling positions run
#   up to the crop's width; above 256 a bf16 number cannot even hold every integer (its step is
#   2 between 256 and 512), so samples land on the wrong pixel and every sharp edge is smeared
#   or shifted. The error reaches a large fraction of the full [-1, 1] range, as upstream's
#   1.71 did.
#
# So the upstream finding reproduces: relative to the precision the frame arrived in (and that
# the upstream reference, an 8-bit OpenCV image, had), fp32 preprocessing is within about one
# 8-bit level and bf16 preprocessing is about two orders of magnitude worse. Against a float32
# reference, the gap between fp32 and bf16 is four to six orders.

# %%
max_err = {name: err.max().item() for name, err in errors.items()}
assert max_err["torchax fp32"] <= 1e-5
assert max_err["8-bit rounding of reference"] <= LEVEL / 2 + 1e-6
assert 0.5 * LEVEL < max_err["torchax bf16"] < 3 * LEVEL
assert 0.5 * LEVEL < max_err["torch CPU bf16"] < 3 * LEVEL
assert max_err["torchax bf16 coordinates"] > 0.1
ratio_vs_bf16_pixels = max_err["torchax bf16 coordinates"] / max_err["torchax bf16"]
ratio_vs_8bit = max_err["torchax bf16 coordinates"] / max_err["8-bit rounding of reference"]
ratio_vs_fp32 = max_err["torchax bf16"] / max_err["torchax fp32"]
assert ratio_vs_bf16_pixels >= 30 and ratio_vs_8bit >= 30 and ratio_vs_fp32 >= 1e3
print(f"bf16 coordinates vs bf16 pixels: ~10^{np.log10(ratio_vs_bf16_pixels):.0f} times the error")
print(f"bf16 coordinates vs 8-bit rounding (upstream's setting): ~10^{np.log10(ratio_vs_8bit):.0f}")
print(f"bf16 pixels vs fp32 pixels: more than 10^{np.floor(np.log10(ratio_vs_fp32)) - 1:.0f} times the error")

# %% [markdown]
# The error map shows where it goes: the bf16-coordinate error follows the edges of the ball,
# the block and the fine texture, because those are where a misplaced sample changes the value
# most.

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
for ax, name in zip(axes, ["torchax bf16", "torchax bf16 coordinates"]):
    im = ax.imshow(errors[name][0].amax(0).numpy() / LEVEL, cmap="magma")
    ax.set_title(f"{name}: |err| in 8-bit levels")
    ax.axis("off")
    fig.colorbar(im, ax=ax, fraction=0.03)
plt.show()

# %% [markdown]
# ### A third precision: what a TPU does with float32 by default
#
# There is one more bf16 in this story, and it is invisible in the code: on a TPU, JAX runs a
# float32 matmul or convolution at `Precision.DEFAULT`, which the matrix unit carries out as a
# single bfloat16 pass (JAX's `jax.lax.Precision` documentation: `HIGH` takes three bf16
# passes, `HIGHEST` full float32). So "torchax fp32" in the table above is float32 only because
# a CPU ignores the setting; on a TPU its convolutions would round their inputs to 8 significant
# bits. A CPU cannot show that error, but it can show the request, and where it survives: in the
# lowered program of the blur, and in the program the TPU compiler builds for a v6e (AOT here).

# %%
import re

from torchax.interop import jax_view

from tpupedia import aot, devices


def conv_precisions(text):
    return sorted(set(re.findall(r"precision_config = \[#stablehlo<precision (\w+)>", text)))


blur_jax = jax.jit(jax_view(image.gaussian_blur))  # the same torch function, as a JAX function
with env:
    resized_jax = resized.to("jax").jax()
lowered = {"default": blur_jax.lower(resized_jax).as_text()}
with jax.default_matmul_precision("highest"):
    lowered["highest"] = blur_jax.lower(resized_jax).as_text()
for name, text in lowered.items():
    print(f"{name:>8}: {text.count('stablehlo.convolution')} convolutions, precision {conv_precisions(text)}")

# %% [markdown]
# The same request on a matmul compiled for a `v6e:2x4` slice: the TPU compiler keeps it on
# the instruction (`operand_precision={highest,highest}`); at the default there is none, and
# the chip takes its fast path.

# %%
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

one_chip = NamedSharding(devices.topology_mesh("v6e:2x4", (2, 4), ("data", "model")), P())
square = aot.abstract((256, 256), jax.numpy.float32, one_chip)
tpu_text = {}
for name in ("default", "highest"):
    with jax.default_matmul_precision(name):
        tpu_text[name] = aot.compile_aot(lambda a, b: a @ b, square, square).compiled.as_text()
for name, text in tpu_text.items():
    requests = sorted(set(re.findall(r"operand_precision=\{[^}]*\}", text)))
    print(f"{name:>8}:", requests or "no precision request")

# %% [markdown]
# So the rule this course follows: **parity checks ask for `"highest"`** (a `with
# jax.default_matmul_precision("highest"):` around the call, active while JAX traces it), and
# **speed paths keep the default**. A bf16 model loses nothing to the default, since its inputs
# are bf16 already; and some TPU kernels refuse the request outright on bf16 inputs (notebook `splash_attention` meets one).

# %% tags=["check"]
assert conv_precisions(lowered["default"]) == ["DEFAULT"] and conv_precisions(lowered["highest"]) == ["HIGHEST"]
assert "operand_precision={highest,highest}" in tpu_text["highest"]
assert "operand_precision" not in tpu_text["default"]

# %% [markdown]
# ### Exercise 2: the 256 pixel levels in bfloat16
#
# `normalise` maps the 256 values of a `uint8` pixel to `k / 127.5 - 1`, from -1 to 1 in steps
# of one 8-bit level. Store those 256 floats in bf16. **Predict** three numbers: how many of them
# bf16 holds exactly, whether any two levels collapse into the same bf16 value (compare one
# level, 2/255, with bf16's largest step inside [-1, 1]), and the largest rounding error, in
# 8-bit levels. Then open the solution, run it, and compare.

# %% tags=["solution"]
levels32 = normalise(torch.arange(256, dtype=torch.uint8))
levels16 = levels32.bfloat16().float()
exact_levels = int((levels16 == levels32).sum())
distinct_levels = levels16.unique().numel()
worst_level_err = ((levels16 - levels32).abs().max() / LEVEL).item()
largest_step = 2.0**-8  # bf16's step in [0.5, 1): 8 significant bits
print(f"exact in bf16: {exact_levels} of 256 | distinct after rounding: {distinct_levels} "
      f"| worst rounding: {worst_level_err:.2f} levels")
print(f"one level {LEVEL:.5f} > largest bf16 step below 1, {largest_step:.5f}: no two levels can meet")
# Exact only where (2k - 255) / 255 has a power-of-two denominator: k = 0 and k = 255 (-1 and 1).
# Rounding moves a value by at most half a step, 2^-9, about a quarter of a level: storing the
# pixels in bf16 costs up to 0.25 levels before any op has run.

# %% tags=["check"]
assert exact_levels == 2 and distinct_levels == 256
assert worst_level_err <= 2.0**-9 / LEVEL < 0.26

# %% [markdown]
# ## 7. What to keep in float32
#
# The table blames the coordinates most, but it mixes stages. Taking one stage at a time, on
# the same crop, with everything else in float32, says which part to protect:

# %%
# NBVAL_IGNORE_OUTPUT
# (the table's bf16 sums round in the CPU's order; the checks below hold the claims)
x32 = normalise(crop_u8)
x16 = x32.bfloat16()
resized32 = image.resize_matmul(x32, size)
wy16 = image.interpolation_matrix(x32.shape[-2], size[0], torch.bfloat16).float()  # bf16 weights,
wx16 = image.interpolation_matrix(x32.shape[-1], size[1], torch.bfloat16).float()  # fp32 positions
stage_outputs = {
    "pixels stored in bf16 (no op)": (x16.float(), x32),
    "resize weights in bf16": (wy16 @ x32 @ wx16.T, resized32),
    "resize coordinates in bf16": (image.resize_matmul(x32, size, coord_dtype=torch.bfloat16), resized32),
    "blur taps + sums in bf16": (image.gaussian_blur(resized32.bfloat16()).float(),
                                 image.gaussian_blur(resized32)),
}
stage_err = {name: (out - ref).abs().max().item() for name, (out, ref) in stage_outputs.items()}
for name, err in stage_err.items():
    print(f"{name:32s} max |err| {fmt(err) if err else 0} ({fmt(err / LEVEL, 1e-2) if err else 0} levels)")

# %% [markdown]
# * **Coordinates** (the sampling positions of a resize, crop offsets, anything that indexes
#   pixels) must stay in float32 or integers: in bf16 they cost hundreds of 8-bit levels on
#   their own (2e+02 above). `F.interpolate` already does this internally (its positions are float32 even for bf16
#   input, on CPU and under torchax); code that builds its own grids, or that runs with
#   `torch.set_default_dtype(torch.bfloat16)`, has to do it on purpose.
# * **Resize weights and the blur's accumulation** cost at most about one 8-bit level in bf16,
#   the same size as storing the pixels in bf16 at all. (The resize weights can even come out
#   exact: when the scale factor makes every weight a short binary fraction, as 280 → 640 does,
#   bf16 holds them without rounding.) Keep them in float32 when the output must match a
#   reference to 8 bits; the cost is small, since preprocessing is a tiny part of a model's
#   FLOPs.
# * **The model itself** can take bf16 inputs: cast *after* preprocessing, once, at the model's
#   boundary.

# %% tags=["check"]
assert stage_err["resize coordinates in bf16"] > 10 * stage_err["resize weights in bf16"]
assert stage_err["resize coordinates in bf16"] > 10 * stage_err["blur taps + sums in bf16"]
assert max(stage_err["resize weights in bf16"], stage_err["blur taps + sums in bf16"]) < 2 * LEVEL

# %% [markdown]
# ### Exercise 3: a per-pixel op against a sum over every pixel
#
# Two bf16 computations on the crop's red channel, brought to [0, 1]: scaling every pixel by 0.7,
# and the channel's mean brightness computed the way a hand-written loop or kernel would, one
# pixel at a time into a **bf16 running sum** (a `jax.lax.fori_loop`, notebook `hf_model_in_jax`).
# **Predict** which of the two loses more against float32, and roughly how much: a fraction of a
# level, or most of the answer? Compare with `torch.sum` on the same bf16 pixels, which keeps its
# running sum in float32 and rounds once at the end.

# %% tags=["solution"]
import jax.numpy as jnp

red32 = (x32[0, 0] + 1) / 2  # the red channel in [0, 1]
red16 = red32.bfloat16()
scale_err = ((red16 * 0.7).float() - red32 * 0.7).abs().max().item() / (LEVEL / 2)  # levels of [0, 1]


def sum_one_by_one(values, acc_dtype):
    """The sum of `values`, added one element at a time into an `acc_dtype` accumulator."""
    flat = values.reshape(-1)
    return jax.lax.fori_loop(0, flat.shape[0], lambda i, s: s + flat[i].astype(acc_dtype), jnp.zeros((), acc_dtype))


running_sum = jax.jit(sum_one_by_one, static_argnums=1)  # the dtype is static: one program per dtype


red16_j = jnp.asarray(red16.float().numpy()).astype(jnp.bfloat16)
true_mean = red32.double().mean().item()
means = {"bf16 running sum": float(running_sum(red16_j, jnp.bfloat16)) / red16.numel(),
         "fp32 running sum": float(running_sum(red16_j, jnp.float32)) / red16.numel(),
         "torch.sum on bf16": red16.sum().item() / red16.numel()}
mean_err = {name: abs(m - true_mean) / true_mean for name, m in means.items()}
from tpupedia.results import measured_text  # its digits vary by CPU: printed against the bound

print("scale by 0.7, per pixel, bf16: max |err|", measured_text(scale_err, 1, fmt=".2f", unit=" levels"))
for name, err in mean_err.items():
    print(f"mean of {red16.numel():,} pixels, {name:17s}: relative error {'< 1%' if err < 0.01 else f'{err:.0%}'}")
# The bf16 sum stops growing: once it passes 256 its step is 2, and adding a pixel below 1 rounds
# back to the same sum. A per-pixel op rounds once per value and never accumulates.

# %% tags=["check"]
assert scale_err < 1  # one rounding of the input, one of the product: under a level
assert mean_err["bf16 running sum"] > 0.5  # most of the answer is lost
assert mean_err["fp32 running sum"] < 2**-8 and mean_err["torch.sum on bf16"] < 2**-8

# %% [markdown]
# ## Takeaways
#
# * A crop whose *size* depends on the mask cannot be jitted: compute the box under jit
#   (`image.mask_bbox`), then either slice on the host after one small `.tolist()` sync, or cut a
#   fixed-size window (`image.window_crop`) so that the whole crop compiles once.
# * Output sizes computed from input shapes are compile-time constants; a jitted resize
#   compiles once per distinct input size. Fixed windows or size buckets keep that number small.
# * Eager torchax pays a dispatch per op; jit the per-frame pipeline and it runs as one program.
# * Preprocess in float32 and cast to bf16 at the model's boundary. bf16 pixels already cost
#   about one 8-bit level; bf16 coordinates cost about a hundred times more, the upstream
#   "two orders of magnitude".
# * On a TPU a float32 matmul or convolution runs as one bfloat16 pass unless asked otherwise:
#   parity checks ask for `"highest"`, timed paths keep the default (section 6).

# %% [markdown]
# ## Self-check
#
# 1. Eager torchax crops with `nonzero` without complaint, but `jax_jit` of the same function
#    fails. Why, and which part of the crop can be compiled anyway?
#
#    <details><summary>Answer</summary>
#
#    Eager dispatch runs each op on concrete data, so `nonzero`'s output length is known before the
#    next op. Under `jax.jit` every shape must be fixed before the data exists, and that length is
#    data. The box itself is four numbers with fixed shape (`any` and `argmax`), so it compiles; the
#    cut either happens on the host or becomes a fixed-size window.
#
#    </details>
#
# 2. A video pipeline crops each clip around its subject at its own size and resizes the crop
#    with a jitted function. What does that cost on a TPU, and how do you avoid it?
#
#    <details><summary>Answer</summary>
#
#    Every distinct crop size is a new input shape, so a new trace and a new compilation. A
#    fixed-size window, or rounding crop sizes up to a few buckets and padding, keeps the number of
#    programs small.
#
#    </details>
#
# 3. Why does jit make the resize much faster here, but not the blur?
#
#    <details><summary>Answer</summary>
#
#    Jit removes per-op dispatch: the resize is many small ops, each a round trip through Python
#    when eager. The blur's time is nearly all inside two depthwise convolutions, which XLA's CPU
#    backend runs slowly, and jit cannot shorten time spent inside one op.
#
#    </details>
#
# 4. Sampling coordinates in bf16 cost hundreds of 8-bit levels, bf16 resize weights about one. Why
#    is the gap so large?
#
#    <details><summary>Answer</summary>
#
#    A coordinate above 256 cannot even hold every integer in bf16 (its step is 2 there), so samples
#    land on the wrong pixel and sharp edges move. A rounded weight only blends the right pixels in
#    slightly wrong proportions, an error the size of one bf16 rounding of a pixel.
#
#    </details>
#
# 5. A float32 parity check passes on this CPU and fails on a TPU by about 1e-3. What is the
#    likely cause, and what should the check ask for?
#
#    <details><summary>Answer</summary>
#
#    On a TPU, JAX runs a float32 matmul or convolution at `Precision.DEFAULT`, one bfloat16 pass,
#    while a CPU ignores the setting. The check should run under
#    `jax.default_matmul_precision("highest")`, active while the function is traced; timed paths
#    keep the default.
#
#    </details>
