import numpy as np
import pytest
import torch

from tpupedia import compat


def test_torchax_imports_on_this_torch_and_matches_torch():
    torchax = compat.import_torchax()
    assert compat.import_torchax() is torchax  # second call is a no-op
    a = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    b = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    expected = torch.nn.functional.gelu(a @ b)
    env = torchax.default_env()
    with env:
        out = torch.nn.functional.gelu(a.to("jax") @ b.to("jax"))
        assert type(out).__module__.startswith("torchax")
        got = out.to("cpu")
    np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=1e-5)


def test_shim_records_only_named_tensor_overloads():
    compat.import_torchax()
    missing = compat.missing_overloads()
    if torch.__version__ >= "2.13":
        assert missing, "torch >= 2.13 removed named-tensor overloads; the shim should have seen them"
    assert all("dimname" in m.lower() or "names" in m.lower() for m in missing)


def test_shim_does_not_hide_other_missing_overloads(monkeypatch):
    monkeypatch.setattr(compat, "_MISSING", [])
    with compat._tolerate_missing_named_overloads():
        with pytest.raises(AttributeError):
            torch.ops.aten.add.no_such_overload  # noqa: B018
        placeholder = torch.ops.aten.prod.some_Dimname_variant
    assert "removed overload" in repr(placeholder)
    assert compat.missing_overloads() == ["aten::prod.some_Dimname_variant"]
    with pytest.raises(AttributeError):  # the patch is gone after the block
        torch.ops.aten.prod.some_Dimname_variant  # noqa: B018
