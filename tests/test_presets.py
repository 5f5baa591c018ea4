import pytest

from tpupedia import presets


def test_default_is_tiny(monkeypatch):
    monkeypatch.delenv(presets.ENV_VAR, raising=False)
    assert presets.current().name == "tiny"
    monkeypatch.setenv(presets.ENV_VAR, "")
    assert presets.current().name == "tiny"


def test_full_from_environment(monkeypatch):
    monkeypatch.setenv(presets.ENV_VAR, "FULL")
    p = presets.current()
    assert p.name == "full" and p.pretrained and p.simulated_devices is None


def test_tiny_simulates_eight_devices():
    p = presets.get("tiny")
    assert p.simulated_devices == 8 and not p.pretrained


def test_unknown_preset_names_value_and_choices(monkeypatch):
    monkeypatch.setenv(presets.ENV_VAR, "huge")
    with pytest.raises(presets.PresetError) as err:
        presets.current()
    assert "'huge'" in str(err.value) and "tiny, full" in str(err.value)
    assert isinstance(err.value, ValueError)
