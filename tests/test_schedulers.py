"""Pure scheduler steps (notebook `cogvideox_pipeline`) against the stock diffusers `step`, and one trace for all steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import CogVideoXDDIMScheduler, CogVideoXDPMScheduler, FlowMatchEulerDiscreteScheduler
from diffusers.schedulers import scheduling_dpm_cogvideox

from tpupedia.models import cogvideox as family
from tpupedia.pipelines import schedulers

SHAPE = (1, 4, 4, 8, 8)
EPSILON = {"prediction_type": "epsilon", "rescale_betas_zero_snr": False}


def _scheduler(cls, steps, changes=None):
    s = cls(**{**family.SCHEDULER_CONFIG, **(changes or {})})
    s.set_timesteps(steps)
    return s


def _run_both(cls, steps, config_changes):
    """The stock loop (as CogVideoXPipeline calls it) and the pure step under one jit, on the same
    model outputs and the same generator; returns the per-step max differences and the traces."""
    stock = _scheduler(cls, steps, config_changes)
    host = schedulers.cogvideox_tables(_scheduler(cls, steps, config_changes))
    tables = {k: jnp.asarray(v) for k, v in host.items()}
    dpm = cls is CogVideoXDPMScheduler
    traces = []

    @jax.jit
    def step(i, x, out, old, noise):
        traces.append(1)
        if dpm:
            return schedulers.dpm_step(tables, i, x, out, old, noise)
        return schedulers.ddim_step(tables, i, x, out), old

    outputs = torch.randn((steps, *SHAPE), generator=torch.Generator().manual_seed(1))
    x_stock = torch.randn(SHAPE, generator=torch.Generator().manual_seed(2))
    x_pure = jnp.asarray(x_stock.numpy())
    old_stock, old_pure = None, jnp.zeros(SHAPE)
    g_stock, g_pure = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    diffs = []
    for i, t in enumerate(stock.timesteps):
        if dpm:
            x_stock, old_stock = stock.step(outputs[i], old_stock, t, stock.timesteps[i - 1] if i > 0 else None,
                                            x_stock, eta=0.0, generator=g_stock, return_dict=False)
            noise = schedulers.dpm_noise(g_pure, SHAPE, torch.float32, host, i)
        else:
            x_stock = stock.step(outputs[i], t, x_stock, eta=0.0, generator=g_stock, return_dict=False)[0]
            noise = np.zeros(SHAPE, np.float32)
        x_pure, old_pure = step(jnp.int32(i), x_pure, jnp.asarray(outputs[i].numpy()), old_pure, jnp.asarray(noise))
        scale = max(1.0, float(x_stock.abs().max()))
        diffs.append(float(np.abs(np.asarray(x_pure) - x_stock.numpy()).max()) / scale)
        if dpm:
            assert np.abs(np.asarray(old_pure) - old_stock.numpy()).max() <= 1e-5 * scale
    # both generators were advanced by the same draws: the next number is the same
    assert torch.equal(torch.randn(3, generator=g_stock), torch.randn(3, generator=g_pure))
    return diffs, len(traces), host


@pytest.mark.parametrize("cls", [CogVideoXDPMScheduler, CogVideoXDDIMScheduler])
@pytest.mark.parametrize("steps, changes", [
    (50, {}),  # CogVideoX1.5-5B as released: v-prediction, zero-SNR, trailing, snr_shift_scale 1
    (4, {"snr_shift_scale": 3.0}),  # the CogVideoX 1.0 shift, few steps (first and last step adjacent)
    (6, EPSILON),
    (7, {"timestep_spacing": "leading", "set_alpha_to_one": False}),  # final_alpha_cumprod = alphas_cumprod[0]
])
def test_pure_step_equals_stock_step_at_every_step(cls, steps, changes):
    """Float32 on both sides, same inputs at every step. Tolerance 1e-5 of the sample's magnitude
    (absolute while it is below 1): the pure step runs the same float32 operations as the stock
    step, but XLA may fuse or reorder them (a few float32 ulps per step), and epsilon
    prediction divides by sqrt(alpha_prod_t), ~0.07 at t=999, which scales those ulps up."""
    diffs, traces, host = _run_both(cls, steps, changes)
    assert traces == 1  # the step index is traced: one program for all steps
    assert len(diffs) == steps and max(diffs) <= 1e-5, diffs
    if cls is CogVideoXDPMScheduler:  # first-order on the first step and where the previous timestep is < 0
        expected = [float(i > 0 and t - 1000 // steps >= 0) for i, t in enumerate(host["timesteps"])]
        assert host["second_order"].tolist() == expected and expected[0] == 0.0
        # the last step is first-order only when its previous timestep is < 0: with 6 trailing
        # steps the last timestep is 166 and 166 - 1000 // 6 = 0, a second-order step to t=0
        assert expected[-1] == (1.0 if (steps, changes) == (6, EPSILON) else 0.0)


def test_tables_resolve_the_final_step_on_the_host():
    s = _scheduler(CogVideoXDPMScheduler, 4)
    host = schedulers.cogvideox_tables(s)
    assert host["timesteps"].tolist() == [999, 749, 499, 249]  # trailing spacing
    assert host["alpha_prod_t"][0] == 0.0  # zero terminal SNR
    assert host["alpha_prod_t_prev"][-1] == 1.0  # 249 - 250 < 0: final_alpha_cumprod (set_alpha_to_one)
    assert host["alpha_prod_t_prev"][0] == np.float32(s.alphas_cumprod[749])
    assert host["alpha_prod_t_back"][1] == 0.0 and host["alpha_prod_t_back"][2] == np.float32(s.alphas_cumprod[749])
    # the last step returns the predicted clean sample: no noise, no memory of the sample
    assert (host["mult1"][-1], host["mult2"][-1], host["mult_noise"][-1]) == (0.0, -1.0, 0.0)
    assert all(np.isfinite(v).all() for v in host.values())
    assert all(v.dtype in (np.float32, np.int32) for v in host.values())
    ddim = schedulers.cogvideox_tables(_scheduler(CogVideoXDDIMScheduler, 4, {"set_alpha_to_one": False}))
    assert ddim["alpha_prod_t_prev"][-1] == np.float32(s.alphas_cumprod[0]) and "mult1" not in ddim


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("steps", [5, 3])
def test_drawn_noise_is_the_noise_the_stock_step_adds(monkeypatch, dtype, steps):
    """Record every `randn_tensor` call the stock step makes; `dpm_noise` must reproduce the
    number of draws per step (one, or two on second-order steps), and its noise must be the last
    draw, bit for bit, in the latents' dtype."""
    calls: list[list[torch.Tensor]] = []
    real = scheduling_dpm_cogvideox.randn_tensor

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        calls[-1].append(out.clone())
        return out

    monkeypatch.setattr(scheduling_dpm_cogvideox, "randn_tensor", recording)
    stock = _scheduler(CogVideoXDPMScheduler, steps)
    host = schedulers.cogvideox_tables(stock)
    g = torch.Generator().manual_seed(42)
    x = torch.randn(SHAPE, generator=g, dtype=dtype)  # the initial latents come first, as in the pipeline
    old = None
    for i, t in enumerate(stock.timesteps):
        calls.append([])
        x, old = stock.step(torch.randn(SHAPE, dtype=dtype), old, t, stock.timesteps[i - 1] if i else None, x,
                            generator=g, return_dict=False)
    assert [len(c) for c in calls] == [1 + int(s) for s in host["second_order"]]

    g_pure = torch.Generator().manual_seed(42)
    torch.randn(SHAPE, generator=g_pure, dtype=dtype)
    drawn = schedulers.draw_dpm_noise(g_pure, SHAPE, host, dtype)
    assert drawn.shape == (steps, *SHAPE) and drawn.dtype == np.float32
    for i, c in enumerate(calls):
        assert c[-1].dtype == dtype and np.array_equal(c[-1].float().numpy(), drawn[i])
    assert torch.equal(torch.rand(2, generator=g), torch.rand(2, generator=g_pure))  # same stream position


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shift, steps", [(1.0, 50), (7.0, 50), (7.0, 8)])
def test_flow_match_euler_step_equals_stock_step(shift, steps, dtype):
    """HunyuanVideo-1.5's loop: `set_timesteps(sigmas=linspace(1, 0, steps + 1)[:-1])`, the shift
    applied by the scheduler (its default is 1.0; the pipeline's checkpoints set their own).

    Op by op (`jax.disable_jit`) the pure step does the stock step's operations in the stock
    dtypes, so every step agrees bit for bit, in float32 and in bf16. Under `jax.jit`, XLA fuses
    `x + dt * out` into one multiply-add that rounds once instead of twice (and skips the bf16
    rounding of the product), so each step agrees to one unit in the last place of the result's
    dtype: |diff| <= eps * (|x| + |dt * out|), eps = 2**-23 (float32), 2**-7 (bf16). The float32
    loop run free (each side on its own output) stays within 1e-5 over all steps."""
    sigmas = np.linspace(1.0, 0.0, steps + 1)[:-1]
    stock = FlowMatchEulerDiscreteScheduler(shift=shift)
    stock.set_timesteps(sigmas=sigmas)
    ref = FlowMatchEulerDiscreteScheduler(shift=shift)
    ref.set_timesteps(sigmas=sigmas)
    host = schedulers.flow_match_tables(ref)
    assert host["sigmas"].shape == (steps + 1,) and host["sigmas"][-1] == 0.0 and host["dt"].shape == (steps,)
    if shift != 1.0:  # shift moves the schedule towards high noise: sigma' = s*sigma / (1 + (s-1)*sigma)
        mid = sigmas[steps // 2]
        np.testing.assert_allclose(host["sigmas"][steps // 2], shift * mid / (1 + (shift - 1) * mid), rtol=1e-6)
    np.testing.assert_array_equal(host["timesteps"], stock.timesteps.float().numpy())
    tables = {k: jnp.asarray(v) for k, v in host.items()}
    traces = []

    def pure(i, x, out):
        traces.append(1)
        return schedulers.flow_match_euler_step(tables, i, x, out)

    jitted = jax.jit(pure)
    jdtype = jnp.bfloat16 if dtype == torch.bfloat16 else jnp.float32
    eps = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-23
    to_jax = lambda t: jnp.asarray(t.float().numpy()).astype(jdtype)  # noqa: E731
    g = torch.Generator().manual_seed(3)
    x_stock = torch.randn(SHAPE, generator=g).to(dtype)
    x_free = to_jax(x_stock)
    for i, t in enumerate(stock.timesteps):
        out = torch.randn(SHAPE, generator=g).to(dtype)
        x_in = x_stock
        x_stock = stock.step(out, t, x_stock, return_dict=False)[0]
        assert x_stock.dtype == dtype
        expected = x_stock.float().numpy()
        with jax.disable_jit():
            eager = pure(jnp.int32(i), to_jax(x_in), to_jax(out))
        assert eager.dtype == jdtype
        np.testing.assert_array_equal(np.asarray(eager.astype(jnp.float32)), expected)
        fused = np.asarray(jitted(jnp.int32(i), to_jax(x_in), to_jax(out)).astype(jnp.float32))
        bound = eps * (x_in.float().abs() + abs(float(host["dt"][i])) * out.float().abs()).numpy()
        assert (np.abs(fused - expected) <= bound).all()
        if dtype == torch.float32:
            x_free = jitted(jnp.int32(i), x_free, to_jax(out))
            assert np.abs(np.asarray(x_free) - expected).max() <= 1e-5
    assert len(traces) == 1 + steps  # one trace under jit, plus one per eager call


def test_unsupported_schedulers_are_refused():
    from diffusers import DDIMScheduler

    s = DDIMScheduler()
    s.set_timesteps(4)
    with pytest.raises(schedulers.SchedulerError, match="DDIMScheduler: expected CogVideoXDDIMScheduler"):
        schedulers.cogvideox_tables(s)
    with pytest.raises(schedulers.SchedulerError, match="set_timesteps"):
        schedulers.cogvideox_tables(CogVideoXDPMScheduler(**family.SCHEDULER_CONFIG))
    with pytest.raises(schedulers.SchedulerError, match="expected FlowMatchEulerDiscreteScheduler"):
        schedulers.flow_match_tables(s)
    with pytest.raises(schedulers.SchedulerError, match="set_timesteps"):
        schedulers.flow_match_tables(FlowMatchEulerDiscreteScheduler())
    stochastic = FlowMatchEulerDiscreteScheduler(stochastic_sampling=True)
    stochastic.set_timesteps(4)
    with pytest.raises(schedulers.SchedulerError, match="stochastic_sampling"):
        schedulers.flow_match_tables(stochastic)
    assert issubclass(schedulers.SchedulerError, ValueError)


@pytest.mark.parametrize("steps, shift", [(4, 5.0), (8, 3.0)])
def test_uniform_euler_is_the_lightning_authors_schedule_and_step(steps, shift):
    """`uniform_euler` against ModelTC/Wan2.2-Lightning's `fm_solvers_euler.py` (92efeb4) written out:
    `get_timesteps` = linspace(1000, 0, steps + 1), sigmas = that / 1000, `timestep_shift`
    `shift * s / (1 + (shift - 1) * s)`, the model given `1000 * sigma` unrounded, and a step
    `sample.float() + (sigma_next - sigma) * output` kept in float32 (bf16 output too). Stock
    diffusers' `FlowMatchEulerDiscreteScheduler` at the same shift and steps is another schedule."""
    scheduler = schedulers.uniform_euler(1000, shift)
    scheduler.set_timesteps(steps)
    s = np.linspace(1000, 0, steps + 1, dtype=np.float32) / 1000
    sigmas = shift * s / (1 + (shift - 1) * s)
    np.testing.assert_allclose(scheduler.sigmas.numpy(), sigmas, rtol=0, atol=1e-6)
    np.testing.assert_allclose(scheduler.timesteps.numpy(), 1000 * sigmas[:-1], rtol=1e-6)
    tables = schedulers.flow_match_tables(scheduler)
    np.testing.assert_allclose(tables["dt"], np.diff(sigmas), atol=1e-6)
    stock = FlowMatchEulerDiscreteScheduler(shift=shift)
    stock.set_timesteps(steps)
    assert float(np.abs(stock.timesteps.numpy() - scheduler.timesteps.numpy()).max()) > 1.0  # a different schedule

    gen = torch.Generator().manual_seed(0)
    sample = torch.randn(1, 4, 2, 3, 3, generator=gen)
    for i, t in enumerate(scheduler.timesteps):
        output = torch.randn(sample.shape, generator=gen).to(torch.bfloat16)
        expected = sample.float() + (torch.tensor(sigmas[i + 1]) - torch.tensor(sigmas[i])) * output.float()
        ours = schedulers.flow_match_euler_step(tables, i, jnp.asarray(sample.numpy()),
                                                jnp.asarray(output.float().numpy()).astype(jnp.bfloat16), keep_float32=True)
        sample = scheduler.step(output, t, sample, return_dict=False)[0]
        assert sample.dtype == torch.float32 and ours.dtype == jnp.float32
        np.testing.assert_allclose(sample.numpy(), expected.numpy(), atol=1e-6)
        np.testing.assert_allclose(np.asarray(ours), sample.numpy(), atol=1e-6)
