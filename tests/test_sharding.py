"""tpupedia.sharding on families notebook `sharding` does not use (Qwen2, Mistral, diffusers tiny DiTs)."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpupedia import aot, devices, sharding, torchax_utils


@pytest.fixture(scope="module")
def env():
    torchax_utils.register_common_outputs()
    return torchax_utils.default_env()


@pytest.fixture(scope="module")
def mesh():
    return devices.make_mesh((2, 4), ("dp", "tp"))


@pytest.fixture(scope="module")
def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=512,
                      use_cache=False, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).eval()


def _on_jax(model, env):
    m = copy.deepcopy(model)
    with env:
        m.to("jax")
    return m


def test_rules_rename_axis_and_unknown_table():
    tp = dict(sharding.rules("qwen2", "tp"))
    assert P("tp", None) in tp.values() and P(None, "tp") in tp.values()
    joint = sharding.rules("mistral", "fsdp", axis=("dp", "tp"))
    assert all(spec == P(("dp", "tp"), None) for _, spec in joint)
    with pytest.raises(KeyError, match="strategies for 'llama'"):
        sharding.rules("llama", "tp_fc2_replicated")


def test_megatron_specs_on_qwen2(qwen2, mesh):
    plan = sharding.plan(qwen2, sharding.rules("qwen2", "tp"), mesh)
    layer = "model.layers.1."
    assert plan[layer + "self_attn.q_proj.weight"].spec == P("tp", None)  # column-parallel: dim 0
    assert plan[layer + "self_attn.k_proj.bias"].spec == P("tp")  # Qwen2's biases follow dim 0
    assert plan[layer + "self_attn.o_proj.weight"].spec == P(None, "tp")  # row-parallel: dim 1
    assert plan[layer + "mlp.up_proj.weight"].shard_shape == (128 // 4, 64)
    assert plan[layer + "mlp.down_proj.weight"].shard_shape == (64, 128 // 4)
    assert plan["lm_head.weight"].spec == P("tp", None)
    # norms and rotary buffers: matched by no rule, replicated, and listed
    assert plan.unmatched == [
        "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
        "model.layers.1.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight",
        "model.norm.weight", "model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq",
    ]
    assert all(plan[n].spec == P() and not plan[n].sharded for n in plan.unmatched)
    assert "| `model.norm.weight` | (64) | `P()` | 256 |" in plan.table()


@pytest.mark.parametrize("strategy", ["replicated", "tp", "tp_transposed", "fsdp"])
def test_outputs_match_torch_under_each_strategy(qwen2, env, mesh, strategy):
    ids = torch.randint(0, 512, (4, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = qwen2(ids).logits.numpy()
    model = _on_jax(qwen2, env)
    axis = ("dp", "tp") if strategy == "fsdp" else None
    with env:
        plan = sharding.apply_rules(model, sharding.rules("qwen2", strategy, axis=axis), mesh)
        ids_j = env.j2t_iso(jax.device_put(jnp.asarray(ids.numpy()), NamedSharding(mesh, P("dp"))))
        logits = torchax_utils.JitModule(model)(ids_j).logits.jax()
    np.testing.assert_allclose(np.asarray(logits), expected, atol=1e-5, rtol=0)
    described = sharding.describe(model)
    assert described.specs() == plan.specs()  # what apply_rules planned is where tensors are
    assert described.bytes_per_device == plan.bytes_per_device
    if strategy == "replicated":
        assert plan.bytes_per_device == plan.bytes_total


def test_describe_and_bytes_per_device(qwen2, env, mesh):
    model = _on_jax(qwen2, env)
    with env:
        sharding.apply_rules(model, sharding.rules("qwen2", "tp"), mesh)
    d = sharding.describe(model)
    q = d["model.layers.0.self_attn.q_proj.weight"]
    assert (q.spec, q.shard_shape, q.bytes_per_device) == (P("tp", None), (16, 64), 16 * 64 * 4)
    tensors = [*qwen2.parameters(), *qwen2.buffers()]
    assert d.bytes_total == sum(t.numel() * 4 for t in tensors) and d.unmatched == []
    assert d.bytes_per_device < d.bytes_total / 2
    cpu = sharding.describe(qwen2)  # not on a mesh: full size, spec None
    assert cpu.bytes_per_device == cpu.bytes_total and cpu["model.norm.weight"].spec is None


def test_non_dividing_spec_names_tensor_dimension_and_axis(mesh):
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(hidden_size=48, intermediate_size=90, num_hidden_layers=1,
                        num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                        vocab_size=100, use_cache=False)
    with torch.device("meta"):
        model = MistralForCausalLM(cfg)
    with pytest.raises(sharding.ShardingError) as err:  # 90 MLP features over 4 devices
        sharding.plan(model, sharding.rules("mistral", "tp"), mesh)
    assert str(err.value).startswith(
        "model.layers.0.mlp.gate_proj.weight: dimension 0 has size 90, which mesh axis "
        "'tp' (size 4) does not divide")
    with pytest.raises(sharding.ShardingError, match=r"dimension 1 has size 90.*'dp' \(size 2\) x 'tp'"):
        sharding.plan(model, [(r".*down_proj\.weight", P(None, ("dp", "tp")))], mesh)
    with pytest.raises(sharding.ShardingError, match="mesh axis 'model'"):
        sharding.plan(model, [(r"lm_head\.weight", P("model", None))], mesh)
    with pytest.raises(sharding.ShardingError, match="3 entries"):
        sharding.plan(model, [(r"lm_head\.weight", P("tp", None, None))], mesh)


def test_apply_rules_needs_jax_tensors(qwen2, mesh):
    with pytest.raises(TypeError, match="module.to\\('jax'\\)"):
        sharding.apply_rules(copy.deepcopy(qwen2), sharding.rules("qwen2", "tp"), mesh)


def test_diffusers_tables_match_their_models(mesh):
    from diffusers import CogVideoXTransformer3DModel, HunyuanVideo15Transformer3DModel

    with torch.device("meta"):
        cog = CogVideoXTransformer3DModel(
            num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4,
            time_embed_dim=2, text_embed_dim=32, num_layers=1, sample_width=4, sample_height=4,
            sample_frames=9, patch_size=2, temporal_compression_ratio=4, max_text_seq_length=16)
        hy = HunyuanVideo15Transformer3DModel(
            in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8,
            num_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1,
            text_embed_dim=16, text_embed_2_dim=32, image_embed_dim=12, rope_axes_dim=(2, 2, 4),
            target_size=16, task_type="t2v")
    from tpupedia.models import cogvideox, hunyuan

    for spec, model in ((cogvideox.SPEC, cog), (hunyuan.SPEC, hy)):
        for strategy, table in spec.sharding.items():
            axis = "tp" if strategy == "fsdp" else None  # the mesh has no "fsdp" axis
            plan = sharding.plan(model, sharding.rules(spec, strategy, axis=axis), mesh)
            used = {p.rule for p in plan.placements}
            assert all(pattern in used for pattern, _ in table), (spec.name, strategy)  # no dead rule
    cog_tp = sharding.plan(cog, sharding.rules(cogvideox.SPEC, "tp"), mesh)
    assert cog_tp["transformer_blocks.0.attn1.to_q.weight"].spec == P("tp", None)
    assert cog_tp["transformer_blocks.0.ff.net.2.weight"].spec == P(None, "tp")
    upstream = sharding.plan(cog, sharding.rules(cogvideox.SPEC, "tp_transposed"), mesh)
    assert upstream["transformer_blocks.0.attn1.to_q.weight"].spec == P(None, "tp")
    hy_tp = sharding.plan(hy, sharding.rules(hunyuan.SPEC, "tp_fc2_replicated", axis=("dp", "tp")), mesh)
    assert hy_tp["transformer_blocks.0.attn.add_q_proj.weight"].spec == P(("dp", "tp"), None)
    assert hy_tp["transformer_blocks.0.ff.net.2.weight"].spec == P()


def test_functional_module_hlo_counts_megatron_all_reduces(qwen2, env, mesh):
    model = _on_jax(qwen2, env)
    ids = jax.device_put(jnp.zeros((4, 8), jnp.int32), NamedSharding(mesh, P("dp")))
    with env:
        sharding.apply_rules(model, sharding.rules("qwen2", "tp"), mesh)
        fm = torchax_utils.FunctionalModule(model, return_dict=False)
        counts = aot.collective_counts(fm.hlo(ids))
        params, buffers = fm.abstract_state(sharding.describe(model), mesh)
    assert counts.get("all-reduce", 0) >= 2 * 2  # o_proj and down_proj in each of 2 layers
    q = params["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (64, 64) and q.sharding.spec == P("tp", None)
    assert buffers["model.rotary_emb.inv_freq"].sharding.spec == P()


# --- placing a CPU module straight from host memory ---------------------------------------------

def test_place_matches_apply_rules_and_runs(qwen2, mesh, env):
    """`place` puts every tensor where `apply_rules` would and the model computes the same: the
    placed model's and the `apply_rules` model's forwards, each jitted (`JitModule`, as the
    pipelines run them), give identical logits for the same tokens."""
    rules = sharding.rules("qwen2", "tp")
    reference = _on_jax(qwen2, env)
    sharding.apply_rules(reference, rules, mesh)
    placed = copy.deepcopy(qwen2)
    plan = sharding.place(placed, rules, mesh, env)
    assert sharding.describe(placed).specs() == plan.specs() == sharding.describe(reference).specs()
    ids = torch.randint(0, 512, (4, 8), generator=torch.Generator().manual_seed(0))
    with env:
        ids_j = env.j2t_iso(jax.device_put(jnp.asarray(ids.numpy()), NamedSharding(mesh, P("dp"))))
        a = torchax_utils.JitModule(placed)(ids_j).logits.jax()
        b = torchax_utils.JitModule(reference)(ids_j).logits.jax()
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_place_never_puts_more_than_a_shard_on_a_device(qwen2, mesh, env, monkeypatch):
    """While `place` builds the arrays, each device holds at most its planned shards; the
    `module.to("jax")` route it replaces first puts the whole model on device 0."""
    rules = sharding.rules("qwen2", "tp")
    baseline = devices.live_bytes()

    def grown():
        return {d: n - baseline.get(d, 0) for d, n in devices.live_bytes().items()}

    peaks: dict[str, int] = {}
    real = jax.make_array_from_callback

    def watched(shape, where, callback):
        out = real(shape, where, callback)
        for d, n in grown().items():
            peaks[d] = max(peaks.get(d, 0), n)
        return out

    monkeypatch.setattr(jax, "make_array_from_callback", watched)
    model = copy.deepcopy(qwen2)
    plan = sharding.place(model, rules, mesh, env)
    monkeypatch.undo()
    per_device = plan.bytes_per_device
    assert peaks and max(peaks.values()) <= per_device < plan.bytes_total / 2
    assert sharding.free(model) == per_device * len(jax.devices())  # every device held exactly its shards

    whole = copy.deepcopy(qwen2)
    with env:
        whole.to("jax")
    first = str(jax.devices()[0])
    assert grown()[first] >= plan.bytes_total  # the old route: the whole model on chip 0
    sharding.free(whole)


def test_place_keeps_bf16_bits_and_free_returns_the_memory(qwen2, mesh, env):
    model = copy.deepcopy(qwen2).to(torch.bfloat16)
    expected = {n: t.detach().clone() for n, t in model.state_dict().items()}
    before = sum(devices.live_bytes().values())
    sharding.place(model, sharding.rules("qwen2", "tp"), mesh, env)
    for name, t in model.state_dict().items():
        got = np.asarray(t._elem)
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(got.view(np.int16), expected[name].view(torch.int16).numpy())
    assert sum(devices.live_bytes().values()) > before
    freed = sharding.free(model)
    assert freed > 0 and sum(devices.live_bytes().values()) == before


def test_place_refuses_a_module_already_on_jax(qwen2, mesh, env):
    with pytest.raises(TypeError, match="apply_rules"):
        sharding.place(_on_jax(qwen2, env), sharding.rules("qwen2", "tp"), mesh, env)
