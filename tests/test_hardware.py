import pytest

from tpupedia import devices, hardware


def test_v6e_facts():
    """https://cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, 32 GiB (the page: "32 GB"), 1638 GBps HBM, 800 GBps ICI."""
    v6e = hardware.chip("V6E")
    assert v6e.hbm_bytes == 32 * 2**30 and v6e.bf16_flops == 918e12 and v6e.hbm_bytes_per_s == 1638e9
    assert v6e.ridge_flops_per_byte == pytest.approx(560.44, abs=0.01)  # 918e12 / 1638e9
    assert round(v6e.ridge_flops_per_byte) == 560


def test_v6e_ici_per_port_and_per_ring_by_hand():
    """800 GB/s bidirectional over 4 ports: 100 GB/s per port per direction; a ring along one
    torus axis sends through that axis's 2 ports, one direction each: 200 GB/s out of a chip."""
    v6e = hardware.chip("v6e")
    assert v6e.link_bytes_per_s == 800e9 and v6e.ici_ports == 4
    assert v6e.ici_port_bytes_per_s == 800e9 / 4 / 2 == 100e9
    assert v6e.ring_bytes_per_s == 2 * 100e9 == 200e9
    assert v6e.ring_bytes_per_s == v6e.link_bytes_per_s / 4  # a quarter of the headline figure


@pytest.mark.parametrize("name, ports, per_port", [("v5e", 4, 50e9), ("v5p", 6, 100e9), ("v6e", 4, 100e9)])
def test_every_tpu_has_ports_and_a_one_axis_ring_figure(name, ports, per_port):
    c = hardware.chip(name)
    assert (c.ici_ports, c.ici_port_bytes_per_s, c.ring_bytes_per_s) == (ports, per_port, 2 * per_port)
    if name != "v5e":  # v5e's table row keeps the older, unlabelled 1,600 Gbps; the ports use 400 GB/s bidirectional
        assert c.ici_port_bytes_per_s * 2 * c.ici_ports == c.link_bytes_per_s


def test_gpus_have_no_ici_ring():
    for name in ("H100", "H200", "B200"):
        c = hardware.chip(name)
        assert c.ici_ports is None and c.ici_port_bytes_per_s is None and c.ring_bytes_per_s is None


def test_every_chip_has_a_source_and_positive_figures():
    assert set(hardware.CHIPS) == {"v5e", "v5p", "v6e", "tpu7x", "H100", "H200", "B200"}
    for c in hardware.CHIPS.values():
        assert c.source.startswith("https://")
        assert min(c.hbm_bytes, c.bf16_flops, c.hbm_bytes_per_s, c.link_bytes_per_s) > 0


def test_roofline_picks_the_slower_bound():
    h100 = hardware.chip("h100")
    # 1 TFLOP of math, 1 MB of traffic: compute-bound
    assert h100.seconds_for(1e12, 1e6) == pytest.approx(1e12 / 989e12)
    # 1 GFLOP of math, 3.35 TB of traffic: memory-bound, exactly one second at 3.35 TB/s
    assert h100.seconds_for(1e9, 3.35e12) == pytest.approx(1.0)


def test_unknown_chip_lists_known_ones():
    with pytest.raises(hardware.HardwareError, match="unknown chip 'v7x'.*v5e, v5p, v6e"):
        hardware.chip("v7x")


@pytest.mark.parametrize(
    "name, chips, accel, hosts",
    [("v6e:2x4", 8, "v6e-8", 1), ("v6e:4x4", 16, "v6e-16", 4), ("v5e:2x2", 4, "v5e-4", 1),
     ("v5p:2x2x2", 8, "v5p-16", 2), ("v6e:16x16", 256, "v6e-256", 64)],
)
def test_parse_topology(name, chips, accel, hosts):
    t = hardware.parse_topology(name)
    assert (t.num_chips, t.accelerator_type, t.hosts) == (chips, accel, hosts)


@pytest.mark.parametrize("bad", ["v6e-8", "v6e:2", "tpu:2x4", "v6e:0x4", "v6e:2x4x1x1"])
def test_bad_topology_names(bad):
    with pytest.raises(hardware.HardwareError, match=repr(bad)):
        hardware.parse_topology(bad)


def test_table_rows_are_in_human_units():
    row = next(r for r in hardware.table_rows() if r["chip"] == "v6e")
    assert row["HBM (GiB)"] == 32 and row["devices per chip"] == 1 and row["scoped VMEM (MiB)"] == 32 and row["bf16 peak (TFLOP/s)"] == 918 and row["ridge (FLOP/byte)"] == 560
    assert row["HBM bandwidth (GB/s)"] == 1638 and row["link (GB/s)"] == 800 and row["ICI ring, one axis (GB/s)"] == 200
    assert next(r for r in hardware.table_rows() if r["chip"] == "H100")["ICI ring, one axis (GB/s)"] == "—"


@pytest.mark.skipif(not devices.has_libtpu(), reason="needs libtpu (pip install 'jax[tpu]')")
@pytest.mark.parametrize("topology, chip", [("v5e:1x1", "v5e"), ("v6e:1x1", "v6e"), ("tpu7x:1x1x1", "tpu7x")])
def test_a_tpu_chips_hbm_is_in_gib_as_its_compile_budget_shows(topology, chip):
    """The budget libtpu gives one program (per device) is more than the decimal reading of the
    page's figure could hold (15.75 GiB on a v5e against 16 x 10^9 bytes = 14.9 GiB) and less than
    the GiB reading, the unit Google's TPU7x table now states."""
    from tpupedia import aot

    c = hardware.chip(chip)
    budget = aot.hbm_budget(devices.tpu_topology(topology)) * c.devices_per_chip
    assert c.hbm_bytes / 2**30 * 1e9 < budget < c.hbm_bytes
