"""Loading a checkpoint (notebook `cogvideox_pipeline`'s loading path, every family): a component whose weights do
not match its class is refused in one line naming the component and the first weights, and a
Hub that cannot be reached (or, offline, a file not cached) is said as such, naming the file."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import requests
import torch
from safetensors.torch import load_file, save_file

from tpupedia.models import checkpoints, hunyuan
from tpupedia.models import cogvideox as family
from tpupedia.pipelines import common


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return family.tiny_checkpoint(tmp_path_factory.mktemp("cogvideox") / "ckpt")


def _edited(checkpoint: Path, folder: Path, edit) -> Path:
    """A copy of `checkpoint` whose transformer weights went through `edit(dict) -> dict`."""
    shutil.copytree(checkpoint, folder)
    (weights,) = (folder / "transformer").glob("*.safetensors")
    save_file(edit(load_file(weights)), weights, metadata={"format": "pt"})
    return folder


def _load(source: Path):
    """The pipelines' component loader (`StagedPipeline._load`) on the transformer of `source`."""
    from diffusers import CogVideoXTransformer3DModel

    pipe = SimpleNamespace(abstract=False, adapters=(), source=str(source), dtype=torch.float32, component_dtype=lambda name: torch.float32)
    return common.StagedPipeline._load(pipe, CogVideoXTransformer3DModel, "transformer")


def test_weights_that_do_not_match_the_class_are_refused_naming_the_component(checkpoint, tmp_path):
    """A removed weight would be "newly initialized", a renamed one also "not used": stock loads
    both with a warning the run silences, and makes a wrong video. Refused in one line naming the
    component and the weights; the checkpoint as written loads (what stock loads silently passes)."""
    assert not _load(checkpoint).training  # the tiny checkpoint itself: no refusal, in eval mode
    first = sorted(load_file(next((checkpoint / "transformer").glob("*.safetensors"))))[0]

    removed = _edited(checkpoint, tmp_path / "removed", lambda w: {k: v for k, v in w.items() if k != first})
    with pytest.raises(checkpoints.CheckpointError) as err:
        _load(removed)
    message = str(err.value)
    assert "\n" not in message and "the transformer weights" in message and "CogVideoXTransformer3DModel" in message
    assert f"1 weight(s) missing from the checkpoint ({first})" in message
    assert "not in the model" not in message

    renamed = _edited(checkpoint, tmp_path / "renamed", lambda w: {("old_" + k if k == first else k): v
                                                                   for k, v in w.items()})
    with pytest.raises(checkpoints.CheckpointError, match=rf"missing from the checkpoint \({first}\).*"
                                                          rf"in the checkpoint but not in the model \(old_{first}\)"):
        _load(renamed)


def test_loading_info_names_the_first_few_keys_of_many():
    info = {"missing_keys": [f"blocks.{i}.weight" for i in range(7)], "unexpected_keys": [], "mismatched_keys": []}
    with pytest.raises(checkpoints.CheckpointError, match=r"the vae weights .*7 weight\(s\) missing from the "
                                                          r"checkpoint \(blocks.0.weight, blocks.1.weight, "
                                                          r"blocks.2.weight and 4 more\)"):
        checkpoints.check_loading_info("DIR", "vae", info)
    checkpoints.check_loading_info("DIR", "vae", {"missing_keys": set(), "unexpected_keys": set()})  # all matched


def _httpx_connect_error():
    import httpx2

    return httpx2.ConnectError("[Errno 101] Network is unreachable")


@pytest.mark.parametrize("raised, offline, said", [
    (lambda: requests.ConnectionError("Max retries exceeded: Network is unreachable"), "0", "could not reach"),
    (_httpx_connect_error, "0", "could not reach"),
    (lambda: huggingface_hub.errors.LocalEntryNotFoundError("cannot find the requested files in the local cache"),
     "0", "could not reach"),
    (lambda: huggingface_hub.errors.LocalEntryNotFoundError("cannot find the requested files in the local cache"),
     "1", "not in the local Hugging Face cache"),
    (lambda: huggingface_hub.errors.OfflineModeIsEnabled("HF_HUB_OFFLINE is set"), "1",
     "not in the local Hugging Face cache"),
], ids=["requests", "httpx", "not-cached", "not-cached-offline", "offline-mode"])
def test_a_hub_out_of_reach_is_said_as_such_naming_the_file(monkeypatch, raised, offline, said):
    """Not "does not appear to have a file named config.json" (HunyuanVideo-1.5 and Wan: named
    `pipeline/config.json` for `model_index.json`), after the Hub's own wait: the Hub could not be
    reached, or, offline, the file is not in the cache, and which file was looked for."""
    import diffusers.configuration_utils

    def download(*args, **kwargs):
        raise raised()

    monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    monkeypatch.setattr(diffusers.configuration_utils, "hf_hub_download", download)
    with pytest.raises(checkpoints.CheckpointError) as err:  # model_index.json first
        hunyuan.component_configs(hunyuan.FULL_ID)
    message = str(err.value)
    assert said in message and "model_index.json" in message and hunyuan.FULL_ID in message, message
    assert "pipeline/config.json" not in message and "\n" not in message
    with pytest.raises(checkpoints.CheckpointError) as err:
        family.component_configs(family.FULL_ID)  # CogVideoX reads its transformer's config first
    assert said in str(err.value) and "transformer/config.json" in str(err.value)


def test_a_missing_file_is_still_a_missing_file(tmp_path):
    """A folder without the file: the error names the file, and says nothing of the Hub."""
    (tmp_path / "model_index.json").write_text("{}")
    with pytest.raises(checkpoints.CheckpointError, match=r"cannot read the transformer config "
                                                          r"\(transformer/config.json\)") as err:
        family.component_configs(str(tmp_path))
    assert "Hub" not in str(err.value)
