"""A profile of a compiled step, read by HLO instruction: where its measured time went.

`jax.profiler.trace(folder)` writes an `.xplane.pb` file; every event that executes an HLO
instruction carries the instruction's name (`hlo_op`), its program (`hlo_module`) and the device.
`op_seconds` sums the events per instruction; `classify` says what an instruction is from the
compiled program's text (a collective by its opcode; attention if it forms the sequence-by-sequence
score matrix or is a Mosaic custom call, which in these programs is splash's kernel; other matmuls
if it holds a `dot` or a `convolution`); `shares` adds the step's time up by those categories,
the measured counterparts of the three parts `tpupedia.predict` predicts.

Introduced in notebook `profiling` (the code is on its page, and checked equal to this module);
notebook `tune_before_you_rent` measures a setting's effect with it.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Callable

__all__ = ["CATEGORIES", "op_seconds", "classify", "shares"]

CATEGORIES = ("attention", "other matmuls", "collectives", "everything else", "not in the HLO")
_COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start|-done)?\(")


def op_seconds(trace_file: str | Path) -> dict[tuple[str, str], float]:
    """Seconds per `(program, HLO instruction)` in a trace, summed over devices and calls."""
    import jax

    found: dict[tuple[str, str], float] = defaultdict(float)
    for plane in jax.profiler.ProfileData.from_file(str(trace_file)).planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_op" in stats:
                    found[stats["hlo_module"], stats["hlo_op"]] += event.duration_ns / 1e9
    return dict(found)


def classify(hlo_text: str, sequence: int) -> Callable[[str], str]:
    """A function from an instruction's name in the compiled program `hlo_text` to its category
    (`CATEGORIES`); `sequence`: the attention's tokens, whose square is the score matrix."""
    computations = dict(re.findall(r"(?ms)^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)^\}", hlo_text))
    instructions = dict(re.findall(r"(?m)^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$", hlo_text))

    def body(name: str) -> str:  # the instruction's line and the computations it calls, recursively
        line = instructions.get(name, "")
        return line + "".join(computations.get(c, "") for c in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", line))

    def category(name: str) -> str:
        if name not in instructions:
            return "not in the HLO"
        line, text = instructions[name], body(name)
        if _COLLECTIVE.search(line):
            return "collectives"
        if 'custom_call_target="tpu_custom_call"' in text or (
                re.search(rf"\[[\d,]*\b{sequence},{sequence}\]", text) and re.search(r"\b(dot|custom-call)\(", text)):
            return "attention"
        if re.search(r"\b(dot|convolution)\(", text):
            return "other matmuls"
        return "everything else"

    return category


def shares(seconds: dict[tuple[str, str], float], module: str, hlo_text: str, sequence: int) -> dict[str, float]:
    """Device-seconds of program `module` by category (`CATEGORIES`), from `op_seconds`."""
    category = classify(hlo_text, sequence)
    out = dict.fromkeys(CATEGORIES, 0.0)
    for (program, op), s in seconds.items():
        if program == module:
            out[category(op)] += s
    return out
