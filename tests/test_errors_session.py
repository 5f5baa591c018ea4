import warnings

import pytest

from tpupedia import errors, presets, session


def test_expect_prints_type_and_message_without_paths(capsys):
    def fail():
        raise ValueError("bad value at /opt/venv/lib/python3.11/site-packages/x/y.py:12 (obj 0x7f3a2b1c9d80)\nline 2")

    err = errors.expect(fail, ValueError)
    out = capsys.readouterr().out
    assert isinstance(err, ValueError)
    assert out.strip() == "ValueError: bad value at <path> (obj 0x…)\nline 2"


def test_expect_fails_when_nothing_is_raised():
    with pytest.raises(AssertionError, match="expected"):
        errors.expect(lambda: None, ValueError)


def test_expect_lets_other_errors_through():
    with pytest.raises(KeyError):
        errors.expect(lambda: {}["x"], ValueError)


def test_clean_message_truncates():
    msg = errors.clean_message(RuntimeError("a\nb\nc\nd"), max_lines=2)
    assert msg == "RuntimeError: a\nb\n..."


def test_start_returns_preset_and_silences_known_noise():
    preset = session.start()  # devices were already simulated by conftest: same count is fine
    assert preset == presets.get("tiny")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        session.quiet()
        warnings.warn("Explicitly requested dtype int64 requested in zeros is not available")
        warnings.warn("something new")
    assert [str(w.message) for w in seen] == ["something new"]


def test_the_full_preset_shows_its_downloads_the_tiny_preset_does_not():
    """A first full-size download (30-80 GB) with no progress bar looks hung: `start` keeps the
    Hub's download bars for a preset that downloads; the tiny preset stays quiet (stored outputs)."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    try:
        session.quiet()
        assert are_progress_bars_disabled()
        session.start("full")  # no simulated devices: touches no JAX device
        assert not are_progress_bars_disabled()
        session.start("tiny")
        assert are_progress_bars_disabled()
    finally:
        disable_progress_bars() if was_disabled else enable_progress_bars()
