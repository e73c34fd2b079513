"""The storage wing: where a load's bytes come from, and its one error boundary.

Layers, each importing only those below it:

- the interface (:mod:`~asyncload.storage.base`): :class:`Storage`, the version pins of a
  remote object (:class:`VersionPins`) and the raw errors a store raises;
- the stores beside each other, each importing only the interface: local files
  (:mod:`~asyncload.storage.local`, with :mod:`~asyncload.storage.mapped`), any fsspec
  filesystem (:mod:`~asyncload.storage.fsspec`) and asyncload's own HTTP/1.1 range reader
  (:mod:`~asyncload.storage.wire`, over :mod:`~asyncload.storage.wire_http`, signing with
  :mod:`~asyncload.storage.sigv4`, its ``storage_options`` mapped by
  :mod:`~asyncload.storage.store_options`);
- the error boundary (:mod:`~asyncload.storage.retrying`: timeout, retries, hedging), whose
  errors are classified and translated in one place (:mod:`~asyncload.storage.classify`);
- the factory (:mod:`~asyncload.storage.factory`): :func:`open_storage` picks the store for a
  checkpoint.

The names below are the wing's interface: other wings and the tests import them from here.
The optional backends' names (fsspec's and wire's) are imported on first use, so
``import asyncload.storage`` imports neither fsspec nor aiohttp. ``ObstoreStorage`` is gone
with obstore (``transport="obstore"`` reads as ``"auto"`` does): asking for it raises an
``AttributeError`` that says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncload.common.lazy import lazy_names
from asyncload.storage.base import (
    CrossOriginRedirectError,
    ListingTooLargeError,
    NotRegularFileError,
    ObjectChangedError,
    RangeIgnoredError,
    RangeMismatchError,
    ShortReadError,
    Storage,
    VersionPins,
    first_byte,
)
from asyncload.storage.classify import HINTS, Failure, classify, translate
from asyncload.storage.factory import is_local, local_root, open_storage
from asyncload.storage.local import INLINE_READ, LocalStorage
from asyncload.storage.retrying import BATCH_INLINE, RetryingStorage, call_with_retry

if TYPE_CHECKING:
    from asyncload.storage.base import Listed
    from asyncload.storage.fsspec import FsspecStorage, close_async_fs
    from asyncload.storage.in_flight import InFlight, InFlightRequest
    from asyncload.storage.mapped import mapped_copies_available
    from asyncload.storage.store_options import StoreSpec, Unmappable, plan_store
    from asyncload.storage.wire import WireStorage

__all__ = [
    "BATCH_INLINE",
    "HINTS",
    "INLINE_READ",
    "CrossOriginRedirectError",
    "Failure",
    "FsspecStorage",
    "InFlight",
    "InFlightRequest",
    "Listed",
    "ListingTooLargeError",
    "LocalStorage",
    "NotRegularFileError",
    "ObjectChangedError",
    "RangeIgnoredError",
    "RangeMismatchError",
    "RetryingStorage",
    "ShortReadError",
    "Storage",
    "StoreSpec",
    "Unmappable",
    "VersionPins",
    "WireStorage",
    "call_with_retry",
    "classify",
    "close_async_fs",
    "first_byte",
    "is_local",
    "local_root",
    "mapped_copies_available",
    "open_storage",
    "plan_store",
    "translate",
]

#: The optional backends' names and their modules, imported on first use (``__getattr__``).
_LAZY = {
    "InFlight": "asyncload.storage.in_flight",
    "InFlightRequest": "asyncload.storage.in_flight",
    "Listed": "asyncload.storage.base",
    "mapped_copies_available": "asyncload.storage.mapped",
    "FsspecStorage": "asyncload.storage.fsspec",
    "close_async_fs": "asyncload.storage.fsspec",
    "StoreSpec": "asyncload.storage.store_options",
    "Unmappable": "asyncload.storage.store_options",
    "plan_store": "asyncload.storage.store_options",
    "WireStorage": "asyncload.storage.wire",
}


def _removed(name: str) -> Any:
    """A name the wing no longer has, with where its job went (else ``NotImplemented``)."""
    if name == "ObstoreStorage":
        raise AttributeError(
            "asyncload.storage.ObstoreStorage was removed with obstore: s3://, gs:// and "
            "http(s):// are read by WireStorage (LoadOptions.transport='wire' or 'auto'), every "
            "other protocol by FsspecStorage"
        )
    return NotImplemented


#: An optional backend's name, its module imported on first use (PEP 562).
__getattr__, __dir__ = lazy_names(__name__, globals(), _LAZY, __all__, fallback=_removed)
del lazy_names  # (not a name of the package)
