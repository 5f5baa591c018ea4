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
from tpupedia.models.spec import KINDS, FamilySpec, FewStepRelease

__all__ = ["FamilyError", "FamilySpec", "all_specs", "get", "names", "video", "ReleaseError", "FewStepRelease",
           "few_step", "release_names", "release_checkpoint", "release_adapters"]


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


# --- few-step releases ----------------------------------------------------------------------------

class ReleaseError(TpupediaError, ValueError):
    """A `--release` name the family does not have, or one of another family's (one line naming
    it and what there is), or a release's adapter file that cannot be had."""


def release_names() -> dict[str, tuple[str, ...]]:
    """Every video family's few-step release names (`FamilySpec.few_step`)."""
    return {s.name: tuple(s.few_step) for s in video()}


def few_step(family: str, name: str) -> FewStepRelease:
    """Release `name` of video family `family`. `ReleaseError` for a name it does not have: for
    another family's release, that family and how to run it; otherwise the names there are."""
    spec = get(family, "video")
    if name in spec.few_step:
        return spec.few_step[name]
    mine = ", ".join(spec.few_step) or "none"
    for other in video():
        if name in other.few_step:
            raise ReleaseError(f"--release {name!r} is a release of {other.name} ({other.few_step[name].title}), not of "
                               f"{family}: run it as `{other.name} --release {name}`; {family}'s releases: {mine}")
    raise ReleaseError(f"--release {name!r} is not a release of {family}; its releases: {mine}")


def release_checkpoint(family: str, release: FewStepRelease, pretrained: bool) -> str:
    """What the release loads: its hub id on the full preset (`pretrained`), else the tiny
    checkpoint of its layout the family module builds (`tiny_release_checkpoint`)."""
    if pretrained:
        return release.model
    return str(get(family, "video").facts.tiny_release_checkpoint(release.name))


def release_adapters(family: str, release: FewStepRelease, source: str, pretrained: bool, *,
                     skip: tuple[str, ...] = (), local_only: bool = False) -> tuple:
    """The release's adapters as `tpupedia.lora.Adapter`s, those for the components in `skip` left
    out (the user gave their own with `--lora`). On the full preset (`pretrained`) each file from
    the Hugging Face Hub (`hf_hub_download`: the cache, else a download; `local_only`: the cache
    alone, `None` for a file not there); on the tiny one random adapters of the same key layout
    and rank for checkpoint `source`, built in code (`tiny_release_adapters`). A file that cannot be
    had is `ReleaseError`, one line naming the repository, the file and the command that fetches it."""
    from tpupedia import lora

    wanted = [a for a in release.adapters if a.component not in skip]
    if not wanted:
        return ()
    if not pretrained:
        built = get(family, "video").facts.tiny_release_adapters(release.name, source)
        return tuple(lora.Adapter(str(built[a.component]), a.scale, a.component) for a in wanted)
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    unavailable = (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError)  # no route to the Hub: not cached
    out = []
    for a in wanted:
        try:
            out.append(lora.Adapter(hf_hub_download(a.repo, a.filename, local_files_only=local_only), a.scale, a.component))
        except unavailable as err:  # not cached offline, no route to the Hub, no such file: one line either way
            if local_only:
                out.append(None)
                continue
            why = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise ReleaseError(f"release {release.name}: adapter {a.where} for {a.component} cannot be had ({why}); "
                               f"fetch it with `hf download {a.repo} {a.filename}`, or give a local copy "
                               f"with --lora PATH@{a.component}") from None
    return tuple(out)
