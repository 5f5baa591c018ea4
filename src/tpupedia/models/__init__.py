"""One module per model family, holding every fact about it, and the ports.

* `cogvideox`: CogVideoX configs, frame and size rules, token counts, step FLOPs, checkpoints
  (notebook 07; the dry-run of notebook 08 reads it);
* `hunyuan`: HunyuanVideo-1.5 facts, a jit-friendly transformer forward with exact padding masks, and
  the split forward DeepCache needs (notebook 09; the dry-run of notebook 08 reads it);
* `llama`: Llama-2-7B facts (notebook 01);
* `cogvideox_vae`: the CogVideoX VAE in Flax NNX (notebook 05); `cogvideox_vae_convert`: its
  weight conversion and layer-by-layer comparison;
* `checkpoints`: tiny checkpoints written once and the one loading path for both presets.
"""

from tpupedia.errors import TpupediaError


class ModelInputError(TpupediaError, ValueError):
    """A size, frame count or option this model cannot produce."""
