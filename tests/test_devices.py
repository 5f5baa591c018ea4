import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from tpupedia import devices, hardware

# libtpu comes with `make env`; a user without jax[tpu] skips these, CI never does.
requires_libtpu = pytest.mark.skipif(
    not devices.has_libtpu() and not __import__("os").environ.get("CI"),
    reason="libtpu not installed (pip install 'jax[tpu]')",
)


def test_session_has_eight_simulated_cpu_devices():
    assert jax.device_count() == 8 and devices.platform() == "cpu"


def test_simulate_again_with_same_count_is_harmless():
    assert len(devices.simulate_cpu_devices(8)) == 8


def test_simulate_after_initialisation_with_other_count_fails_loudly():
    with pytest.raises(devices.DeviceSetupError, match="already initialised with 8 cpu"):
        devices.simulate_cpu_devices(4)


def test_simulate_rejects_nonpositive():
    with pytest.raises(ValueError, match="n >= 1"):
        devices.simulate_cpu_devices(0)


def test_make_mesh_uses_auto_axes_and_shards():
    mesh = devices.make_mesh((2, 4), ("dp", "tp"))
    assert dict(mesh.shape) == {"dp": 2, "tp": 4}
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    x = jax.device_put(np.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("dp", "tp")))
    assert {s.data.shape for s in x.addressable_shards} == {(4, 2)}


@pytest.mark.parametrize("shape, names", [((3, 4), ("a", "b")), ((16,), ("a",))])
def test_mesh_shape_mismatch_names_shape_and_device_count(shape, names):
    with pytest.raises(devices.MeshShapeError) as err:
        devices.make_mesh(shape, names)
    assert str(shape) in str(err.value) and "8 are available" in str(err.value)


def test_mesh_axis_name_count_mismatch():
    with pytest.raises(devices.MeshShapeError, match="2 axes but 1 names"):
        devices.make_mesh((2, 4), ("dp",))


@requires_libtpu
def test_tpu_topology_describes_a_v6e_8():
    devs = devices.tpu_topology("v6e:2x4")
    assert len(devs) == 8 and {d.platform for d in devs} == {"tpu"}
    assert "v6" in devs[0].device_kind.lower()
    mesh = devices.topology_mesh("v6e:2x4", None, ("x", "y"))
    assert dict(mesh.shape) == {"x": 2, "y": 4}


def test_tpu_topology_without_libtpu_says_how_to_install(monkeypatch):
    monkeypatch.setattr(devices, "has_libtpu", lambda: False)
    with pytest.raises(devices.AOTUnavailableError, match=r"pip install 'jax\[tpu\]"):
        devices.tpu_topology("v6e:2x4")


def test_bad_topology_fails_before_touching_libtpu(monkeypatch):
    monkeypatch.setattr(devices, "has_libtpu", lambda: pytest.fail("libtpu was consulted"))
    with pytest.raises(hardware.HardwareError):
        devices.tpu_topology("v6e-8")


@requires_libtpu
def test_libtpu_prints_nothing_on_a_cpu_host():
    """Without quiet_libtpu, libtpu writes timestamped warnings to stderr on hosts with no TPU."""
    code = textwrap.dedent(
        """
        from tpupedia import devices
        devices.simulate_cpu_devices(2)
        print(len(devices.tpu_topology("v6e:2x4")))
        """
    )
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("TPU_")}
    env.pop("JAX_PLATFORMS", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "8"
    assert out.stderr.strip() == ""


@pytest.mark.parametrize("count, shape", [(8, (2, 4)), (4, (2, 2)), (2, (2, 1)), (1, (1, 1)), (3, (1, 3))])
def test_default_mesh_shape_uses_every_device_present(count, shape):
    """Notebooks build meshes from the devices present, so a GPU machine with 1 or 4 GPUs runs
    the cells a v6e-8 runs; the product is always the device count."""
    assert devices.default_mesh_shape(count) == shape


def test_kernels_are_interpreted_off_tpu():
    assert devices.platform() == "cpu" and devices.interpret_kernels()
