"""A checkpoint's files rewritten under a read: :func:`check_unchanged` (one of the load's
checks, :mod:`.checks`; on its own so that ``asyncload.safe_open`` needs no more than it).
"""

from __future__ import annotations

import asyncio

from asyncload.common.errors import CheckpointChangedError
from asyncload.storage import RetryingStorage

__all__ = ["check_unchanged"]


async def check_unchanged(storage: RetryingStorage, fingerprints: dict[str, object]) -> None:
    """Raise if a file of the checkpoint was rewritten or replaced while this load read
    it (a save in progress into the same directory): the bytes may be torn."""
    names = list(fingerprints)
    now = await asyncio.gather(*(storage.fingerprint(n) for n in names), return_exceptions=True)
    for name, fp in zip(names, now):
        if fp != fingerprints[name]:
            raise CheckpointChangedError(
                f"{storage.url(name)} changed while it was being read: a save is writing into "
                "this checkpoint "
                "(or replaced it); the destination holds a mix, load again once the save has "
                "finished",
                path=storage.url(name),
                seen=repr(fingerprints[name]),
                now=None if isinstance(fp, BaseException) else repr(fp),
            )
