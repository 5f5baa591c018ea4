"""Showing a real error in a notebook without storing anything machine-specific.

JAX and torchax error messages often name the file and line that was being traced (a temporary
file of the notebook kernel, a path into site-packages) or a process id: true, but different on
every machine and every run, so they cannot be stored in a notebook that CI compares. `expect`
runs a call that must fail, checks the exception type, and prints the type and the message with
such paths replaced by `<path>`. The assert is part of the lesson: if the error ever stops
happening, the notebook fails.

Introduced in notebook `hf_model_in_jax` (a Hugging Face model in JAX).
"""

from __future__ import annotations

import re
from typing import Callable

__all__ = ["TpupediaError", "expect", "clean_message"]


class TpupediaError(Exception):
    """Base of every error this package raises on purpose (bad input, a refused stage file, a
    plan that cannot be built). Each module's error class derives from it (and from the builtin
    it specialises, `ValueError` or `RuntimeError`), so the `tpupedia` command catches this one
    class and prints one clear line instead of a traceback."""

_PATH = re.compile(r"(?:[A-Za-z]:)?(?:/[\w.@+-]+)+/[\w.@+-]+\.py(?::\d+)?")
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


def clean_message(err: BaseException, max_lines: int = 3) -> str:
    """`Type: message`, first `max_lines` non-empty lines, file paths and addresses masked."""
    lines = [line.rstrip() for line in str(err).splitlines() if line.strip()]
    text = "\n".join(lines[:max_lines]) + ("\n..." if len(lines) > max_lines else "")
    text = _ADDRESS.sub("0x…", _PATH.sub("<path>", text))
    return f"{type(err).__name__}: {text}"


def expect(call: Callable[[], object], error: type[BaseException] | tuple[type[BaseException], ...],
           max_lines: int = 3) -> BaseException:
    """Run `call`, which must raise `error`; print the cleaned message and return the exception."""
    try:
        call()
    except error as err:
        print(clean_message(err, max_lines))
        return err
    raise AssertionError(f"expected {error} to be raised, but the call succeeded")
