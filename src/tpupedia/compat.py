"""The one place torchax is imported.

torchax 0.0.13 (the newest on PyPI) refers to 22 named-tensor operator overloads, such as
`aten.prod.dim_Dimname`, that PyTorch 2.13 removed, so a plain `import torchax` fails with
`AttributeError: The underlying op of 'aten.prod' has no overload name 'dim_Dimname'`.
google/torchax fixed this upstream (#102, released as 0.0.14); until that release is on PyPI we
let exactly those missing overloads resolve to inert placeholder keys while torchax builds its
op tables. `torch._decomp.get_decompositions` keeps only real operator objects, so the
placeholders are ignored.

Introduced in notebook `hf_model_in_jax` (a Hugging Face model in JAX); every notebook and module that needs
torchax calls `import_torchax` instead of `import torchax`. Delete the shim once a fixed
torchax is on PyPI.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from types import ModuleType

from tpupedia.errors import TpupediaError

__all__ = ["import_torchax", "missing_overloads", "TorchaxImportError"]

_MISSING: list[str] = []


class TorchaxImportError(TpupediaError, ImportError):
    """torchax is not installed, or could not be imported even with the shim."""


class _RemovedOverload:
    """Stands in for an operator overload that this PyTorch no longer has."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<removed overload {self.name}>"


def _is_named_tensor_overload(key: str) -> bool:
    low = key.lower()
    return not key.startswith("__") and ("dimname" in low or "names" in low)


@contextlib.contextmanager
def _tolerate_missing_named_overloads():
    import torch._ops as ops

    original = ops.OpOverloadPacket.__getattr__

    def patched(self, key):
        try:
            return original(self, key)
        except AttributeError:
            if not _is_named_tensor_overload(key):
                raise
            name = f"{self._qualified_op_name}.{key}"
            _MISSING.append(name)
            return _RemovedOverload(name)

    ops.OpOverloadPacket.__getattr__ = patched
    try:
        yield
    finally:
        ops.OpOverloadPacket.__getattr__ = original


def import_torchax() -> ModuleType:
    """Import torchax (and build its default environment) on any supported PyTorch.

    Returns the `torchax` module. Safe to call repeatedly; the shim only acts on the first call.
    """
    if "torchax" in sys.modules and getattr(sys.modules["torchax"], "_tpupedia_ready", False):
        return sys.modules["torchax"]
    try:
        importlib.import_module("torch")
    except ImportError as err:  # pragma: no cover - torch is a hard dependency
        raise TorchaxImportError("torchax needs PyTorch: pip install 'torch==2.13.0'") from err
    with _tolerate_missing_named_overloads():
        try:
            torchax = importlib.import_module("torchax")
            importlib.import_module("torchax.decompositions")  # loaded lazily by default_env()
        except ModuleNotFoundError as err:
            raise TorchaxImportError(
                "torchax is not installed: pip install 'torchax==0.0.13' (or pip install -e .)"
            ) from err
        torchax.default_env()  # builds the op tables, which touch more overloads
    torchax._tpupedia_ready = True
    return torchax


def missing_overloads() -> list[str]:
    """The operator overloads the shim had to stand in for (empty on a fixed torchax)."""
    return sorted(set(_MISSING))
