"""Step caches for every family: which steps run the whole transformer, which reuse a cache.

Adjacent denoising steps compute similar things, so most of a step can be skipped by reusing
what an earlier step computed. Which steps run in full is decided on the host, before anything
is compiled (a *static schedule*), so there is no branch inside jit: the pipeline compiles two
programs, the full step (which also returns the cache) and the cached step (which takes it), and
the Python loop picks one per step. Three ways to cache, one mechanism:

* `deepcache` (DeepCache; upstream's HunyuanVideo-1.5 helper): a full step keeps the state
  entering the last `tail` blocks; a cached step runs only those blocks from it. Schedule
  `START:END:INTERVAL` (`Schedule`): every step before `start` and from `end` on runs in full,
  and one step in `interval` between them.
* `fbcache` (First-Block-Cache, diffusers' `FirstBlockCacheConfig`): a full step keeps the
  residual of the blocks after the first (`last block's output - first block's output`, for the
  video stream and, where blocks return it, the text stream); a cached step runs the first
  block and adds that residual to its output.
* `magcache` (MagCache, diffusers' `MagCacheConfig`): a full step keeps the residual of all the
  blocks (`last block's output - first block's input`, video stream); a cached step runs no
  block and adds it to the blocks' input.

diffusers decides FBCache at run time (the first block's residual changed less than a threshold
since the last full step) and MagCache from per-step magnitude ratios calibrated once per model.
Here both become static schedules from a *calibration run* (every step full, recording the
quantity each method thresholds, `Calibration`): `full_steps_from` turns it into the list of
full steps for a threshold. A list of full steps can also be given directly
(`fbcache:full=0,1,2,4`), which is how notebook `fewer_steps` and the parity tests replay the
skips stock diffusers' hook chose and get its latents (tests/test_stepcache.py). A threshold
with `@FILE` (`magcache:0.06@cal.json`) keeps the calibration run's record in that file
(`write_calibration`) and later runs read it instead of calibrating (`read_calibration`), as
diffusers' MagCache takes `mag_ratios` calibrated once per model; in a job of several hosts every
host must see the same file.

The blocks are cached as diffusers' hooks cache them, at trace time: `traced` swaps each block's
`forward` while the step is traced (the first block, the cut, the last block record or add;
the blocks a cached step skips return their input, which costs nothing in the compiled
program). What differs between models is a fact of the family's module
(`tpupedia.models.<family>`): `CACHE_BLOCKS`, the transformer's block list, and
`CACHE_TEXT_STREAM`, whether a block returns the text stream beside the video's (diffusers'
`TransformerBlockRegistry` records the same as `return_encoder_hidden_states_index`).

The speed-up a schedule can give is bounded by the compiled programs' FLOPs (`speedup_bound`):
`steps * full / (n_full * full + n_cached * cached)`. Quality is measured, not assumed:
`tpupedia.metrics.compare` gives PSNR and SSIM of a cached video against the uncached one
(`tpupedia bench deepcache`). Introduced in notebook `hunyuan_tuning_and_i2v` (DeepCache) and
notebook `fewer_steps` (all three, calibration, parity with diffusers' hook); the
knowledge-base page `docs/kb/step-caches.md` says which cache to use when.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from tpupedia.errors import TpupediaError

__all__ = ["StepCacheError", "DeepCacheError", "Schedule", "UPSTREAM_DEFAULT", "StepCache", "METHODS", "Calibration",
           "parse", "parse_step_cache", "fbcache_full_steps", "magcache_full_steps", "full_steps_from",
           "traced", "speedup_bound", "MAGCACHE_MAX_SKIP", "MAGCACHE_RETENTION", "settings", "FIELD", "run_loop",
           "CALIBRATION_FORMAT", "write_calibration", "read_calibration"]


class StepCacheError(TpupediaError, ValueError):
    """A step cache that does not fit the run: an unknown method, a bad threshold or step list."""


DeepCacheError = StepCacheError
"""DeepCache's name for the same error (`tpupedia.pipelines.deepcache`)."""

METHODS = ("deepcache", "fbcache", "magcache")
"""What a cached step does: run the last blocks from a cached state, run the first block and
add the cached residual of the others, or run no block and add the cached residual of all."""

MAGCACHE_MAX_SKIP = 3
"""diffusers' `MagCacheConfig.max_skip_steps` default: at most this many cached steps in a row."""
MAGCACHE_RETENTION = 0.2
"""diffusers' `MagCacheConfig.retention_ratio` default: the first fifth of the steps run in full."""


@dataclass(frozen=True)
class Schedule:
    """DeepCache's schedule. Full steps: `[0, start)`, `range(start, end, interval)`, `[end, steps)`; the rest cached."""

    start: int
    end: int
    interval: int
    tail: int = 1
    """Blocks a cached step recomputes (upstream: the last dual-stream block)."""

    def check(self, steps: int, layers: int | None = None) -> None:
        """Refuse a schedule that cannot apply to `steps` steps (and `layers` blocks)."""
        for name in ("start", "end", "interval", "tail"):
            if not isinstance(getattr(self, name), int):
                raise DeepCacheError(f"deepcache {name}={getattr(self, name)!r} must be an integer")
        if self.interval < 1:
            raise DeepCacheError(f"deepcache interval={self.interval} must be >= 1 (1 recomputes every step)")
        if not 0 <= self.start < self.end <= steps:
            raise DeepCacheError(f"deepcache {self.start}:{self.end}:{self.interval} must satisfy "
                                 f"0 <= start < end <= steps={steps}")
        _check_tail(self.tail, layers)

    def full_steps(self, steps: int) -> list[int]:
        """The steps that run every block, in order; the first is always step 0."""
        self.check(steps)
        inside = set(range(self.start, self.end, self.interval))
        return [i for i in range(steps) if i < self.start or i >= self.end or i in inside]

    def __str__(self) -> str:
        return f"{self.start}:{self.end}:{self.interval}"


UPSTREAM_DEFAULT = Schedule(11, 45, 4)
"""The upstream TPU defaults (`--cache_start_step 11 --cache_end_step 45 --cache_step_interval 4`)."""


def _check_tail(tail: int, layers: int | None) -> None:
    if not isinstance(tail, int) or tail < 1 or (layers is not None and tail >= layers):
        raise DeepCacheError(f"deepcache tail={tail} blocks must be >= 1 and fewer than the model's {layers} blocks")


def parse(text: str) -> Schedule:
    """`"START:END:INTERVAL"` -> `Schedule`, e.g. `"11:45:4"`."""
    parts = text.split(":")
    try:
        start, end, interval = (int(p) for p in parts)
    except ValueError:
        raise DeepCacheError(f"deepcache {text!r}: expected START:END:INTERVAL, three integers (e.g. 11:45:4)") from None
    return Schedule(start, end, interval)


@dataclass(frozen=True)
class StepCache:
    """A step cache: its `method` (`METHODS`) and its schedule, one of: `full`, the full steps
    given; `threshold`, a calibration run's quantity thresholded (`full_steps_from`;
    `fbcache` and `magcache`); `deepcache`, DeepCache's `START:END:INTERVAL`."""

    method: str
    full: tuple[int, ...] | None = None
    threshold: float | None = None
    deepcache: Schedule | None = None
    tail: int = 1
    """`deepcache`: the blocks a cached step runs."""
    max_skip: int = MAGCACHE_MAX_SKIP
    retention: float = MAGCACHE_RETENTION
    calibration_file: str | None = None
    """A threshold's saved calibration (`METHOD:THRESHOLD@FILE`): read when the file exists, so no
    calibration pass runs; written there by the calibration pass when it does not."""
    calibration_hash: str | None = None
    """The saved calibration's content hash as the run found it when it started (`pinned`)."""

    def pinned(self) -> "StepCache":
        """This cache with its saved calibration's hash as the file is now (none if it is not
        there yet): a run pins it once, before its first stage, so that every stage's settings
        agree even after the calibration pass writes the file."""
        path = None if self.calibration_file is None else Path(self.calibration_file)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path is not None and path.exists() else None
        return dataclasses.replace(self, calibration_hash=digest)

    @property
    def calibrated(self) -> bool:
        """Whether the schedule needs a calibration run first (a threshold, no list of steps)."""
        return self.threshold is not None

    def check(self, steps: int, layers: int | None = None) -> None:
        """Refuse a step cache that cannot apply to `steps` steps (and `layers` blocks), in one line."""
        if self.method not in METHODS:
            raise StepCacheError(f"step cache {self.method!r} is not one of {', '.join(METHODS)}")
        if self.method == "deepcache":
            _check_tail(self.tail, layers)
        if self.deepcache is not None:
            self.deepcache.check(steps, layers)
        if self.threshold is not None and (not math.isfinite(self.threshold) or self.threshold < 0):
            raise StepCacheError(f"step cache {self}: threshold {self.threshold} must be a finite number >= 0")
        if self.calibration_file is not None:
            self._check_file(steps)
        if self.full is not None:
            bad = [i for i in self.full if not isinstance(i, int) or not 0 <= i < steps]
            if bad:
                raise StepCacheError(f"step cache {self}: full steps {bad} are not steps of this run (0..{steps - 1})")
            if list(self.full) != sorted(set(self.full)) or not self.full or self.full[0] != 0:
                raise StepCacheError(f"step cache {self}: the full steps must be increasing and start at 0 "
                                     "(the first step has nothing cached to reuse)")

    def _check_file(self, steps: int) -> None:
        path = Path(self.calibration_file)
        if self.threshold is None:
            raise StepCacheError(f"step cache {self}: a calibration file goes with a threshold (e.g. {self.method}:0.05@FILE)")
        if not path.exists():
            if not path.parent.is_dir():
                raise StepCacheError(f"step cache {self}: the calibration would be written to {path}, whose folder "
                                     "does not exist")
            return
        saved = read_calibration(path)
        if self.method == "fbcache" and len(saved.change) != steps:
            raise StepCacheError(f"step cache {self}: {path} was calibrated at {len(saved.change)} steps and this run has "
                                 f"{steps}; fbcache's changes are per step (magcache's ratios interpolate): name a new "
                                 "file to calibrate at this many steps")

    def saved_calibration(self, identity: dict) -> "Calibration | None":
        """The saved calibration (`calibration_file`), read and validated, or `None` where there is
        none yet; one made on another model (its `identity`: the family and the transformer's
        config fingerprint, `Calibration.identity`) is refused."""
        if self.calibration_file is None or not Path(self.calibration_file).exists():
            return None
        saved = read_calibration(self.calibration_file)
        if saved.identity and identity and saved.identity != identity:
            differ = sorted(k for k in identity if saved.identity.get(k) != identity[k])
            raise StepCacheError(f"step cache {self}: {self.calibration_file} was calibrated on another model "
                                 f"({', '.join(f'{k} {saved.identity.get(k)!r}, not {identity[k]!r}' for k in differ)}); "
                                 "name a new file to calibrate this one")
        return saved

    def full_steps(self, steps: int, calibration: "Calibration | None" = None) -> list[int]:
        """The steps that run every block, in order (step 0 always). A threshold needs the
        `calibration` run's record."""
        self.check(steps)
        if self.full is not None:
            return list(self.full)
        if self.deepcache is not None:
            return self.deepcache.full_steps(steps)
        if calibration is None:
            raise StepCacheError(f"step cache {self}: a threshold needs a calibration run first")
        return full_steps_from(calibration, self, steps)

    def __str__(self) -> str:
        if self.full is not None:
            return f"{self.method}:full={','.join(map(str, self.full))}"
        if self.deepcache is not None:
            return f"{self.method}:{self.deepcache}"
        return f"{self.method}:{self.threshold:g}" + (f"@{self.calibration_file}" if self.calibration_file else "")


_FORMS = ("fbcache:THRESHOLD (e.g. fbcache:0.05), magcache:THRESHOLD (e.g. magcache:0.06), either with @FILE to "
          "save its calibration or read it back (magcache:0.06@cal.json), "
          "deepcache:START:END:INTERVAL (e.g. deepcache:11:45:4), or METHOD:full=0,1,2,4 (the full steps)")


def parse_step_cache(text: str) -> StepCache:
    """`--step-cache` -> `StepCache`: `fbcache:0.05`, `magcache:0.06`, `deepcache:11:45:4`, or
    any method with its full steps, `fbcache:full=0,1,2,4`. A bad value is one line naming it
    and the forms allowed."""
    method, _, rest = str(text).partition(":")
    if method not in METHODS:
        raise StepCacheError(f"--step-cache {text!r}: {method!r} is not one of {', '.join(METHODS)}; use {_FORMS}")
    rest, at, file = rest.partition("@")
    if at and (method == "deepcache" or rest.startswith("full=") or not file):
        raise StepCacheError(f"--step-cache {text!r}: @FILE names a threshold's saved calibration "
                             f"(e.g. {'fbcache' if method == 'deepcache' else method}:0.05@cal.json); use {_FORMS}")
    if rest.startswith("full="):
        try:
            full = tuple(int(s) for s in rest.removeprefix("full=").split(","))
        except ValueError:
            raise StepCacheError(f"--step-cache {text!r}: full= takes step numbers separated by commas; use {_FORMS}") from None
        return StepCache(method, full=full)
    if method == "deepcache":
        try:
            return StepCache(method, deepcache=parse(rest))
        except DeepCacheError:
            raise StepCacheError(f"--step-cache {text!r}: deepcache takes START:END:INTERVAL; use {_FORMS}") from None
    try:
        threshold = float(rest)
    except ValueError:
        raise StepCacheError(f"--step-cache {text!r}: {method} takes a threshold (a number) or full=STEPS; "
                             f"use {_FORMS}") from None
    if not math.isfinite(threshold) or threshold < 0:
        raise StepCacheError(f"--step-cache {text!r}: the threshold must be a finite number >= 0")
    return StepCache(method, threshold=threshold, calibration_file=file or None)


def settings(cache: StepCache | None) -> dict:
    """What a step cache adds to the denoise stage's settings (nothing when off, so stage files
    made before step caches existed still match); a saved calibration the run read adds its
    content's hash (`StepCache.pinned`), since the steps it picks depend on it."""
    if cache is None:
        return {}
    return {"step_cache": str(cache)} | ({"step_cache_calibration": cache.calibration_hash}
                                         if cache.calibration_hash else {})


# --- calibration: every step full, the quantity each method thresholds ------------------------------

@dataclass
class Calibration:
    """A calibration run's record, one value per step: `change`, the relative L1 change of the
    first block's output residual from the step before (what FBCache thresholds; `inf` at step
    0), and `ratio`, the mean ratio of the whole stack's residual norms, this step over the one
    before (MagCache's `mag_ratios`; 1 at step 0, as diffusers' calibration records it)."""

    change: list[float] = field(default_factory=list)
    ratio: list[float] = field(default_factory=list)
    identity: dict = field(default_factory=dict)
    """The model it was made on: the family and its transformer's config fingerprint (saved files)."""

    def lists(self) -> dict[str, list]:
        """`change` (null at step 0) and `ratio` as JSON lists: the run's timings and the saved file."""
        return {"change": [None if math.isinf(c) else c for c in self.change], "ratio": list(self.ratio)}

    def record(self, cache: dict, previous: dict | None) -> None:
        """Append step's quantities from its full step's `cache` and the step before's."""
        import jax.numpy as jnp

        if previous is None:
            self.change.append(math.inf)
            self.ratio.append(1.0)
            return
        head, before = cache["head"], previous["head"]
        self.change.append(float(jnp.abs(head - before).mean() / jnp.abs(before).mean()))
        now = jnp.linalg.norm(cache["stack"].astype(jnp.float32), axis=-1)
        then = jnp.linalg.norm(previous["stack"].astype(jnp.float32), axis=-1)
        self.ratio.append(float((now / (then + 1e-8)).mean()))


CALIBRATION_FORMAT = "tpupedia-step-cache-calibration"
"""The saved calibration file's `format` (`write_calibration`, `read_calibration`; version 1)."""


def write_calibration(path: "str | os.PathLike", calibration: Calibration) -> Path:
    """Save a calibration run's record as JSON, atomically: `format`, `version`, `identity`, and
    one `change` (null at step 0) and one `ratio` per step. diffusers' MagCache asks for the same:
    `mag_ratios` calibrated once per model (`MagCacheConfig(calibrate=True)` prints them)."""
    import json

    from tpupedia import files

    record = {"format": CALIBRATION_FORMAT, "version": 1, "identity": calibration.identity,
              "steps": len(calibration.change), **calibration.lists()}
    return files.write_text_atomic(path, json.dumps(record, indent=1) + "\n")


def read_calibration(path: "str | os.PathLike") -> Calibration:
    """A saved calibration, validated: a file that is not one is one line naming it and what is wrong."""
    import json

    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise StepCacheError(f"calibration file {path}: not readable JSON ({type(err).__name__}: {err})") from None
    if not isinstance(record, dict) or record.get("format") != CALIBRATION_FORMAT or record.get("version") != 1:
        raise StepCacheError(f"calibration file {path}: not a step-cache calibration (expected format "
                             f"{CALIBRATION_FORMAT!r}, version 1, as --step-cache METHOD:THRESHOLD@FILE writes it)")
    change, ratio, steps = record.get("change"), record.get("ratio"), record.get("steps")
    numbers = (isinstance(change, list) and isinstance(ratio, list) and isinstance(steps, int) and steps >= 2
               and len(change) == len(ratio) == steps and change[0] is None
               and all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in change[1:] + ratio))
    if not numbers:
        raise StepCacheError(f"calibration file {path}: expected `steps` (>= 2) and that many `change` values (null, "
                             "then numbers >= 0) and `ratio` values (numbers >= 0)")
    return Calibration([math.inf, *map(float, change[1:])], [float(r) for r in ratio], dict(record.get("identity") or {}))


def fbcache_full_steps(change: Sequence[float], threshold: float) -> list[int]:
    """FBCache's rule as a static schedule: a step runs in full when the first block's residual
    has changed by more than `threshold` since the last full step. diffusers compares with the
    last full step's residual itself; a calibration run records only consecutive changes, so
    the change since the last full step is taken as their sum, which bounds it from above (the
    triangle inequality): the schedule never caches a step the runtime rule would recompute on
    the calibration run's trajectory (up to the normalisation)."""
    full, since = [], 0.0
    for i, c in enumerate(change):
        since += c
        if i == 0 or since > threshold:
            full.append(i)
            since = 0.0
    return full


def magcache_full_steps(ratio: Sequence[float], threshold: float, steps: int | None = None,
                        max_skip: int = MAGCACHE_MAX_SKIP, retention: float = MAGCACHE_RETENTION) -> list[int]:
    """MagCache's rule, exactly as diffusers 0.42's `MagCacheHeadHook` applies it (float32, the
    ratios interpolated to `steps` by nearest neighbour as `MagCacheConfig` does): from step
    `int(retention * steps + 0.5)` on, the ratios multiply into an accumulated ratio whose
    distance from 1 adds to an accumulated error; a step is cached while that error is within
    `threshold`, at most `max_skip` in a row and once a residual exists; a full step resets them.
    It reads only the ratios, so the decision is static in diffusers too."""
    import numpy as np

    ratios = np.asarray(ratio, np.float32)
    steps = len(ratios) if steps is None else steps
    if len(ratios) != steps:  # diffusers' `nearest_interp`
        idx = np.round(np.arange(steps, dtype=np.float32) * ((len(ratios) - 1) / (steps - 1))).astype(int) \
            if steps > 1 else np.array([len(ratios) - 1])
        ratios = ratios[idx]
    acc_ratio, acc_err, acc_steps, cached_ok = np.float32(1.0), np.float32(0.0), 0, False
    full, keep = [], int(retention * steps + 0.5)
    for i in range(steps):
        compute = True
        if i >= keep:
            acc_ratio = np.float32(acc_ratio * ratios[i])
            acc_steps += 1
            acc_err = np.float32(acc_err + abs(np.float32(1.0) - acc_ratio))
            if cached_ok and acc_err <= threshold and acc_steps <= max_skip:
                compute = False
            else:
                acc_ratio, acc_err, acc_steps = np.float32(1.0), np.float32(0.0), 0
        if compute:
            full.append(i)
            cached_ok = True
    return full


def full_steps_from(calibration: Calibration, cache: StepCache, steps: int) -> list[int]:
    """`cache`'s full steps from a calibration run's record and its threshold."""
    if cache.method == "fbcache":
        return fbcache_full_steps(calibration.change[:steps], cache.threshold)
    if cache.method == "magcache":
        return magcache_full_steps(calibration.ratio, cache.threshold, steps, cache.max_skip, cache.retention)
    raise StepCacheError(f"step cache {cache}: {cache.method} has no threshold; give START:END:INTERVAL or full=STEPS")


def speedup_bound(full_flops: float, cached_flops: float, steps: int, n_full: int) -> float:
    """The most a schedule with `n_full` of `steps` full steps can speed the denoising up, from
    the compiled programs' FLOPs (`tpupedia.aot.Program.flops`): the FLOPs of all-full steps over
    the schedule's."""
    return steps * full_flops / (n_full * full_flops + (steps - n_full) * cached_flops)


# --- the blocks, cached at trace time ---------------------------------------------------------------

def _streams(signature: inspect.Signature, args: tuple, kwargs: dict) -> tuple[Any, Any]:
    bound = signature.bind_partial(*args, **kwargs).arguments
    return bound["hidden_states"], bound.get("encoder_hidden_states")


@contextlib.contextmanager
def traced(transformer: Any, facts: Any, cache: StepCache, mode: str, cached: dict | None = None,
           calibrate: bool = False) -> Iterator[dict]:
    """While tracing a step of `transformer` (a family module `facts` names its blocks:
    `CACHE_BLOCKS`, `CACHE_TEXT_STREAM`), its blocks cache as `cache.method` says. `mode`
    `"full"`: every block runs and the dict yielded fills with what a cached step needs (and,
    with `calibrate`, the first block's residual `head` and the stack's residual `stack` that
    `Calibration` reads); `"cached"`: the step reuses `cached`, the dict a full step filled.
    The blocks' `forward` is restored on exit."""
    blocks = list(getattr(transformer, facts.CACHE_BLOCKS))
    n, text_stream, method = len(blocks), bool(facts.CACHE_TEXT_STREAM), cache.method
    cut = n - cache.tail if method == "deepcache" else None
    if method == "deepcache":
        _check_tail(cache.tail, n)
    record: dict = {}
    saved = [(b, b.__dict__.get("forward")) for b in blocks]

    def pack(h, t):
        return (h, t) if text_stream else h

    def split(out):
        return (out[0], out[1]) if text_stream else (out, None)

    def wrap(k: int, block: Any):
        original = block.forward
        signature = inspect.signature(original)

        def forward(*args, **kwargs):
            h_in, t_in = _streams(signature, args, kwargs)
            if mode == "full":
                if k == 0:
                    record["_head_in"] = h_in
                if method == "deepcache" and k == cut:
                    record["state"] = (h_in, t_in) if text_stream else h_in
                out = original(*args, **kwargs)
                h, t = split(out)
                if k == 0:
                    record["_head_out"] = (h, t)
                    if calibrate:
                        record["head"] = h - h_in
                if k == n - 1:
                    head_h, head_t = record.pop("_head_out")
                    head_in = record.pop("_head_in")
                    if method == "fbcache":
                        record["residual"] = (h - head_h, t - head_t) if text_stream else h - head_h
                    if method == "magcache":
                        record["residual"] = h - head_in
                    if calibrate:
                        record["stack"] = h - head_in
                return out
            # cached
            if method == "fbcache":
                if k == 0:  # diffusers: `tail_block_residuals[i] + output[i]`
                    h, t = split(original(*args, **kwargs))
                    res = cached["residual"]
                    return pack(res[0] + h, res[1] + t) if text_stream else res + h
                return pack(h_in, t_in)
            if method == "magcache":
                if k == 0:  # diffusers: `hidden_states + previous_residual`, the text stream as it came in
                    return pack(h_in + cached["residual"], t_in)
                return pack(h_in, t_in)
            if k < cut:  # deepcache: the state entering the cut, from the cache
                return cached["state"] if k == cut - 1 else pack(h_in, t_in)
            return original(*args, **kwargs)

        return forward

    try:
        for k, b in enumerate(blocks):
            b.forward = wrap(k, b)
        yield record
    finally:
        for b, own in saved:
            if own is None:
                b.__dict__.pop("forward", None)
            else:
                b.forward = own


FIELD = {"parse": parse_step_cache, "metavar": "METHOD:THRESHOLD|METHOD:full=STEPS",
         "help": "reuse cached blocks on some steps: fbcache:0.05 or magcache:0.06 (a calibration run, every step full, "
                 "picks the steps first), deepcache:START:END:INTERVAL, or METHOD:full=0,1,2,4 (the steps that run in "
                 "full); off by default"}
"""The `step_cache` field's metadata in each family's `Request`: the `--step-cache` flag."""


def run_loop(cache: StepCache | None, steps: int, loop: Any, always_full: frozenset = frozenset(),
             identity: dict | None = None) -> tuple[Any, dict]:
    """Every family's denoising loop, with or without a step cache. `loop(full_steps, calibration)`
    runs all `steps` and returns `(result, timings)`: `full_steps` (a set) names the steps that
    run the full program, the others the cached one, and a `Calibration` records every step's
    cache. Without a cache, `loop(None, None)`. With a threshold, a calibration pass first (every
    step full; read instead from the cache's `calibration_file` where it exists, and saved there
    with `identity` where it does not), then the steps it keeps plus `always_full` (Wan's first
    step of each expert); with a schedule, the schedule alone. The timings gain the full steps,
    the replay that gives the same frames, and the calibration."""
    import time

    if cache is None:
        return loop(None, None)
    extra: dict = {}
    calibration = cache.saved_calibration(identity or {})
    if calibration is not None:
        extra = {"calibration_read": cache.calibration_file}
    elif cache.calibrated:
        start = time.perf_counter()
        calibration = Calibration(identity=dict(identity or {}))
        loop(set(range(steps)), calibration)
        extra = {"calibration_s": time.perf_counter() - start, "calibration": calibration.lists()}
        if cache.calibration_file is not None:
            write_calibration(cache.calibration_file, calibration)
            extra["calibration_written"] = cache.calibration_file
    full = cache.full_steps(steps, calibration)
    if cache.calibrated:
        full = sorted(set(full) | set(always_full))
    result, timings = loop(set(full), None)
    return result, timings | extra | {"step_cache": str(cache), "full_steps": full,
                                      "replay": f"{cache.method}:full={','.join(map(str, full))}"}
