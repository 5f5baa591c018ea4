"""Scheduler steps as pure functions of a traced step index, so one compiled step serves all steps.

diffusers' schedulers cannot be traced by `jax.jit` as they are: the CogVideoX `step`s branch in
Python on `prev_timestep >= 0` and index `alphas_cumprod` with the timestep, the DPM solver
draws its noise inside `step` from the pipeline's generator and keeps the previous prediction
as Python state, and the flow-match Euler step finds its own index with `.nonzero().item()`.
Here every per-step number is computed once on the host by the stock scheduler's own code
(`alphas_cumprod`, `get_variables`, `get_mult`, `sigmas`, in the dtype `step` computes them),
stacked into arrays indexed by the step `i`, and the step itself is a few multiply-adds on those
arrays. The Python branches become table entries (`second_order[i]`), the state an argument,
and the noise an argument drawn on the host (`dpm_noise`) in the order the stock step draws it.

| stock scheduler | tables | pure step |
|---|---|---|
| `CogVideoXDDIMScheduler` | `cogvideox_tables` | `ddim_step` |
| `CogVideoXDPMScheduler` | `cogvideox_tables` | `dpm_step` (+ `dpm_noise` / `draw_dpm_noise`) |
| `FlowMatchEulerDiscreteScheduler` | `flow_match_tables` | `flow_match_euler_step` |

Numerics: the CogVideoX pure steps compute in float32. The stock step, given bf16 latents,
computes in bf16; with float32 latents the two agree to float32 rounding (the tests: 1e-5).
The flow-match step follows the stock dtype rules exactly (float32 sample, the `dt * output`
product in the output's dtype, the result cast back).

Introduced in notebook 06 (CogVideoX text-to-video in three stages).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tpupedia.errors import TpupediaError

__all__ = ["SchedulerError", "cogvideox_tables", "ddim_step", "dpm_step", "dpm_noise", "draw_dpm_noise",
           "flow_match_tables", "flow_match_euler_step"]

_PREDICTIONS = ("epsilon", "v_prediction", "sample")


class SchedulerError(TpupediaError, ValueError):
    """A scheduler or configuration the pure steps do not reproduce."""


def _prev_timestep(scheduler: Any, t: int) -> int:
    """The stock rule: `t - num_train_timesteps // num_inference_steps` (not the next entry of
    `timesteps`; with "trailing" spacing the two differ by rounding)."""
    return t - scheduler.config.num_train_timesteps // scheduler.num_inference_steps


def cogvideox_tables(scheduler: Any, timesteps: Any | None = None) -> dict[str, np.ndarray]:
    """Per-step arrays for `ddim_step` / `dpm_step`, from a stock `CogVideoXDDIMScheduler` or
    `CogVideoXDPMScheduler` after `set_timesteps` (default timesteps: the scheduler's).

    Every column has shape `(steps,)`, float32 unless said:

    * `timesteps` (int32) and `prediction` (int32 scalar: index into epsilon, v_prediction,
      sample);
    * `alpha_prod_t`, `alpha_prod_t_prev` (`final_alpha_cumprod` where the stock rule's
      previous timestep is < 0: the `prev_timestep >= 0` branch resolved here);
      `sqrt_alpha`, `sqrt_beta` (the x0 prediction);
    * DDIM: `a`, `b` (`prev = a * sample + b * x0`);
    * DPM: `alpha_prod_t_back` (at `timesteps[i-1]`; 0 on step 0, unused there), `mult1..4`,
      `mult_noise` and `second_order`: 1.0 where the stock step takes its second-order branch
      (not on step 0, which has no previous prediction, and not where the previous timestep is
      < 0: the last step when the step count divides `num_train_timesteps`; with 6 "trailing"
      steps the last timestep is 166, its previous one 166 - 1000 // 6 = 0, and the stock
      solver ends at `alphas_cumprod[0]` instead of `final_alpha_cumprod`). On the other
      steps `mult3`, `mult4` are 0 (the stock values may be inf there and are unused).

    Every value is computed by the stock methods in the scheduler's own dtype (float64 for
    `scaled_linear` betas) and rounded once to float32, as the stock step rounds it when it
    multiplies a float32 sample.
    """
    import torch
    from diffusers import CogVideoXDDIMScheduler, CogVideoXDPMScheduler

    dpm = isinstance(scheduler, CogVideoXDPMScheduler)
    if not dpm and not isinstance(scheduler, CogVideoXDDIMScheduler):
        raise SchedulerError(f"{type(scheduler).__name__}: expected CogVideoXDDIMScheduler or CogVideoXDPMScheduler")
    if scheduler.config.prediction_type not in _PREDICTIONS:
        raise SchedulerError(f"prediction_type {scheduler.config.prediction_type!r} is not one of {_PREDICTIONS}")
    if scheduler.num_inference_steps is None:
        raise SchedulerError("call scheduler.set_timesteps(steps) before building its tables")
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
        put(alpha_prod_t=a, alpha_prod_t_prev=a_prev, sqrt_alpha=a**0.5, sqrt_beta=(1 - a) ** 0.5)
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
        put(alpha_prod_t_back=0.0 if a_back is None else a_back,
            mult1=mult[0], mult2=mult[1], mult3=mult[2], mult4=mult[3],
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
    """`CogVideoXDDIMScheduler.step(model_output, timesteps[i], latents)` as a pure function;
    returns the previous sample. `i` may be traced. The stock step ignores `eta` and draws no
    noise, so neither is an argument here."""
    x0 = _x0(tables, i, latents, model_output)
    return tables["a"][i] * latents + tables["b"][i] * x0


def dpm_step(tables: dict, i: Any, latents: Any, model_output: Any, old_pred_original_sample: Any,
             noise: Any) -> tuple[Any, Any]:
    """`CogVideoXDPMScheduler.step(model_output, old_pred_original_sample, timesteps[i],
    timesteps[i-1] if i > 0 else None, latents)` as a pure function of a (traceable) step
    index: returns `(prev_sample, pred_original_sample)`.

    `old_pred_original_sample` is the previous step's second output (any finite array, such as
    zeros, on step 0: the tables zero its weight there). `noise` has the latents' shape: the
    noise the stock step adds at step `i`, as `dpm_noise` draws it. The stock step ignores
    `eta`: it always adds `mult_noise * noise` (an SDE solver; `mult_noise` is 0 on the last
    step).
    """
    import jax.numpy as jnp

    x0 = _x0(tables, i, latents, model_output)
    m1, m2, m3, m4, mn = (tables[k][i] for k in ("mult1", "mult2", "mult3", "mult4", "mult_noise"))
    first_order = m1 * latents - m2 * x0 + mn * noise
    second_order = m1 * latents - m2 * (m3 * x0 - m4 * old_pred_original_sample) + mn * noise
    return jnp.where(tables["second_order"][i] > 0, second_order, first_order), x0


def dpm_noise(generator: Any, shape: tuple[int, ...], dtype: Any, tables: dict, i: int) -> np.ndarray:
    """The noise the stock `CogVideoXDPMScheduler.step` adds at step `i`, drawn from the same
    CPU `torch.Generator`, as a float32 array of `shape`.

    The stock step calls `randn_tensor(sample.shape, generator=generator, dtype=sample.dtype)`
    once on *every* step, and a second time on second-order steps (`tables["second_order"][i]`),
    where the second draw replaces the first: so a step consumes one or two draws and adds the
    last. Call this once per step, in step order, after the initial latents were drawn from
    the same generator (as `CogVideoXPipeline` does: latents, then one `step` per timestep,
    nothing else in between), with the latents' dtype: a bf16 draw consumes the generator as
    the stock bf16 pipeline does.
    """
    from diffusers.utils.torch_utils import randn_tensor

    draw = randn_tensor(shape, generator=generator, dtype=dtype)
    if tables["second_order"][i]:
        draw = randn_tensor(shape, generator=generator, dtype=dtype)
    return draw.float().numpy()


def draw_dpm_noise(generator: Any, shape: tuple[int, ...], tables: dict, dtype: Any = None) -> np.ndarray:
    """The noise of every step at once: float32 `(steps, *shape)`, row `i` as `dpm_noise(...,
    i)`. The number of draws per step depends on the timesteps (see `dpm_noise`), so this takes
    the tables, not a step count. Host memory is `steps` latents; at full size prefer
    `dpm_noise` once per step."""
    import torch

    dtype = torch.float32 if dtype is None else dtype
    return np.stack([dpm_noise(generator, shape, dtype, tables, i) for i in range(len(tables["timesteps"]))])


def flow_match_tables(scheduler: Any) -> dict[str, np.ndarray]:
    """Per-step arrays for `flow_match_euler_step`, from a stock `FlowMatchEulerDiscreteScheduler`
    after `set_timesteps` (shift, dynamic shifting, custom `sigmas` included: they are already
    in `scheduler.sigmas`).

    Columns: `timesteps` (float32, what the model is given), `sigmas` (`steps + 1`, the last
    the terminal sigma) and `dt = sigmas[i+1] - sigmas[i]` (float32, computed as the stock step
    computes it). The stock step finds `i` itself from the timestep (its first match, the
    second when a timestep repeats); the loop index used here is the same for the pipelines'
    strictly decreasing schedules.
    """
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler

    if not isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        raise SchedulerError(f"{type(scheduler).__name__}: expected FlowMatchEulerDiscreteScheduler")
    if getattr(scheduler, "num_inference_steps", None) is None:  # set by set_timesteps only
        raise SchedulerError("call scheduler.set_timesteps(...) before building its tables")
    if scheduler.config.stochastic_sampling:
        raise SchedulerError("stochastic_sampling=True draws noise inside step; only the deterministic Euler step "
                             "is reproduced")
    sigmas = scheduler.sigmas.detach().cpu()
    steps = len(scheduler.timesteps)
    if len(sigmas) != steps + 1:
        raise SchedulerError(f"expected {steps + 1} sigmas for {steps} timesteps, got {len(sigmas)}")
    dt = torch.stack([sigmas[i + 1] - sigmas[i] for i in range(steps)])
    return {"timesteps": scheduler.timesteps.detach().cpu().float().numpy(),
            "sigmas": sigmas.float().numpy(), "dt": dt.float().numpy()}


def flow_match_euler_step(tables: dict, i: Any, latents: Any, model_output: Any) -> Any:
    """`FlowMatchEulerDiscreteScheduler.step(model_output, timesteps[i], latents)` (deterministic
    Euler) as a pure function of a (traceable) step index: `latents + dt[i] * model_output`,
    with the stock dtypes: the sample in float32, the product in the output's dtype, the result
    cast back to the output's dtype. Op by op it is the stock step bit for bit; under `jax.jit`
    XLA fuses the multiply-add (one rounding instead of two): one ulp (tests/test_schedulers.py)."""
    import jax.numpy as jnp

    dtype = model_output.dtype
    delta = tables["dt"][i].astype(dtype) * model_output  # torch casts the 0-dim dt to the output's dtype
    return (latents.astype(jnp.float32) + delta.astype(jnp.float32)).astype(dtype)
