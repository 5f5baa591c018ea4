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

    pipe = SimpleNamespace(abstract=False, adapters=(), quantized=None, source=str(source), dtype=torch.float32,
                           component_dtype=lambda name: torch.float32)
    pipe._quantized = lambda module, subfolder: common.StagedPipeline._quantized(pipe, module, subfolder)
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


def test_weights_the_class_does_not_use_load_as_stock_loads_them_and_are_named(checkpoint, tmp_path):
    """A checkpoint with an extra weight (a newer export, a training leftover) loads in stock with a
    warning and the same video: it loads here too, and a warning names what was ignored."""
    import torch

    extra = _edited(checkpoint, tmp_path / "extra", lambda w: w | {"leftover.weight": torch.zeros(2)})
    with pytest.warns(checkpoints.IgnoredWeightsWarning, match=r"the transformer weights load as stock diffusers "
                                                               r"loads them, ignoring 1 weight\(s\) in the checkpoint "
                                                               r"but not in the model \(leftover.weight\)"):
        assert not _load(extra).training


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


def _cached_snapshot(cache: Path, repo: str, commit: str) -> None:
    """`repo` at `commit` in a Hugging Face cache laid out as `hf download` lays it out."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "snapshots" / commit).mkdir(parents=True)
    (folder / "snapshots" / commit / "model_index.json").write_text('{"_class_name": "CogVideoXPipeline"}')
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)


def test_a_hub_checkpoints_stage_files_name_the_revision_its_configs_were_read_from(tmp_path, monkeypatch):
    """A hub id names whatever its `main` is today: the stage files name the commit of the cached
    snapshot the run read (`OWNER/NAME@COMMIT`), so a checkpoint updated on the Hub makes them
    stale instead of mixing two models. Not cached yet: the id alone; a folder: its resolved
    path. A run labels its stage files after its configs are read, so its first run (which
    downloads them) and every later one agree."""
    import huggingface_hub.constants as constants

    from tpupedia import presets
    from tpupedia.pipelines import cogvideox as pipeline

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = family.FULL_ID
    assert checkpoints.source_label(repo) == repo  # nothing cached
    assert checkpoints.source_label(tmp_path) == str(tmp_path.resolve())
    configs = family.full_configs()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(checkpoints, "download_bytes", lambda source: None)  # the Hub is not asked for its sizes
    ran = []

    def download_configs(source):  # what component_configs leaves in the cache: the snapshot it read
        if not (tmp_path / "hub").exists():
            _cached_snapshot(tmp_path / "hub", repo, "a1b2c3d4e5f6")
        return configs

    monkeypatch.setattr(family, "component_configs", download_configs)
    monkeypatch.setattr(common, "run_stages", lambda pipe, request, **kwargs: ran.append(pipe.source_label) or [])
    request = pipeline.Request(prompt="a cat", **family.default_request(presets.get("full")))
    for _ in range(2):  # the first run finds nothing cached when it names the checkpoint; the second finds it
        pipeline.run(request, pipeline.Options(quiet=True), preset=presets.get("full"), workdir=tmp_path / "run",
                     log=lambda _: None, plan="off")
    assert ran == [f"{repo}@a1b2c3d4e5f6"] * 2
    assert checkpoints.hub_revision(repo) == "a1b2c3d4e5f6" and checkpoints.hub_revision("not a hub id") is None
    settings = [pipeline.PIPELINE.settings_for(label, configs, request, pipeline.Options(), torch.bfloat16, "denoise")
                for label in (f"{repo}@a1b2c3d4e5f6", f"{repo}@0f0f0f0f0f0f")]
    assert settings[0]["source"] != settings[1]["source"]


def test_a_download_that_does_not_fit_the_hub_caches_disk_is_refused_before_it_starts(tmp_path, monkeypatch):
    """Before a full-size run downloads a hub checkpoint, the sizes the Hub lists for the files it
    would fetch (safetensors weights, configs, tokenizers; other weight formats and the model
    card's pictures left out; files already cached not counted) are held against the free space of
    the Hugging Face cache's disk: too little is one line naming both, before any file (configs
    included) is fetched. Offline, or a folder, nothing is asked."""
    import collections

    import huggingface_hub.constants as constants

    from tpupedia import presets
    from tpupedia.pipelines import cogvideox as pipeline

    repo = family.FULL_ID
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub" / "not-made-yet"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    files = {"model_index.json": 500, "transformer/diffusion_pytorch_model.safetensors": 10 * 2**30,
             "text_encoder/model.safetensors": 9 * 2**30, "transformer/diffusion_pytorch_model.bin": 20 * 2**30,
             "assets/demo.mp4": 2**30, "tokenizer/spiece.model": 800_000}
    info = SimpleNamespace(siblings=[SimpleNamespace(rfilename=name, size=size) for name, size in files.items()])
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo_id, **kwargs: info)
    usage = collections.namedtuple("usage", "total used free")
    free = {"bytes": 12 * 2**30}
    monkeypatch.setattr("shutil.disk_usage", lambda folder: usage(0, 0, free["bytes"]))
    assert checkpoints.download_bytes(repo) == 19 * 2**30 + 800_500
    monkeypatch.setattr(family, "component_configs", lambda source: pytest.fail("configs fetched"))
    request = pipeline.Request(prompt="a cat", **family.default_request(presets.get("full")))
    with pytest.raises(checkpoints.CheckpointError) as refused:
        pipeline.run(request, pipeline.Options(quiet=True), preset=presets.get("full"), workdir=tmp_path / "run",
                     log=lambda _: None)
    message = str(refused.value)
    assert f"{repo}: its files need 19.0 GiB" in message and "has 12.0 GiB free" in message
    assert "HF_HUB_CACHE" in message and "\n" not in message
    _cached_snapshot(tmp_path / "hub" / "not-made-yet", repo, "a1b2c3")  # model_index.json is cached now
    assert checkpoints.download_bytes(repo) == 19 * 2**30 + 800_000
    free["bytes"] = 20 * 2**30
    assert checkpoints.check_disk(repo) == 19 * 2**30 + 800_000
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert checkpoints.download_bytes(repo) is None and checkpoints.download_bytes(str(tmp_path)) is None
