"""The family registry: every model family the package knows, found, not listed.

A family module (`tpupedia.models.<module>`) that exports `SPEC`, a `tpupedia.models.spec.
FamilySpec`, is a family; this module imports the model modules once and collects their specs.
The command line builds its subcommands and flags from it, the dry-run and the plan look families
up in it, the docs render their tables from it and the tests parametrize over it, so none of them
names a family, and adding one is its model module, its pipeline module
(`tpupedia.pipelines.<name>`, by convention), a scheduler step if it is new, its tests and its
notebook (tests/test_families.py checks that nothing else names it).

    >>> from tpupedia import families
    >>> [s.name for s in families.video()]
    ['cogvideox', 'hunyuan']

Introduced with the family registry (issue 20); notebook `plan_without_tpu` plans a run from it.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from tpupedia.errors import TpupediaError
from tpupedia.models.spec import KINDS, FamilySpec

__all__ = ["FamilyError", "FamilySpec", "all_specs", "get", "names", "video"]


class FamilyError(TpupediaError, ValueError):
    """A family name the registry does not have (the message lists those it has)."""


@functools.cache
def all_specs() -> tuple[FamilySpec, ...]:
    """Every registered spec, video families first, each kind in name order."""
    import tpupedia.models as models

    specs = []
    for info in pkgutil.iter_modules(models.__path__):
        module = importlib.import_module(f"{models.__name__}.{info.name}")
        spec = getattr(module, "SPEC", None)
        if isinstance(spec, FamilySpec):
            specs.append(spec)
    seen: dict[str, str] = {}
    for s in specs:
        if s.name in seen:
            raise FamilyError(f"family {s.name!r} is registered twice: {seen[s.name]} and {s.module}")
        seen[s.name] = s.module
    return tuple(sorted(specs, key=lambda s: (KINDS.index(s.kind), s.name)))


def names(kind: str | None = None) -> tuple[str, ...]:
    """The registered names (of one `kind`: `"video"`, `"llm"`, `"vae"`)."""
    return tuple(s.name for s in all_specs() if kind is None or s.kind == kind)


def video() -> tuple[FamilySpec, ...]:
    """The text-to-video families: those with a staged pipeline."""
    return tuple(s for s in all_specs() if s.kind == "video")


def get(name: str, kind: str | None = None) -> FamilySpec:
    """The spec registered as `name` (of `kind`, if given); `FamilyError` names what exists."""
    for s in all_specs():
        if s.name == name and (kind is None or s.kind == kind):
            return s
    allowed = names(kind)
    what = f"{kind} family" if kind else "family"
    raise FamilyError(f"{what} {name!r} is not one of {', '.join(allowed)}")
