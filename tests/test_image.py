import pytest
import torch
import torch.nn.functional as F

from tpupedia import image
from tpupedia.compat import import_torchax


@pytest.fixture(scope="module")
def env():
    return import_torchax().default_env()


def _frame(h=48, w=80, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(1, 3, h, w, generator=g)


def _disk_mask(h=48, w=80, cy=20, cx=50, r=6):
    yy, xx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    return (((yy - cy) ** 2 + (xx - cx) ** 2) < r * r).float()


def test_mask_bbox_matches_nonzero_and_unites_leading_dims():
    mask = torch.stack([_disk_mask(cy=20, cx=50), _disk_mask(cy=30, cx=10)])[None]  # (1, 2, H, W)
    ys, xs = torch.nonzero(mask.amax((0, 1)), as_tuple=True)
    expected = [ys.min().item(), ys.max().item() + 1, xs.min().item(), xs.max().item() + 1]
    assert image.mask_bbox(mask).tolist() == expected


def test_mask_bbox_of_empty_mask_is_whole_image():
    assert image.mask_bbox(torch.zeros(48, 80)).tolist() == [0, 48, 0, 80]


def test_mask_bbox_jits_under_torchax(env):
    from torchax.interop import jax_jit

    mask = _disk_mask()
    with env:
        box = jax_jit(image.mask_bbox)(mask.to("jax")).cpu()
    assert box.tolist() == image.mask_bbox(mask).tolist()


def test_expand_box_pads_clips_and_keeps_even_sides():
    top, bottom, left, right = image.expand_box((10, 21, 70, 79), (48, 80), pad_ratio=0.5)
    assert (top, left) == (4, 66) and right == 80  # clipped at the right edge
    assert (bottom - top) % 2 == 0 and (right - left) % 2 == 0


def test_window_crop_equals_slice_and_stays_inside(env):
    from torchax.interop import jax_jit

    frame = _frame()
    assert torch.equal(image.window_crop(frame, torch.tensor([20, 30]), (8, 10)),
                       frame[..., 16:24, 25:35])
    corner = image.window_crop(frame, torch.tensor([0, 79]), (8, 10))
    assert torch.equal(corner, frame[..., 0:8, 70:80])
    with env:
        jitted = jax_jit(image.window_crop, kwargs_for_jax_jit={"static_argnums": (2,)})
        out = jitted(frame.to("jax"), torch.tensor([20, 30]).to("jax"), (8, 10)).cpu()
    assert torch.equal(out, frame[..., 16:24, 25:35])


@pytest.mark.parametrize("hw, expected", [((720, 1280), (640, 1136)), ((1080, 1920), (640, 1136)),
                                          ((300, 200), (960, 640)), ((100, 1000), (128, 1280))])
def test_target_size_short_side_multiple_of_16_long_side_capped(hw, expected):
    h, w = image.target_size(*hw)
    assert (h, w) == expected
    assert h % 16 == 0 and w % 16 == 0 and max(h, w) <= 1280


@pytest.mark.parametrize("size", [(32, 48), (96, 160)])
def test_resize_matmul_matches_interpolate(size):
    frame = _frame()
    expected = image.resize_bilinear(frame, size)
    torch.testing.assert_close(image.resize_matmul(frame, size), expected, atol=1e-5, rtol=0)


def test_interpolation_rows_sum_to_one():
    w = image.interpolation_matrix(48, 130)
    torch.testing.assert_close(w.sum(1), torch.ones(130))
    assert int((w != 0).sum(1).max()) <= 2


def test_bf16_coordinates_are_far_worse_than_bf16_pixels():
    frame = _frame(300, 300)
    ref = image.resize_bilinear(frame, (640, 640))
    bf = frame.bfloat16()
    pixels = (image.resize_matmul(bf, (640, 640)).float() - ref).abs().max()
    coords = (image.resize_matmul(bf, (640, 640), torch.bfloat16).float() - ref).abs().max()
    assert coords > 10 * pixels


def test_gaussian_blur_equals_2d_convolution_with_outer_product_kernel():
    frame = _frame()
    taps = image.gaussian_kernel1d(7, 1.5)
    assert abs(taps.sum().item() - 1) < 1e-6 and torch.equal(taps, taps.flip(0))
    kernel2d = (taps[:, None] * taps[None, :]).expand(3, 1, 7, 7)
    expected = F.conv2d(F.pad(frame, (3, 3, 3, 3), mode="reflect"), kernel2d, groups=3)
    torch.testing.assert_close(image.gaussian_blur(frame, 7, 1.5), expected, atol=1e-6, rtol=0)


def test_pipeline_under_torchax_jit_matches_cpu(env):
    from torchax.interop import jax_jit

    def pipeline(x):
        return image.gaussian_blur(image.resize_bilinear(x, (64, 96)))

    frame = _frame()
    with env:
        out = jax_jit(pipeline)(frame.to("jax")).cpu()
    torch.testing.assert_close(out, pipeline(frame), atol=1e-5, rtol=0)
