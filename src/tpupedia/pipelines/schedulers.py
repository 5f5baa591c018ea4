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
| `uniform_euler` (the Wan 2.2 Lightning authors' Euler) | `flow_match_tables` | `flow_match_euler_step(..., keep_float32=True)` |
| `UniPCMultistepScheduler` (flow sigmas, Wan) | `unipc_tables` | `unipc_step` (+ `unipc_state`) |

Numerics: the CogVideoX pure steps compute in float32. The stock step, given bf16 latents,
computes in bf16; with float32 latents the two agree to float32 rounding (the tests: 1e-5).
The flow-match step follows the stock dtype rules exactly (float32 sample, the `dt * output`
product in the output's dtype, the result cast back); the Lightning authors' Euler keeps the
sample in float32 throughout.

Introduced in notebook `cogvideox_pipeline` (CogVideoX text-to-video in three stages).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from tpupedia.errors import TpupediaError

__all__ = ["SchedulerError", "cogvideox_tables", "ddim_step", "dpm_step", "dpm_noise", "draw_dpm_noise",
           "flow_match_tables", "flow_match_euler_step", "uniform_sigmas", "uniform_euler", "SOLVERS", "unipc_tables",
           "unipc_step", "unipc_state"]

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


def flow_match_euler_step(tables: dict, i: Any, latents: Any, model_output: Any, keep_float32: bool = False) -> Any:
    """`FlowMatchEulerDiscreteScheduler.step(model_output, timesteps[i], latents)` (deterministic
    Euler) as a pure function of a (traceable) step index: `latents + dt[i] * model_output`,
    with the stock dtypes: the sample in float32, the product in the output's dtype, the result
    cast back to the output's dtype. Op by op it is the stock step bit for bit; under `jax.jit`
    XLA fuses the multiply-add (one rounding instead of two): one ulp (tests/test_schedulers.py).
    `keep_float32`: the `uniform_euler` step instead, everything in float32 and the result kept so."""
    import jax.numpy as jnp

    if keep_float32:
        return latents.astype(jnp.float32) + tables["dt"][i].astype(jnp.float32) * model_output.astype(jnp.float32)
    dtype = model_output.dtype
    delta = tables["dt"][i].astype(dtype) * model_output  # torch casts the 0-dim dt to the output's dtype
    return (latents.astype(jnp.float32) + delta.astype(jnp.float32)).astype(dtype)


SOLVERS = ("unipc", "euler")
"""A Wan run's solvers: `unipc`, the checkpoint's `UniPCMultistepScheduler` (stock `WanPipeline`'s),
and `euler`, the Wan 2.2 Lightning authors' Euler (`uniform_euler`), which their few-step adapters
were distilled with."""


def uniform_sigmas(steps: int) -> np.ndarray:
    """`steps` sigmas evenly spaced from 1 down to (not including) 0, before any shift: the
    Lightning authors' `get_timesteps(steps) / 1000` without its final 0 (`uniform_euler`)."""
    return np.linspace(1.0, 0.0, steps + 1, dtype=np.float32)[:-1]


def uniform_euler(num_train_timesteps: int = 1000, shift: float = 1.0) -> Any:
    """The Euler solver the Wan 2.2 Lightning adapters were distilled with, as a diffusers
    scheduler a stock pipeline can take (`pipe.scheduler = uniform_euler(...)`; notebook
    `fewer_steps`). Its schedule is `uniform_sigmas(steps)` shifted as flow matching shifts
    (`shift * s / (1 + (shift - 1) * s)`), the timesteps `1000 * sigma` unrounded and a terminal
    0; its step `x + (sigma[i+1] - sigma[i]) * v` in float32, the result kept in float32.
    ModelTC/Wan2.2-Lightning at 92efeb4, `wan/utils/fm_solvers_euler.py` (`EulerScheduler`,
    `get_timesteps`, `timestep_shift`); stock diffusers' `FlowMatchEulerDiscreteScheduler` with
    no sigmas given spaces the timesteps between its own shifted sigma bounds and then shifts
    again, a different schedule. `flow_match_tables` reads it like any flow-match Euler."""
    return _uniform_euler_class()(num_train_timesteps=num_train_timesteps, shift=shift)


@functools.cache
def _uniform_euler_class() -> type:
    """The scheduler class, made on first use (diffusers is imported only then)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteSchedulerOutput

    class UniformEulerScheduler(FlowMatchEulerDiscreteScheduler):
        """`uniform_euler`'s scheduler: the flow-match Euler with evenly spaced sigmas, float32 steps."""

        def set_timesteps(self, num_inference_steps: int | None = None, device: Any = None, **kwargs: Any) -> None:
            if kwargs.get("sigmas") is None and kwargs.get("timesteps") is None:
                kwargs["sigmas"] = uniform_sigmas(num_inference_steps).tolist()
            super().set_timesteps(num_inference_steps, device, **kwargs)

        def step(self, model_output: Any, timestep: Any, sample: Any, *_: Any, return_dict: bool = True,
                 **__: Any) -> Any:
            if self.step_index is None:
                self._init_step_index(timestep)
            dt = self.sigmas[self.step_index + 1] - self.sigmas[self.step_index]
            prev = sample.float() + dt * model_output.float()
            self._step_index += 1
            return FlowMatchEulerDiscreteSchedulerOutput(prev_sample=prev) if return_dict else (prev,)

    return UniformEulerScheduler


def unipc_tables(scheduler: Any) -> dict[str, np.ndarray]:
    """Per-step arrays for `unipc_step`, from a stock `UniPCMultistepScheduler` after
    `set_timesteps`: the flow-matching configuration Wan ships (`prediction_type="flow_prediction"`,
    `use_flow_sigmas`, `predict_x0`, B(h) solvers, `solver_order` 1 or 2), its flow shift already
    in `scheduler.sigmas`.

    The stock `step` keeps Python state (the last two converted outputs, the last sample, a
    warm-up counter) and decides per call which order its predictor and corrector use. Those
    decisions depend only on the step index, so they are made here, with the stock code's own
    arithmetic on its own sigmas (0-dim float32 torch tensors, `torch.linalg.solve` for the
    corrector's weights), and stored as columns of shape `(steps,)`:

    * `timesteps` (what the model is given), `sigmas` (`steps + 1`);
    * the predictor from step `i` to `i + 1`: `p_x` (sigma ratio), `p_m0` (alpha * h phi_1),
      `p_q` (alpha * B(h)), `p_rk`, `p_two` (1.0 for the second-order update);
    * the corrector of step `i` (from step `i - 1`): `c_on` (1.0 where it runs: not the first
      step, not disabled), `c_x`, `c_m0`, `c_q`, `c_rk`, `c_rho0`, `c_rho1` (its weights; second
      order where `c_rho0` is not 0).
    """
    import torch
    from diffusers import UniPCMultistepScheduler

    if not isinstance(scheduler, UniPCMultistepScheduler):
        raise SchedulerError(f"{type(scheduler).__name__}: expected UniPCMultistepScheduler")
    if getattr(scheduler, "num_inference_steps", None) is None:
        raise SchedulerError("call scheduler.set_timesteps(...) before building its tables")
    config = scheduler.config
    wanted = {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "predict_x0": True,
              "thresholding": False, "solver_p": None}
    for key, value in wanted.items():
        if config.get(key) != value:
            raise SchedulerError(f"UniPC with {key}={config.get(key)!r}: the pure step reproduces {key}={value!r} "
                                 "(Wan's flow-matching configuration)")
    if config.solver_order not in (1, 2) or config.solver_type not in ("bh1", "bh2"):
        raise SchedulerError(f"UniPC solver_order={config.solver_order}, solver_type={config.solver_type!r}: "
                             "the pure step reproduces orders 1 and 2 with bh1 or bh2")
    sigmas = scheduler.sigmas.detach().cpu()
    steps = len(scheduler.timesteps)

    def alpha_sigma(s):  # `_sigma_to_alpha_sigma_t` with flow sigmas
        return 1 - s, s

    def lam(s):
        a, s_ = alpha_sigma(s)
        return torch.log(a) - torch.log(s_)

    def coefficients(t_index: int, s0_index: int):  # what both updates compute from (t, s0)
        alpha_t, sigma_t = alpha_sigma(sigmas[t_index])
        _, sigma_s0 = alpha_sigma(sigmas[s0_index])
        h = lam(sigmas[t_index]) - lam(sigmas[s0_index])
        hh = -h  # predict_x0
        h_phi_1 = torch.expm1(hh)
        b_h = hh if config.solver_type == "bh1" else torch.expm1(hh)
        return sigma_t / sigma_s0, alpha_t * h_phi_1, alpha_t * b_h, h, hh, h_phi_1, b_h

    orders, done = [], 0
    for i in range(steps):  # the stock warm-up and `lower_order_final`
        order = min(config.solver_order, steps - i) if config.lower_order_final else config.solver_order
        orders.append(min(order, done + 1))
        done = min(done + 1, config.solver_order)
    cols = {k: np.zeros(steps, np.float32) for k in ("p_x", "p_m0", "p_q", "p_two", "c_on", "c_x", "c_m0", "c_q",
                                                     "c_rho0", "c_rho1")}
    cols["p_rk"] = np.ones(steps, np.float32)
    cols["c_rk"] = np.ones(steps, np.float32)
    for i in range(steps):
        ratio, m0_coef, q, h, *_ = coefficients(i + 1, i)
        cols["p_x"][i], cols["p_m0"][i], cols["p_q"][i] = float(ratio), float(m0_coef), float(q)
        if orders[i] == 2:
            cols["p_two"][i], cols["p_rk"][i] = 1.0, float((lam(sigmas[i - 1]) - lam(sigmas[i])) / h)
        if i == 0 or (i - 1) in config.disable_corrector:
            continue
        order = orders[i - 1]
        ratio, m0_coef, q, h, hh, h_phi_1, b_h = coefficients(i, i - 1)
        cols["c_on"][i], cols["c_x"][i], cols["c_m0"][i], cols["c_q"][i] = 1.0, float(ratio), float(m0_coef), float(q)
        if order == 1:
            cols["c_rho1"][i] = 0.5
            continue
        rk = (lam(sigmas[i - 2]) - lam(sigmas[i - 1])) / h
        rks = torch.stack([rk, torch.ones(())])
        r, b, h_phi_k, factorial = [], [], h_phi_1 / hh - 1, 1
        for k in range(1, order + 1):
            r.append(torch.pow(rks, k - 1))
            b.append(h_phi_k * factorial / b_h)
            factorial *= k + 1
            h_phi_k = h_phi_k / hh - 1 / factorial
        rhos = torch.linalg.solve(torch.stack(r), torch.stack(b))
        cols["c_rk"][i], cols["c_rho0"][i], cols["c_rho1"][i] = float(rk), float(rhos[0]), float(rhos[1])
    return {"timesteps": scheduler.timesteps.detach().cpu().float().numpy(),
            "sigmas": sigmas.float().numpy(), **cols}


def unipc_step(tables: dict, i: Any, sample: Any, model_output: Any, state: Any) -> tuple[Any, Any]:
    """`UniPCMultistepScheduler.step(model_output, timesteps[i], sample)` as a pure function of a
    (traceable) step index: `(prev_sample, state)`. `state` is `(last_sample, m_prev, m_prev2)`,
    the stock step's Python state (the corrected sample of the step before, the last two
    converted outputs), zeros before the first step (`unipc_state`). Computes in float32, as the
    stock step does on float32 latents (the converted output `sample - sigma * output` takes the
    product in the output's dtype, as torch does)."""
    import jax.numpy as jnp

    t = {k: v[i] for k, v in tables.items() if k != "sigmas"}
    last, m1, m2 = state
    sample = sample.astype(jnp.float32)
    sigma = tables["sigmas"][i]
    m = sample - (sigma.astype(model_output.dtype) * model_output).astype(jnp.float32)  # x0 from the flow
    # UniC: correct this step's sample with the new output (the predictor of step i-1 made it)
    corr_res = jnp.where(t["c_rho0"] != 0, t["c_rho0"] * ((m2 - m1) / t["c_rk"]), 0.0)
    corrected = (t["c_x"] * last - t["c_m0"] * m1) - t["c_q"] * (corr_res + t["c_rho1"] * (m - m1))
    x = jnp.where(t["c_on"] > 0, corrected, sample)
    # UniP: predict the next sample from the corrected one
    pred_res = jnp.where(t["p_two"] > 0, 0.5 * ((m1 - m) / t["p_rk"]), 0.0)
    new = (t["p_x"] * x - t["p_m0"] * m) - t["p_q"] * pred_res
    return new, (x, m, m1)


def unipc_state(shape: tuple[int, ...]) -> tuple[Any, Any, Any]:
    """The state `unipc_step` starts from: zeros (read only where the tables say so), three
    separate buffers, so that a step can donate them."""
    import jax.numpy as jnp

    return tuple(jnp.zeros(shape, jnp.float32) for _ in range(3))
