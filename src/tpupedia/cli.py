"""The `tpupedia` command. Each subcommand is a thin shell over a library function."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from tpupedia import __version__
from tpupedia.errors import TpupediaError

__all__ = ["main", "build_parser"]


def _doctor(args: argparse.Namespace) -> int:
    from tpupedia import doctor

    report = doctor.run(topology=args.topology)
    print(report.to_json() if args.json else doctor.format_report(report))
    return 0 if all(c.ok for c in report.checks) else 1


class CommandLineError(TpupediaError, ValueError):
    """A flag value the command cannot use (printed as one line, exit status 2)."""


def _positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise CommandLineError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")


def _report_bench(record: dict, output: str) -> int:
    from tpupedia import bench

    path = bench.merge_record(record, output)
    m = record["machine"]
    config = ", ".join(f"{k} {v}" for k, v in record["config"].items())
    print(f"{record['bench']} ({config}) on {m['device_kind']} ({m['cpu_count']} CPUs)")
    print(f"  torch eager   steady {record['torch_eager']['steady_s'] * 1e3:9.1f} ms")
    compiled = record.get("torch_compile")
    if isinstance(compiled, dict):
        print(f"  torch.compile steady {compiled['steady_s'] * 1e3:9.1f} ms (first call {compiled['first_s']:.2f} s)")
    elif compiled:
        print(f"  torch.compile {compiled}")
    print(f"  torchax jit   steady {record['torchax_jit']['steady_s'] * 1e3:9.1f} ms "
          f"(first call {record['torchax_jit']['first_s']:.2f} s)")
    print(f"  ratio jit/eager {record['ratio_jit_over_eager']:.2f}, max abs diff {record['max_abs_diff']:.1e}")
    if record.get("mfu_torchax_jit") is not None:
        print(f"  torchax jit MFU {record['mfu_torchax_jit']:.1%} of the chip's bf16 peak")
    print(f"  written to {path}")
    return 0


def _bench_llama(args: argparse.Namespace) -> int:
    from tpupedia import bench

    _positive(layers=args.layers, hidden=args.hidden, seq=args.seq, batch=args.batch, repeat=args.repeat)
    if args.hidden % 64:
        raise CommandLineError(f"--hidden must be a multiple of 64 (head dim 64), got {args.hidden}")
    record = bench.bench_llama(layers=args.layers, hidden=args.hidden, seq=args.seq,
                               batch=args.batch, repeat=args.repeat)
    return _report_bench(record, args.output)


def _bench_dit(args: argparse.Namespace) -> int:
    from tpupedia import bench

    _positive(layers=args.layers, heads=args.heads, head_dim=args.head_dim, frames=args.frames,
              height=args.height, width=args.width, text_tokens=args.text_tokens, repeat=args.repeat)
    record = bench.bench_dit(layers=args.layers, heads=args.heads, head_dim=args.head_dim, frames=args.frames,
                             height=args.height, width=args.width, text_tokens=args.text_tokens,
                             repeat=args.repeat, torch_compile=not args.no_torch_compile)
    return _report_bench(record, args.output)


def _dryrun(args: argparse.Namespace) -> int:
    from tpupedia import dryrun, families, results
    from tpupedia.pipelines.common import parse_mesh

    report = dryrun.run(
        model=args.model, topology=args.topology, resolution=args.resolution, frames=args.frames,
        sharding=args.sharding, attention=args.attention, layers=args.layers, seq=args.seq,
        measured_step_seconds=args.measured_step_seconds, mesh_shape=parse_mesh(args.mesh) if args.mesh else None,
        mask=args.mask, block_sizes=_block_sizes(args.block_sizes),
    )
    print(report.summary())
    if args.record:
        spec = families.get(args.model)
        command = f"tpupedia dryrun {args.model} --topology {args.topology}"
        if spec.kind == "llm":
            command += f" --seq {args.seq}"
        else:
            command += f" --resolution {report.width}x{report.height} --frames {report.frames}"
        if spec.kind != "vae":  # a VAE runs whole on one chip, without attention
            command += f" --sharding {args.sharding} --attention {args.attention}"
        if args.layers:
            command += f" --layers {args.layers}"
        if args.attention == "splash":
            command += f" --block-sizes {','.join(map(str, report.block_sizes))}"
        if report.mask:
            command += f" --mask {args.mask}"
        if args.mesh:
            command += f" --mesh {args.mesh}"
        print(f"  recorded in {dryrun.record(report, args.record, command=command.strip())}")
    if args.json:
        print(f"  written to {results.write_json_atomic(args.json, report.as_dict())}")
    return 0


def _predict(args: argparse.Namespace) -> int:
    from tpupedia import dryrun, predict
    from tpupedia.pipelines.common import parse_mesh

    mesh = parse_mesh(args.mesh) if args.mesh else None
    found = None
    if args.resolution:
        width, height = dryrun.parse_resolution(args.resolution, 16)
        found = predict.reported(args.model, f"{width}x{height}")
        if found and (args.frames not in (None, found["frames"]) or (mesh or found["mesh"]) != found["mesh"]
                      or args.sharding != found["sharding"] or args.topology != "v6e:2x4" or args.batch != 2):
            found = None  # another run than the one reported
    steps = args.steps if args.steps is not None else found and found["steps"]
    prediction = predict.predict_step(args.model, args.topology, args.resolution, args.frames, sharding=args.sharding,
                                      mesh_shape=mesh, block_sizes=_block_sizes(args.block_sizes),
                                      reported_step_s=found and found["step_s"],
                                      reported_source=found["source"] if found else "", batch=args.batch, steps=steps)
    print(prediction.summary())
    if args.record:
        command = (f"tpupedia predict {args.model} --topology {args.topology} --resolution "
                   f"{prediction.width}x{prediction.height} --frames {prediction.frames} --sharding {args.sharding}"
                   + (f" --mesh {args.mesh}" if args.mesh else "")
                   + (f" --block-sizes {args.block_sizes}" if args.block_sizes else "")
                   + (f" --batch {args.batch}" if args.batch != 2 else "") + (f" --steps {args.steps}" if args.steps else ""))
        print(f"  recorded in {predict.record(prediction, args.record, command=command)}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from tpupedia import plan, presets, results
    from tpupedia.pipelines import common

    pipeline = _pipeline_module(args.model_family)
    family = pipeline.PIPELINE.family
    release = _few_step(args)
    model = args.model if args.model is not None or release is None else release.model
    fields = family.default_request(presets.get("full")) | pipeline.PIPELINE.release_request(
        model, getattr(args, "image", None)) | (
        release.request_fields() if release else {}) | {
        k: v for k, v in (("frames", args.frames), ("steps", args.steps)) if v is not None}
    if args.resolution:
        from tpupedia import dryrun

        fields["width"], fields["height"] = dryrun.parse_resolution(args.resolution, 16)
    fields |= _unset_left(_family_values(args, pipeline), fields)
    adapters = given = _adapters(args)
    if release is not None:
        if release.image_to_video and getattr(args, "image", None) is None:
            raise CommandLineError(f"--release {release.name} generates from a picture: give --image PICTURE")
        adapters = _release_adapters(args, release, given, model, pretrained=True, local_only=True) + given
    request = pipeline.Request(prompt=args.prompt, image=getattr(args, "image", None), lora=adapters,
                               quantize=args.quantize, **fields)
    if release is not None:
        print(_release_line(release, fields, model, adapters, _replaced(args, given))
              + f"; planned with {request.steps} steps")
    pipeline.PIPELINE.check_size_given(request, ["--resolution"] if args.resolution else [])
    options = common.Options(mesh=common.parse_mesh(args.mesh) if args.mesh else None, sharding=args.sharding,
                             attention=args.attention, block_sizes=_block_sizes(args.block_sizes))
    if args.search or args.cheapest:
        return _tune(args, request, options, model)
    result = plan.make(args.model_family, request, options, model=model, topology=args.topology,
                       layers=args.layers, vae_tiling=args.vae_tiling, resident=args.batch,
                       stages=tuple(s.strip() for s in args.stages.split(",")) if args.stages else plan.STAGES)
    print(result.summary())
    if args.json:
        print(f"  written to {results.write_json_atomic(args.json, result.as_dict())}")
    if args.record:
        print(f"  recorded in {plan.record(result, args.record, command='tpupedia ' + ' '.join(args.argv))}")
    result.check()  # a run that will not fit: PlanError, one line naming the stage and the fix, exit 2
    return 0


def _tune(args: argparse.Namespace, request, options, model) -> int:
    """`plan --search` and `plan --cheapest` (`tpupedia.tune`): every line a prediction, said so."""
    from tpupedia import tune

    layers = args.layers or 1
    stages = tuple(s.strip() for s in args.stages.split(",")) if args.stages else ("text", "denoise")
    make = dict(model=model, layers=layers, stages=stages, vae_tiling=args.vae_tiling)
    print(f"predicted, not measured: stages {', '.join(stages)}, {layers} layer(s) per model compiled and scaled "
          "to full depth; compile times at this host's speed")
    if args.cheapest:
        prices = tune.parse_prices(args.price)
        for chip, slices in tune.UNLISTED_SLICES.items():
            if chip not in prices:
                print(f"  {', '.join(slices)}: not priced, {chip} has no public list price (--price {chip}=DOLLARS "
                      "per chip-hour adds it)")
        priced = tune.cheapest(args.model_family, request, options, videos=args.videos, deadline=args.deadline,
                               kind="spot" if args.spot else "on_demand", searched=args.search, prices=prices,
                               quantize=tune.QUANTIZE, **make)
        for c in priced:
            cost = (f"{c.video_s:.1f} s a video + {c.compile_s:.0f} s of compiles / {c.videos} = "
                    f"${c.dollars_per_video:.3f} a video at ${c.price_per_chip_hour:.2f} per chip-hour"
                    + (f", {c.settings['quantize']} weights (--quantize {c.settings['quantize']}: only where bf16 "
                       "does not fit, as it changes the frames)" if c.settings.get("quantize") and
                       request.quantize is None else "")
                    if c.fits else c.note)
            print(f"  {c.topology:8s} {c.chips} chips: {cost}")
        best = priced[0]
        if not best.fits or (args.deadline is not None and best.video_s > args.deadline):
            fastest = min((c for c in priced if c.fits), key=lambda c: c.video_s, default=None)
            raise CommandLineError("no slice " + ("fits" if fastest is None else
                                   f"meets --deadline {args.deadline:g} s: the fastest, {fastest.topology}, is "
                                   f"predicted at {fastest.video_s:.1f} s a video"))
        print(f"cheapest: {best.topology}, ${best.dollars_per_video:.3f} a video (predicted; prices in "
              "tpupedia.hardware.PRICES, with their source)")
        if best.settings:
            print("  " + tune.command_line(args.model_family, best.settings, f"--topology {best.topology}"))
        return 0
    ranked = tune.search(args.model_family, request, options, topology=args.topology, **make)
    for c in ranked:
        s = c.settings
        label = (f"mesh dp={s['mesh'][0]},tp={s['mesh'][1]} sharding {s['sharding']}"
                 + (f" blocks {'/'.join(map(str, s['block_sizes']))}" if s["block_sizes"] else "")
                 + (f" vae tiling {s['vae_tiling']}" if "vae_tiling" in s else ""))
        verdict = f"predicted {c.predicted_s:.1f} s a video" if c.fits else c.why_not
        print(f"  {label:52s} {verdict}")
    if ranked and request.quantize is None:  # not ranked: it changes the frames
        smaller = tune.with_quantized(args.model_family, request, options, ranked[0].settings, topology=args.topology,
                                      **make)
        print(f"with --quantize {tune.QUANTIZE} (weight-only; it changes the frames: notebook fewer_steps): "
              + (f"predicted {smaller.predicted_s:.1f} s a video, its largest stage "
                 f"{max(st.peak for st in smaller.plan.stages) / 2**30:.2f} GiB per {smaller.plan.unit}"
                 if smaller.fits else smaller.why_not))
    if not ranked or not ranked[0].fits:
        raise CommandLineError(f"no setting fits {args.topology}: try a larger slice (--cheapest names one)")
    print("fastest predicted: " + tune.command_line(args.model_family, ranked[0].settings))
    if len({c.settings["block_sizes"] for c in ranked}) > 1:
        print("  block sizes rank by their padding alone: the splash model runs every block size at the MXU's ceiling; "
              "measure the winners on the slice (notebook splash_attention's sweep)")
    for symptom in tune.diagnose(ranked[0].plan):
        print(f"  symptom, {symptom.name}: {symptom.evidence}; try {symptom.settings[0]}")
    if getattr(request, "step_cache", None) is None:  # not ranked: it changes the video
        cached = tune.with_step_cache(args.model_family, request, options, ranked[0].settings, topology=args.topology,
                                      **make)
        print(f"with --step-cache {tune.STEP_CACHE} (it changes the video: notebook fewer_steps): "
              + (f"predicted {cached.predicted_s:.1f} s a video" if cached.fits else cached.why_not))
    return 0


def _adapters(args: argparse.Namespace) -> tuple:
    """`--lora` values (repeatable) as `tpupedia.lora.Adapter`s (`LoraError`: one line, exit 2)."""
    from tpupedia import lora

    return lora.parse_all(getattr(args, "lora", None))


def _few_step(args: argparse.Namespace):
    """The `--release NAME` of the command's family (`tpupedia.families.few_step`), or `None`
    (`ReleaseError`: one line naming it and what there is, before anything loads)."""
    name = getattr(args, "release", None)
    if name is None:
        return None
    from tpupedia import families

    return families.few_step(args.model_family, name)


def _unset_left(values: dict, fields: dict) -> dict:
    """The family's flag values (`_family_values`) a release's defaults keep: a flag not given
    (`None`) does not replace a value `fields` already has."""
    return {k: v for k, v in values.items() if v is not None or k not in fields}


def _replaced(args: argparse.Namespace, given: tuple) -> tuple[str, ...]:
    """The components whose release adapter `--replace-release-lora` leaves out: those a `--lora`
    adapts; none without the flag (the release's adapters and the user's stack)."""
    return tuple(dict.fromkeys(a.component for a in given)) if getattr(args, "replace_release_lora", False) else ()


def _release_adapters(args: argparse.Namespace, release, given: tuple, source: str, *, pretrained: bool,
                      local_only: bool = False) -> tuple:
    """The release's adapters (`tpupedia.families.release_adapters`), to go before the `given`
    `--lora` ones: they stack, as diffusers stacks named adapters, unless
    `--replace-release-lora` leaves out the release's adapter of each component a `--lora`
    adapts (`_replaced`); with `local_only`, those in the Hugging Face cache, the others said in a
    line."""
    from tpupedia import families

    skip = _replaced(args, given)
    found = families.release_adapters(args.model_family, release, source, pretrained, local_only=local_only, skip=skip)
    missing = [a for a, f in zip([a for a in release.adapters if a.component not in skip], found) if f is None]
    if missing:
        print(f"  release {release.name}: {', '.join(a.where for a in missing)} not in the Hugging Face cache: "
              "the fuse's host memory is not counted (the planned programs are the same with the adapters fused)")
    return tuple(f for f in found if f is not None)


def _release_line(release, fields: dict, model: str, adapters: tuple, replaced: tuple[str, ...] = ()) -> str:
    """What a `--release` applied, in one line: each default and whether a flag replaced it, the
    checkpoint, the adapters (the release's, stacked with any `--lora` on the same component, or
    `replaced` by them), and what differs from the upstream reference run."""
    wanted = release.request_fields()
    parts = [f"{k} {fields[k]}" + ("" if fields[k] == v else f" (--{k.replace('_', '-')} given; the release's is {v})")
             for k, v in wanted.items()]
    line = f"release {release.name} ({release.title}): {', '.join(parts)}; checkpoint {model}"
    if adapters:
        line += "; adapters " + ", ".join(f"{a.path}:{a.scale:g}@{a.component}" for a in adapters)
    if replaced:
        line += f"; the release's adapter for {', '.join(replaced)} replaced by --lora (--replace-release-lora)"
    if release.note:
        line += f"; note: {release.note}"
    return line


def _named(args: argparse.Namespace, family) -> str | None:
    """The checkpoint the user named (`--model`, the family's environment variable), or `None`
    for the preset's own, the tiny checkpoint of a `--release` on the tiny preset included."""
    return None if getattr(args, "release_tiny", False) else family.named_source(args.model)


def _add_release_flag(parser: argparse.ArgumentParser, spec) -> None:
    """`--release NAME` (every video family, so that another family's release name is refused in one line)."""
    parser.add_argument("--release", default=None, metavar="NAME",
                        help="a step-distilled or few-step release with its own defaults (steps, guidance, shift, "
                             "adapters; flags you give win): " + ("; ".join(
                                 f"{r.name}: {r.title}" for r in spec.few_step.values()) or "none for this family"))
    if any(r.adapters for r in spec.few_step.values()):
        parser.add_argument("--replace-release-lora", action="store_true",
                            help="leave out the release's adapter for each component a --lora adapts (default: "
                                 "both fused, the release's first, as diffusers stacks named adapters)")


def _add_quantize_flag(parser: argparse.ArgumentParser, family: str) -> None:
    from tpupedia import quantize

    parser.add_argument("--quantize", choices=tuple(quantize.FORMATS), default=None,
                        help="store the transformers' linears in 8 bits, one scale per output channel (weight-only: "
                             f"half the bytes, the same FLOPs), but those tpupedia.models.{family}.QUANTIZE_KEEP keeps; "
                             "int8 or fp8 (e4m3) weights, bf16 matmuls either way")


def _add_lora_flag(parser: argparse.ArgumentParser, family: str) -> None:
    from tpupedia import lora

    parser.add_argument("--lora", action="append", default=None, metavar=lora.FORMAT,
                        help="fuse a LoRA adapter (a .safetensors file, the folder save_lora_weights wrote, or "
                             "hf:OWNER/NAME[/WEIGHT_NAME] on the Hub) into the "
                             "transformer's weights before they are "
                             "sharded; repeatable; SCALE default 1.0, COMPONENT default transformer (transformer_2: "
                             f"a two-expert checkpoint's low-noise expert); the formats diffusers loads for {family}")


def _block_sizes(text: str | None) -> tuple[int, int, int] | None:
    """`--block-sizes Q,KV,KV_COMPUTE` checked (`AttentionError`: one line, exit 2, before JAX starts)."""
    from tpupedia import attention

    return attention.parse_block_sizes(text) if text else None


def _pipeline_module(name: str):
    """The staged pipeline of video family `name` (`FamilySpec.pipeline`)."""
    import importlib

    from tpupedia import families

    return importlib.import_module(families.get(name, "video").pipeline)


def _family_fields(pipeline) -> list:
    """The fields a family's `Request` adds to `common.Request` (HunyuanVideo-1.5's `shift`,
    `deepcache`): each becomes a flag of `generate` and `bench generate`, its `metadata` giving
    the help text, a metavar, the flag's `type` and `parse` (text -> value, raising the family's
    error, so that a bad value is one line naming it)."""
    import dataclasses

    from tpupedia.pipelines import common

    shared = {f.name for f in dataclasses.fields(common.Request)}
    return [f for f in dataclasses.fields(pipeline.Request) if f.name not in shared]


def _add_family_flags(parser: argparse.ArgumentParser, pipeline) -> None:
    """A flag for each of `_family_fields(pipeline)` (`generate`, `bench generate`, `plan`)."""
    for f in _family_fields(pipeline):
        parser.add_argument(f"--{f.name.replace('_', '-')}", default=None, metavar=f.metadata.get("metavar"),
                            type=f.metadata.get("type", str), help=f.metadata.get("help"))


def _family_values(args: argparse.Namespace, pipeline) -> dict:
    """The family's request fields from the flags `_add_family_flags` added, each `parse`d; a flag
    not given is left out, so the field keeps its default (or a release's)."""
    out = {}
    for f in _family_fields(pipeline):
        value = getattr(args, f.name)
        if value is not None:
            parse = f.metadata.get("parse")
            out[f.name] = parse(value) if parse else value
    return out


def _generate_setup(args: argparse.Namespace):
    """Preset, pipeline module, request and options from the command line, validated before JAX
    starts or any model loads; then the preset's devices and the compilation cache. Shared by
    `generate` and `bench generate` for every family."""
    from tpupedia import devices, distributed, presets, rehearsal, session
    from tpupedia.pipelines import common

    pipeline = _pipeline_module(args.model_family)
    family = pipeline.PIPELINE.family
    preset = presets.get(args.preset) if args.preset else presets.current()
    if args.devices is not None:
        _positive(devices=args.devices)
    if args.devices is not None and not preset.simulated_devices:
        raise CommandLineError(f"--devices {args.devices} sets how many CPU devices the {preset.name} preset "
                               "simulates; it has none (it uses the machine's devices)")
    release = _few_step(args)
    named = _named(args, family)
    if named and not preset.pretrained and not Path(named).expanduser().is_dir():
        preset = presets.get("full")  # a hub id is a released checkpoint: its request and dtype, not the tiny ones
        if not args.quiet:
            print(f"{named}: a hub checkpoint, run with the {preset.name} preset's request and dtype "
                  "(a tiny checkpoint is a folder)")
    fields = family.default_request(preset) | (pipeline.PIPELINE.release_request(
        named, getattr(args, "image", None)) if preset.pretrained else {}) \
        | (release.request_fields() if release else {}) | {k: v for k, v in (
        ("frames", args.frames), ("height", args.height), ("width", args.width), ("steps", args.steps),
        ("guidance", args.guidance), ("seed", args.seed), ("fps", args.fps)) if v is not None}
    fields |= _unset_left(_family_values(args, pipeline), fields)
    adapters = _adapters(args)
    if release is not None:
        from tpupedia import families

        if release.image_to_video and getattr(args, "image", None) is None and not getattr(args, "prompts", None):
            raise CommandLineError(f"--release {release.name} generates from a picture: give --image PICTURE")
        source = args.model or family.named_source(None)
        if source is None:  # the preset's: the release's checkpoint, or on the tiny preset one of its layout
            source = args.model = families.release_checkpoint(args.model_family, release, preset.pretrained)
            args.release_tiny = not preset.pretrained
        given = adapters
        adapters = _release_adapters(args, release, given, source, pretrained=preset.pretrained,
                                     local_only=rehearsal.target() is not None) + given  # a rehearsal fetches nothing
        if not args.quiet:
            print(_release_line(release, fields, source, adapters, _replaced(args, given)))
    request = pipeline.Request(prompt=args.prompt or "(from --prompts)", negative_prompt=args.negative_prompt,
                               vae_tiling=args.vae_tiling == "on", image=getattr(args, "image", None),
                               lora=adapters, quantize=getattr(args, "quantize", None), **fields)
    options = common.Options(mesh=common.parse_mesh(args.mesh) if args.mesh else None, sharding=args.sharding,
                             attention=args.attention, block_sizes=_block_sizes(args.block_sizes), quiet=args.quiet,
                             dtype=args.dtype)
    pipeline.PIPELINE.check_size_given(request, [f for f, v in (("--width", args.width), ("--height", args.height))
                                                 if v is not None])
    configs = None  # a checkpoint named on the command line: its configs' rules (JSON only, no weights)
    if family.named_source(args.model):  # a release's tiny checkpoint too: its adapters are checked against it
        configs = pipeline.PIPELINE.checkpoint_configs(family.model_source(preset, args.model)[0])
    if getattr(args, "prompts", None):  # every line of the batch, its picture included
        from tpupedia import batch

        pipeline.PIPELINE.validate(request, options, None, configs, kind=False)
        common.batch_requests(pipeline.PIPELINE, batch.read_prompts(args.prompts), request, options, None, configs,
                              model=args.model)
    else:
        pipeline.validate(request, options, configs=configs)
    if getattr(args, "prompts", None) and args.outdir:
        common.check_workdir(args.outdir, "--outdir")
    elif getattr(args, "workdir", None):
        common.check_workdir(args.workdir)
    if distributed.requested():  # one process of a `tpupedia launch` job (notebook `beyond_one_host`)
        distributed.initialize()
    elif preset.simulated_devices and (args.devices or not _named(args, family)):
        devices.simulate_cpu_devices(args.devices or preset.simulated_devices)
    elif preset.simulated_devices:  # a checkpoint of any size: the devices this machine has (notebook `beyond_one_host`)
        import jax

        devices.quiet_libtpu()
        found = jax.devices()
        if not args.quiet:
            print(f"devices: {len(found)} x {found[0].device_kind}, this machine's: a named checkpoint is not run on "
                  f"the {preset.name} preset's {preset.simulated_devices} simulated CPU devices, which would share "
                  "this host's memory, each with its own copy of every replicated weight (--devices N simulates N)")
    else:
        distributed.initialize()  # on a TPU host, joins its slice (variables or VM metadata); a no-op off a TPU
    cache = args.compilation_cache
    if cache is None and preset.pretrained:  # full-size programs take minutes to compile: keep them
        import os

        from tpupedia.models import checkpoints

        cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(checkpoints.cache_dir() / "jax-compilation-cache")
    if cache and cache != "off":
        import jax

        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    session.quiet(downloads=preset.pretrained)  # a first full-size download shows its progress
    return preset, pipeline, request, options, _plan_choice(args, family, preset)


def _plan_choice(args: argparse.Namespace, family, preset) -> str:
    """The run's `plan` (`tpupedia.pipelines.common.PLAN`): `off` with `--no-plan`; `on` for a
    full-size preset or a checkpoint the user named (of any size, so planned on the tiny preset
    too: a TPU's HBM, or on CPU devices the host's memory); else `off`, the tiny preset's own
    models, seconds and megabytes. The run checks its plan itself before anything loads."""
    if args.no_plan or not (preset.pretrained or _named(args, family)):
        return "off"
    return "on"


def _generate(args: argparse.Namespace) -> int:

    if (args.prompt is None) == (args.prompts is None):
        raise CommandLineError("give either --prompt TEXT (one video) or --prompts FILE --outdir DIR (a batch)")
    if args.prompts is not None and args.outdir is None:
        raise CommandLineError("--prompts FILE needs --outdir DIR for the videos")
    if args.out is not None or args.prompts is not None:  # an mp4 at the end: the encoder now, not after decode
        from tpupedia import video

        video.check_encoder()
    preset, pipeline, request, options, plan = _generate_setup(args)
    if args.prompts is not None:
        pipeline.run_batch(args.prompts, request, options, preset=preset, outdir=args.outdir, model=args.model,
                           force=args.force, plan=plan, vae_tiling=args.vae_tiling,
                           log=(lambda _: None) if args.quiet else print)
        return 0
    pipeline.run(request, options, preset=preset, model=args.model, stage=args.stage,
                 workdir=args.workdir or f"tpupedia-runs/{args.model_family}", out=args.out, force=args.force,
                 command="tpupedia " + shlex.join(args.argv), log=(lambda _: None) if args.quiet else print,
                 plan=plan, vae_tiling=args.vae_tiling)
    return 0


def _bench_generate(args: argparse.Namespace) -> int:
    from tpupedia import bench

    preset, pipeline, request, options, plan = _generate_setup(args)
    record = bench.bench_generate(args.model_family, preset, request, options, model=args.model,
                                  stock={"auto": None, "on": True, "off": False}[args.stock],
                                  command="tpupedia " + shlex.join(args.argv), plan=plan,
                                  vae_tiling=args.vae_tiling)
    path = bench.merge_record(record, args.output, key=bench._pipeline_key)
    m = record["machine"]
    print(f"generate {args.model_family} on {m['device_kind']} x{m['devices']} ({m['cpu_count']} CPUs): "
          f"{record['total_s']:.1f} s in all")
    for stage, t in record["stages"].items():
        steady = f", steady {t['steady_s'] * 1e3:.1f} ms" if "steady_s" in t else ""
        print(f"  {stage:8} first call {t['first_s']:.2f} s{steady}")
    if "stock" in record:
        print(f"  stock diffusers (eager, {record['stock']['torch_threads']} torch threads): "
              f"{record['stock']['total_s']:.1f} s in all, step {record['stock']['steady_s'] * 1e3:.1f} ms; "
              f"compiled step / stock step = {record['ratio_step_over_stock']:.2f}")
    print(f"  written to {path}")
    return 0


def _bench_first_video(args: argparse.Namespace) -> int:
    from tpupedia import bench

    _positive(runs=args.runs)
    record = bench.bench_first_video(args.model_family, prompt=args.prompt, runs=args.runs, again=args.again,
                                     cache=args.cache)
    path = bench.merge_record(record, args.output, key=bench.first_video_key)
    m = record["machine"]
    print(f"first video, {args.model_family} --preset tiny, on {m['cpu']} ({m['cpu_count']} CPUs): `{record['generate']}`")
    for run in record["runs"]:
        stages = ", ".join(f"{name} {t['first_s']:.1f} s" for name, t in run["stages"].items())
        print(f"  cache {run['cache']:5}: {run['total_s']:5.1f} s to exit (load {run['load_before']:.2f} before): "
              f"{run['until_first_call_s']:.1f} s until the first stage's first call; first calls {stages}; "
              f"the stages' loading and files {sum(t['rest_s'] for t in run['stages'].values()):.1f} s; "
              f"mp4 {run['video_s']:.2f} s; exit {run['exit_s']:.2f} s")
    print(f"  written to {path}")
    return 0


def _bench_deepcache(args: argparse.Namespace) -> int:
    from tpupedia.pipelines import deepcache

    if args.steps is None:
        args.steps = 50  # the upstream schedule needs 50 steps
    if args.deepcache is None:
        args.deepcache = str(deepcache.UPSTREAM_DEFAULT)
    return _bench_stepcache(args, "deepcache")


def _bench_quantize(args: argparse.Namespace) -> int:
    from tpupedia import bench

    fmt, args.quantize = args.quantize, None  # the first run keeps the checkpoint's dtype
    preset, pipeline, request, options, plan = _generate_setup(args)
    record = bench.bench_quantize(args.model_family, preset, request, options, model=args.model, fmt=fmt, plan=plan,
                                  vae_tiling=args.vae_tiling)
    path = bench.merge_record(record, args.output, key=bench._pipeline_key)
    r = record["result"]
    bound = r["bound"]
    print(f"{fmt} weights against {record['config']['dtype']}: PSNR {r['psnr_db']:.1f} dB, SSIM {r['ssim']:.4f}, "
          f"largest error {r['max_abs']:.2e}"
          + (f" (the tests' bound: at most {bound['max_abs']}, {bound['psnr_db']:.0f} dB and SSIM {bound['ssim']})"
             if bound else "")
          + f"; denoise {r['plain_s']:.2f} s -> {r['quantized_s']:.2f} s on this machine; merged into {path}")
    return 0


def _bench_stepcache(args: argparse.Namespace, name: str = "stepcache") -> int:
    from tpupedia import bench

    if name == "stepcache" and args.step_cache is None:
        raise CommandLineError(f"bench stepcache {args.model_family}: give --step-cache SPEC "
                               "(e.g. fbcache:0.05, magcache:0.06@cal.json, deepcache:11:45:4)")
    preset, pipeline, request, options, plan = _generate_setup(args)
    record = bench.bench_stepcache(args.model_family, preset, request, options, model=args.model, bench=name,
                                   plan=plan, vae_tiling=args.vae_tiling)
    path = bench.merge_record(record, args.output, key=bench._pipeline_key)
    r = record["result"]
    calibration = f" after a {r['calibration_s']:.1f} s calibration pass" if r["calibration_s"] is not None else ""
    print(f"{record['step_cache']} over {request.steps} steps: {r['full_steps']} full"
          f"{calibration}, denoise {r['plain_s']:.2f} s -> {r['cached_s']:.2f} s ({r['speedup']:.2f}x measured, "
          f"{r['bound']:.2f}x the FLOPs' bound); PSNR {r['psnr_db']:.1f} dB, SSIM {r['ssim']:.4f} against the "
          "uncached video")
    print(f"  written to {path}")
    return 0


def _launch(args: argparse.Namespace) -> int:
    from tpupedia import distributed

    command = args.tpupedia_command[1:] if args.tpupedia_command[:1] == ["--"] else args.tpupedia_command
    return distributed.launch(command, args.local_processes, args.devices_per_process,
                              hub_checkpoint=_launched_hub_checkpoint(command))


def _launched_hub_checkpoint(command: list[str]) -> str | None:
    """The hub checkpoint a launched command would run (`--model`, or the family's environment
    variable, that is no folder here), for `distributed.check_launched`; `None` for none."""
    from tpupedia import distributed, families

    words = distributed.runs_models(command)
    family = command[len(words)] if words is not None and len(command) > len(words) else None
    if family not in families.names("video"):
        return None
    named = families.get(family, "video").facts.named_source(distributed.flag_value(command, "--model"))
    return named if named and not Path(named).expanduser().is_dir() else None


def _distributed_check(_args: argparse.Namespace) -> int:
    from tpupedia import distributed

    print("\n".join(distributed.check()))
    return 0


def _add_generate_arguments(p: argparse.ArgumentParser, spec, *, stages: bool) -> None:
    family = spec.name
    source = p.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=["tiny", "full"], default=None,
                        help=f"tiny: random tiny checkpoint, CPU; full: {spec.full_id} "
                             "(default: $TPUPEDIA_PRESET)")
    source.add_argument("--model", default=None, help=f"a diffusers-format {family} checkpoint directory or hub id")
    p.add_argument("--prompt", default=None if stages else "A panda plays an acoustic guitar in a bamboo forest.")
    p.add_argument("--negative-prompt", default="")
    i2v = _pipeline_module(family).PIPELINE.image_to_video
    if i2v:
        from tpupedia import pictures

        p.add_argument("--image", default=None, metavar="PICTURE",
                       help="image-to-video: the picture the video starts from (PNG, JPEG, WebP; at most "
                            f"{pictures.MAX_SIDE} px a side), with the family's image-to-video checkpoint")
    if stages:
        p.add_argument("--stage", choices=["all", "text", *(["image"] if i2v else []), "denoise", "decode"], default="all")
        p.add_argument("--workdir", default=None, help=f"where stage files live (default tpupedia-runs/{family})")
        p.add_argument("--out", default=None, help="write the video to this .mp4 (needs the decode stage)")
        p.add_argument("--force", action="store_true", help="rerun stages whose files are up to date")
        p.add_argument("--prompts", default=None, help="a batch (a UTF-8 file): one prompt a line, or JSONL with prompt/seed/frames/height/width/image/lora "
                            "(image: a picture, lora: a list of adapters, relative to the JSONL file)")
        p.add_argument("--outdir", default=None, help="with --prompts: where NNNN-slug.mp4, its JSON and index.jsonl go")
        _add_lora_flag(p, family)
        _add_quantize_flag(p, family)
    for flag, kind in (("--frames", int), ("--height", int), ("--width", int), ("--steps", int),
                       ("--guidance", float), ("--seed", int), ("--fps", int)):
        p.add_argument(flag, type=kind, default=None,
                       help=f"default: the checkpoint's where its configs say, else the preset's ({spec.module})")
    p.add_argument("--mesh", default=None, help="dp=N,tp=M (default: dp=2 and tp the rest of the devices)")
    p.add_argument("--sharding", choices=["tp", "fsdp", "replicated"], default="tp")
    p.add_argument("--attention", choices=["auto", "splash", "reference"], default="auto",
                   help="auto: splash on TPU, the reference elsewhere")
    p.add_argument("--block-sizes", default=None, metavar="Q,KV,KV_COMPUTE",
                   help=f"splash block sizes, multiples of 128 (default: tpupedia.models.{family}.SPLASH_BLOCK_SIZES)")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="auto: bfloat16 on the full preset, float32 on the tiny one")
    p.add_argument("--compilation-cache", default=None,
                   help="JAX persistent compilation cache directory, or off (default: on the full preset "
                        "$JAX_COMPILATION_CACHE_DIR if set, else $TPUPEDIA_CACHE/jax-compilation-cache; off on the "
                        "tiny one)")
    p.add_argument("--quiet", action="store_true", help="no progress bar or per-stage lines")
    p.add_argument("--vae-tiling", nargs="?", choices=["auto", "on", "off"], const="on", default="auto",
                   help="decode in overlapping spatial tiles; auto: on a TPU with the full preset, the plan turns it "
                        "on when a frame does not fit one chip, otherwise off")
    p.add_argument("--no-plan", action="store_true",
                   help="skip the plan's checks before loading weights (the full preset or a checkpoint named with "
                        "--model: a TPU's HBM, or this host's memory for CPU devices; cached per shape)")
    p.add_argument("--devices", type=int, default=None,
                   help="simulated CPU devices (the tiny preset: default its 8, or none for a checkpoint named with "
                        "--model, which runs on this machine's devices; simulated devices share the host's memory)")
    _add_family_flags(p, _pipeline_module(family))
    _add_release_flag(p, spec)


def build_parser() -> argparse.ArgumentParser:
    from tpupedia import bench, families, quantize

    parser = argparse.ArgumentParser(
        prog="tpupedia",
        description="gpu-tpu-pedia helpers: check a machine, plan and run TPU video generation.",
    )
    parser.add_argument("--version", action="version", version=f"tpupedia {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("doctor", help="platform, devices, versions, AOT availability, preset")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--topology", default="v6e:2x4", help="TPU slice to try an AOT description of (v6e:2x4)"
    )
    p.set_defaults(func=_doctor)

    d = sub.add_parser("dryrun", help="AOT-compile one full-size step for a TPU slice; per-chip memory, collectives, roofline")
    d.add_argument("model", choices=list(families.names()),
                   help="; ".join(f"{s.name}: {s.title}" for s in families.all_specs()))
    d.add_argument("--topology", default="v6e:2x4", help="TPU slice as libtpu names it (v6e:2x4, v6e:4x4, v5e:2x4, v5p:2x2x2; one chip: v5e:1x1)")
    d.add_argument("--resolution", default=None,
                   help="720p, 480p or WIDTHxHEIGHT (video models; default: the family's, as generate --preset full)")
    d.add_argument("--frames", type=int, default=None, help="4n+1 frames (video models; default: the family's)")
    d.add_argument("--seq", type=int, default=2048, help="sequence length (an llm: " + ", ".join(families.names("llm")) + ")")
    d.add_argument("--sharding", default="tp", help="the model's sharding strategy: " + "; ".join(
                       f"{s.name}: {', '.join(s.strategies)}" for s in families.all_specs() if s.strategies))
    d.add_argument("--attention", default="reference", choices=["reference", "splash"])
    d.add_argument("--block-sizes", default=None, metavar="Q,KV,KV_COMPUTE",
                   help="splash block sizes, multiples of 128 (default: the family's SPLASH_BLOCK_SIZES)")
    d.add_argument("--layers", type=int, default=None, help="compile N layers and scale the weights to full depth")
    d.add_argument("--mesh", default=None, help="dp=N,tp=M over the slice's chips (default dp=2, tp the rest)")
    d.add_argument("--mask", choices=["vector", "matrix"], default="vector",
                   help="text padding as the pipeline's (B, S) vector or the stock processor's (B, 1, S, S) matrix ("
                        + ", ".join(s.name for s in families.all_specs() if "matrix" in s.dryrun_masks) + ")")
    d.add_argument("--measured-step-seconds", type=float, default=None, help="a measured step time, to report MFU")
    d.add_argument("--json", default=None, help="also write the report as JSON to this file")
    d.add_argument("--record", default=None, nargs="?", const="docs/results/dryruns.json",
                   help="merge the report into a results file (default docs/results/dryruns.json)")
    d.set_defaults(func=_dryrun)

    pr = sub.add_parser("predict", help="predict one denoising step's time on a TPU slice (a prediction: the "
                                        "compiler's estimate, attention stood in, plus splash and ICI models)")
    pr.add_argument("model", choices=list(families.names("video")))
    pr.add_argument("--topology", default="v6e:2x4", help="TPU slice as libtpu names it (v6e:2x4, v5e:2x4, ...)")
    pr.add_argument("--resolution", default=None, help="720p, 480p or WIDTHxHEIGHT (default: the family's)")
    pr.add_argument("--frames", type=int, default=None, help="4n+1 frames (default: the family's)")
    pr.add_argument("--sharding", default="tp", help="the sharding table (as dryrun's --sharding)")
    pr.add_argument("--mesh", default=None, help="dp=N,tp=M over the slice's chips (default dp=2, tp the rest)")
    pr.add_argument("--block-sizes", default=None, metavar="Q,KV,KV_COMPUTE",
                    help="splash block sizes the attention model pads to (default: the family's)")
    pr.add_argument("--batch", type=int, choices=[1, 2], default=2,
                    help="the step's batch: 2, the guidance pair; 1, guidance off (a few-step release; --mesh dp=1,tp=N)")
    pr.add_argument("--steps", type=int, default=None, help="steps in a video, for its predicted denoising time")
    pr.add_argument("--record", default=None, nargs="?", const="docs/results/predictions.json",
                    help="merge the prediction into a results file (default docs/results/predictions.json)")
    pr.set_defaults(func=_predict)

    pl = sub.add_parser("plan", help="AOT-compile every program a generate run executes for a TPU slice; "
                                     "per-stage per-chip peak, binding stage; exit 2 if it will not fit")
    plsub = pl.add_subparsers(dest="model_family", required=True)
    for spec in families.video():
        name = spec.name
        q = plsub.add_parser(name, help=f"plan `tpupedia generate {name} --preset full`")
        q.add_argument("--model", default=None,
                       help="the checkpoint whose configs to plan: a hub id or diffusers folder (default: the release "
                            "generate --preset full loads; built in, no download: "
                            + ", ".join(spec.releases) + ")")
        q.add_argument("--topology", default="v6e:2x4", help="TPU slice as libtpu names it (v6e:2x4, v6e:2x2, v6e:4x4, v5e:2x4; one chip: v5e:1x1)")
        q.add_argument("--mesh", default=None, help="dp=N,tp=M (default: dp=2 for the guidance pair, tp the rest)")
        q.add_argument("--resolution", default=None, help="720p, 480p or WIDTHxHEIGHT (default: the family's)")
        q.add_argument("--frames", type=int, default=None)
        q.add_argument("--steps", type=int, default=None)
        q.add_argument("--prompt", default="a video", help="the prompt (ByT5 is planned only for quoted glyph text)")
        q.add_argument("--sharding", choices=["tp", "fsdp", "replicated"], default="tp")
        q.add_argument("--attention", choices=["auto", "splash", "reference"], default="auto",
                       help="auto: splash, as a TPU run picks it")
        q.add_argument("--block-sizes", default=None, metavar="Q,KV,KV_COMPUTE",
                       help=f"splash block sizes, multiples of 128 (default: tpupedia.models.{name}.SPLASH_BLOCK_SIZES)")
        q.add_argument("--vae-tiling", choices=["auto", "on", "off"], default="auto",
                       help="auto: tiled only when the untiled decode does not fit one chip")
        q.add_argument("--layers", type=int, default=None, help="compile N layers per model, add the rest's weights")
        q.add_argument("--batch", action="store_true", help="plan a batch: every stage's models stay resident")
        q.add_argument("--stages", default=None,
                       help="plan only these stages, comma-separated: text, image, denoise, decode "
                            "(default: all the request runs)")
        if _pipeline_module(spec.name).PIPELINE.image_to_video:
            q.add_argument("--image", default=None, metavar="PICTURE",
                           help="plan image-to-video (the release's image-to-video checkpoint; the picture "
                                "is read for its aspect only: a family that sizes the video from the picture plans "
                                "that size)")
        _add_family_flags(q, _pipeline_module(spec.name))
        _add_lora_flag(q, name)
        _add_quantize_flag(q, name)
        _add_release_flag(q, spec)
        q.add_argument("--json", default=None, help="also write the plan as JSON to this file")
        q.add_argument("--search", action="store_true",
                       help="plan every mesh, sharding table and splash block size this slice allows and rank those "
                            "that fit by predicted time (default --layers 1); prints the best's generate command")
        q.add_argument("--cheapest", action="store_true",
                       help="price one video on each single-host v5e and v6e slice at the listed prices (and tpu7x:2x2x1 at "
                            "your --price) and name the cheapest that fits (and meets --deadline); with --search, each "
                            "slice at its best setting")
        q.add_argument("--deadline", type=float, default=None, metavar="SECONDS",
                       help="with --cheapest: the predicted seconds one video may take (compiles not counted)")
        q.add_argument("--videos", type=int, default=1,
                       help="with --cheapest: videos one process makes, sharing its compiles (default 1)")
        q.add_argument("--spot", action="store_true", help="with --cheapest: Spot prices instead of on-demand")
        q.add_argument("--price", action="append", default=[], metavar="CHIP=DOLLARS",
                       help="with --cheapest: your price per chip-hour for CHIP (repeatable); tpu7x has no public list "
                            "price, so its single-host slice is priced only with one")
        q.add_argument("--record", default=None, nargs="?", const="docs/results/plans.json",
                       help="merge the plan into a results file (default docs/results/plans.json)")
        q.set_defaults(func=_plan)

    b = sub.add_parser("bench", help="benchmarks; results go to a JSON file the docs render")
    bsub = b.add_subparsers(dest="bench", required=True)
    ll = bsub.add_parser("llama", help="random Llama forward: torchax jit vs PyTorch eager")
    ll.add_argument("--layers", type=int, default=8)
    ll.add_argument("--hidden", type=int, default=512)
    ll.add_argument("--seq", type=int, default=512)
    ll.add_argument("--batch", type=int, default=4)
    ll.add_argument("--repeat", type=int, default=5)
    ll.add_argument("--output", default="docs/results/benchmarks.json", help="results file to merge into")
    ll.set_defaults(func=_bench_llama)
    dit = bsub.add_parser("dit", help=bench.DIT_HELP)
    dit.add_argument("--layers", type=int, default=2)
    dit.add_argument("--heads", type=int, default=8)
    dit.add_argument("--head-dim", type=int, default=64)
    dit.add_argument("--frames", type=int, default=9)
    dit.add_argument("--height", type=int, default=64)
    dit.add_argument("--width", type=int, default=64)
    dit.add_argument("--text-tokens", type=int, default=32)
    dit.add_argument("--repeat", type=int, default=5)
    dit.add_argument("--no-torch-compile", action="store_true", help="skip torch.compile (it needs a C++ toolchain)")
    dit.add_argument("--output", default="docs/results/benchmarks.json", help="results file to merge into")
    dit.set_defaults(func=_bench_dit)
    g = sub.add_parser("generate", help="text-to-video (or image-to-video) in stages (text, [image,] denoise, decode), with resumable stage files")
    gsub = g.add_subparsers(dest="model_family", required=True)
    for spec in families.video():
        gen = gsub.add_parser(spec.name, help=spec.title)
        _add_generate_arguments(gen, spec, stages=True)
        gen.set_defaults(func=_generate)
    bg = bsub.add_parser("generate", help="the whole text-to-video pipeline, per-stage first-call and steady timings")
    bgsub = bg.add_subparsers(dest="model_family", required=True)
    for spec in families.video():
        bgen = bgsub.add_parser(spec.name, help=f"{spec.name}: text, denoise and decode in a temporary work directory")
        _add_generate_arguments(bgen, spec, stages=False)
        bgen.add_argument("--output", default="docs/results/pipelines.json", help="results file to merge into")
        bgen.add_argument("--stock", choices=["auto", "on", "off"], default="auto",
                          help="also run the stock diffusers pipeline on the host and report the step ratio "
                               "(auto: with the tiny preset, not with full)")
        bgen.set_defaults(func=_bench_generate)
    sc = bsub.add_parser("stepcache", help="a family with and without a step cache: steps, time, the FLOPs' bound, "
                                           "PSNR/SSIM")
    scsub = sc.add_subparsers(dest="model_family", required=True)
    for spec in families.video():
        q = scsub.add_parser(spec.name, help=f"{spec.name} twice from one seed, without and with --step-cache")
        _add_generate_arguments(q, spec, stages=False)
        q.add_argument("--output", default="docs/results/pipelines.json", help="results file to merge into")
        q.set_defaults(func=_bench_stepcache)
    bq = bsub.add_parser("quantize", help="a family with and without --quantize: PSNR/SSIM, the largest error, time")
    bqsub = bq.add_subparsers(dest="model_family", required=True)
    for spec in families.video():
        q = bqsub.add_parser(spec.name, help=f"{spec.name} twice from one seed, in its own dtype and with --quantize")
        _add_generate_arguments(q, spec, stages=False)
        q.add_argument("--quantize", choices=tuple(quantize.FORMATS), default="int8",
                       help="the transformers' weight format of the second run (default int8)")
        q.add_argument("--output", default="docs/results/pipelines.json", help="results file to merge into")
        q.set_defaults(func=_bench_quantize)
    dc = bsub.add_parser("deepcache", help="a family with and without DeepCache: steps, PSNR/SSIM, time")
    dcsub = dc.add_subparsers(dest="model_family", required=True)
    for spec in families.video():  # the families whose requests take a DeepCache schedule
        if any(f.name == "deepcache" for f in _family_fields(_pipeline_module(spec.name))):
            q = dcsub.add_parser(spec.name, help=f"{spec.name} twice from one seed, without and with DeepCache")
            _add_generate_arguments(q, spec, stages=False)
            q.add_argument("--output", default="docs/results/pipelines.json", help="results file to merge into")
            q.set_defaults(func=_bench_deepcache)

    fv = bsub.add_parser("first-video", help="the README's first tiny video as a user runs it (a new process, folder "
                                             "and empty cache): seconds to the mp4, and where they go")
    fv.add_argument("model_family", choices=list(families.names("video")))
    fv.add_argument("--prompt", default=bench.FIRST_VIDEO_PROMPT)
    fv.add_argument("--runs", type=int, default=2, help="runs from an empty cache (default 2; the best is reported)")
    fv.add_argument("--no-again", dest="again", action="store_false",
                    help="skip the second run after each, with the cache the first left (its tiny checkpoint)")
    fv.add_argument("--cache", default=None, metavar="DIR",
                    help="every run with this TPUPEDIA_CACHE instead of a new empty one (a user's later runs)")
    fv.add_argument("--output", default=str(bench.DEFAULT_FIRST_VIDEO_RESULTS), help="results file to merge into")
    fv.set_defaults(func=_bench_first_video)

    la = sub.add_parser("launch", help="run a tpupedia command as N local processes of one multi-controller JAX job")
    la.add_argument("--local-processes", type=int, default=2)
    la.add_argument("--devices-per-process", type=int, default=4, help="simulated CPU devices in each process")
    la.add_argument("tpupedia_command", nargs=argparse.REMAINDER, help=f"-- then the tpupedia command, e.g. -- generate {families.video()[0].name} ...")
    la.set_defaults(func=_launch)
    dch = sub.add_parser("distributed-check", help="join the multi-process job and show what this process sees")
    dch.set_defaults(func=_distributed_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line: `argv`, or the process's own arguments when `None` (the `tpupedia`
    script, `python -m tpupedia.cli`). In that case the process ends when this returns, and the
    garbage collector is frozen first: the interpreter's shutdown otherwise collects again and
    again while it tears down the thousands of modules torch, JAX, transformers and diffusers
    import, which took 1.3 to 2 s of every command's wall time on a 2-core host (after the video
    was written). Frozen objects are still freed by their reference counts; `atexit` handlers run
    as before."""
    if argv is None:
        try:
            return _main(sys.argv[1:])
        finally:
            import gc

            gc.freeze()
    return _main(list(argv))


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    args.argv = argv  # the command line, recorded in stage files and results
    from tpupedia import devices

    devices.quiet_libtpu()  # no libtpu start-up noise on hosts without a TPU
    if args.command in ("bench", "dryrun", "plan"):
        from tpupedia import session

        session.quiet()
    from tpupedia import rehearsal

    try:
        return args.func(args)
    except rehearsal.Rehearsed as done:  # the plan checked for the rehearsal's slice, nothing loaded
        print(f"tpupedia {args.command}: {done}")
        return 0
    except TpupediaError as err:  # bad input or a refused file: one clear line, no traceback
        print(f"tpupedia {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
