"""The shape facts of a video checkpoint, read from its component configs.

How many pixels one latent covers, how many frames one latent frame stands for, how many latents
one transformer token covers and how many channels a latent has: diffusers' pipelines read these
from the components they load (`vae_scale_factor_spatial`, `vae_scale_factor_temporal`,
`transformer.config.patch_size`, ...), never from constants, so a checkpoint with a shallower VAE
or another patch size gets frames of the right size. Each family module says where its configs
keep them (`tpupedia.models.cogvideox.shape_facts`, `tpupedia.models.hunyuan.shape_facts`) and
keeps the released checkpoint's values as the default (`DEFAULT_SHAPES`), which the presets and
the dry-run use.

Introduced with the full path of notebooks `cogvideox_pipeline` and `hunyuan_video` (a checkpoint given with `--model`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ShapeFacts"]


@dataclass(frozen=True)
class ShapeFacts:
    """Compression and patch sizes of one checkpoint (see the module docstring)."""

    spatial: int
    """VAE compression in height and width (8 for CogVideoX, 16 for HunyuanVideo-1.5)."""
    temporal: int
    """VAE compression in time; the first frame is kept, so F frames give (F - 1) / temporal + 1."""
    patch: int
    """Transformer patch in height and width, in latents."""
    patch_t: int | None
    """Transformer patch in time, in latent frames (`None`: the model has none)."""
    latent_channels: int
    """Channels of the latents the scheduler steps."""

    @property
    def size_multiple(self) -> int:
        """Width and height must be multiples of this: one transformer token per `size_multiple` pixels."""
        return self.spatial * self.patch

    def frames_ok(self, frames: object) -> bool:
        """Whether the VAE can produce exactly `frames` frames: temporal * n + 1."""
        return isinstance(frames, int) and not isinstance(frames, bool) and frames >= 1 and (frames - 1) % self.temporal == 0

    def size_ok(self, width: object, height: object) -> bool:
        """Whether `width` x `height` tiles into whole tokens."""
        m = self.size_multiple
        return all(isinstance(v, int) and not isinstance(v, bool) and v > 0 and v % m == 0 for v in (width, height))

    def latent_frames(self, frames: int) -> int:
        """Latent frames for `frames` video frames, as diffusers computes them: (F - 1) // temporal + 1."""
        return (frames - 1) // self.temporal + 1

    def latent_size(self, height: int, width: int) -> tuple[int, int]:
        """`(h, w)` of the latents for a `height` x `width` video."""
        return height // self.spatial, width // self.spatial

    def frames_for(self, latent_frames: int) -> int:
        """Video frames the VAE decodes from `latent_frames` latent frames: temporal * (L - 1) + 1."""
        return self.temporal * (latent_frames - 1) + 1
