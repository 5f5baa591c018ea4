"""gpu-tpu-pedia helpers: the small library the notebooks introduce and the `tpupedia` command uses.

Modules are imported lazily so that `import tpupedia` never touches JAX: the device set-up in
`tpupedia.devices` has to run *before* JAX initialises its backends.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
