"""`tpupedia.torchax_utils`: every helper agrees with PyTorch on the CPU (fp32, within 1e-5)."""

import jax
import pytest
import torch
import transformers
from transformers.modeling_outputs import SequenceClassifierOutput

from tpupedia import torchax_utils as tu
from tpupedia.compat import import_torchax

torchax = import_torchax()
ATOL = 1e-5
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
F = torch.nn.functional


@pytest.fixture(scope="module")
def env():
    return tu.default_env()


def _close(jax_tensor, cpu_tensor):
    torch.testing.assert_close(jax_tensor.torch(), cpu_tensor, rtol=0, atol=ATOL)


def test_default_env_is_torchax_default_env(env):
    assert env is torchax.default_env()


# --- register_output_pytree -------------------------------------------------------------------


def test_register_output_pytree_round_trips_none_fields_by_name():
    out = SequenceClassifierOutput(logits=torch.ones(2, 3), attentions=(torch.zeros(1),))
    assert tu.register_output_pytree(SequenceClassifierOutput) is SequenceClassifierOutput
    leaves, treedef = jax.tree_util.tree_flatten(out)
    assert len(leaves) == 2  # only the fields that are set
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert type(back) is SequenceClassifierOutput
    assert back.loss is None and back.hidden_states is None
    assert torch.equal(back.logits, out.logits) and torch.equal(back.attentions[0], out.attentions[0])


def test_positional_flatten_would_be_lossy():
    out = SequenceClassifierOutput(logits=torch.ones(2, 3))
    by_position = SequenceClassifierOutput(*out.to_tuple())  # what a positional flatten rebuilds
    assert by_position.loss is not None and by_position.logits is None  # logits landed in `loss`


def test_register_output_pytree_twice_is_a_no_op():
    first = tu.register_output_pytree(SequenceClassifierOutput)
    assert tu.register_output_pytree(SequenceClassifierOutput) is first


def test_register_common_outputs_covers_hf_and_diffusers_outputs():
    from diffusers.models.autoencoders.vae import DecoderOutput
    from transformers.modeling_outputs import CausalLMOutputWithPast

    classes = tu.register_common_outputs()
    assert CausalLMOutputWithPast in classes and DecoderOutput in classes
    leaves, _ = jax.tree_util.tree_flatten(DecoderOutput(sample=torch.ones(1)))
    assert len(leaves) == 1


# --- JitModule --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2_pair(env):
    """A tiny random GPT-2 (fp32) and its CPU logits for one batch."""
    tu.register_common_outputs()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    ).eval()
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
    with env:
        model.to("jax")
    return model, ids, expected


def test_jit_module_static_kwargs_compile_separate_variants_and_match_torch(env, gpt2_pair):
    model, ids, expected = gpt2_pair
    jm = tu.JitModule(model)
    with env:
        ids_j = ids.to("jax")
        as_output = jm(ids_j, use_cache=False)
        as_tuple = jm(ids_j, use_cache=False, return_dict=False)
        again = jm(ids_j, use_cache=False)
    assert jm.compiled_variants == 2  # one program per distinct set of static keywords
    assert type(as_output).__name__ == "CausalLMOutputWithCrossAttentions"
    assert isinstance(as_tuple, tuple)
    for logits in (as_output.logits, as_tuple[0], again.logits):
        _close(logits, expected)


def test_jit_module_stands_in_for_the_wrapped_module(gpt2_pair):
    model, _, _ = gpt2_pair
    jm = tu.JitModule(model)
    assert isinstance(jm, transformers.GPT2LMHeadModel)
    assert jm.config is model.config
    assert jm.compiled_variants == 0  # nothing is traced before the first call


def test_plain_jittable_module_traces_python_flags(env, gpt2_pair):
    """The failure JitModule exists for: a bool keyword becomes a tracer under jax.jit."""
    from torchax.interop import JittableModule

    model, ids, _ = gpt2_pair
    with env, pytest.raises(jax.errors.ConcretizationTypeError, match="use_cache"):
        JittableModule(model)(ids.to("jax"), use_cache=False)


class _TinyAutoencoder(torch.nn.Module):
    """VAE-shaped: `encode`, `decode` (with a static option) and a buffer."""

    def __init__(self):
        super().__init__()
        self.enc = torch.nn.Linear(8, 4)
        self.dec = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.SiLU(), torch.nn.Linear(16, 8))
        self.register_buffer("scale", torch.tensor(0.5))

    def encode(self, x):
        return self.enc(x)

    def decode(self, z, scaled=True):
        out = self.dec(z)
        return out * self.scale if scaled else out

    def forward(self, x):
        return self.decode(self.encode(x))


def test_jit_module_compiles_listed_methods(env):
    torch.manual_seed(0)
    ae = _TinyAutoencoder().eval()
    z = torch.randn(3, 4)
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = {True: ae.decode(z), False: ae.decode(z, scaled=False)}
        expected_fwd, expected_enc = ae(x), ae.encode(x)
    with env:
        ae.to("jax")
        jm = tu.JitModule(ae, methods=("decode",))
        z_j, x_j = z.to("jax"), x.to("jax")
        got = {True: jm.decode(z_j), False: jm.decode(z_j, scaled=False)}
        assert jm.compiled_variants == 2
        got_fwd = jm(x_j)
        assert jm.compiled_variants == 3
        got_enc = jm.encode(x_j)  # not listed: runs eagerly on the wrapped module, no new program
        assert jm.compiled_variants == 3
    for scaled in (True, False):
        _close(got[scaled], expected[scaled])
    _close(got_fwd, expected_fwd)
    _close(got_enc, expected_enc)


# --- move_tensors -----------------------------------------------------------------------------


def test_move_tensors_moves_scheduler_state_and_steps_like_torch(env):
    from diffusers import CogVideoXDDIMScheduler

    scheduler = CogVideoXDDIMScheduler()
    scheduler.set_timesteps(4)
    before = {k: v.clone() for k, v in vars(scheduler).items() if isinstance(v, torch.Tensor)}
    others = {k: v for k, v in vars(scheduler).items() if not isinstance(v, torch.Tensor)}
    eps = torch.randn(1, 3, 4, 4, 4, generator=torch.Generator().manual_seed(1))
    sample = torch.randn(1, 3, 4, 4, 4, generator=torch.Generator().manual_seed(2))
    t = scheduler.timesteps[1]
    expected = scheduler.step(eps, t, sample).prev_sample

    with env:
        assert tu.move_tensors(scheduler) is scheduler
        got = scheduler.step(eps.to("jax"), t.to("jax"), sample.to("jax")).prev_sample
    assert {"alphas_cumprod", "timesteps"} <= before.keys()
    for name, value in before.items():
        moved = getattr(scheduler, name)
        assert isinstance(moved, torchax.tensor.Tensor), name
        # float64 tables arrive as float32: JAX runs without x64 (`jax_enable_x64` off)
        torch.testing.assert_close(moved.torch().double(), value.double(), rtol=1e-6, atol=0)
    for name, value in others.items():
        assert getattr(scheduler, name) is value, name
    _close(got, expected)


def test_move_tensors_back_to_cpu(env):
    class State:
        pass

    state = State()
    state.table, state.label = torch.arange(4.0), "kept"
    with env:
        tu.move_tensors(state)
        assert isinstance(state.table, torchax.tensor.Tensor)
        tu.move_tensors(state, "cpu")
    assert type(state.table) is torch.Tensor and state.table.device.type == "cpu"
    assert torch.equal(state.table, torch.arange(4.0)) and state.label == "kept"


# --- masked_row_safe_sdpa ---------------------------------------------------------------------


def _qkv(heads_kv=2):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 5, 8, generator=g)
    k = torch.randn(2, heads_kv, 6, 8, generator=g)
    v = torch.randn(2, heads_kv, 6, 8, generator=g)
    return q, k, v


def _bool_mask_with_empty_rows():
    mask = torch.rand(2, 1, 5, 6, generator=torch.Generator().manual_seed(1)) > 0.4
    mask[..., 0] = True
    mask[0, :, 2, :] = False  # fully masked query rows
    mask[1, :, 4, :] = False
    return mask


CASES = {
    "bool mask with fully masked rows": lambda: {"attn_mask": _bool_mask_with_empty_rows()},
    "no mask": lambda: {},
    "causal": lambda: {"is_causal": True},
    "float mask": lambda: {"attn_mask": torch.randn(2, 1, 5, 6, generator=torch.Generator().manual_seed(2))},
    "scale": lambda: {"attn_mask": _bool_mask_with_empty_rows(), "scale": 0.3},
}


@pytest.mark.parametrize("case", list(CASES))
def test_masked_row_safe_sdpa_matches_torch(env, case):
    q, k, v = _qkv()
    kwargs = CASES[case]()
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    with env:
        moved = {n: (t.to("jax") if isinstance(t, torch.Tensor) else t) for n, t in kwargs.items()}
        got = tu.masked_row_safe_sdpa(q.to("jax"), k.to("jax"), v.to("jax"), **moved)
    assert not torch.isnan(got.torch()).any()
    _close(got, expected)


def test_masked_row_safe_sdpa_with_grouped_query_attention(env):
    q, k, v = _qkv(heads_kv=1)
    mask = _bool_mask_with_empty_rows()
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    with env:
        got = tu.masked_row_safe_sdpa(q.to("jax"), k.to("jax"), v.to("jax"), attn_mask=mask.to("jax"),
                                      enable_gqa=True)
    _close(got, expected)


def test_install_masked_row_safe_sdpa_replaces_torchax_nan_rows(env):
    q, k, v = _qkv()
    mask = _bool_mask_with_empty_rows()
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ops = tu.SDPA_OPS
    before = {op: env._ops.get(op) for op in ops}
    from torchax.ops.jtorch import _sdpa_reference  # what torchax 0.0.13 runs for SDPA

    with env:
        stock = _sdpa_reference(q.to("jax"), k.to("jax"), v.to("jax"), mask.to("jax"))
    with tu.restoring_ops(env):
        tu.install_masked_row_safe_sdpa(env)
        assert all(env._ops[op].is_user_defined for op in ops)
        with env:
            fixed = F.scaled_dot_product_attention(q.to("jax"), k.to("jax"), v.to("jax"), attn_mask=mask.to("jax"))
    assert all(env._ops.get(op) is before[op] for op in ops)  # restoring_ops put the stock ones back
    assert torch.isnan(stock.torch()[0, :, 2]).all()  # torchax 0.0.13: NaN where PyTorch gives 0
    assert not torch.isnan(fixed.torch()).any()
    _close(fixed, expected)
