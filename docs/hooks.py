"""mkdocs hook: render tables that live in code, so the site never keeps a second copy.

`{{ hardware_table }}` in a page becomes the chip table from `tpupedia.hardware`;
`{{ figure:NAME }}` becomes one named number from its source (`tpupedia.figures`);
`{{ diagram:NAME }}` the picture a notebook draws of one core idea (`tpupedia.diagrams`);
`{{ zh_terms }}` becomes the Chinese edition's glossary from `docs/zh/terms.yml`;
`{{ plans_table }}` every recorded plan, `{{ v5e_plans_table }}` those for v5e slices and one chip,
`{{ slice_picker_table }}` which stages of each release fit each slice a reader can get;
`{{ first_video_table }}` the README's first tiny video per family (`tpupedia bench first-video`);
`{{ quantize_table }}` each family's tiny run quantized against the same run unquantized (`tpupedia bench quantize`).

On notebook pages it also folds the cells a lesson tags (`FOLDED`): an exercise's solution and the
asserts that check a claim stay on the page, executed in CI, behind a summary line a reader opens.
mkdocs-jupyter cannot fold a cell itself; nbconvert marks a tagged cell's `<div>` with a
`celltag_<tag>` class, and `on_page_content` wraps that `<div>` in a `<details>`.
"""

from __future__ import annotations

import re
from pathlib import Path

from tpupedia import diagrams, figures, hardware, results

_RESULTS = Path(__file__).parent / "results" / "benchmarks.json"
_DRYRUNS = Path(__file__).parent / "results" / "dryruns.json"
_UPSTREAM = Path(__file__).parent / "results" / "upstream.json"
_PIPELINES = Path(__file__).parent / "results" / "pipelines.json"
_PLANS = Path(__file__).parent / "results" / "plans.json"
_FIRST_VIDEO = Path(__file__).parent / "results" / "first_video.json"
_ZH_TERMS = Path(__file__).parent / "zh" / "terms.yml"

_COLUMNS = [
    "chip",
    "vendor",
    "HBM (GiB)",
    "devices per chip",
    "bf16 peak (TFLOP/s)",
    "HBM bandwidth (GB/s)",
    "ridge (FLOP/byte)",
    "link (GB/s)",
    "ICI ring, one axis (GB/s)",
    "link type",
    "scoped VMEM (MiB)",
    "MXU",
    "read",
]


def _hardware_table() -> str:
    rows = hardware.table_rows()
    lines = ["| " + " | ".join(_COLUMNS) + " | source |", "|" + "---|" * (len(_COLUMNS) + 1)]
    for r in rows:
        cells = [str(r[c]) for c in _COLUMNS]
        note = f" ({r['note']})" if r["note"] else ""
        lines.append("| " + " | ".join(cells) + f" | [vendor page]({r['source']}){note} |")
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def _bench_table() -> str:
    records = results.load(_RESULTS)
    if not records:
        return "*No benchmark has been recorded yet.*"
    lines = [
        "| bench | config | measured on | PyTorch eager | torch.compile | torchax jit, first call | torchax jit, steady | jit / eager | MFU (jit) | max abs diff | date | command |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        c, m = r["config"], r["machine"]
        config = ", ".join(f"{k} {v}" for k, v in c.items())
        where = f"{m['device_kind']} ({m['platform']}, {m['cpu_count']} CPUs), torch {m['versions']['torch']}, jax {m['versions']['jax']}"
        compiled = r.get("torch_compile")
        compiled = _ms(compiled["steady_s"]) if isinstance(compiled, dict) else ("not run" if not compiled else "failed")
        mfu = r.get("mfu_torchax_jit")
        mfu = f"{mfu:.1%}" if mfu is not None else "peak unknown"
        lines.append(
            f"| {r['bench']} | {config} | {where} | {_ms(r['torch_eager']['steady_s'])} | {compiled} | "
            f"{r['torchax_jit']['first_s']:.2f} s | {_ms(r['torchax_jit']['steady_s'])} | "
            f"{r['ratio_jit_over_eager']:.2f} | {mfu} | {r['max_abs_diff']:.1e} | {r['measured_at']} | `{r['command']}` |"
        )
    return "\n".join(lines)


def _pipeline_table() -> str:
    records = [r for r in results.load(_PIPELINES) if "stages" in r and "--mesh" not in r["command"]]
    if not records:
        return "*No pipeline run has been recorded yet.*"
    lines = ["| pipeline | request | measured on | text (first / steady) | denoise (first call / steady per step) | "
             "stock diffusers step (eager) | step / stock | decode | whole run (stock: the call, models loaded) | date | command |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        c, m, st = r["config"], r["machine"], r["stages"]
        request = (f"{c['frames']} frames, {c['width']}x{c['height']}, {c['steps']} steps, {c['dtype']}, "
                   f"{c['attention']} attention, {c['vae']} VAE, {c['source']}")
        where = f"{m['devices']} x {m['device_kind']} ({m['platform']}, {m['cpu_count']} CPUs), jax {m['versions']['jax']}"
        stock = r.get("stock")
        versus = (f"{_ms(stock['steady_s'])} | {r['ratio_step_over_stock']:.2f}" if stock else "not run | ")
        whole = f"{r['total_s']:.1f} s" + (f" ({stock['total_s']:.1f} s)" if stock else "")
        lines.append(
            f"| {r['bench']} | {request} | {where} | {st['text']['first_s']:.2f} s / {_ms(st['text']['steady_s'])} | "
            f"{st['denoise']['first_s']:.2f} s / {_ms(st['denoise']['steady_s'])} | {versus} | "
            f"{st['decode']['first_s']:.2f} s | {whole} | {r['measured_at']} | `{r['command']}` |")
    return "\n".join(lines)


def _first_video_table() -> str:
    """Time to the README's first tiny video per family (`tpupedia bench first-video FAMILY`): the
    best first run from an empty cache, split into its parts, and the best second run."""
    records = results.load(_FIRST_VIDEO)
    if not records:
        return "*No first video has been timed yet.*"
    lines = ["| family | first run, empty cache | again, cache kept | until the first stage's first call "
             "(start, imports, set-up, checkpoint, loading) | first calls: text / denoise / decode | "
             "the stages' other loading and files | mp4, exit | measured on | date | command |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: r["config"]["family"]):
        m = r["machine"]
        empty = [run for run in r["runs"] if run["cache"] == "empty"]
        kept = [run for run in r["runs"] if run["cache"] == "kept"]
        best = min(empty, key=lambda run: run["total_s"])
        others = ", ".join(f"{run['total_s']:.1f}" for run in empty if run is not best)
        first = f"**{best['total_s']:.1f} s**" + (f" (other runs: {others} s)" if others else "")
        again = ", ".join(f"{run['total_s']:.1f} s" for run in kept) or "-"
        calls = " / ".join(f"{t['first_s']:.1f} s" for t in best["stages"].values())
        rest = sum(t["rest_s"] for t in best["stages"].values())
        loads = sorted(run["load_before"] for run in r["runs"])
        where = (f"{m['cpu']} ({m['cpu_count']} cores), {m['devices']} simulated devices; load average "
                 f"{loads[0]:.1f} to {loads[-1]:.1f} before the runs")
        lines.append(f"| {r['config']['family']} | {first} | {again} | {best['until_first_call_s']:.1f} s | {calls} | "
                     f"{rest:.1f} s | {best['video_s']:.2f} s, {best['exit_s']:.2f} s | {where} | {r['measured_at']} | "
                     f"`{r['command']}` |")
    return "\n".join(lines)


def _mesh_table() -> str:
    """The steady denoising step of each family's tiny-preset records, one column per simulated
    device count and mesh (`tpupedia bench generate FAMILY --devices N [--mesh ...]`)."""
    records = [r for r in results.load(_PIPELINES) if "stages" in r and r["config"]["source"] == "preset:tiny"
               and "mesh" in r["config"]]
    if not records:
        return "*No mesh comparison has been recorded yet.*"
    column = lambda r: (r["machine"]["devices"], r["config"]["mesh"])  # noqa: E731
    columns = sorted({column(r) for r in records}, key=lambda c: (c[0], c[1]))
    rows: dict[str, dict] = {}
    for r in records:
        rows.setdefault(r["bench"].removeprefix("generate-"), {})[column(r)] = r["stages"]["denoise"]["steady_s"]
    where = {f"{r['machine']['device_kind']} ({r['machine']['cpu_count']} CPUs), {r['config']['steps']} steps, "
             f"{r['measured_at']}" for r in records}
    lines = ["| family | " + " | ".join(f"{n} device{'s' * (n > 1)}, {mesh}" for n, mesh in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for family, steps in sorted(rows.items()):
        lines.append(f"| {family} | " + " | ".join(_ms(steps[c]) if c in steps else "-" for c in columns) + " |")
    return "\n".join(lines) + "\n\nMeasured on " + "; ".join(sorted(where)) + "."


def _plans_table(chip: str = "") -> str:
    """Every recorded plan, or only those for one chip generation (`chip="v5e"`)."""
    records = [r for r in (results.load(_PLANS) if _PLANS.exists() else [])
               if not chip or r["topology"].split(":")[0] == chip]
    if not records:
        return "*No plan has been recorded yet.*"
    gib = 2**30
    lines = ["| model | request | slice, mesh | depth compiled | text | image | denoise | decode | binding | verdict | "
             "libtpu, date | command |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        q = r["request"]
        peaks = {s["stage"]: ("does not compile" if s["peak"] is None else f"{s['peak'] / gib:.2f} GiB")
                 for s in r["stages"]}
        if "decode" in peaks:
            peaks["decode"] += f" ({'tiled' if r['vae_tiling'] else 'untiled'})"
        mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items())
        if r.get("attention"):
            mesh += f", {r['attention']} attention"
        depth = "full" if r["layers"] is None else f"{r['layers']} layer(s), the rest's weights added"
        verdict = "fits" if r["fits"] else f"does not fit: {r['advice']}"
        kind = " image-to-video" if q.get("image") else ""
        checkpoint = f"<br>`{r['checkpoint']}`" if r.get("checkpoint") else ""
        lines.append(f"| {r['family']}{kind}{' (batch)' if r['resident'] else ''}{checkpoint} | {q['width']}x{q['height']}, "
                     f"{q['frames']} frames, {q['steps']} steps | {r['topology']} ({r['chips']} chips), {mesh} | {depth} | "
                     + " | ".join(peaks.get(s, "not planned" if s != "image" or kind else "—")
                                  for s in ("text", "image", "denoise", "decode"))
                     + f" | {r['binding']} | {verdict} | {r['libtpu']}, {r['compiled_at']} | `{r['command']}` |")
    return "\n".join(lines)


PICKER_SLICES = (("v5e:1x1", "one v5e chip (Colab's v5e-1)"), ("v5e:2x4", "v5e-8 (Kaggle)"),
                 ("v6e:2x4", "v6e-8"), ("tpu7x:2x2x1", "tpu7x-8 (4 chips)"), ("tpu7x:2x2x2", "tpu7x-16 (8 chips)"))
"""The slices a reader can get, cheapest first: the columns of `{{ slice_picker_table }}`."""


def _slice_picker_table() -> str:
    """One row per release and video size, one column per slice (`PICKER_SLICES`): which recorded stages fit
    there (a stage fits if any recorded plan of it on that slice fits, with the plan's settings
    in its command), which do not, and which no plan has covered yet; where every stage of a video
    fits, its predicted time (`tpupedia.plan.recorded_run`) and, where the chip has a list price
    (`hardware.PRICES`), what that time costs on demand."""
    from tpupedia import plan

    records = results.load(_PLANS) if _PLANS.exists() else []
    if not records:
        return "*No plan has been recorded yet.*"
    found: dict[tuple, dict[str, dict[str, list[bool]]]] = {}
    steps: dict[tuple, int] = {}
    for r in records:
        if r["resident"]:
            continue
        q = r["request"]
        row = (r.get("checkpoint") or r["family"], q["width"], q["height"], q["frames"], bool(q.get("image")),
               q.get("quantize") or "")
        cell = found.setdefault(row, {}).setdefault(r["topology"], {})
        for stage in r["stages"]:
            cell.setdefault(stage["stage"], []).append(stage["peak"] is not None and stage["peak"] <= r["hbm"])
            if stage["stage"] == "denoise":
                steps.setdefault(row, q["steps"])
    lines = ["| release | " + " | ".join(label for _, label in PICKER_SLICES) + " |",
             "|---|" + "---|" * len(PICKER_SLICES)]
    for row in sorted(found):
        checkpoint, width, height, frames, image, quantized = row
        cells = []
        for topology, _ in PICKER_SLICES:
            stages = found[row].get(topology)
            if not stages:
                cells.append("not planned")
                continue
            fit = [s for s in ("text", "image", "denoise", "decode") if s in stages and any(stages[s])]
            over = [s for s in ("text", "image", "denoise", "decode") if s in stages and not any(stages[s])]
            verb = lambda stages, one, many: ", ".join(stages) + (one if len(stages) == 1 else many)  # noqa: E731
            text = "; ".join(part for part in (verb(fit, " fits", " fit") if fit else "",
                                               "**" + verb(over, " does not fit", " do not fit") + "**" if over else "")
                             if part)
            run = (plan.recorded_run(records, checkpoint, topology, width, height, frames, steps[row], image=image,
                                     quantize=quantized or None) if row in steps else None)
            if run is not None:
                topo = hardware.parse_topology(topology)
                price = hardware.PRICES.get(topo.chip.name)
                cost = (f", ${run['seconds'] / 3600 * topo.num_chips * price['on_demand']:.2f} on demand" if price
                        else ", no list price")
                text += f"<br>{run['seconds']:.0f} s a video, {steps[row]} steps (predicted{cost})"
            cells.append(text)
        weights = f", {quantized} weights (`--quantize {quantized}`)" if quantized else ""
        lines.append(f"| `{checkpoint}`<br>{width}x{height}, {frames} frames{weights} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _stepcache_table() -> str:
    records = [r for r in results.load(_PIPELINES) if r["bench"] in ("deepcache", "stepcache")]
    if not records:
        return "*No step-cache comparison has been recorded yet.*"
    lines = ["| family, request | cache | full steps | denoise without / with | speed-up measured | FLOPs' bound | "
             "PSNR | SSIM | measured on | date | command |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        c, m, x = r["config"], r["machine"], r["result"]
        request = f"{c['family']}, {c['frames']} frames, {c['width']}x{c['height']}, {c['dtype']}, {c['source']}"
        cache = f"deepcache:{c['deepcache']}" if c.get("deepcache") else c["step_cache"]
        where = f"{m['devices']} x {m['device_kind']} ({m['platform']}, {m['cpu_count']} CPUs)"
        bound = f"{x['bound']:.2f}x" if x.get("bound") else "-"
        calibration = f" (+{x['calibration_s']:.1f} s calibration)" if x.get("calibration_s") else ""
        lines.append(f"| {request} | {cache} | {x['full_steps']} of {x['steps']} | {x['plain_s']:.2f} s / "
                     f"{x['cached_s']:.2f} s{calibration} | {x['speedup']:.2f}x | {bound} | {x['psnr_db']:.1f} dB | "
                     f"{x['ssim']:.4f} | {where} | {r['measured_at']} | `{r['command']}` |")
    return "\n".join(lines)


def _quantize_table() -> str:
    records = [r for r in results.load(_PIPELINES) if r["bench"] == "quantize"]
    if not records:
        return "*No quantized run has been recorded yet.*"
    lines = ["| family, request | weights | PSNR | SSIM | largest error | the tests' bound | denoise without / with | "
             "measured on | date | command |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(records, key=lambda r: (r["config"]["family"], r["quantize"])):
        c, m, x = r["config"], r["machine"], r["result"]
        request = f"{c['family']}, {c['frames']} frames, {c['width']}x{c['height']}, {c['dtype']}, {c['source']}"
        where = f"{m['devices']} x {m['device_kind']} ({m['platform']}, {m['cpu_count']} CPUs)"
        b = x.get("bound")
        bound = f"≤ {b['max_abs']:g}, ≥ {b['psnr_db']:.0f} dB, ≥ {b['ssim']:g}" if b else "none (real weights)"
        lines.append(f"| {request} | {r['quantize']} | {x['psnr_db']:.1f} dB | {x['ssim']:.4f} | {x['max_abs']:.2e} | "
                     f"{bound} | {x['plain_s']:.2f} s / {x['quantized_s']:.2f} s | {where} | {r['measured_at']} | "
                     f"`{r['command']}` |")
    return "\n".join(lines)


def _step_flops(model: str, width: int, height: int, frames: int) -> float:
    from tpupedia import families

    return families.get(model, "video").facts.step_flops(width, height, frames)["total"]


def _upstream() -> list[dict]:
    import json

    return json.loads(_UPSTREAM.read_text())["records"] if _UPSTREAM.exists() else []


def _results_table() -> str:
    g = 2**30
    lines = [
        "| model | resolution | frames | steps | hardware | first run | steady state | memory per chip | MFU | provenance |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in _upstream():
        chip = hardware.chip(r["chip"])
        flops = _step_flops(r["model"], r["width"], r["height"], r["frames"])
        mfu = flops / (r["step_s"] * r["chips"] * chip.bf16_flops)
        lines.append(
            f"| {r['name']} | {r['width']}x{r['height']} | {r['frames']} | {r['steps']} | {r['chips']} x {chip.name} ({r['mesh']}) | "
            f"{r['first_run'] or '—'} | {r['step_s']:.2f} s/step | {r['memory'] or '—'} | {mfu:.0%} | reported upstream: {r['source']} |"
        )
    for r in (results.load(_DRYRUNS) if _DRYRUNS.exists() else []):
        size = f"{r['width']}x{r['height']}" if r["width"] else f"{r['tokens']} tokens"
        if r["fits"]:
            memory = f"fits: {r['arguments_bytes'] / g:.2f} GiB args + {r['temporaries_bytes'] / g:.2f} GiB temp of {r['hbm_bytes'] / g:.2f}"
        else:
            memory = f"**does not fit**: {r['oom_required_bytes'] / g:.2f} GiB temp of {r['oom_available_bytes'] / g:.2f}"
        depth = "all" if r["layers_compiled"] == r["layers_full"] else f"{r['layers_compiled']} of {r['layers_full']}"
        lines.append(
            f"| {r['model']}, {r['attention']} attention, {r['sharding']} | {size} | {r['frames'] or '—'} | 1 | "
            f"{r['topology']} ({r['num_chips']} x {r['chip']}), mesh {r['mesh']} | — | ≥ {r['roofline_seconds']:.2f} s/step "
            f"(roofline{', ' + r['bound'] + '-bound' if r.get('bound') else ''}) | "
            f"{memory} | — | AOT here (libtpu {r['libtpu']}, {depth} layers): `{r['command']}` |"
        )
    for r in results.load(_RESULTS):
        c, m = r["config"], r["machine"]
        size = f"{c['width']}x{c['height']}" if "width" in c else f"seq {c['seq']} x batch {c['batch']}"
        mfu = r.get("mfu_torchax_jit")
        lines.append(
            f"| {r['bench']} ({c['layers']} layers), torchax jit | {size} | {c.get('frames', '—')} | 1 | "
            f"{m['device_kind']} ({m['cpu_count']} CPUs) | {r['torchax_jit']['first_s']:.2f} s | "
            f"{_ms(r['torchax_jit']['steady_s'])} per step | — | {f'{mfu:.1%}' if mfu is not None else 'peak unknown'} | "
            f"measured here: `{r['command']}` |"
        )
    return "\n".join(lines)


def _results_chart() -> str:

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _upstream()
    if not rows:
        return ""
    names = [f"{r['name']}\n{r['chips']} x {r['chip']}" for r in rows]
    reported = [r["step_s"] for r in rows]
    floors = [_step_flops(r["model"], r["width"], r["height"], r["frames"]) / (r["chips"] * hardware.chip(r["chip"]).bf16_flops)
              for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(rows) + 1.2))
    y = range(len(rows))
    ax.barh([i + 0.2 for i in y], reported, height=0.4, label="reported upstream (s/step)", color="#3f51b5")
    ax.barh([i - 0.2 for i in y], floors, height=0.4, label="roofline floor at bf16 peak (computed here)", color="#ff9800")
    return _bar_chart_svg(fig, ax, names, "seconds per denoising step (CFG batch of 2)", fontsize=7, below=-0.25)


def _bar_chart_svg(fig, ax, names, xlabel: str, *, fontsize: int, below: float) -> str:
    """A horizontal bar chart's labels, legend and grid, then the figure as inline SVG."""
    import io

    import matplotlib.pyplot as plt

    ax.set_yticks(list(range(len(names))), names, fontsize=fontsize)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.legend(fontsize=fontsize + 1, loc="upper center", bbox_to_anchor=(0.5, below), ncol=2, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    plt.close(fig)
    svg = buf.getvalue()
    return svg[svg.index("<svg"):]


_PREDICTIONS = Path(__file__).parent / "results" / "predictions.json"


def _predictions() -> list[dict]:
    return sorted(results.load(_PREDICTIONS) if _PREDICTIONS.exists() else [],
                  key=lambda r: (r["model"], -r["width"] * r["height"]))


def _predictions_table() -> str:
    """`tpupedia predict` records (`docs/results/predictions.json`): each predicted step, its three
    parts, and the step time reported upstream for the same run."""
    rows = _predictions()
    if not rows:
        return ""
    lines = ["| run | slice, mesh, table | predicted s/step | of it: XLA + splash + ICI | predicted denoising per video "
             "| reported upstream s/step | predicted vs reported |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        mesh = ", ".join(f"{k}={v}" for k, v in r["mesh"].items())
        reported = f"{r['reported_step_s']:.2f}" if r.get("reported_step_s") else "none"
        error = f"{r['error']:+.0%}" if r.get("error") is not None else "-"
        video = f"{r['video_s']:.0f} s ({r['steps']} steps)" if r.get("video_s") else "-"
        guidance = ", guidance off" if r.get("batch") == 1 else ""
        lines.append(f"| {r['model']} {r['width']}x{r['height']}, {r['frames']} frames{guidance} | {r['topology']}, "
                     f"{mesh}, `{r['sharding']}` | **{r['step_s']:.2f}** (predicted) | {r['xla_s']:.2f} + "
                     f"{r['attention_s']:.2f} + {r['ici_s']:.2f} | {video} | {reported} | {error} |")
    return "\n".join(lines)


def _plan_predictions_table() -> str:
    """The stages of recorded plans (`docs/results/plans.json`) that carry a predicted time
    (`tpupedia plan` on a slice: `Plan.predicted_s`), each beside what upstream reported for the
    same stage, slice and mesh where it did (`Plan.reported`)."""
    records = [r for r in (results.load(_PLANS) if _PLANS.exists() else [])
               if any(s.get("predicted_s") is not None for s in r["stages"])]
    if not records:
        return "*No plan with predicted times has been recorded yet.*"

    def against(predicted, found):
        if not found:
            return "none", "-"
        return f"{found['seconds']:.2f} s", f"{predicted / found['seconds'] - 1:+.0%}"

    lines = ["| run | slice, mesh | stage | predicted per video | reported upstream | predicted vs reported "
             "| predicted compile (this host) | reported compile | predicted vs reported |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        q = r["request"]
        mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items())
        for s in r["stages"]:
            if s.get("predicted_s") is None:
                continue
            run, run_err = against(s["predicted_s"], s.get("reported"))
            comp, comp_err = against(s["predicted_compile_s"], s.get("reported_compile"))
            lines.append(f"| {r['family']} {q['width']}x{q['height']}, {q['frames']} frames, {q['steps']} steps "
                         f"| {r['topology']}, {mesh} | {s['stage']} | **{s['predicted_s']:.2f} s** (predicted) | {run} "
                         f"| {run_err} | {s['predicted_compile_s']:.0f} s (predicted) | {comp} | {comp_err} |")
    return "\n".join(lines)


def _elsewhere_table() -> str:
    """Whole runs other implementations report (each family module's `REPORTED_ELSEWHERE`), each
    beside this course's predicted run of the same video on the same slice, summed from its
    recorded stage plans (`tpupedia.plan.recorded_run`)."""
    from tpupedia import families, plan

    records = results.load(_PLANS) if _PLANS.exists() else []
    lines = ["| run | slice | reported, and by whom | their mesh | this course's mesh | predicted text + denoise + "
             "decode | predicted run | predicted vs reported |", "|---|---|---|---|---|---|---|---|"]
    for spec in families.video():
        for x in getattr(spec.facts, "REPORTED_ELSEWHERE", ()):
            width, height = map(int, x["resolution"].split("x"))
            run = plan.recorded_run(records, x["model"], x["topology"], width, height, x["frames"], x["steps"])
            topo = hardware.parse_topology(x["topology"])
            where = f"{x['topology']} ({x['accelerator']}: {topo.num_chips} chips, {topo.num_devices} devices)"
            head = (f"| `{x['model']}` {width}x{height}, {x['frames']} frames, {x['steps']} steps | {where} "
                    f"| {x['seconds']:.1f} s, {x['project']} | `{x['mesh']}` ")
            if run is None:
                lines.append(head + "| not planned | - | - | - |")
                continue
            mesh = next(",".join(f"{k}={v}" for k, v in r["mesh"].items()) for r in records
                        if r["command"] == run["commands"][0])
            parts = " + ".join(f"{run['stages'][s]:.2f}" for s in ("text", "denoise", "decode"))
            lines.append(head + f"| {mesh} | {parts} s | **{run['seconds']:.1f} s** (predicted) "
                         f"| {run['seconds'] / x['seconds'] - 1:+.0%} |")
    return "\n".join(lines)


def _predictions_chart() -> str:

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in _predictions() if r.get("reported_step_s")]
    if not rows:
        return ""
    names = [f"{r['model']} {r['width']}x{r['height']}, {r['frames']}f" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(rows) + 1.3))
    y = range(len(rows))
    parts = (("xla_s", "predicted: XLA, the compiler's counts", "#8c9eff"),
             ("attention_s", "predicted: splash, the kernel model", "#3f51b5"),
             ("ici_s", "predicted: collectives at ring bandwidth", "#1a237e"))
    left = [0.0] * len(rows)
    for key, label, color in parts:
        values = [r[key] for r in rows]
        ax.barh([i - 0.2 for i in y], values, left=left, height=0.4, label=label, color=color)
        left = [a + b for a, b in zip(left, values)]
    ax.barh([i + 0.2 for i in y], [r["reported_step_s"] for r in rows], height=0.4, color="#ff9800",
            label="reported upstream (TPU v6e-8)")
    for i, r in enumerate(rows):
        ax.text(max(r["step_s"], r["reported_step_s"]) * 1.02, i, f"{r['error']:+.0%}", va="center", fontsize=8)
    ax.set_xlim(0, 1.12 * max(max(r["step_s"], r["reported_step_s"]) for r in rows))
    return _bar_chart_svg(fig, ax, names, "seconds per denoising step", fontsize=7, below=-0.22)


def _families_table() -> str:
    """Every registered family (`tpupedia.families`): what it is, where it lives, how it shards."""
    from tpupedia import families

    lines = ["| name | kind | what it is | module | full preset | sharding strategies | attention mask |",
             "|---|---|---|---|---|---|---|"]
    for s in families.all_specs():
        lines.append(f"| `{s.name}` | {s.kind} | {s.title} | `{s.module}` | {f'`{s.full_id}`' if s.full_id else '-'} | "
                     f"{', '.join(f'`{x}`' for x in s.strategies) or '-'} | {s.mask} |")
    return "\n".join(lines)


def _zh_terms() -> str:
    """The Chinese edition's glossary (`docs/zh/terms.yml`), one row per English term."""
    import yaml

    keep = {"always": "始终", "first": "首次", "never": "不保留"}
    lines = ["| English | 中文 | 保留英文 | 不要用 | 说明 |", "|---|---|---|---|---|"]
    for term in sorted(yaml.safe_load(_ZH_TERMS.read_text(encoding="utf-8")), key=lambda t: t["en"].lower()):
        lines.append(f"| {term['en']} | {term['zh']} | {keep[term['keep']]} | {'、'.join(term.get('avoid', [])) or '—'} | "
                     f"{term.get('note', '')} |")
    return "\n".join(lines)


def on_page_markdown(markdown, page, config, files):  # noqa: ARG001 - mkdocs hook signature
    tables = {"families_table": _families_table, "hardware_table": _hardware_table, "bench_table": _bench_table,
              "results_table": _results_table, "stepcache_table": _stepcache_table,
              "quantize_table": _quantize_table,
              "pipeline_table": _pipeline_table, "mesh_table": _mesh_table, "plans_table": _plans_table,
              "first_video_table": _first_video_table,
              "v5e_plans_table": lambda: _plans_table("v5e"), "slice_picker_table": _slice_picker_table,
              "results_chart": _results_chart, "zh_terms": _zh_terms,
              "predictions_table": _predictions_table, "predictions_chart": _predictions_chart,
              "plan_predictions_table": _plan_predictions_table, "elsewhere_table": _elsewhere_table}
    for name, render in tables.items():
        if "{{ " + name + " }}" in markdown:
            markdown = markdown.replace("{{ " + name + " }}", render())
    root = Path(__file__).resolve().parents[1]
    return diagrams.render(figures.render(markdown, root), root)


FOLDED = {"solution": "Solution (run it, then compare with your answer)", "check": "Check: the asserts behind this claim"}
"""Cell tags folded on notebook pages, with the summary line shown in their place."""
_CELL = re.compile(r'<div class="jp-Cell [^"]*\bcelltag_(' + "|".join(FOLDED) + r')\b[^"]*"[^>]*>')
_DIV = re.compile(r"<div\b|</div>")


def fold_tagged_cells(html: str) -> str:
    """Wrap every cell `<div>` whose class names a `FOLDED` tag in a closed `<details>` whose
    class is the tag. A cell's `<div>` nests others, so its end is found by counting them."""
    out, at = [], 0
    for start in _CELL.finditer(html):
        if start.start() < at:  # inside a cell already folded (cells do not nest; defensive)
            continue
        depth, end = 0, None
        for tag in _DIV.finditer(html, start.start()):
            depth += 1 if tag.group(0) == "<div" else -1
            if depth == 0:
                end = tag.end()
                break
        if end is None:
            raise ValueError(f"docs/hooks.py: a {start.group(1)} cell's <div> is never closed")
        kind = start.group(1)
        out += [html[at:start.start()], f'<details class="{kind}"><summary>{FOLDED[kind]}</summary>',
                html[start.start():end], "</details>"]
        at = end
    return "".join(out) + html[at:]


_XMODE = re.compile(
    r'<div class="jp-OutputArea-child">\s*<div class="jp-OutputPrompt jp-OutputArea-prompt">[^<]*</div>\s*'
    r'<div class="jp-RenderedText jp-OutputArea-output" data-mime-type="text/plain"[^>]*>\s*'
    r"<pre>Exception reporting mode: Minimal\n?</pre>\s*</div>\s*</div>\s*")
_EMPTY_OUTPUTS = re.compile(
    r'<div class="jp-Cell-outputWrapper">\s*<div class="jp-Collapser jp-OutputCollapser jp-Cell-outputCollapser">\s*'
    r'</div>\s*<div class="jp-OutputArea jp-Cell-outputArea">\s*</div>\s*</div>\s*')


def drop_xmode_output(html: str) -> str:
    """A notebook page without the "Exception reporting mode: Minimal" that each notebook's first
    cell prints (`%xmode Minimal`, which keeps a lesson's expected errors short): the output
    removed, and the cell's output area with it when nothing else is in it. A stream that printed
    more keeps the rest."""
    html = _XMODE.sub("", html)
    html = _EMPTY_OUTPUTS.sub("", html)
    return html.replace("<pre>Exception reporting mode: Minimal\n", "<pre>")


_HEADING = re.compile(r'<h([1-6]) id="([^"]+)"[^>]*>(.*?)</h\1>', re.S)
_RENDERED_DIV = re.compile(r'<div class="([^"]*\bjp-Rendered(?:Markdown|HTML|Text|Image|SVG|Latex)\b[^"]*)"')


def notebook_toc_tokens(html: str) -> list[dict]:
    """The table of contents of a rendered notebook, read from its markdown cells' headings as
    rendered: each heading's own id, and its text with inline code kept. (mkdocs-jupyter builds
    the TOC from a markdown copy of the notebook with every code span deleted, so a heading
    "A mesh and a `NamedSharding`" lost its code, and its link an id the page does not have.)
    Markdown that a cell *outputs* is not a section of the lesson, as in mkdocs-jupyter's TOC."""
    import bisect
    import html as html_lib

    from markdown.extensions.toc import nest_toc_tokens

    owners = [(m.start(), m.group(1)) for m in _RENDERED_DIV.finditer(html)]
    starts = [at for at, _ in owners]
    flat = []
    for m in _HEADING.finditer(html):
        k = bisect.bisect_left(starts, m.start()) - 1  # the rendered <div> the heading is in
        if k < 0 or "jp-RenderedMarkdown" not in owners[k][1] or "jp-OutputArea-output" in owners[k][1]:
            continue
        inner = re.sub(r'<a class="anchor-link"[^>]*>.*?</a>', "", m.group(3), flags=re.S)
        text = html_lib.unescape(re.sub(r"<[^>]+>", "", inner)).strip()
        flat.append({"level": int(m.group(1)), "id": m.group(2), "name": html_lib.escape(text, quote=False),
                     "html": inner.strip(), "data-toc-label": "", "children": []})
    return nest_toc_tokens(flat)


def on_page_content(html, page, config, files):  # noqa: ARG001 - mkdocs hook signature
    if not page.file.src_uri.endswith(".ipynb"):
        return html
    from mkdocs.structure.toc import get_toc

    html = drop_xmode_output(fold_tagged_cells(html))
    page.toc = get_toc(notebook_toc_tokens(html))
    return html


# --- the left navigation: a page listed in both editions' trees opens its own language's ---------

def _page_link(page):
    """A nav entry that links to `page` without being it: what the other edition's tree lists
    (its title stays the page's own, which mkdocs-jupyter sets from the notebook's first heading)."""
    from mkdocs.structure.nav import Link

    class PageLink(Link):
        title = property(lambda self: self.page.title, lambda self, value: None)

    link = PageLink(page.title, page.url)
    link.page = page
    return link


def own_language_nav(nav) -> None:
    """Every page listed in more than one place of the nav (the notebooks, the results and the
    reference pages sit in the English tree and in the 中文 section) stays a page in the tree of
    its own language, English unless its source is under `zh/`, and becomes a plain link in the
    others. mkdocs hands one `Page` to every place that lists it, and the last place listed wins
    its parent: every English notebook page opened the 中文 section and marked itself active
    there. Previous/next links follow the same order: a page's neighbours in its own tree."""
    from mkdocs.structure.nav import Section, _get_by_type
    from mkdocs.structure.pages import Page

    places: dict[int, list] = {}

    def walk(items, parent, zh):
        for i, item in enumerate(items):
            if parent is None:  # a top-level entry: the 中文 section is the one holding the zh/ pages
                zh = isinstance(item, Section) and any(
                    p.file.src_uri.startswith("zh/") for p in _get_by_type(item.children, Page))
            if isinstance(item, Page):
                places.setdefault(id(item), []).append((item, items, i, parent, zh))
            elif isinstance(item, Section):
                walk(item.children, item, zh)

    walk(nav.items, None, False)
    for found in places.values():
        if len(found) < 2:
            continue
        page = found[0][0]
        zh_page = page.file.src_uri.startswith("zh/")
        home = next((f for f in found if f[4] == zh_page), found[0])
        for _, items, i, parent, _zh in found:
            if not (items is home[1] and i == home[2]):
                items[i] = _page_link(page)
                items[i].parent = parent
        page.parent = home[3]
    nav.pages = _get_by_type(nav.items, Page)
    for i, page in enumerate(nav.pages):
        page.previous_page = nav.pages[i - 1] if i else None
        page.next_page = nav.pages[i + 1] if i + 1 < len(nav.pages) else None


def on_nav(nav, config, files):  # noqa: ARG001 - mkdocs hook signature
    own_language_nav(nav)
    return nav
