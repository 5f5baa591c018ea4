"""Chips, devices and hosts kept apart (`tpupedia.hardware.Topology`): a TPU7x chip is two JAX
devices, so a mesh, a sharding and a compile budget count devices while peaks, HBM and prices
count chips, and a VM is not a host count. The slices are libtpu's own descriptions
(`tpupedia.devices.tpu_topology`), compiled for ahead of time."""

from __future__ import annotations

import pytest

from tpupedia import devices, hardware

requires_libtpu = pytest.mark.skipif(not devices.has_libtpu(), reason="needs libtpu (pip install 'jax[tpu]')")


def test_a_tpu7x_slice_has_chips_devices_and_hosts_of_its_own():
    one, two = hardware.parse_topology("tpu7x:2x2x1"), hardware.parse_topology("tpu7x:2x2x2")
    assert (one.num_chips, one.num_devices, one.hosts, one.accelerator_type) == (4, 8, 1, "tpu7x-8")
    assert (two.num_chips, two.num_devices, two.hosts, two.accelerator_type) == (8, 16, 2, "tpu7x-16")
    v6e = hardware.parse_topology("v6e:2x4")
    assert (v6e.num_chips, v6e.num_devices, v6e.hosts, v6e.accelerator_type) == (8, 8, 1, "v6e-8")
    chip = hardware.chip("tpu7x")
    assert chip.devices_per_chip == 2 and chip.device_bf16_flops == chip.bf16_flops / 2 == 2307e12 / 2
    assert chip.fp8_flops == 2 * chip.bf16_flops and chip.hbm_bytes == 192 * 2**30
    assert hardware.chip("v6e").device_bf16_flops == hardware.chip("v6e").bf16_flops  # one device per chip


@pytest.mark.parametrize("name, said", [("v7x:2x2x1", "libtpu names TPU7x (Ironwood) slices tpu7x:AxBxC, as in "
                                                      "tpu7x:2x2x1"),
                                        ("tpu7x:2x4", "a TPU7x slice is a 3D torus, named AxBxC"),
                                        ("v8e:2x2", "CHIP one of v5e, v5p, v6e, tpu7x")])
def test_a_tpu7x_slice_spelled_another_way_is_refused_naming_libtpus_name(name, said):
    with pytest.raises(hardware.HardwareError, match=said.replace("(", r"\(").replace(")", r"\)")):
        hardware.parse_topology(name)


@requires_libtpu
def test_libtpu_lists_two_devices_per_tpu7x_chip_each_with_its_own_budget():
    """The pinned libtpu's `tpu7x:2x2x1`: eight devices, two on each chip's coordinates
    (`core_on_chip` 0 and 1), one host, 94.75 GiB of compile budget per device: half the chip's
    192 GiB, less what the runtime keeps."""
    from tpupedia import aot

    found = devices.tpu_topology("tpu7x:2x2x1")
    assert len(found) == 8 and {d.device_kind for d in found} == {"TPU7x"}
    chips = {tuple(d.coords) for d in found}
    assert len(chips) == 4 and sorted(d.core_on_chip for d in found) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert {d.process_index for d in found} == {0}
    assert aot.hbm_budget(found) == 94.75 * 2**30 < hardware.chip("tpu7x").hbm_bytes / 2
    assert hardware.chip_for_device_kind("TPU7x").name == "tpu7x"


def test_a_step_on_a_tpu7x_device_runs_at_half_a_chips_peak_and_attention_at_the_chips():
    """`predict.Work` is one device's compiled FLOPs and bytes: on TPU7x, at a device's share of
    the chip's peak and bandwidth (each TensorCore does half the chip's work); splash's MXU
    passes, counted over the slice, at the chips' peak: four chips, not eight devices."""
    from tpupedia import predict

    chip = hardware.chip("tpu7x")
    work = predict.Work(flops=1e15, bytes=0.0, ici_bytes=0.0, attention_flops=4e15)
    xla, attention, ici = work.times(chip, 4)
    assert xla == pytest.approx(1e15 / (2307e12 / 2))
    assert attention == pytest.approx(4e15 / (4 * 2307e12)) and ici == 0.0
    v6e = hardware.chip("v6e")
    assert work.times(v6e, 8)[0] == pytest.approx(1e15 / v6e.bf16_flops)  # one device per chip: unchanged


@requires_libtpu
def test_a_plan_on_tpu7x_meshes_its_devices_and_holds_each_against_its_own_budget():
    """`tpupedia plan` for a tpu7x:2x2x1: the mesh spans the eight devices (dp=2, tp=4), each
    program is held against one device's 94.75 GiB, and the summary says chips and devices."""
    from tpupedia import plan, presets
    from tpupedia.models import cogvideox as family
    from tpupedia.pipelines import cogvideox as pipeline

    configs = family.component_configs(str(family.tiny_checkpoint()))
    request = pipeline.Request(prompt="a cat", **family.default_request(presets.get("tiny")))
    found = plan.make("cogvideox", request, pipeline.Options(), configs=configs, topology="tpu7x:2x2x1",
                      stages=("text", "denoise"), dtype="float32")
    assert found.fits and (found.chips, found.devices, found.mesh) == (4, 8, {"dp": 2, "tp": 4})
    assert found.hbm == 94.75 * 2**30 and found.memory == "HBM per device" and found.unit == "device"
    head = found.summary().splitlines()
    assert "on tpu7x:2x2x1 (4 chips, 8 devices), mesh {'dp': 2, 'tp': 4}" in head[0]
    assert head[1] == "  HBM per device: 94.75 GiB"


@requires_libtpu
@pytest.mark.parametrize("name, processes", [("v6e:2x4", 1), ("v5e:2x4", 1), ("v5e:1x1", 1), ("tpu7x:1x1x1", 1),
                                             ("tpu7x:2x2x1", 1), ("v6e:4x4", 4), ("tpu7x:2x2x2", 2)])
def test_a_slice_compiles_on_as_many_hosts_as_it_has_vms(name, processes):
    """A v6e-8 or a v5e-8 is one 8-chip VM: its devices are one process, not libtpu's default two
    hosts of 2x2 chips; a multi-host slice keeps 4 chips per VM (`devices.host_bounds`)."""
    found = devices.tpu_topology(name)
    assert len({d.process_index for d in found}) == processes == hardware.parse_topology(name).hosts


def test_the_slice_picker_sums_up_each_releases_recorded_plans_per_slice(tmp_path, monkeypatch):
    """The free-TPU guide's and the results page's picker (`docs/hooks._slice_picker_table`):
    a stage fits a slice if a recorded plan of it there fits, does not if none does, and a slice
    no plan covered says so."""
    import importlib.util
    from pathlib import Path

    from tpupedia import results

    path = Path(__file__).resolve().parents[1] / "docs" / "hooks.py"
    spec = importlib.util.spec_from_file_location("docs_hooks", path)
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)

    def plan(topology, stages, hbm=10.0):
        return {"family": "wan", "checkpoint": "Wan-AI/X", "topology": topology, "resident": False, "hbm": hbm,
                "request": {"width": 832, "height": 480, "frames": 81, "steps": 50}, "command": f"plan {topology}",
                "stages": [{"stage": s, "peak": p, "predicted_s": 100.0} for s, p in stages]}

    plans = tmp_path / "plans.json"
    results.write_json_atomic(plans, {"records": [plan("v5e:1x1", [("text", 5.0), ("denoise", 12.0)]),
                                                  plan("tpu7x:2x2x1", [("text", 5.0), ("denoise", 6.0)]),
                                                  plan("tpu7x:2x2x1", [("decode", 6.0)]),
                                                  plan("v5e:2x4", [("text", 5.0), ("denoise", 6.0), ("decode", 6.0)])]})
    monkeypatch.setattr(hooks, "_PLANS", plans)
    (row,) = [line for line in hooks._slice_picker_table().splitlines() if "Wan-AI/X" in line]
    cells = [c.strip() for c in row.split("|")[2:-1]]
    # a whole video that fits gets its predicted time (three stages of 100 s) and, with a list price, its cost
    dollars = 300 / 3600 * 8 * hardware.PRICES["v5e"]["on_demand"]
    assert cells == ["text fits; **denoise does not fit**",
                     f"text, denoise, decode fit<br>300 s a video, 50 steps (predicted, ${dollars:.2f} on demand)",
                     "not planned",
                     "text, denoise, decode fit<br>300 s a video, 50 steps (predicted, no list price)", "not planned"]
