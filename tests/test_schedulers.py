"""Pure scheduler steps (notebook 06) against the stock diffusers `step`, and one trace for all steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import CogVideoXDDIMScheduler, CogVideoXDPMScheduler

from tpupedia.models import cogvideox as family
from tpupedia.pipelines import schedulers

SHAPE = (1, 4, 4, 8, 8)


def _run_both(cls, steps, config_changes):
    """The stock loop (as CogVideoXPipeline calls it) and the pure step under one jit, on the same
    model outputs and the same generator; returns the per-step max abs differences and traces."""
    config = {**family.SCHEDULER_CONFIG, **config_changes}
    stock = cls(**config)
    stock.set_timesteps(steps)
    pure = cls(**config)
    pure.set_timesteps(steps)
    host = schedulers.cogvideox_tables(pure)
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
                                            x_stock, generator=g_stock, return_dict=False)
            noise = schedulers.dpm_noise(g_pure, SHAPE, torch.float32, host, i)
        else:
            x_stock = stock.step(outputs[i], t, x_stock, generator=g_stock, return_dict=False)[0]
            noise = np.zeros((2, *SHAPE), np.float32)
        x_pure, old_pure = step(jnp.int32(i), x_pure, jnp.asarray(outputs[i].numpy()), old_pure, jnp.asarray(noise))
        scale = max(1.0, float(x_stock.abs().max()))  # relative once values exceed 1
        diffs.append(float(np.abs(np.asarray(x_pure) - x_stock.numpy()).max()) / scale)
    # both generators were advanced by the same draws: the next number is the same
    assert torch.equal(torch.randn(3, generator=g_stock), torch.randn(3, generator=g_pure))
    return diffs, len(traces), host


@pytest.mark.parametrize("cls", [CogVideoXDPMScheduler, CogVideoXDDIMScheduler])
@pytest.mark.parametrize("steps, changes", [(50, {}), (4, {"snr_shift_scale": 3.0}),
                                            (6, {"prediction_type": "epsilon", "rescale_betas_zero_snr": False})])
def test_pure_step_equals_stock_step_at_every_step(cls, steps, changes):
    """Float32 on both sides. 1e-5 of the sample's magnitude (absolute below 1) allows for a different
    order of the same float32 operations (epsilon prediction divides by sqrt(alpha) ~ 0.07 at t=999)."""
    diffs, traces, host = _run_both(cls, steps, changes)
    assert traces == 1  # the step index is traced: one program for all steps
    assert max(diffs) <= 1e-5, diffs
    if cls is CogVideoXDPMScheduler:  # first-order on the first step and where the next timestep is < 0
        expected = [float(i > 0 and t - 1000 // steps >= 0) for i, t in enumerate(host["timesteps"])]
        assert host["second_order"].tolist() == expected and expected[0] == 0.0 and sum(expected) >= steps - 2


def test_unsupported_scheduler_is_refused():
    from diffusers import DDIMScheduler

    s = DDIMScheduler()
    s.set_timesteps(4)
    with pytest.raises(schedulers.SchedulerError, match="DDIMScheduler"):
        schedulers.cogvideox_tables(s)
