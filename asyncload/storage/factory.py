"""The factory above the stores: :func:`open_storage` picks the store for a checkpoint (a local
path, a ``file://`` URL or any fsspec URL), :func:`is_local` and :func:`local_root` tell a local
checkpoint and its directory.

Local files are always there (:mod:`asyncload.storage.local`); the optional backends are
imported only when a checkpoint needs them, as torchsnapshot's ``storage_plugin.py`` does:
the wire transport (:mod:`asyncload.storage.wire`) for ``s3://``, ``gs://``, ``gcs://`` and
``http(s)://`` (credentials from another host through botocore's chain or google-auth,
:mod:`asyncload.storage.credentials`), fsspec (:mod:`asyncload.storage.fsspec`) where wire
cannot honour an option (said in a log line and ``LoadStats.transport``) and for every other
protocol.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse, urlsplit

from asyncload.common.errors import StorageReadError, redact_text, redact_url
from asyncload.storage.base import Storage
from asyncload.storage.local import LocalStorage

__all__ = ["is_local", "local_root", "open_storage"]

log = logging.getLogger("asyncload.storage")


def is_local(checkpoint: str | os.PathLike[str]) -> bool:
    """Whether ``checkpoint`` is on the local file system: a ``PathLike``, a path, or a
    ``file://`` URL."""
    if isinstance(checkpoint, os.PathLike):
        return True
    s = str(checkpoint)
    return "://" not in s or s.startswith("file://")


def local_root(checkpoint: str | os.PathLike[str]) -> str:
    """The directory of a local ``checkpoint`` (:func:`is_local`): its path, or the path of its
    ``file://`` URL."""
    if isinstance(checkpoint, os.PathLike):
        return os.fspath(checkpoint)
    s = str(checkpoint)
    if s.startswith("file://"):
        return unquote(urlparse(s).path)
    return s


def open_storage(
    checkpoint: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None,
    executor: concurrent.futures.Executor,
    *,
    transport: str = "auto",
    mapped_copies: bool = True,
    max_listing_size: int | None = None,
) -> Storage:
    """A Storage for a local path, ``PathLike``, ``file://`` URL or any fsspec URL.

    ``transport`` (``LoadOptions.transport``) picks the client for ``s3://``, ``gs://``,
    ``gcs://`` and ``http(s)://``: ``"wire"`` (asyncload's own HTTP/1.1 range reader,
    :mod:`asyncload.storage.wire`), ``"fsspec"``, or ``"auto"`` (wire where the URL and
    ``storage_options`` map onto it, else fsspec: the store's ``transport`` says why, as
    ``LoadStats.transport`` and an INFO line of the ``asyncload.storage`` logger do).
    ``"obstore"`` is deprecated (obstore is no longer used): it warns once per call and does
    what ``"auto"`` does. Every other protocol is fsspec's. ``mapped_copies``
    (``LoadOptions.local_mapped_copies``): local files only, see
    :mod:`asyncload.storage.mapped`. ``max_listing_size`` (``LoadOptions.max_metadata_size``):
    the most bytes of a directory listing.

    Raised: :class:`StorageReadError` for ``transport="wire"`` when it cannot honour an
    option (the message names it), and for a ``storage_options`` key no client of an
    ``s3://``, ``gs://`` or ``http(s)://`` store takes (the message names the closest one).
    """
    if transport == "obstore":
        warnings.warn(
            'LoadOptions.transport="obstore" is deprecated: obstore is no longer used, and '
            '"obstore" reads as "auto" does (wire for s3://, gs:// and http(s)://, fsspec '
            'otherwise); pass transport="auto" (or "wire" / "fsspec")',
            DeprecationWarning,
            stacklevel=2,
        )
        transport = "auto"
    if is_local(checkpoint):
        return LocalStorage(
            str(Path(local_root(checkpoint))), executor, mapped_copies=mapped_copies
        )
    s = str(checkpoint)
    protocol = s.split("://", 1)[0]
    options = storage_options or {}
    from asyncload.storage.store_options import unknown_key

    typo = unknown_key(protocol, options)
    if typo is not None:
        raise StorageReadError(f"{redact_url(s)}: {typo}", path=redact_url(s))
    if transport == "fsspec":
        return _fsspec_storage(s, protocol, options, executor, max_listing_size)
    made = _wire_storage(s, protocol, options, executor, max_listing_size)
    if isinstance(made, Storage):
        return made
    if made is not None and transport == "wire":
        raise StorageReadError(
            f"{redact_url(s)} cannot be read with LoadOptions.transport='wire': {made} "
            "(use transport='fsspec', or 'auto' to choose by itself)",
            path=redact_url(s),
        )
    store = _fsspec_storage(s, protocol, options, executor, max_listing_size)
    if made is not None:  # why wire cannot read it: said, never silent
        log.info("reading %s through fsspec, not wire: %s", redact_url(s), made)
        store.transport = f"fsspec (wire cannot honour: {made})"
    return store


def _wire_storage(
    url: str,
    protocol: str,
    options: Mapping[str, Any],
    executor: concurrent.futures.Executor,
    max_listing_size: int | None,
) -> Storage | str | None:
    """The wire transport's store for ``url``; why it cannot serve it (an option or a source
    of credentials it does not handle); or ``None`` for a protocol it is not used for. Its
    HTTP directory listings go through fsspec."""
    from asyncload.storage.store_options import REMOTE_PROTOCOLS, Unmappable

    if protocol.lower() not in REMOTE_PROTOCOLS:
        return None
    from asyncload.storage.wire import WireStorage, plan_wire

    try:
        spec = plan_wire(url, options, executor)
    except Unmappable as exc:
        return redact_text(str(exc))
    lister = _lister(url, options, executor, max_listing_size)
    return WireStorage(url, spec, lister=lister, max_listing_size=max_listing_size)


def _lister(
    url: str,
    options: Mapping[str, Any],
    executor: concurrent.futures.Executor,
    max_listing_size: int | None,
) -> Callable[[], Storage]:
    """What makes the store of an HTTP directory listing (fsspec's), when one is needed."""

    def lister() -> Storage:
        return _fsspec_storage(url, urlsplit(url).scheme, options, executor, max_listing_size)

    return lister


def _fsspec_storage(
    url: str,
    protocol: str,
    options: Mapping[str, Any],
    executor: concurrent.futures.Executor,
    max_listing_size: int | None,
) -> Storage:
    """The fsspec filesystem of ``protocol`` for ``url`` (fsspec imported here, on first use)."""
    from asyncload.storage.fsspec import FsspecStorage

    return FsspecStorage(url, protocol, options, executor, max_listing_size=max_listing_size)
