"""One module per model family, holding every fact about it, and the ports.

* `cogvideox`: CogVideoX configs, frame and size rules, token counts, step FLOPs, checkpoints
  (notebook `cogvideox_pipeline`; the dry-run of notebook `plan_without_tpu` reads it);
* `hunyuan`: HunyuanVideo-1.5 facts, a jit-friendly transformer forward with exact padding masks, and
  the split forward DeepCache needs (notebooks `hunyuan_video` and `hunyuan_tuning_and_i2v`; the dry-run of notebook `plan_without_tpu` reads it);
* `llama`: Llama-2-7B facts (notebook `hf_model_in_jax`);
* `cogvideox_vae`: the CogVideoX VAE in Flax NNX (notebook `cogvideox_vae_flax`); `cogvideox_vae_convert`: its
  weight conversion and layer-by-layer comparison;
* `checkpoints`: tiny checkpoints written once and the one loading path for both presets.
"""

from tpupedia.errors import TpupediaError


class ModelInputError(TpupediaError, ValueError):
    """A size, frame count or option this model cannot produce."""
