"""Model ports used by the course.

* `cogvideox_vae`: the CogVideoX VAE in Flax NNX (notebook 05);
  `cogvideox_vae_convert`: its weight conversion and layer-by-layer comparison;
* `hunyuan_static`: a jit-friendly forward for diffusers' HunyuanVideo-1.5 transformer (used by
  the dry-run planner of notebook 09).
"""
