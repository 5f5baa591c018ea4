"""Scheduler steps as pure functions of a traced step index, so one compiled step serves all steps.

diffusers' CogVideoX schedulers cannot be traced by `jax.jit` as they are: `step` branches in
Python on `prev_timestep >= 0`, indexes `alphas_cumprod` with the timestep, and the DPM solver
draws its noise inside `step` from the pipeline's generator. Here every per-step number is
computed once on the host by the stock scheduler's own code (`alphas_cumprod`, `get_variables`,
`get_mult`, in float32 torch as `step` computes them), stacked into arrays indexed by the step
`i`, and the step itself is a few multiply-adds on those arrays. The Python branches become
table entries (`second_order[i]`), and the noise is an argument drawn on the host
(`dpm_noise`) in the order the stock step draws it.

Numerics: the pure steps compute in float32. The stock step, given bf16 latents, multiplies them
by the first coefficient in bf16 before promoting; with float32 latents (the tiny preset's parity
tests) the two agree to float32 rounding.

Introduced in notebook 06 (CogVideoX text-to-video in three stages).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tpupedia.errors import TpupediaError

__all__ = ["SchedulerError", "cogvideox_tables", "ddim_step", "dpm_step", "dpm_noise"]

_PREDICTIONS = ("epsilon", "v_prediction", "sample")


class SchedulerError(TpupediaError, ValueError):
    """A scheduler or configuration the pure steps do not reproduce."""


def _prev_timestep(scheduler: Any, t: int) -> int:
    return t - scheduler.config.num_train_timesteps // scheduler.num_inference_steps


def cogvideox_tables(scheduler: Any, timesteps: Any | None = None) -> dict[str, np.ndarray]:
    """Per-step arrays for `ddim_step` / `dpm_step`, from a stock `CogVideoXDDIMScheduler` or
    `CogVideoXDPMScheduler` after `set_timesteps` (default timesteps: the scheduler's).

    Keys: `timesteps` (int32); `sqrt_alpha`, `sqrt_beta` (for the x0 prediction); DDIM: `a`, `b`;
    DPM: `mult1..4`, `mult_noise`, `second_order` (1.0 where the stock step takes its
    second-order branch and draws a second noise). All float32, shape `(steps,)`.
    """
    import torch
    from diffusers import CogVideoXDDIMScheduler, CogVideoXDPMScheduler

    if scheduler.config.prediction_type not in _PREDICTIONS:
        raise SchedulerError(f"prediction_type {scheduler.config.prediction_type!r} is not one of {_PREDICTIONS}")
    dpm = isinstance(scheduler, CogVideoXDPMScheduler)
    if not dpm and not isinstance(scheduler, CogVideoXDDIMScheduler):
        raise SchedulerError(f"{type(scheduler).__name__}: expected CogVideoXDDIMScheduler or CogVideoXDPMScheduler")
    if scheduler.num_inference_steps is None:
        raise SchedulerError("call scheduler.set_timesteps(steps) first")
    timesteps = [int(t) for t in (scheduler.timesteps if timesteps is None else timesteps)]
    acp = scheduler.alphas_cumprod
    rows: dict[str, list[float]] = {}

    def put(**values):
        for k, v in values.items():
            rows.setdefault(k, []).append(float(v))

    for i, t in enumerate(timesteps):
        prev = _prev_timestep(scheduler, t)
        a = acp[t]
        a_prev = acp[prev] if prev >= 0 else scheduler.final_alpha_cumprod
        put(sqrt_alpha=a**0.5, sqrt_beta=(1 - a) ** 0.5)
        if not dpm:
            a_t = ((1 - a_prev) / (1 - a)) ** 0.5
            put(a=a_t, b=a_prev**0.5 - a**0.5 * a_t)
            continue
        second = i > 0 and prev >= 0  # the stock step: `old_pred_original_sample is None or prev_timestep < 0`
        a_back = acp[timesteps[i - 1]] if i > 0 else None
        h, r, _, _ = scheduler.get_variables(a, a_prev, a_back)
        mult = list(scheduler.get_mult(h, r, a, a_prev, a_back)) + [torch.tensor(0.0)] * 2
        if not second:  # the second-order terms are unused (and may be inf) on these steps
            mult[2] = mult[3] = torch.tensor(0.0)
        put(mult1=mult[0], mult2=mult[1], mult3=mult[2], mult4=mult[3],
            mult_noise=(1 - a_prev) ** 0.5 * (1 - (-2 * h).exp()) ** 0.5, second_order=float(second))
    tables = {k: np.asarray(v, np.float32) for k, v in rows.items()}
    tables["timesteps"] = np.asarray(timesteps, np.int32)
    tables["prediction"] = np.asarray(_PREDICTIONS.index(scheduler.config.prediction_type), np.int32)
    return tables


def _x0(tables, i, sample, model_output):
    """The predicted clean sample, as the stock step computes it for each prediction type."""
    import jax.numpy as jnp

    sa, sb = tables["sqrt_alpha"][i], tables["sqrt_beta"][i]
    return jnp.select(
        [tables["prediction"] == 0, tables["prediction"] == 1],
        [(sample - sb * model_output) / sa, sa * sample - sb * model_output],
        model_output,
    )


def ddim_step(tables: dict, i: Any, latents: Any, model_output: Any) -> Any:
    """`CogVideoXDDIMScheduler.step(model_output, timesteps[i], latents)` (eta 0) as a pure function."""
    x0 = _x0(tables, i, latents, model_output)
    return tables["a"][i] * latents + tables["b"][i] * x0


def dpm_step(tables: dict, i: Any, latents: Any, model_output: Any, old_pred_original_sample: Any,
             noise: Any) -> tuple[Any, Any]:
    """`CogVideoXDPMScheduler.step(...)` as a pure function: returns `(prev_sample, pred_original)`.

    `noise` is `(2, *latents.shape)`: the first and the second draw of the stock step for step `i`
    (`dpm_noise`); the second-order branch uses the second, the first-order branch the first.
    """
    import jax.numpy as jnp

    x0 = _x0(tables, i, latents, model_output)
    second = tables["second_order"][i] > 0
    m1, m2, m3, m4, mn = (tables[k][i] for k in ("mult1", "mult2", "mult3", "mult4", "mult_noise"))
    first_order = m1 * latents - m2 * x0 + mn * noise[0]
    denoised_d = m3 * x0 - m4 * old_pred_original_sample
    second_order = m1 * latents - m2 * denoised_d + mn * noise[1]
    return jnp.where(second, second_order, first_order), x0


def dpm_noise(generator: Any, shape: tuple[int, ...], dtype: Any, tables: dict, i: int) -> np.ndarray:
    """The noise the stock `CogVideoXDPMScheduler.step` draws at step `i`, from the same generator,
    as a float32 `(2, *shape)` array: one draw on every step, a second one on second-order steps
    (the second slot is zeros otherwise). Call once per step, in order, after the initial latents."""
    from diffusers.utils.torch_utils import randn_tensor

    draws = [randn_tensor(shape, generator=generator, dtype=dtype)]
    draws.append(randn_tensor(shape, generator=generator, dtype=dtype) if tables["second_order"][i] else draws[0] * 0)
    return np.stack([d.float().numpy() for d in draws])
