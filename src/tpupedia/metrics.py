"""Image quality of a video against a reference: PSNR and SSIM, from scikit-image.

Used where a video is compared with another made differently from the same seed: DeepCache
against the uncached run (notebook `hunyuan_tuning_and_i2v`, `tpupedia bench deepcache`), bf16 against float32. The
numbers are scikit-image's (`skimage.metrics`), the maintained implementations papers and tools
report, computed frame by frame over the color channels and averaged over the frames.
"""

from __future__ import annotations

import numpy as np

__all__ = ["psnr", "ssim", "compare"]


def psnr(a: np.ndarray, b: np.ndarray, peak: float = 1.0) -> float:
    """Peak signal-to-noise ratio in dB of `a` against `b` (values in [0, peak]); inf if equal."""
    from skimage.metrics import peak_signal_noise_ratio

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if np.array_equal(a, b):
        return float("inf")
    return float(peak_signal_noise_ratio(b, a, data_range=peak))


def ssim(a: np.ndarray, b: np.ndarray, peak: float = 1.0, window: int = 7) -> float:
    """Mean structural similarity of two frame stacks `(..., H, W, C)` in [0, peak]:
    `skimage.metrics.structural_similarity` on each frame (Wang et al. 2004 with a `window` x
    `window` uniform window, K1 = 0.01, K2 = 0.03, sample covariance, the border windows left
    out), averaged over frames and channels."""
    from skimage.metrics import structural_similarity

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    h, w, c = a.shape[-3:]
    size = min(window, h, w)
    size -= 1 - size % 2  # an odd window, as scikit-image requires
    frames = zip(a.reshape(-1, h, w, c), b.reshape(-1, h, w, c))
    return float(np.mean([structural_similarity(x, y, win_size=size, data_range=peak, channel_axis=-1)
                          for x, y in frames]))


def compare(video: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    """`{"psnr_db", "ssim", "max_abs"}` of `video` against `reference`."""
    return {"psnr_db": psnr(video, reference), "ssim": ssim(video, reference),
            "max_abs": float(np.max(np.abs(np.asarray(video, np.float64) - np.asarray(reference, np.float64))))}
