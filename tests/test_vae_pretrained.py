"""Loading the CogVideoX VAE port from a diffusers checkpoint on disk: bf16 and float32 weights,
the `vae/` subfolder of a pipeline repository, safetensors only, and the tiny checkpoint that
notebook `cogvideox_vae_flax` loads through the same path as the real `zai-org/CogVideoX1.5-5B` VAE."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLCogVideoX as TorchVAE
from flax import nnx

from tpupedia import presets
from tpupedia.models import checkpoints, cogvideox
from tpupedia.models import cogvideox_vae_convert as convert


def _torch_vae(dtype: torch.dtype) -> TorchVAE:
    torch.manual_seed(0)
    vae = TorchVAE(**cogvideox.tiny_vae_config()).eval()
    with torch.no_grad():  # norms start at exactly 1/0: perturb so a swapped scale/bias shows
        for p in vae.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return vae.to(dtype)


def _params(model) -> dict[str, np.ndarray]:
    """{torch-style dotted name of the NNX path: parameter}, as stored (dtype kept)."""
    return {".".join(map(str, path)): var.get_value() for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _expected(tv: TorchVAE) -> dict[str, torch.Tensor]:
    """The torch state dict under NNX names, with NNX layouts (float32, exact for bf16)."""
    out = {}
    for key, t in tv.state_dict().items():
        path, rule = convert.nnx_path(key, t.ndim)
        a = t.float().numpy()
        out[".".join(map(str, path))] = np.transpose(a, rule.transpose) if rule.transpose else a
    return out


@pytest.fixture(scope="module")
def bf16_repo(tmp_path_factory):
    """A pipeline-style directory holding only `vae/`, written in bfloat16 with safetensors."""
    root = tmp_path_factory.mktemp("repo")
    tv = _torch_vae(torch.bfloat16)
    tv.save_pretrained(root / "vae", safe_serialization=True)
    return root, tv


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
def test_bf16_checkpoint_loads_exactly(bf16_repo, dtype):
    root, tv = bf16_repo
    assert {p.name for p in (root / "vae").iterdir()} == {"config.json", "diffusion_pytorch_model.safetensors"}
    model = convert.from_pretrained(root, subfolder="vae", dtype=dtype)
    got, want = _params(model), _expected(tv)
    assert got.keys() == want.keys() and len(got) == len(tv.state_dict())
    for name, value in got.items():
        assert value.dtype == dtype, name  # the requested dtype, for every parameter
        # bf16 -> float32 is exact, so the loaded values equal torch's bit for bit
        np.testing.assert_array_equal(np.asarray(value.astype(jnp.float32)), want[name], err_msg=name)
    assert model.dtype == dtype  # compute dtype follows


def test_subfolder_path_and_direct_path_agree(bf16_repo):
    root, _ = bf16_repo
    a = _params(convert.from_pretrained(root, subfolder="vae"))
    b = _params(convert.from_pretrained(root / "vae"))
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(np.asarray(a[name]), np.asarray(b[name]))


def test_pickle_checkpoints_are_refused(tmp_path):
    tv = _torch_vae(torch.float32)
    tv.save_pretrained(tmp_path, safe_serialization=False)  # diffusion_pytorch_model.bin: a pickle
    assert list(tmp_path.glob("*.bin")) and not list(tmp_path.glob("*.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"\*\.safetensors"):
        convert.from_pretrained(tmp_path)


def test_missing_subfolder_is_reported(bf16_repo):
    root, _ = bf16_repo
    with pytest.raises(FileNotFoundError, match="'transformer'"):
        convert.from_pretrained(root, subfolder="transformer")


def test_tiny_checkpoint_is_one_loading_path(tmp_path, monkeypatch):
    """Notebook `cogvideox_vae_flax` on the tiny preset: a cached checkpoint with `vae/`, loaded by diffusers and by
    the port exactly as the full preset loads `zai-org/CogVideoX1.5-5B`."""
    monkeypatch.setenv("TPUPEDIA_CACHE", str(tmp_path))
    monkeypatch.delenv(cogvideox.ENV_MODEL, raising=False)
    source, label = convert.model_source(presets.get("tiny"))
    assert label == "preset:tiny" and Path(source).parent == tmp_path
    assert sorted(p.name for p in (Path(source) / "vae").iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
    assert convert.model_source(presets.get("tiny"))[0] == source  # cached, not rewritten
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert convert.model_source(presets.get("full")) == (cogvideox.FULL_ID, cogvideox.FULL_ID)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline and not downloaded: one clear error, not a failed download
    with pytest.raises(checkpoints.CheckpointError, match=f"{cogvideox.FULL_ID}: no such folder here.*HF_HUB_OFFLINE=1"):
        convert.model_source(presets.get("full"))
    tv = TorchVAE.from_pretrained(source, subfolder="vae", torch_dtype=torch.float32, use_safetensors=True)
    fv = convert.from_pretrained(source, subfolder="vae", dtype=jnp.float32)
    got, want = _params(fv), _expected(tv)
    assert got.keys() == want.keys()
    for name, value in got.items():
        np.testing.assert_array_equal(np.asarray(value), want[name], err_msg=name)
    norms = [v for k, v in want.items() if k.endswith("scale")]
    assert norms and not any(np.all(v == 1) for v in norms)  # perturbed, not the 1/0 defaults
