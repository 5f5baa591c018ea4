import json

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
