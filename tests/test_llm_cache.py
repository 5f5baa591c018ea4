"""`llm.static_cache`: a StaticCache rebuilt around given arrays decodes what no cache decodes
(notebook `hf_model_in_jax`, section 7)."""

import jax
import pytest
import torch

from tpupedia import llm, torchax_utils


def _tiny_model(seed=0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llm.tiny_llama_config()).eval()
    model.config.use_cache = False
    return model


def _cached_greedy(model, ids, new_tokens, cache_len):
    env = torchax_utils.default_env()  # imports torchax through tpupedia.compat's shim
    from torchax.interop import JittableModule, jax_jit

    torchax_utils.register_common_outputs()
    config = model.config
    with env, jax.default_matmul_precision("highest"):
        model.to("jax")
        jitted = JittableModule(model)

        def step(params, buffers, token, keys, values, lengths):
            cache = llm.static_cache(config, keys, values, lengths)
            out = jitted.functional_call("forward", params, buffers, token, past_key_values=cache, use_cache=True)
            return (out.logits[:, -1], *llm.cache_arrays(cache))

        decoded = llm.greedy_decode(jax_jit(step), jitted.params, jitted.buffers, ids, config, cache_len,
                                    new_tokens, dtype=model.dtype)
        model.to("cpu")
    return decoded


def test_cached_greedy_decode_equals_uncached_greedy_decode():
    model = _tiny_model()
    ids = torch.tensor([[1, 87, 88, 89, 90, 91, 92]])
    new_tokens = 6
    with torch.no_grad():
        uncached = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, use_cache=False, pad_token_id=2)
    cached, lengths = _cached_greedy(model, ids, new_tokens, cache_len=ids.shape[1] + new_tokens)
    assert torch.equal(cached, uncached)
    assert lengths == [ids.shape[1] + new_tokens - 1] * model.config.num_hidden_layers  # the last token is not fed back


def test_a_cache_shorter_than_the_prompt_silently_decodes_something_else():
    model = _tiny_model()
    ids = torch.tensor([[1, 87, 88, 89, 90, 91, 92, 93, 94]])
    right, _ = _cached_greedy(model, ids, 4, cache_len=ids.shape[1] + 4)
    short, _ = _cached_greedy(model, ids, 4, cache_len=4)
    assert not torch.equal(right, short)


def test_static_cache_wraps_the_given_arrays():
    config = llm.tiny_llama_config()
    keys, values, lengths = llm.empty_cache_arrays(config, 12, dtype=torch.float32)
    lengths = [torch.tensor(5) for _ in lengths]
    cache = llm.static_cache(config, keys, values, lengths)
    assert len(cache.layers) == config.num_hidden_layers and cache.layers[0].get_max_length() == 12
    assert int(cache.get_seq_length()) == 5
    k, v, n = llm.cache_arrays(cache)
    assert all(a is b for a, b in zip(k + v + n, keys + values + lengths))
    layer = cache.layers[0]
    assert (layer.batch_size, layer.num_heads, layer.k_head_dim, layer.v_head_dim) == (1, 2, 16, 16)


def test_static_cache_rejects_a_layer_count_that_does_not_match_the_config():
    config = llm.tiny_llama_config()
    keys, values, lengths = llm.empty_cache_arrays(llm.tiny_llama_config(num_hidden_layers=1), 8)
    with pytest.raises(ValueError, match="layers"):
        llm.static_cache(config, keys, values, lengths)
