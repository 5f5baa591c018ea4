"""One attention function for every platform, and one SDPA override for torchax.

Introduced in notebook `splash_attention` (splash attention).

:func:`attention` takes PyTorch-layout arrays ``(batch, heads, seq, head_dim)`` and computes
softmax attention with one of three back ends:

``"splash"``
    JAX's splash attention Pallas kernel: compiled for the TPU on a TPU, run in Pallas interpret
    mode elsewhere (slow, but the same kernel code; this is how CI checks it).
``"reference"``
    ``jax.nn.dot_product_attention`` (XLA; on a GPU XLA may pick cuDNN). It materialises the
    score matrix, so it is for short sequences, checks and GPUs.
``"auto"``
    splash on a TPU, the reference elsewhere (``resolve_backend``; the pipelines' ``--attention
    auto`` means the same). The functions here default to ``"splash"``: calling this module is
    asking for the kernel, interpreted off a TPU, as notebook `splash_attention` runs it.

Masks. Splash masks are static, host-side objects, while a caller such as Hugging Face passes a
*traced* boolean mask of shape ``(B, 1, Sq, Skv)``. The splash path represents exactly the masks
of the form ``base[i, j] & q_valid[i] & kv_valid[j]``, where ``base`` is all-true or causal
(``i >= j``) and the validity vectors are per batch element. That covers key padding, query
padding, joint text+video padding and HF's explicit causal(+padding) masks. The validity vectors
become splash :class:`SegmentIds`: valid tokens share segment 0, masked or padded keys get
segment 2 and masked or padded queries segment 1, so they match nothing. Padding a sequence up to
a block multiple uses the same segment ids, which makes padding *exact* (a zero key inside a
``FullMask`` is not masked: it has logit 0 and still takes a share of the softmax).

Any other mask (per-head masks, float/additive masks, arbitrary patterns) goes to the reference
path. With ``mask_structure="check"`` (the default) the decomposition is verified at run time on
the mask itself and ``lax.switch`` picks the splash form that reproduces it, or the reference if
none does, so a wrong answer is never returned silently. Query rows with no visible key return
0 (as PyTorch on CPU does), not NaN, on every path.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.sharding import PartitionSpec as P

from tpupedia.errors import TpupediaError

__all__ = [
    "AttentionError",
    "recording",
    "AttentionLayoutWarning",
    "LANE",
    "BACKENDS",
    "resolve_backend",
    "padded_attend",
    "round_up",
    "default_block_sizes",
    "check_block_sizes",
    "check_block_rules",
    "parse_block_sizes",
    "BLOCK_LADDER",
    "block_candidates",
    "chip_block_sizes",
    "fitting_block_sizes",
    "split_mask",
    "reference_attention",
    "splash_attention",
    "attention",
    "install_attention",
    "cache_info",
]

LANE = 128
"""A TPU vreg is 8 sublanes x 128 lanes: splash tiles must be multiples of 128 along sequences."""

BACKENDS = ("auto", "splash", "reference")
_MASK_STRUCTURES = ("check", "padding", "causal_padding")


class AttentionError(TpupediaError, ValueError):
    """Inputs or settings that attention cannot honour; the message names the value and the rule."""


class AttentionLayoutWarning(UserWarning):
    """Heads (or batch) did not divide the mesh axis; a different layout was used."""


# ---------------------------------------------------------------------------------------------
# block sizes


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-int(n) // int(multiple)) * int(multiple)


def default_block_sizes(q_len: int, kv_len: int, max_block: int = 512) -> sa.BlockSizes:
    """Block sizes of at most ``max_block``, never larger than the 128-padded sequence."""
    bq = min(max_block, round_up(q_len, LANE))
    bkv = min(max_block, round_up(kv_len, LANE))
    return sa.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv)


def _as_block_sizes(block_sizes: Any) -> sa.BlockSizes:
    if isinstance(block_sizes, sa.BlockSizes):
        return block_sizes
    if isinstance(block_sizes, dict):
        return sa.BlockSizes(**block_sizes)
    if isinstance(block_sizes, (tuple, list)) and len(block_sizes) in (2, 3):
        return sa.BlockSizes(*[int(b) for b in block_sizes])
    raise AttentionError(
        f"block_sizes={block_sizes!r}: expected splash BlockSizes, a dict of its fields, or "
        "(block_q, block_kv[, block_kv_compute])"
    )


def check_block_sizes(block_sizes: Any, q_len: int, kv_len: int) -> sa.BlockSizes:
    """Validate forward block sizes for sequences of ``q_len`` queries and ``kv_len`` keys.

    Rules: each of ``block_q``, ``block_kv``, ``block_kv_compute`` is a positive multiple of 128
    (the TPU lane width; the kernel's tiles are laid out in 128-lane registers, also in interpret
    mode); ``block_kv_compute`` divides ``block_kv``; and no block exceeds its sequence padded to
    a multiple of 128 (a larger block would only compute padding).
    """
    bs = _as_block_sizes(block_sizes)
    limits = {"block_q": round_up(q_len, LANE), "block_kv": round_up(kv_len, LANE),
              "block_kv_compute": round_up(kv_len, LANE)}
    for name, limit in limits.items():
        value = getattr(bs, name)
        if not isinstance(value, int) or value <= 0 or value % LANE:
            raise AttentionError(
                f"{name}={value!r} is not a positive multiple of {LANE}: splash tiles sequences "
                f"in {LANE}-lane TPU registers"
            )
        if value > limit:
            raise AttentionError(
                f"{name}={value} exceeds the padded sequence length {limit} "
                f"(length rounded up to a multiple of {LANE}); use at most {limit}"
            )
    if bs.block_kv % bs.block_kv_compute:
        raise AttentionError(
            f"block_kv_compute={bs.block_kv_compute} must divide block_kv={bs.block_kv}"
        )
    return bs


def check_block_rules(block_sizes: Any) -> tuple[int, int, int]:
    """The rules of :func:`check_block_sizes` that hold for any sequence length (multiples of 128,
    ``block_kv_compute`` divides ``block_kv``): for block sizes that are upper bounds, capped per
    call to each sequence (:func:`install_attention`, :func:`padded_attention`). Returns
    ``(block_q, block_kv, block_kv_compute)``."""
    bs = _as_block_sizes(block_sizes)
    longest = max(v for v in (bs.block_q, bs.block_kv, bs.block_kv_compute) if isinstance(v, int))
    bs = check_block_sizes(bs, longest, longest)
    return bs.block_q, bs.block_kv, bs.block_kv_compute


def parse_block_sizes(text: str) -> tuple[int, int, int]:
    """``"3328,2816,256"`` as checked ``(block_q, block_kv, block_kv_compute)`` (``--block-sizes``)."""
    parts = [p.strip() for p in str(text).split(",")]
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise AttentionError(f"block sizes {text!r}: expected three positive integers "
                             "BLOCK_Q,BLOCK_KV,BLOCK_KV_COMPUTE, e.g. 3328,2816,256")
    return check_block_rules(tuple(int(p) for p in parts))


BLOCK_LADDER = ((2048, 2048), (2048, 1024), (1024, 1024), (1024, 512), (512, 512))
"""The `(block_q, block_kv)` steps a chip with less scoped VMEM than its family's blocks need
steps down through, largest first (`block_candidates`)."""

PROBE_HEAD_DIM = 128
"""The head width a block probe compiles at: the widest of the three families' heads (Wan's and
HunyuanVideo-1.5's; CogVideoX's are 64), so blocks that fit it fit them all."""


def block_candidates(block_sizes: Any) -> list[tuple[int, int, int]]:
    """`block_sizes`, then each step of `BLOCK_LADDER` no larger than it in either sequence, with
    `block_kv_compute` the largest common multiple of 128 of the asked one and the step's
    `block_kv` (it must divide `block_kv`): what `fitting_block_sizes` tries, in order."""
    bq, bkv, bkvc = check_block_rules(block_sizes)
    found = [(bq, bkv, bkvc)]
    for q, kv in BLOCK_LADDER:
        if q <= bq and kv <= bkv and (q, kv) != (bq, bkv):
            found.append((q, kv, math.gcd(kv, bkvc)))
    return found


def _fits_vmem(device: Any, blocks: tuple[int, int, int], head_dim: int) -> bool:
    """Whether the TPU compiler fits one splash call at `blocks` in `device`'s scoped VMEM,
    compiled for that device alone (kept like every compile) at the call shape that needs the
    most as measured here with libtpu 0.0.42.1: a batch of two (the guidance pair on one device
    asks about 3 MiB more than one video), 16 heads and a padded sequence eight blocks long (with
    a batch of two, 8 heads or more ask 1 to 2 MiB more than 2 to 4; Wan 14B's 40 heads at 75,600
    tokens asked no more than 16 at 16,376)."""
    from jax.sharding import Mesh, NamedSharding

    from tpupedia import aot

    mesh = Mesh([device], ("x",))
    arg = aot.abstract((2, 16, 8 * max(blocks[:2]) - 8, head_dim), jnp.bfloat16, NamedSharding(mesh, P()))
    result = aot.compile_aot(lambda q, k, v: splash_attention(q, k, v, block_sizes=blocks, interpret=False),
                             arg, arg, arg)
    return result.vmem_required_bytes is None


@functools.lru_cache(maxsize=None)
def fitting_block_sizes(device: Any, block_sizes: tuple[int, int, int],
                        head_dim: int = PROBE_HEAD_DIM) -> tuple[int, int, int]:
    """The first of `block_candidates(block_sizes)` whose splash kernel the TPU compiler fits in
    `device`'s scoped VMEM (it reports a kernel that does not: "Scoped allocation with size
    23.94M and limit 16.00M exceeded"). Measured with libtpu 0.0.42.1 on this project's CI host:
    one bf16 head of width 128 at the families' blocks (3072/2048/1024, 2048/2048/512,
    3328/2816/256) needs 17.95 to 23.35 MiB on a v5e and 20.67 to 28.04 MiB on a v5p, whose
    limit is 16 MiB, and a batch of two about 3 MiB more; a v6e's and a TPU7x's limit is 32 MiB.
    Raises `AttentionError` if none fits.

    Introduced in notebook `tune_before_you_rent` (one v5e chip)."""
    for blocks in block_candidates(block_sizes):
        if _fits_vmem(device, blocks, head_dim):
            return blocks
    raise AttentionError(f"splash blocks {'/'.join(map(str, block_sizes))}: no step down to "
                         f"{'/'.join(map(str, block_candidates(block_sizes)[-1]))} fits the scoped VMEM of "
                         f"{device.device_kind}; raise the limit (--xla_tpu_scoped_vmem_limit_kib in LIBTPU_INIT_ARGS)")


def chip_block_sizes(device: Any, block_sizes: Any) -> tuple[int, int, int]:
    """The splash blocks a TPU `device` runs a family's `block_sizes` at: as they are on a chip
    with at least the scoped VMEM of the v6e they were tuned on (`Chip.scoped_vmem_bytes`: v6e
    and TPU7x 32 MiB), else the first that fits (`fitting_block_sizes`: a v5e's or v5p's 16 MiB).
    A chip the hardware table does not know is probed."""
    from tpupedia import hardware

    blocks = check_block_rules(block_sizes)
    tuned_on = hardware.chip("v6e").scoped_vmem_bytes
    known = hardware.chip_for_device_kind(device.device_kind)
    vmem = None if known is None else known.scoped_vmem_bytes
    if vmem is not None and vmem >= tuned_on:
        return blocks
    return fitting_block_sizes(device, blocks)


def _cap_block_sizes(bs: sa.BlockSizes, q_len: int, kv_len: int) -> sa.BlockSizes:
    """Shrink blocks to the 128-padded sequence (what the installed override does per call)."""
    bq = min(bs.block_q, round_up(q_len, LANE))
    bkv = min(bs.block_kv, round_up(kv_len, LANE))
    bkvc = bs.block_kv_compute if bkv % bs.block_kv_compute == 0 else bkv
    return sa.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=min(bkvc, bkv))


def capped_block_sizes(block_sizes: Any, q_len: int, kv_len: int) -> tuple[int, int, int]:
    """`(block_q, block_kv, block_kv_compute)` a call of these lengths runs at: `block_sizes`
    shrunk to the 128-padded sequence as the installed override shrinks them per call
    (`tpupedia.predict` counts the padded blocks with them)."""
    bs = _cap_block_sizes(_as_block_sizes(block_sizes), q_len, kv_len)
    return bs.block_q, bs.block_kv, bs.block_kv_compute


_RECORDS: list[list[list[int]]] = []


@contextlib.contextmanager
def recording():
    """Record every splash call made through the torchax overrides inside the block
    (`install_attention`, `padded_attend`): yields a list that fills with `[batch, heads, q_len,
    kv_len, head_dim, block_q, block_kv, block_kv_compute]` per call (the global shapes and the
    blocks asked, which `capped_block_sizes` shrinks to the call's sequence as the kernel runs
    them). A call is recorded where the model makes it, while its program is
    traced (the jitted kernel below is traced once per shape, the model's call is not), so a
    program's calls are recorded while it is lowered (`tpupedia.plan` counts a step's attention
    work with it, `tpupedia.predict.splash_flops`)."""
    calls: list[list[int]] = []
    _RECORDS.append(calls)
    try:
        yield calls
    finally:
        _RECORDS.remove(calls)


def _record(q_shape, kv_len: int, block_sizes: Any) -> None:
    """Add one splash call to every open `recording`: its shapes and the blocks it runs at."""
    if not _RECORDS:
        return
    b, h, sq, d = (int(n) for n in q_shape)
    bs = default_block_sizes(sq, kv_len) if block_sizes is None else _as_block_sizes(block_sizes)
    for calls in _RECORDS:  # the blocks as asked: `capped_block_sizes` gives what the call runs at
        calls.append([b, h, sq, int(kv_len), d, bs.block_q, bs.block_kv, bs.block_kv_compute])


# ---------------------------------------------------------------------------------------------
# input checks and masks


def _check_qkv(q, k, v) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise AttentionError(
            f"q, k, v must be (batch, heads, seq, head_dim); got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        raise AttentionError(
            f"head dims differ: q {q.shape[-1]}, k {k.shape[-1]}, v {v.shape[-1]}; "
            "q, k and v must share one head_dim"
        )
    if k.shape != v.shape:
        raise AttentionError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[0] != k.shape[0]:
        raise AttentionError(f"batch sizes differ: q {q.shape[0]}, k/v {k.shape[0]}")
    if q.shape[1] % k.shape[1]:
        raise AttentionError(
            f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads "
            "(grouped-query attention needs q_heads % kv_heads == 0)"
        )


def _causal(q_len: int, kv_len: int) -> jax.Array:
    # PyTorch's is_causal: top-left aligned, query i sees keys j <= i.
    return jnp.arange(q_len)[:, None] >= jnp.arange(kv_len)[None, :]


def split_mask(mask: jax.Array, *, causal: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Split a boolean ``(B, 1|Sq, Skv)``-broadcastable mask into per-token validity.

    Returns ``(q_valid (B, Sq), kv_valid (B, Skv), exact)``, where ``exact`` is a traced bool:
    whether ``base & q_valid[:, :, None] & kv_valid[:, None, :]`` reproduces the mask, ``base``
    being causal if ``causal`` else all-true.
    """
    m = mask[:, 0] if mask.ndim == 4 else mask
    q_valid = m.any(-1)
    kv_valid = m.any(-2)
    rebuilt = q_valid[:, :, None] & kv_valid[:, None, :]
    if causal:
        rebuilt = rebuilt & _causal(m.shape[-2], m.shape[-1])
    return q_valid, kv_valid, jnp.all(rebuilt == m)


def _bool_mask(mask, q, k):
    """Broadcast a user mask to (B, 1, Sq, Skv) bool, or return None if splash can't take it."""
    b, _, sq, _ = q.shape
    skv = k.shape[2]
    if mask.dtype != jnp.bool_ or mask.ndim > 4 or (mask.ndim == 4 and mask.shape[1] != 1):
        return None
    m = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    return jnp.broadcast_to(m, (b, 1, sq, skv))


# ---------------------------------------------------------------------------------------------
# the reference path


def reference_attention(q, k, v, mask=None, *, is_causal=False, scale=None) -> jax.Array:
    """Softmax attention with ``jax.nn.dot_product_attention``; fully masked query rows give 0.

    ``q`` is ``(B, H, Sq, D)``, ``k``/``v`` are ``(B, Hkv, Skv, D)`` (GQA when Hkv < H).
    ``mask``: boolean (True = attend) or additive float, broadcastable to ``(B, H, Sq, Skv)``.
    """
    _check_qkv(q, k, v)
    if mask is not None and is_causal:
        raise AttentionError("pass either a mask or is_causal=True, not both (as in PyTorch)")
    b, h, sq, d = q.shape
    skv = k.shape[2]
    scale = d**-0.5 if scale is None else float(scale)
    bias = None
    if is_causal:
        mask = _causal(sq, skv)
    if mask is not None and mask.dtype != jnp.bool_:
        bias = jnp.broadcast_to(mask.astype(jnp.float32), (b, h, sq, skv))
        mask = None
    if mask is not None:
        mask = jnp.broadcast_to(mask, (b, h, sq, skv))
    out = jax.nn.dot_product_attention(
        q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3),
        bias=bias, mask=mask, scale=scale,
    ).transpose(0, 2, 1, 3)
    if mask is not None:
        out = jnp.where(mask.any(-1)[..., None], out, 0)
    return out.astype(q.dtype)


# ---------------------------------------------------------------------------------------------
# the splash path


_warned: set[tuple] = set()


def _warn_once(key: tuple, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, AttentionLayoutWarning, stacklevel=3)


@functools.lru_cache(maxsize=128)
def _kernel(causal: bool, heads: int, q_len: int, kv_len: int, block: tuple, interpret: bool):
    base = sa.CausalMask if causal else sa.FullMask
    mask = sa.MultiHeadMask([base((q_len, kv_len)) for _ in range(heads)])
    bs = sa.BlockSizes(block_q=block[0], block_kv=block[1], block_kv_compute=block[2])
    with jax.ensure_compile_time_eval():  # concrete mask info, even when first built under jit
        return sa.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=bs,
                                  interpret=interpret)


def cache_info():
    """Hits and misses of the kernel cache (one kernel per shape, mask kind and block sizes)."""
    return _kernel.cache_info()


@dataclass(frozen=True)
class _Layout:
    batch_axis: str | None
    head_axis: str | None
    seq_axis: str | None  # q split along the sequence (cross-attention layout)


def _choose_layout(mesh, layout, batch_axis, head_axis, b, h, hkv, causal) -> _Layout:
    names = mesh.axis_names
    if head_axis is None:
        head_axis = names[-1]
    if batch_axis is None and len(names) > 1:
        batch_axis = names[0]
    for ax in (head_axis, batch_axis):
        if ax is not None and ax not in names:
            raise AttentionError(f"mesh has axes {names}; no axis named {ax!r}")
    if batch_axis is not None and b % mesh.shape[batch_axis]:
        _warn_once(("batch", b, mesh.shape[batch_axis]),
                   f"batch {b} does not divide mesh axis {batch_axis!r} "
                   f"({mesh.shape[batch_axis]}); replicating over it")
        batch_axis = None
    n = mesh.shape[head_axis]
    if layout not in ("heads", "sequence"):
        raise AttentionError(f"layout={layout!r}: expected 'heads' or 'sequence'")
    if layout == "sequence" and causal:
        raise AttentionError("layout='sequence' splits queries and needs a non-causal mask")
    if layout == "heads" and h % n:
        if not causal:
            _warn_once(("heads", h, n), f"{h} heads do not divide mesh axis {head_axis!r} ({n}); "
                       "splitting queries along the sequence instead")
            return _Layout(batch_axis, None, head_axis)
        _warn_once(("heads", h, n), f"{h} heads do not divide mesh axis {head_axis!r} ({n}); "
                   "replicating attention over it")
        return _Layout(batch_axis, None, None)
    if layout == "sequence":
        return _Layout(batch_axis, None, head_axis)
    del hkv  # kv heads are repeated to the query heads when they do not divide
    return _Layout(batch_axis, head_axis, None)


def splash_attention(
    q, k, v, q_valid=None, kv_valid=None, *, is_causal=False, scale=None, block_sizes=None,
    interpret=None, mesh=None, layout="heads", batch_axis=None, head_axis=None,
) -> jax.Array:
    """Splash attention on ``(B, H, S, D)`` arrays with exact padding.

    ``q_valid`` ``(B, Sq)`` / ``kv_valid`` ``(B, Skv)`` mark real tokens (default: all).
    Sequences are padded to block multiples; padded and invalid tokens are excluded through
    segment ids, and query rows with no visible key return 0. ``block_sizes`` are checked with
    :func:`check_block_sizes`. ``interpret`` defaults to True off TPU. With a ``mesh``, the kernel
    runs under ``shard_map``: heads split over ``head_axis`` (default: the mesh's last axis) and
    batch over ``batch_axis`` (default: its first, if it has two or more); ``layout="sequence"``
    splits the queries instead (non-causal only, e.g. cross-attention).
    """
    _check_qkv(q, k, v)
    b, h, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else float(scale)
    bs = default_block_sizes(sq, skv) if block_sizes is None else check_block_sizes(block_sizes, sq, skv)
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    lay = _Layout(None, None, None)
    n_seq = 1
    if mesh is not None:
        lay = _choose_layout(mesh, layout, batch_axis, head_axis, b, h, hkv, is_causal)
        if lay.seq_axis is not None:
            n_seq = mesh.shape[lay.seq_axis]
        if lay.head_axis is not None and hkv % mesh.shape[lay.head_axis]:
            k = jnp.repeat(k, h // hkv, axis=1)
            v = jnp.repeat(v, h // hkv, axis=1)
            hkv = h
    sqp, skvp = round_up(sq, bs.block_q * n_seq), round_up(skv, bs.block_kv)
    qv = jnp.ones((b, sq), bool) if q_valid is None else jnp.broadcast_to(q_valid, (b, sq))
    kvv = jnp.ones((b, skv), bool) if kv_valid is None else jnp.broadcast_to(kv_valid, (b, skv))
    qv = jnp.pad(qv, ((0, 0), (0, sqp - sq)))
    kvv = jnp.pad(kvv, ((0, 0), (0, skvp - skv)))
    q_seg = jnp.where(qv, 0, 1).astype(jnp.int32)
    kv_seg = jnp.where(kvv, 0, 2).astype(jnp.int32)
    def pad(x, s):
        return jnp.pad(x, ((0, 0), (0, 0), (0, s - x.shape[2]), (0, 0)))

    qp, kp, vp = pad(q * jnp.asarray(scale, q.dtype), sqp), pad(k, skvp), pad(v, skvp)
    block = (bs.block_q, bs.block_kv, bs.block_kv_compute)

    def local(q, k, v, q_seg, kv_seg, qv):
        kern = _kernel(bool(is_causal), q.shape[1], q.shape[2], k.shape[2], block, bool(interpret))
        out = jax.vmap(lambda a, b_, c, s, t: kern(a, b_, c, segment_ids=sa.SegmentIds(s, t)))(
            q, k, v, q_seg, kv_seg)
        return jnp.where(qv[:, None, :, None], out, 0).astype(q.dtype)

    if mesh is None:
        out = local(qp, kp, vp, q_seg, kv_seg, qv)
    else:
        ba, ha, sa_ = lay.batch_axis, lay.head_axis, lay.seq_axis
        q_spec = P(ba, ha, sa_, None)
        kv_spec = P(ba, ha, None, None)
        qs_spec, kvs_spec = P(ba, sa_), P(ba, None)
        out = jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, qs_spec, kvs_spec, qs_spec),
                            out_specs=q_spec, check_vma=False)(qp, kp, vp, q_seg, kv_seg, qv)
    return out[:, :, :sq]


# ---------------------------------------------------------------------------------------------
# the dispatcher


def resolve_backend(backend: str = "auto", platform: str | None = None) -> str:
    """``"splash"`` or ``"reference"``: what ``backend`` means on ``platform`` (default: JAX's).

    The one meaning of ``"auto"`` everywhere (the pipelines, the plan, the dry-run): the splash
    kernel on a TPU, the reference elsewhere: a GPU has no splash kernel, and on a CPU the
    kernel runs in Pallas' interpret mode, which is for checking correctness, not for speed. Ask
    for ``"splash"`` to interpret it off a TPU (notebook `splash_attention` does)."""
    if backend not in BACKENDS:
        raise AttentionError(f"backend={backend!r}: expected one of {BACKENDS}")
    platform = platform or jax.default_backend()
    if backend == "auto":
        return "splash" if platform == "tpu" else "reference"
    return backend


def attention(
    q, k, v, mask=None, *, is_causal=False, scale=None, backend="splash", block_sizes=None,
    interpret=None, mesh=None, layout="heads", batch_axis=None, head_axis=None,
    mask_structure="check", cap_block_sizes=False,
) -> jax.Array:
    """Scaled dot-product attention, PyTorch semantics, on ``(B, H, S, D)`` arrays.

    ``mask`` is boolean (True = attend) or additive float, broadcastable to ``(B, H, Sq, Skv)``;
    ``is_causal`` is top-left aligned as in PyTorch; GQA when k/v have fewer heads. See the
    module docstring for which masks the splash path represents; ``mask_structure`` says how a
    boolean mask is handled there: ``"check"`` verifies at run time (``lax.switch`` between
    padding, causal+padding and the reference), ``"padding"`` / ``"causal_padding"`` trust the
    caller that the mask has that form (no reference branch is compiled).
    """
    _check_qkv(q, k, v)
    if mask is not None and is_causal:
        raise AttentionError("pass either a mask or is_causal=True, not both (as in PyTorch)")
    if mask_structure not in _MASK_STRUCTURES:
        raise AttentionError(f"mask_structure={mask_structure!r}: expected one of {_MASK_STRUCTURES}")
    if resolve_backend(backend) == "reference":
        return reference_attention(q, k, v, mask, is_causal=is_causal, scale=scale)
    sq, skv = q.shape[2], k.shape[2]
    if block_sizes is not None and cap_block_sizes:
        block_sizes = _cap_block_sizes(_as_block_sizes(block_sizes), sq, skv)
    kw = dict(scale=scale, block_sizes=block_sizes, interpret=interpret, mesh=mesh,
              layout=layout, batch_axis=batch_axis, head_axis=head_axis)
    if mask is None:
        return splash_attention(q, k, v, is_causal=is_causal, **kw)
    m = _bool_mask(mask, q, k)
    if m is None:  # float or per-head mask: not representable by segment ids
        return reference_attention(q, k, v, mask, scale=scale)
    if mask_structure != "check":
        causal = mask_structure == "causal_padding"
        qv, kvv, _ = split_mask(m, causal=causal)
        return splash_attention(q, k, v, qv, kvv, is_causal=causal, **kw)
    qv, kvv, exact_full = split_mask(m, causal=False)
    _, _, exact_causal = split_mask(m, causal=True)
    index = jnp.where(exact_full, 0, jnp.where(exact_causal, 1, 2))
    kw_nc = dict(kw, layout=layout)
    kw_c = dict(kw, layout="heads")
    branches = (
        lambda q, k, v, qv, kvv, m: splash_attention(q, k, v, qv, kvv, is_causal=False, **kw_nc),
        lambda q, k, v, qv, kvv, m: splash_attention(q, k, v, qv, kvv, is_causal=True, **kw_c),
        lambda q, k, v, qv, kvv, m: reference_attention(q, k, v, m, scale=scale),
    )
    return jax.lax.switch(index, branches, q, k, v, qv, kvv, m)


# ---------------------------------------------------------------------------------------------
# torchax


class AttentionOverride:
    """What :func:`install_attention` installed (its settings, for display and tests)."""

    def __init__(self, backend, mesh, block_sizes, mask_structure, interpret):
        self.backend = backend
        self.mesh = mesh
        self.block_sizes = block_sizes
        self.mask_structure = mask_structure
        self.interpret = interpret
        self.calls = 0

    def __repr__(self) -> str:
        mesh = None if self.mesh is None else dict(self.mesh.shape)
        return (f"AttentionOverride(backend={self.backend!r}, mesh={mesh}, "
                f"mask_structure={self.mask_structure!r}, interpret={self.interpret})")


def install_attention(
    env, mesh=None, backend="splash", block_sizes=None, *, mask_structure="check", interpret=None,
    **layout_kwargs,
) -> AttentionOverride:
    """Make ``F.scaled_dot_product_attention`` inside the torchax ``env`` call :func:`attention`.

    Registered for both ``torch.nn.functional.scaled_dot_product_attention`` and
    ``torch.ops.aten.scaled_dot_product_attention``. ``block_sizes`` here are upper bounds: each
    call shrinks them to its own 128-padded sequence (as upstream does with ``min``), so one
    setting serves a 226-token text encoder and a 40k-token transformer. ``layout_kwargs``
    (``layout``, ``batch_axis``, ``head_axis``) are passed on. Returns an
    :class:`AttentionOverride` describing what was installed.
    """

    from tpupedia.compat import import_torchax

    import_torchax()
    from torchax.interop import call_jax

    resolved = resolve_backend(backend)
    if block_sizes is not None:
        check_block_rules(block_sizes)
    info = AttentionOverride(resolved, mesh, block_sizes, mask_structure, interpret)
    jitted = jax.jit(
        functools.partial(attention, backend=resolved, block_sizes=block_sizes,
                          interpret=interpret, mesh=mesh, mask_structure=mask_structure,
                          cap_block_sizes=True, **layout_kwargs),
        static_argnames=("is_causal", "scale"),
    )

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):  # noqa: ARG001 - torch's signature; GQA is read from the shapes
        if dropout_p:
            raise AttentionError(f"dropout_p={dropout_p}: attention dropout is not supported "
                                 "(inference only); pass 0.0")
        info.calls += 1
        if resolved == "splash":
            _record(query.shape, key.shape[2], block_sizes)
        return call_jax(jitted, query, key, value, attn_mask, is_causal=bool(is_causal),
                        scale=None if scale is None else float(scale))

    from tpupedia.torchax_utils import SDPA_OPS

    for op in SDPA_OPS:
        env.override_op_definition(op, sdpa)
    return info



# ---------------------------------------------------------------------------------------------
# padding declared as a vector (HunyuanVideo-1.5, notebook `hunyuan_video`)


def padded_attend(backend: str, *, mesh=None, interpret=None, block_sizes=None, batch_axis="dp", head_axis="tp"):
    """``attend(q, k, v, valid)`` on torchax tensors: :func:`padded_attention` jitted with these
    settings and called through ``torchax.interop.call_jax``: what a family's padded forward
    (a processor that keeps the text padding as a ``(B, S)`` vector) calls, in the pipelines and
    in the dry-run. ``mesh`` is used by splash only (batch on ``batch_axis``, heads on ``head_axis``)."""
    splash = resolve_backend(backend) == "splash"
    fn = jax.jit(functools.partial(padded_attention, backend=backend, interpret=interpret,
                                   mesh=mesh if splash else None,
                                   batch_axis=batch_axis, head_axis=head_axis, block_sizes=block_sizes))

    def attend(q, k, v, valid):
        from torchax.interop import call_jax

        if splash:
            _record(q.shape, k.shape[2], block_sizes)
        return call_jax(fn, q, k, v, valid)

    return attend


def padded_attention(q, k, v, valid, *, backend="splash", scale=None, block_sizes=None, interpret=None, mesh=None,
                     batch_axis=None, head_axis=None) -> jax.Array:
    """Joint attention with padding: token ``j`` is visible to token ``i`` iff ``valid[:, i]``
    and ``valid[:, j]`` (``valid``: ``(B, S)`` booleans; ``q, k, v``: ``(B, H, S, D)``).

    This is the mask a joint text-video processor builds as a ``(B, 1, S, S)`` matrix (notebook `hunyuan_video`), declared
    by its structure instead: the splash path turns ``valid`` into segment ids and never forms an
    ``S x S`` mask; the reference path broadcasts it inside the score computation. Query rows that
    see no key (the padded tokens) return 0 on both paths. ``block_sizes`` are upper bounds, capped
    to the 128-padded sequence (as :func:`install_attention` does per call).
    """
    valid = valid.astype(bool)
    if resolve_backend(backend) == "reference":
        return reference_attention(q, k, v, valid[:, None, None, :] & valid[:, None, :, None], scale=scale)
    if block_sizes is not None:
        check_block_rules(block_sizes)
        block_sizes = _cap_block_sizes(_as_block_sizes(block_sizes), q.shape[2], k.shape[2])
    return splash_attention(q, k, v, valid, valid, scale=scale, block_sizes=block_sizes, interpret=interpret,
                            mesh=mesh, batch_axis=batch_axis, head_axis=head_axis)
