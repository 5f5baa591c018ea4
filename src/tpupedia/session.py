"""The first cell of every notebook: read the preset, set up devices, silence known noise.

Notebook `start_here` walks through these steps one at a time; later notebooks call `start()`.

The warnings silenced here are harmless and known, and each would otherwise print a line (often
with a path or a timestamp) into stored notebook outputs that CI compares:

* `Explicitly requested dtype int64 ... will be truncated to int32`: JAX runs with 32-bit
  integers unless `jax_enable_x64` is set, and PyTorch code asks for int64 everywhere.
* `The given NumPy array is not writable`: torchax wraps read-only NumPy views of JAX arrays.
* `IProgress not found`: tqdm without ipywidgets.
* `is_gradient_checkpointing is deprecated`: touched by torchax when it collects a model's
  tensors with `getattr` over `dir(module)`.

Introduced in notebook `hf_model_in_jax` (a Hugging Face model in JAX).
"""

from __future__ import annotations

import logging
import warnings

from tpupedia import devices, presets

__all__ = ["KNOWN_NOISE", "quiet", "start"]

KNOWN_NOISE = (
    "Explicitly requested dtype",
    "The given NumPy array is not writable",
    "IProgress not found",
    ".*is_gradient_checkpointing. is deprecated",
    "Guiders are .* experimental",
    r"os\.fork\(\) was called",  # imageio-ffmpeg starts ffmpeg with fork + exec: no JAX code runs in the child
)


def quiet(downloads: bool = False) -> None:
    """Filter the known-harmless warnings and quiet library logging and progress bars.

    `downloads`: keep the Hugging Face Hub's download progress bars (the full preset: a first
    download of 30-80 GB with nothing on screen looks hung). transformers' `disable_progress_bar`
    also turns the Hub's bars off, so they are turned back on here, unless
    `HF_HUB_DISABLE_PROGRESS_BARS` says otherwise. The libraries' warnings about weights that do
    not match their model ("newly initialized", "not used") stay quiet because the pipelines refuse
    such a checkpoint themselves (`tpupedia.models.checkpoints.load_component`)."""
    for message in KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=message)
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.ERROR)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
    try:
        import diffusers

        diffusers.utils.logging.set_verbosity_error()
        diffusers.utils.logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass
    if downloads:
        from huggingface_hub import constants
        from huggingface_hub.utils import enable_progress_bars

        if constants.HF_HUB_DISABLE_PROGRESS_BARS is not True:  # the user's `=1` has priority
            enable_progress_bars()


def start(name: str | None = None) -> presets.Preset:
    """Read the preset (`$TPUPEDIA_PRESET` unless `name` is given), create its simulated
    devices before JAX initialises, and call `quiet` (the Hub's download bars kept for a preset that
    downloads its checkpoints). Returns the preset.

    On a host with TPU chips (Colab's v5e-1, Kaggle's v5e-8, a v5e-1 VM) the tiny preset keeps them beside
    its simulated CPU devices: meshes and models live on the CPU devices, and Pallas kernels can
    compile on the chip (`devices.kernel_chip`)."""
    preset = presets.get(name) if name else presets.current()
    if preset.simulated_devices:
        devices.simulate_cpu_devices(preset.simulated_devices, chip=True)
    quiet(downloads=preset.pretrained)
    return preset
