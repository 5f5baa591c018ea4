import json

from test_devices import requires_libtpu

from tpupedia import cli, devices, doctor, results


def _checks(report):
    return {c.name: c for c in report.checks}


def test_doctor_reports_everything_on_this_machine():
    checks = _checks(doctor.run())
    for name in ("python", "preset", "torch", "jax", "jaxlib", "torchax", "flax", "transformers",
                 "diffusers", "libtpu", "platform", "devices", "torchax import", "TPU AOT compile"):
        assert name in checks, name
    assert checks["platform"].value == "cpu"
    assert checks["devices"].value == "8 x cpu"  # the test session simulates 8 devices
    assert checks["preset"].ok and checks["preset"].value.startswith("tiny")


@requires_libtpu
def test_doctor_sees_aot_for_v6e():
    c = _checks(doctor.run())["TPU AOT compile"]
    assert c.ok and "v6e:2x4: 8 x TPU v6" in c.value


def test_doctor_without_libtpu_says_unavailable_and_how_to_get_it(monkeypatch):
    monkeypatch.setattr(devices, "has_libtpu", lambda: False)
    c = _checks(doctor.run())["TPU AOT compile"]
    assert not c.ok and "unavailable" in c.value and "jax[tpu]" in c.hint


def test_doctor_survives_missing_packages(monkeypatch):
    real = results.version
    monkeypatch.setattr(results, "version", lambda d: None if d in ("flax", "torchax") else real(d))
    checks = _checks(doctor.run())
    assert not checks["flax"].ok and checks["flax"].value == "not installed"
    assert "pip install 'flax" in checks["flax"].hint
    assert "torchax import" not in checks  # not attempted without torchax


def test_doctor_bad_preset_is_reported_not_raised(monkeypatch):
    monkeypatch.setenv("TPUPEDIA_PRESET", "huge")
    c = _checks(doctor.run())["preset"]
    assert not c.ok and "'huge'" in c.value and "tiny, full" in c.value


def test_cli_doctor_json_and_exit_code(capsys, monkeypatch):
    assert cli.main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["jax"]["ok"] and data["jax"]["value"]
    monkeypatch.setenv("TPUPEDIA_PRESET", "huge")
    assert cli.main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "-- preset" in out and "-> unset TPUPEDIA_PRESET" in out


def test_doctor_checks_the_video_encoder(monkeypatch):
    import importlib.util

    assert _checks(doctor.run())["video encoder"].ok  # the video extra is installed here
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "imageio_ffmpeg" else real(name, *a))
    c = _checks(doctor.run())["video encoder"]
    assert not c.ok and "imageio-ffmpeg" in c.value and "pip install imageio-ffmpeg" in c.hint


def test_doctor_checks_free_disk_against_what_a_full_size_video_writes(monkeypatch):
    import shutil

    from tpupedia import families, presets, video

    full = [spec.facts.default_request(presets.get("full")) for spec in families.video()]
    need = max(video.output_bytes(r["frames"], r["height"], r["width"]) for r in full)
    assert need >= max(r["frames"] * r["height"] * r["width"] * 3 * 4 for r in full)  # the float32 decode file
    usage = shutil.disk_usage(".")
    monkeypatch.setattr(shutil, "disk_usage", lambda folder: usage._replace(free=need + 1))
    assert _checks(doctor.run())["disk space"].ok
    monkeypatch.setattr(shutil, "disk_usage", lambda folder: usage._replace(free=need - 1))
    c = _checks(doctor.run())["disk space"]
    assert not c.ok and f"writes up to {need / 2**30:.1f} GiB" in c.value and "--workdir" in c.hint


def test_doctor_shows_the_hub_caches_free_space(tmp_path, monkeypatch):
    """A row for the disk a full-size checkpoint downloads to (`HF_HUB_CACHE`, made by the first
    download: its nearest existing folder is measured), which every full-size run checks a
    checkpoint's files against before downloading."""
    import collections

    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "not" / "made"))
    seen = []
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr("shutil.disk_usage", lambda folder: seen.append(str(folder)) or usage(0, 0, 3 * 2**30))
    c = _checks(doctor.run())["Hub cache"]
    assert c.ok and "3.0 GiB free for " + str(tmp_path / "not" / "made") in c.value and str(tmp_path) in seen
