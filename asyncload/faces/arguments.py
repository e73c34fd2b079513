"""The commonest slips in a call to a load face, caught before anything is opened, each
with a message that names the fix: a module passed as the state dict, the two arguments
swapped, :class:`LoadOptions` passed as ``storage_options`` (or a dict as ``options``), a
URL whose scheme asyncload does not read (``s4://``) or that lost a slash (``s3:/bucket``)."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from typing import Any

from asyncload.common.options import LoadOptions

__all__ = [
    "check_checkpoint_url",
    "check_load_arguments",
    "check_source_arguments",
    "readable_schemes",
]

#: The schemes asyncload reads through its own clients (local files, wire) or names first in a
#: message; every other protocol fsspec knows is read through fsspec.
_OWN_SCHEMES = ("file", "s3", "gs", "gcs", "http", "https")
#: ``scheme:`` then one slash (or none) and no second one: ``s3:/bucket/ck``, ``gs:bucket``.
_LOST_SLASH = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):/?(?!/)")


def readable_schemes() -> list[str]:
    """Every URL scheme a checkpoint can have: asyncload's own first, then the other
    protocols fsspec knows (its registry, plugins included), sorted."""
    from fsspec.registry import known_implementations, registry

    others = sorted((set(known_implementations) | set(registry)) - set(_OWN_SCHEMES))
    return [*_OWN_SCHEMES, *others]


def check_checkpoint_url(checkpoint: object, *, name: str = "checkpoint") -> None:
    """Raise ``ValueError`` for a checkpoint URL asyncload cannot read, naming the fix: an
    unknown scheme (the schemes it reads listed, the closest first), a known scheme followed
    by one slash or none (``s3:/bucket``: "did you mean ``s3://bucket``"), unless a local path
    of that name exists. ``TypeError`` for a checkpoint that is neither a ``str`` nor a
    ``PathLike``. Chained fsspec URLs (``simplecache::s3://...``) are left to fsspec."""
    if isinstance(checkpoint, os.PathLike):
        return
    if not isinstance(checkpoint, str):
        raise TypeError(
            f"{name} must be a path or URL (str or os.PathLike), not {type(checkpoint).__name__}"
        )
    if "::" in checkpoint:
        return
    if "://" in checkpoint:
        scheme = checkpoint.split("://", 1)[0].lower()
        if scheme in _OWN_SCHEMES:
            return
        schemes = readable_schemes()
        if scheme in schemes:
            return
        close = difflib.get_close_matches(scheme, schemes, n=3, cutoff=0.5)
        hint = f"did you mean {' or '.join(repr(c + '://') for c in close)}? " if close else ""
        raise ValueError(
            f"{name} {checkpoint!r:.200} has the scheme {scheme!r}, which asyncload does not read: "
            f"{hint}asyncload reads local paths and the schemes "
            f"{', '.join(_OWN_SCHEMES)} (its own clients), and through fsspec "
            f"{', '.join(s for s in schemes if s not in _OWN_SCHEMES)}"
        )
    m = _LOST_SLASH.match(checkpoint)
    if m is None or os.path.exists(checkpoint):
        return
    scheme = m.group(1).lower()
    if scheme not in _OWN_SCHEMES and scheme not in readable_schemes():
        return
    rest = checkpoint[m.end() :]
    # file:/abs/path names the local path /abs/path: file:///abs/path
    fixed = f"{m.group(1)}:///{rest}" if scheme == "file" else f"{m.group(1)}://{rest}"
    raise ValueError(
        f"{name} {checkpoint!r:.200} is neither a local path that exists nor a URL: "
        f"did you mean {fixed!r:.200}? (a URL's scheme is followed by '://')"
    )


def check_load_arguments(
    state_dict: object,
    checkpoint: object,
    options: object,
    storage_options: object,
    *,
    face: str = "asyncload.load",
) -> None:
    """Raise ``TypeError``/``ValueError`` naming the fix for the slips a call to ``face``
    (``asyncload.load``, ``aload``, ``start_load``) makes most often, before anything is
    opened; return quietly for a call that looks right."""
    usage = f"{face}(state_dict, checkpoint, options=..., storage_options=...)"
    if _is_location(state_dict) and not _is_location(checkpoint):
        raise TypeError(
            f"{face} got the checkpoint {state_dict!r:.200} as its first argument and a "
            f"{type(checkpoint).__name__} as its second: the two arguments are swapped; "
            f"call {usage}"
        )
    if _is_module(state_dict):
        raise TypeError(
            f"{face} got a {type(state_dict).__name__} (a torch.nn.Module) as its state dict: "
            "pass `model.state_dict()`, which holds the module's tensors and loads into them "
            "in place"
        )
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"{face} needs a state dict (a dict of tensors such as `model.state_dict()`) as "
            f"its first argument, not a {type(state_dict).__name__}"
        )
    check_source_arguments(checkpoint, options, storage_options, face=face)


def check_source_arguments(
    checkpoint: object, options: object, storage_options: object, *, face: str
) -> None:
    """The checks of :func:`check_load_arguments` that every face taking a checkpoint makes
    (``read_state_dict``, ``iter_tensors``, ``safe_open`` too): the URL, ``LoadOptions`` as
    ``storage_options``, a dict as ``options``."""
    check_checkpoint_url(checkpoint)
    if isinstance(storage_options, LoadOptions):
        raise TypeError(
            f"{face} got a LoadOptions as storage_options: pass it as `options=` "
            "(storage_options is a dict for the storage client: endpoint_url, region, ...)"
        )
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise TypeError(
            "storage_options must be a dict of options for the storage client, not "
            f"{type(storage_options).__name__}"
        )
    if options is not None and not isinstance(options, LoadOptions):
        if isinstance(options, Mapping):
            raise TypeError(
                f"{face} got a {type(options).__name__} as options: options takes a "
                "LoadOptions (`options=asyncload.LoadOptions(...)`); a dict for the storage "
                "client goes to `storage_options=`"
            )
        raise TypeError(f"options must be a LoadOptions, not {type(options).__name__}")


def _is_location(value: object) -> bool:
    return isinstance(value, (str, os.PathLike))


def _is_module(value: Any) -> bool:
    import torch.nn

    return isinstance(value, torch.nn.Module)
