import json
import os

import pytest

from tpupedia import bench, cli, results


def test_time_call_separates_first_call():
    calls = []
    t = bench.time_call(lambda: calls.append(1), repeat=3)
    assert len(calls) == 4 and t.repeats == 3 and len(t.samples_s) == 3
    assert t.steady_s == sorted(t.samples_s)[1]


def _record(device="cpu", layers=1, ratio=0.5):
    return {"bench": "llama", "config": {"layers": layers}, "machine": {"device_kind": device, "cpu_count": 2},
            "ratio_jit_over_eager": ratio}


def test_merge_record_replaces_same_bench_config_and_machine(tmp_path):
    path = tmp_path / "r.json"
    bench.merge_record(_record(ratio=0.5), path)
    bench.merge_record(_record(layers=2), path)
    bench.merge_record(_record(ratio=0.7), path)  # same key as the first: replaces it
    records = results.load(path)
    assert len(records) == 2
    assert [r["ratio_jit_over_eager"] for r in records if r["config"]["layers"] == 1] == [0.7]
    assert not list(tmp_path.glob(".*.tmp"))


def test_load_results_rejects_foreign_files(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="not a tpupedia results file"):
        results.load(path)
    assert results.load(tmp_path / "missing.json") == []


def test_bench_llama_small_record_is_complete_and_exact():
    r = bench.bench_llama(layers=1, hidden=64, seq=16, batch=1, repeat=2)
    assert r["max_abs_diff"] < 1e-5
    assert r["ratio_jit_over_eager"] == pytest.approx(r["torchax_jit"]["steady_s"] / r["torch_eager"]["steady_s"])
    assert r["machine"]["platform"] == "cpu" and r["machine"]["versions"]["torchax"]
    assert r["command"].startswith("tpupedia bench llama --layers 1 --hidden 64")


@pytest.mark.parametrize("args, message", [
    (["--hidden", "100"], "--hidden must be a multiple of 64"),
    (["--layers", "0"], "--layers must be a positive integer, got 0"),
])
def test_cli_bench_rejects_bad_sizes_before_building(args, message, tmp_path, capsys):
    assert cli.main(["bench", "llama", *args, "--output", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tpupedia bench: ") and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r.json").exists()


def test_bench_dit_builds_the_family_transformer_and_agrees_with_eager():
    """`bench dit` takes its transformer and inputs from the registry's family (`bench_step`):
    the jitted step equals PyTorch eager and the FLOPs are the family's count."""
    from tpupedia import bench
    from tpupedia.models import cogvideox

    record = bench.bench_dit(layers=1, heads=2, head_dim=16, frames=9, height=32, width=32, text_tokens=8, repeat=2,
                             torch_compile=False)
    assert record["bench"] == "dit" and record["max_abs_diff"] < 1e-4
    assert record["approx_matmul_flops"] == cogvideox.step_flops(32, 32, 9, layers=1, heads=2, head_dim=16,
                                                                 text_tokens=8)["total"]


def test_bench_first_video_writes_a_record_whose_parts_add_up(tmp_path, monkeypatch, capsys):
    """`tpupedia bench first-video FAMILY` runs the README's generate command as a new process in
    a new folder and records the wall time to its exit with the parts it can see. Structure only:
    no speed is asserted (the numbers are a benchmark's, on the results page). To stay short, the
    command here keeps this session's caches (`--cache`: the tiny checkpoint; and JAX's
    compilation cache, which a user's first run has not, so `FIRST_RUN_UNSET` keeps it here)."""
    from tpupedia import families, files

    family = families.names("video")[0]
    monkeypatch.setattr(bench, "FIRST_RUN_UNSET", ("TPUPEDIA_",))
    out = tmp_path / "first_video.json"
    assert cli.main(["bench", "first-video", family, "--runs", "1", "--no-again", "--cache", str(files.cache_dir()),
                     "--output", str(out)]) == 0
    assert f"written to {out}" in capsys.readouterr().out
    [record] = results.load(out)
    assert record["bench"] == "first-video" and record["config"] == {"family": family, "preset": "tiny",
                                                                      "prompt": bench.FIRST_VIDEO_PROMPT}
    m = record["machine"]
    assert m["cpu"] and m["cpu_count"] == os.cpu_count() and (m["platform"], m["devices"]) == ("cpu", 8)
    assert record["generate"] == f"tpupedia generate {family} --preset tiny --prompt 'a panda playing a guitar' --out x.mp4"
    assert record["command"] == f"tpupedia bench first-video {family} --runs 1 --no-again --cache DIR"
    [run] = record["runs"]
    assert run["cache"] == "given" and record["best"] == {"given": run["total_s"]}
    assert list(run["stages"]) == ["text", "denoise", "decode"]  # in the order they ran
    assert all(t["first_s"] > 0 and t["rest_s"] >= 0 for t in run["stages"].values())
    parts = [run["until_first_call_s"], *(t["first_s"] + t["rest_s"] for t in run["stages"].values()),
             run["video_s"], run["exit_s"]]
    assert all(p > 0 for p in parts) and run["total_s"] == pytest.approx(sum(parts))
    bench.merge_record(record, out, key=bench.first_video_key)  # the same family on the same CPU: replaced
    assert len(results.load(out)) == 1


def test_bench_first_video_refuses_no_runs_in_one_line(tmp_path, capsys):
    assert cli.main(["bench", "first-video", "cogvideox", "--runs", "0", "--output", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "tpupedia bench: --runs must be a positive integer, got 0"
    assert not (tmp_path / "r.json").exists()


def test_the_command_line_freezes_the_collector_only_as_the_process_ends(monkeypatch):
    """Run as the `tpupedia` script (no `argv`), `main` freezes the garbage collector on its way
    out, so the interpreter's shutdown does not collect over every module the stack imported;
    called with `argv` (a test, a notebook) it leaves the collector alone."""
    import gc
    import sys

    if gc.get_freeze_count():
        pytest.skip("something in this process froze the collector already")
    assert cli.main(["bench", "first-video", "cogvideox", "--runs", "0"]) == 2 and gc.get_freeze_count() == 0
    monkeypatch.setattr(sys, "argv", ["tpupedia", "--version"])
    try:
        with pytest.raises(SystemExit):
            cli.main()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
