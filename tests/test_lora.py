"""LoRA adapters (`tpupedia.lora`, `generate --lora PATH[:SCALE][@COMPONENT]`): fused on the host as stock
diffusers fuses them, for adapters of several ranks and target modules and a community key layout;
recorded in the stage fingerprints; bad adapters refused in one line before the transformer loads;
grouped by adapter set in a batch; counted by plan and doctor. Notebook `fewer_steps` holds the
CogVideoX run with an adapter against stock diffusers' frames, and the sharding table of a fused
transformer against the checkpoint's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tpupedia import lora, presets
from tpupedia.models import checkpoints
from tpupedia.models import cogvideox as cog_family
from tpupedia.pipelines import cogvideox as cog_pipeline
from tpupedia.pipelines import stages

TINY = presets.get("tiny")
REQUEST = cog_pipeline.Request(prompt="a panda playing a guitar", negative_prompt="blurry", frames=9, height=16,
                               width=16, steps=2, guidance=6.0, seed=3, fps=8)


def _transformer(family, source: str, component: str = "transformer"):
    import diffusers

    return checkpoints.load_component(getattr(diffusers, family.TRANSFORMER_CLASS), source, component,
                                      dtype=torch.float32)


def write_adapter(family, source: str, path: Path, rank: int, targets: list[str], *, alpha: int | None = None,
                  seed: int = 0, component: str = "transformer", prefix: str | None = "transformer",
                  drop: str | None = None) -> Path:
    """A random adapter for `source`'s `component` in the layout diffusers/peft writes: `add_adapter`
    (random A and B), `get_peft_model_state_dict`, keys under `prefix.`; with `alpha`, peft's config
    in the header as diffusers' `save_lora_weights` writes it (`lora_adapter_metadata`)."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    module = _transformer(family, source, component)
    config = LoraConfig(r=rank, lora_alpha=alpha or rank, target_modules=targets, init_lora_weights=False)
    module.add_adapter(config)
    state = {(f"{prefix}.{k}" if prefix else k): v.contiguous() for k, v in get_peft_model_state_dict(module).items()
             if drop is None or drop not in k}
    metadata = {"format": "pt"}
    if alpha is not None:
        meta = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.to_dict().items()}
        metadata["lora_adapter_metadata"] = json.dumps({f"{prefix}.{k}" if prefix else k: v for k, v in meta.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata=metadata)
    return path


@pytest.fixture(scope="module")
def cog(tmp_path_factory):
    """A tiny CogVideoX checkpoint and three adapters: rank 2 on the attention's q/k, rank 8 with
    alpha 16 (scaling 2) on the feed-forward, the output projection and a norm's linear, rank 4 on v."""
    folder = tmp_path_factory.mktemp("lora-cog")
    source = str(cog_family.tiny_checkpoint())
    adapters = {
        "qk": write_adapter(cog_family, source, folder / "qk.safetensors", 2, ["to_q", "to_k"], seed=1),
        "ff": write_adapter(cog_family, source, folder / "ff.safetensors", 8, ["ff.net.0.proj", "proj_out", "norm1.linear"],
                            alpha=16, seed=2),
        "v": write_adapter(cog_family, source, folder / "v.safetensors", 4, ["to_v"], seed=3),
    }
    return source, adapters


def _stock_fused(source: str, adapters: list[tuple[Path, float]]):
    """Stock diffusers' transformer with the adapters loaded and fused (`load_lora_weights`,
    then `fuse_lora(lora_scale=...)`, or for several `set_adapters` with their weights) and unloaded."""
    pipe = cog_pipeline.common.load_stock(__import__("diffusers").CogVideoXPipeline, source)
    for i, (path, _) in enumerate(adapters):
        pipe.load_lora_weights(str(path), adapter_name=f"a{i}")
    if len(adapters) == 1:
        pipe.fuse_lora(lora_scale=adapters[0][1])
    else:
        pipe.set_adapters([f"a{i}" for i in range(len(adapters))], [s for _, s in adapters])
        pipe.fuse_lora()
    pipe.unload_lora_weights()
    return pipe


@pytest.mark.parametrize("chosen", [[("qk", 1.0)], [("ff", 0.6)], [("qk", 0.5), ("v", -1.5)]],
                         ids=["rank2-qk", "rank8-alpha16-ff", "two-adapters"])
def test_fused_weights_equal_stock_diffusers_fused(cog, chosen):
    """Adapters of ranks 2, 4 and 8 on attention, feed-forward, norm and output layers, one at a time
    or two with their own scales: the fused transformer's every tensor equals stock's, bit for bit,
    with the same names (the adapter layers unloaded) and the adapted weights really changed."""
    source, adapters = cog
    plain = _transformer(cog_family, source)
    base = {k: v.clone() for k, v in plain.state_dict().items()}
    mine = lora.fuse(plain, [lora.Adapter(str(adapters[n]), s) for n, s in chosen], cog_family)
    stock = _stock_fused(source, [(adapters[n], s) for n, s in chosen]).transformer.state_dict()
    ours = mine.state_dict()
    assert list(ours) == list(base) == list(stock)
    assert all(torch.equal(ours[k], stock[k]) for k in ours), [k for k in ours if not torch.equal(ours[k], stock[k])]
    changed = {k for k in ours if not torch.equal(ours[k], base[k])}
    targets = {"qk": ("to_q", "to_k"), "ff": ("ff.net.0.proj", "proj_out", "norm1.linear"), "v": ("to_v",)}
    wanted = {k for k in base if k.endswith(".weight") and any(f"{t}.weight" in k for n, _ in chosen for t in targets[n])}
    assert changed == wanted and wanted


def test_adapters_are_recorded_in_the_denoise_and_decode_fingerprints(cog, tmp_path):
    """Each adapter's file digest, scale and component go into the denoise and decode settings; the text
    stage and a run without adapters keep their fingerprints; a moved file is the same adapter."""
    import shutil

    source, adapters = cog
    configs = cog_family.component_configs(source)

    def settings(stage, *chosen):
        request = dataclasses.replace(REQUEST, lora=tuple(chosen))
        return cog_pipeline.CogVideoX.settings_for(source, configs, request, cog_pipeline.Options(), torch.float32, stage)

    a = lora.Adapter(str(adapters["qk"]), 0.5)
    moved = Path(shutil.copy(adapters["qk"], tmp_path / "elsewhere.safetensors"))
    assert settings("text", a) == settings("text")
    assert "lora" not in settings("denoise") and "lora" not in settings("decode")
    import hashlib

    assert settings("denoise", a)["lora"] == [{"sha256": hashlib.sha256(adapters["qk"].read_bytes()).hexdigest(),
                                                "scale": 0.5, "component": "transformer"}]
    fingerprints = {stages.fingerprint(settings(stage, *chosen)) for stage in ("denoise", "decode")
                    for chosen in ((), (a,), (a._replace(scale=0.6),), (lora.Adapter(str(adapters["v"]), 0.5),))}
    assert len(fingerprints) == 8  # every adapter change reruns both stages
    assert settings("decode", a) == settings("decode", a._replace(path=str(moved)))


def test_a_changed_adapter_reruns_denoise_and_names_it(cog, tmp_path):
    """A stage file made without the adapter is not up to date for a request with it: `status` names `lora`."""
    source, adapters = cog
    configs = cog_family.component_configs(source)
    settings = cog_pipeline.CogVideoX.settings_for(source, configs, REQUEST, cog_pipeline.Options(), torch.float32,
                                                   "denoise")
    stages.write(tmp_path, "denoise", {"latents": torch.zeros(1)}, settings)
    with_adapter = dataclasses.replace(REQUEST, lora=(lora.Adapter(str(adapters["v"])),))
    reason = stages.status(tmp_path, "denoise", cog_pipeline.CogVideoX.settings_for(
        source, configs, with_adapter, cog_pipeline.Options(), torch.float32, "denoise"))
    assert reason is not None and "lora=(absent) in the file" in reason


@pytest.mark.parametrize("text, expected", [
    ("style.safetensors", ("style.safetensors", 1.0, "transformer")),
    ("style.safetensors:0.8", ("style.safetensors", 0.8, "transformer")),
    ("dir/style.safetensors@transformer_2", ("dir/style.safetensors", 1.0, "transformer_2")),
    ("a@b/style.safetensors:-0.5@transformer_2", ("a@b/style.safetensors", -0.5, "transformer_2")),
    ("c:/x/style.safetensors", ("c:/x/style.safetensors", 1.0, "transformer")),
])
def test_lora_values_parse(text, expected):
    assert tuple(lora.parse(text)) == expected


@pytest.mark.parametrize("text, named", [("style.safetensors:strong", "'strong' is not a number"),
                                         ("style.safetensors:nan", "'nan' must be a finite number"),
                                         ("", "give PATH[:SCALE][@COMPONENT]")])
def test_a_scale_that_is_not_a_number_is_refused_by_the_command_line_in_one_line(text, named, capsys):
    from tpupedia import cli

    assert cli.main(["generate", "cogvideox", "--prompt", "a cat", "--lora", text]) == 2
    err = capsys.readouterr().err.strip()
    assert named in err and len(err.splitlines()) == 1 and err.startswith("tpupedia generate: --lora")


def _wan_community_adapter(source: str, path: Path, component: str, rank: int = 4, seed: int = 5) -> Path:
    """A Wan adapter in the original Wan trainers' layout diffusers converts (`diffusion_model.blocks.N.self_attn.q`,
    `lora_down`/`lora_up` and an `alpha` per layer)."""
    from safetensors.torch import save_file

    from tpupedia.models import wan

    config = wan.component_configs(source)[component]
    dim = config["num_attention_heads"] * config["attention_head_dim"]
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(config["num_layers"]):
        for o in ("q", "k", "v", "o"):
            key = f"diffusion_model.blocks.{i}.self_attn.{o}"
            state[f"{key}.lora_down.weight"] = torch.randn(rank, dim, generator=g)
            state[f"{key}.lora_up.weight"] = torch.randn(dim, rank, generator=g)
            state[f"{key}.alpha"] = torch.tensor(float(2 * rank))
    save_file(state, str(path))
    return path


def test_a_wan_community_adapter_for_the_low_noise_expert_fuses_as_stock(tmp_path):
    """Wan 2.2's two experts: an adapter in the original trainers' key layout `@transformer_2` goes into the
    low-noise expert alone, converted and fused as stock's `load_lora_weights(..., load_into_transformer_2=True)`
    and `fuse_lora(components=["transformer_2"])` do; `@transformer_2` on a one-expert checkpoint is refused."""
    from diffusers import WanPipeline

    from tpupedia.models import wan

    source = str(wan.tiny_checkpoint(experts=2))
    configs = wan.component_configs(source)
    path = _wan_community_adapter(source, tmp_path / "lightning_low.safetensors", "transformer_2")
    adapter = lora.parse(f"{path}:0.7@transformer_2")
    lora.check([adapter], wan, configs)
    mine = lora.fuse(_transformer(wan, source, "transformer_2"), [adapter], wan).state_dict()
    pipe = cog_pipeline.common.load_stock(WanPipeline, source)
    pipe.load_lora_weights(str(path), load_into_transformer_2=True)
    pipe.fuse_lora(components=["transformer_2"], lora_scale=0.7)
    pipe.unload_lora_weights()
    stock = pipe.transformer_2.state_dict()
    assert list(mine) == list(stock) and all(torch.equal(mine[k], stock[k]) for k in mine)
    plain = _transformer(wan, source, "transformer_2").state_dict()
    assert not torch.equal(mine["blocks.0.attn1.to_q.weight"], plain["blocks.0.attn1.to_q.weight"])
    one = wan.component_configs(str(wan.tiny_checkpoint()))
    with pytest.raises(lora.LoraError, match=r"no 'transformer_2'; an adapter goes into transformer$"):
        lora.check([adapter], wan, one)


def test_a_hunyuan_adapter_loads_through_its_transformer_with_or_without_the_prefix(tmp_path):
    """HunyuanVideo-1.5's pipeline has no LoRA loader: the transformer's `load_lora_adapter` reads the file,
    keys under `transformer.` or bare as peft writes them, and the fuse is W + scale * alpha/r * B @ A."""
    from safetensors.torch import load_file

    from tpupedia.models import hunyuan

    source = str(hunyuan.tiny_checkpoint())
    configs = hunyuan.component_configs(source)
    fused = {}
    for prefix in ("transformer", None):
        path = write_adapter(hunyuan, source, tmp_path / f"{prefix}.safetensors", 4, ["to_q", "ff.net.2"], alpha=2,
                             seed=7, prefix=prefix)
        lora.check([lora.Adapter(str(path))], hunyuan, configs)
        fused[prefix] = lora.fuse(_transformer(hunyuan, source), [lora.Adapter(str(path), 1.5)], hunyuan).state_dict()
    assert all(torch.equal(fused["transformer"][k], fused[None][k]) for k in fused[None])
    plain = _transformer(hunyuan, source).state_dict()
    state = load_file(str(tmp_path / "None.safetensors"))
    layers = sorted({k.split(".lora_")[0] for k in state})
    assert "transformer_blocks.1.ff.net.2" in layers and "transformer_blocks.0.attn.to_q" in layers
    for layer in layers:
        a, b = state[f"{layer}.lora_A.weight"], state[f"{layer}.lora_B.weight"]
        want = plain[f"{layer}.weight"] + 1.5 * (2 / 4) * (b @ a)
        torch.testing.assert_close(fused[None][f"{layer}.weight"], want, rtol=1e-6, atol=1e-6)


def test_a_hunyuan_run_with_an_adapter_gives_the_frames_of_stock_with_it_fused(tmp_path):
    """HunyuanVideo-1.5 end to end with `--lora` (fused on the host, then sharded over the 8 simulated devices):
    the frames of stock `HunyuanVideo15Pipeline` whose transformer loaded and fused the same adapter, fp32,
    within 1e-4, and not the frames without it."""
    from safetensors.torch import load_file

    from tpupedia.models import hunyuan
    from tpupedia.pipelines import hunyuan as pipeline

    source = str(hunyuan.tiny_checkpoint())
    path = write_adapter(hunyuan, source, tmp_path / "a.safetensors", 4, ["to_q", "ff.net.2"], alpha=2, seed=7)
    plain = pipeline.Request(prompt="a fox", negative_prompt="blurry", **(hunyuan.default_request(TINY) | {"steps": 2}))
    request = dataclasses.replace(plain, lora=(lora.Adapter(str(path), 1.5),))
    pipe, call = pipeline.stock(source, request)
    pipe.transformer.load_lora_adapter(str(path), prefix="transformer", adapter_name="a", use_safetensors=True)
    pipe.transformer.fuse_lora(lora_scale=1.5, adapter_names=["a"])
    pipe.transformer.unload_lora()
    with torch.no_grad():
        expected = pipe(**call).frames[0]
    pipeline.run(request, pipeline.Options(quiet=True), preset=TINY, model=source, workdir=tmp_path / "run",
                 log=lambda _: None)
    frames = load_file(str(tmp_path / "run" / "decode.safetensors"))["frames"].numpy()
    assert frames.shape == expected.shape and float(np.abs(frames - expected).max()) <= 1e-4
    pipeline.run(plain, pipeline.Options(quiet=True), preset=TINY, model=source, workdir=tmp_path / "run",
                 log=lambda _: None)  # the text stage is kept; denoise and decode rerun without the adapter
    without = load_file(str(tmp_path / "run" / "decode.safetensors"))["frames"].numpy()
    assert float(np.abs(without - expected).max()) > 1e-3


def test_a_folder_that_save_lora_weights_wrote_is_read_as_stock_load_lora_weights_reads_it(cog, tmp_path):
    """Issue 53: a folder diffusers' `save_lora_weights` wrote, which stock `load_lora_weights`
    takes, was refused as "no such file". It names its `pytorch_lora_weights.safetensors`, and the
    fused transformer is stock's, bit for bit; a folder where stock would pick by listing order, or
    with nothing to pick, is refused in one line naming what it holds."""
    import diffusers
    from safetensors.torch import load_file

    source, adapters = cog
    state = {k.removeprefix("transformer."): v for k, v in load_file(str(adapters["ff"])).items()}
    folder = tmp_path / "style"
    diffusers.CogVideoXPipeline.save_lora_weights(str(folder), transformer_lora_layers=state)
    (folder / "optimizer.safetensors").write_bytes((folder / lora.WEIGHTS_NAME).read_bytes())  # stock skips it too
    adapter = lora.parse(f"{folder}:0.6")
    assert adapter == (str(folder / lora.WEIGHTS_NAME), 0.6, "transformer")
    mine = lora.fuse(_transformer(cog_family, source), [adapter], cog_family).state_dict()
    stock = _stock_fused(source, [(folder, 0.6)]).transformer.state_dict()
    assert list(mine) == list(stock) and all(torch.equal(mine[k], stock[k]) for k in mine)
    assert lora.parse_all(["style"], base=tmp_path) == (adapter._replace(scale=1.0),)  # a JSONL batch's folder
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        (two / name).write_bytes(b"")
    _one_line_refusal(lambda: lora.parse(str(two)), "2 adapters (a.safetensors, b.safetensors); give the file")
    _one_line_refusal(lambda: lora.parse(str(tmp_path)), "no .safetensors adapter", lora.WEIGHTS_NAME)


@pytest.fixture(scope="module")
def other_size():
    """A tiny CogVideoX checkpoint of another width (attention heads of 8, not the tiny preset's)."""
    return str(cog_family.tiny_checkpoint(transformer={"attention_head_dim": 8}))


def test_a_hub_adapter_is_named_as_stock_loads_one_with_or_without_its_weight_name(tmp_path, monkeypatch, capsys):
    """`hf:OWNER/NAME/WEIGHT_NAME`, as `load_lora_weights("OWNER/NAME", weight_name=...)`, and
    `hf:OWNER/NAME`, whose file stock picks from the repository's list by its folder rule: fetched
    into the Hugging Face cache (said in a line), kept with the scale and component; a repository
    that cannot be had, or holds several adapters, is one line with the fix."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    fetched = []

    def download(repo, filename):
        if repo == "owner/missing":
            raise LocalEntryNotFoundError("offline, and the file is not in the cache")
        fetched.append((repo, filename))
        return str(tmp_path / repo / filename)

    listing = {"owner/style": ["README.md", "optimizer.safetensors", lora.WEIGHTS_NAME],
               "owner/two": ["a.safetensors", "b.safetensors"]}
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo: listing[repo])
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: None)
    assert lora.parse("hf:owner/style/v2/style.safetensors:0.8@transformer_2") == (
        str(tmp_path / "owner/style/v2/style.safetensors"), 0.8, "transformer_2")
    assert lora.parse("hf:owner/style") == (str(tmp_path / "owner/style" / lora.WEIGHTS_NAME), 1.0, "transformer")
    assert fetched == [("owner/style", "v2/style.safetensors"), ("owner/style", lora.WEIGHTS_NAME)]
    assert "LoRA hf:owner/style: fetching pytorch_lora_weights.safetensors from owner/style" in capsys.readouterr().out
    _one_line_refusal(lambda: lora.parse("hf:owner/two"), "2 adapters (a.safetensors, b.safetensors)",
                      "hf:owner/two/WEIGHT_NAME")
    _one_line_refusal(lambda: lora.parse("hf:owner/missing/x.safetensors"), "--lora hf:owner/missing/x.safetensors",
                      "cannot be had from the Hub", "hf download owner/missing x.safetensors")
    _one_line_refusal(lambda: lora.parse("hf:owner/style/x.bin"), "x.bin is not a .safetensors file")
    _one_line_refusal(lambda: lora.parse("hf:owner"), "give hf:OWNER/NAME[/WEIGHT_NAME]")


def _one_line_refusal(call, *named) -> str:
    with pytest.raises(lora.LoraError) as info:
        call()
    message = str(info.value)
    assert len(message.splitlines()) == 1 and all(n in message for n in named), message
    return message


def test_bad_adapters_are_refused_in_one_line_naming_the_value(cog, other_size, tmp_path):
    from safetensors.torch import load_file, save_file

    from tpupedia.models import wan

    source, adapters = cog
    configs = cog_family.component_configs(source)
    check = lambda *a: lambda: lora.check(a, cog_family, configs)  # noqa: E731
    _one_line_refusal(check(lora.Adapter(str(tmp_path / "missing.safetensors"))), "missing.safetensors", "no such file")
    pickled = tmp_path / "old.bin"
    pickled.write_bytes(b"\x80\x04K\x01.")  # a pickle: never unpickled
    _one_line_refusal(check(lora.Adapter(str(pickled))), "old.bin", "not a .safetensors file")
    fake = tmp_path / "fake.safetensors"
    fake.write_bytes(b"not a safetensors file")
    _one_line_refusal(check(lora.Adapter(str(fake))), "fake.safetensors", "not a readable safetensors file")
    _one_line_refusal(check(lora.Adapter(str(adapters["qk"]), component="transformer_2")),
                      "no 'transformer_2'", "an adapter goes into transformer")
    wide = write_adapter(cog_family, other_size, tmp_path / "wide.safetensors", 2, ["to_q"])
    _one_line_refusal(check(lora.Adapter(str(wide))), "lora_A.weight has shape", "another family or model size")
    wan_source = str(wan.tiny_checkpoint())
    foreign = write_adapter(wan, wan_source, tmp_path / "wan-style.safetensors", 2, ["to_q"])
    _one_line_refusal(check(lora.Adapter(str(foreign))), "unexpected key", "has no layer 'blocks.0.attn1.to_q'")
    half = write_adapter(cog_family, source, tmp_path / "half.safetensors", 2, ["to_q"], drop="transformer_blocks.1.attn1.to_q.lora_B")
    _one_line_refusal(check(lora.Adapter(str(half))), "missing key 'transformer_blocks.1.attn1.to_q.lora_B.weight'")
    state = load_file(str(adapters["qk"]))
    save_file(state | {"text_encoder.encoder.block.0.lora_A.weight": torch.zeros(2, 4)}, str(tmp_path / "te.safetensors"))
    _one_line_refusal(check(lora.Adapter(str(tmp_path / "te.safetensors"))), "unexpected key 'text_encoder.encoder")
    save_file(state | {"transformer.proj_out.lora_magnitude_vector": torch.zeros(4)}, str(tmp_path / "dora.safetensors"))
    _one_line_refusal(check(lora.Adapter(str(tmp_path / "dora.safetensors"))), "unexpected key 'proj_out.lora_magnitude_vector'",
                      ".lora_A.weight")


def test_a_bad_adapter_stops_a_run_before_the_transformer_loads(cog, tmp_path, monkeypatch):
    """The adapter's shapes are checked against the transformer built on `meta` from its config: no model loaded,
    no stage run."""
    from safetensors.torch import load_file, save_file

    source, _ = cog
    wide = write_adapter(cog_family, source, tmp_path / "rank.safetensors", 2, ["to_q"])
    state = load_file(str(wide))
    key = next(k for k in state if k.endswith("lora_B.weight"))
    save_file(state | {key: torch.zeros(state[key].shape[0] + 1, 2)}, str(wide))
    loaded = []
    real = checkpoints.load_component
    monkeypatch.setattr(checkpoints, "load_component", lambda cls, *a, **k: loaded.append(cls.__name__) or real(cls, *a, **k))
    request = dataclasses.replace(REQUEST, lora=(lora.Adapter(str(wide)),))
    with pytest.raises(lora.LoraError, match="another family or model size"):
        cog_pipeline.run(request, cog_pipeline.Options(quiet=True), preset=TINY, model=source, workdir=tmp_path / "w",
                         log=lambda _: None)
    assert loaded == [] and not (tmp_path / "w" / "text.json").exists()


def test_a_batch_reads_adapters_per_line_and_runs_each_adapter_set_once(cog, tmp_path, monkeypatch):
    """JSONL lines name their adapters relative to the file; the lines run grouped by adapter set (first use
    first), so the transformer is loaded and fused once per set, not once per change of line."""
    from tpupedia import batch

    source, adapters = cog
    prompts = tmp_path / "p.jsonl"
    (tmp_path / "ad").mkdir()
    (tmp_path / "ad" / "v.safetensors").write_bytes(adapters["v"].read_bytes())
    prompts.write_text("\n".join(json.dumps(line) for line in [
        {"prompt": "a panda", "lora": ["ad/v.safetensors:0.5"]}, {"prompt": "a cat", "lora": []},
        {"prompt": "a fox", "lora": ["ad/v.safetensors:0.5"]}, {"prompt": "rain"}]) + "\n")
    items = batch.read_prompts(prompts)
    assert dict(items[0].overrides)["lora"] == (lora.Adapter(str(tmp_path / "ad" / "v.safetensors"), 0.5),)
    assert dict(items[1].overrides)["lora"] == ()
    fused, loaded = [], []
    real, load = lora.fuse, checkpoints.load_component
    monkeypatch.setattr(lora, "fuse", lambda module, chosen, family: fused.append(chosen) or real(module, chosen, family))
    monkeypatch.setattr(checkpoints, "load_component", lambda cls, *a, **k: loaded.append(cls.__name__) or load(cls, *a, **k))
    base = dataclasses.replace(REQUEST, steps=1)
    made = cog_pipeline.run_batch(prompts, base, cog_pipeline.Options(quiet=True), preset=TINY, model=source,
                                  outdir=tmp_path / "out", log=lambda _: None)
    assert made == [items[i].name for i in (0, 2, 1, 3)]
    assert fused == [[lora.Adapter(str(tmp_path / "ad" / "v.safetensors"), 0.5)]]
    assert loaded.count("CogVideoXTransformer3DModel") == 2  # one per adapter set: with v, then without
    record = json.loads((tmp_path / "out" / f"{items[2].name}.json").read_text())
    assert record["overrides"]["lora"] == [[str(tmp_path / "ad" / "v.safetensors"), 0.5, "transformer"]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "lora": ["a.safetensors:loud"]}) + "\n")
    _one_line_refusal(lambda: batch.read_prompts(bad), "bad.jsonl line 1: lora a.safetensors:loud", "'loud' is not a number")


def test_plan_counts_the_host_memory_the_fuse_needs(cog):
    """`fuse_bytes`: the transformer in the run's dtype (its tensors counted from the meta build) plus twice each
    adapter file; `tpupedia plan` states it as a note."""
    source, adapters = cog
    configs = cog_family.component_configs(source)
    weights = sum(t.numel() for t in _transformer(cog_family, source).state_dict().values())
    chosen = [lora.Adapter(str(adapters["qk"])), lora.Adapter(str(adapters["ff"]))]
    files = sum(Path(a.path).stat().st_size for a in chosen)
    assert lora.fuse_bytes(chosen, cog_family, configs, "bfloat16") == {"transformer": 2 * weights + 2 * files}
    assert lora.fuse_bytes(chosen, cog_family, configs, "float32") == {"transformer": 4 * weights + 2 * files}
    from tpupedia import devices, plan

    if not devices.has_libtpu():
        pytest.skip("the plan's AOT compiles for a TPU need libtpu")
    request = dataclasses.replace(REQUEST, lora=tuple(chosen))
    p = plan.make("cogvideox", request, cog_pipeline.Options(), configs=configs, topology="v6e:2x2", dtype="float32",
                  stages=("denoise",))
    assert p.fuse_host == 4 * weights + 2 * files and p.as_dict()["fuse_host"] == p.fuse_host
    assert f"LoRA: fusing 2 adapter(s) on the host, before the weights are placed, needs about {p.fuse_host / 2**30:.2f} GiB" in p.summary()
    assert plan.make("cogvideox", REQUEST, cog_pipeline.Options(), configs=configs, topology="v6e:2x2", dtype="float32",
                     stages=("denoise",)).fuse_host == 0


def test_doctor_counts_the_host_memory_a_full_size_fuse_needs(monkeypatch):
    from tpupedia import doctor, families, hardware

    needs = {s.name: max(lora.transformer_bytes(s.facts, c, k, "bfloat16") for k in lora.components(c))
             for s in families.video() for c in [s.facts.full_configs()]}
    assert all(n > 2**30 for n in needs.values())  # billions of parameters
    monkeypatch.setattr(hardware, "host_memory_available", lambda: max(needs.values()) + 1)
    line = next(c for c in doctor.run().checks if c.name == "LoRA fuse (host)")
    assert line.ok and line.hint == "" and all(f"{n} {b / 2**30:.1f} GiB" in line.value for n, b in needs.items())
    smallest = min(needs, key=needs.get)
    monkeypatch.setattr(hardware, "host_memory_available", lambda: needs[smallest] + 1)
    line = next(c for c in doctor.run().checks if c.name == "LoRA fuse (host)")
    assert line.ok and smallest not in line.hint and all(n in line.hint for n in needs if n != smallest)
    monkeypatch.setattr(hardware, "host_memory_available", lambda: 1)
    assert not next(c for c in doctor.run().checks if c.name == "LoRA fuse (host)").ok


def test_a_hunyuan_adapter_in_the_original_layout_is_refused_naming_its_first_key(tmp_path):
    """diffusers 0.42.1 ships no LoRA loader for HunyuanVideo-1.5 (`HunyuanVideo15Pipeline` is a
    plain `DiffusionPipeline`), so nothing converts the original repository's key names: such a
    file is refused in one line naming its first key, not fused into nothing."""
    import diffusers
    from safetensors.torch import save_file

    from tpupedia.models import hunyuan

    assert not issubclass(diffusers.HunyuanVideo15Pipeline, diffusers.loaders.lora_base.LoraBaseMixin)
    assert hunyuan.LORA_LOADER is None
    path = tmp_path / "original.safetensors"
    save_file({"double_blocks.0.img_attn_qkv.lora_A.weight": torch.zeros(4, 64),
               "double_blocks.0.img_attn_qkv.lora_B.weight": torch.zeros(192, 4)}, str(path))
    source = str(hunyuan.tiny_checkpoint())
    _one_line_refusal(lambda: lora.check([lora.Adapter(str(path))], hunyuan, hunyuan.component_configs(source)),
                      "unexpected key 'double_blocks.0.img_attn_qkv.lora_A.weight'", "no layer 'double_blocks.0.img_attn_qkv'")
