"""The nouns of a load: where a saved tensor's bytes are (:class:`TensorLocation`), a run
of bytes and where it goes (:class:`Piece`), one read request (:class:`Chunk`).

Formats answer with a ``TensorLocation``; planning (:mod:`asyncload.engine.plan`) turns locations
and destinations into pieces and groups pieces into chunks; the reader pool
(:mod:`asyncload.engine.pipeline`) reads chunks; assembly (:mod:`asyncload.engine.assembly`) hands
each piece its bytes. Byte ranges are half-open ``[start, end)`` of a file named relative to the
checkpoint root.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncload.formats import TensorLocation

__all__ = ["Chunk", "Piece", "TensorLocation"]


@dataclass
class Piece:
    """Bytes ``[start, end)`` of file ``name`` and where they go: straight into ``into``
    (the destination's own memory) or through ``deliver`` (called on an assembly thread
    with exactly those bytes); neither: read only to be checksummed, or a probe."""

    name: str
    start: int
    end: int
    into: memoryview | None = None
    deliver: Callable[[memoryview], None] | None = None
    #: Keeps destination tensors alive while a raw memoryview points into them.
    keep: object = None
    #: Checksum of the storage these bytes belong to (``verify=True``): a ``CrcTracker``.
    tracker: Any = None
    #: ``deliver`` copies to a device and needs its bytes in pinned host memory (see ``_cuda``).
    pinned: bool = False
    #: Destination bytes this piece fills, when not ``end - start`` (gaps read through, casts).
    useful: int | None = None
    #: Counted in ``bytes_assembled`` (False for header probes and bytes read only to be checked).
    payload: bool = True

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class Chunk:
    """One read request: ``[start, end)`` of file ``name``, cut into pieces (``segments``,
    sorted, inside the request; gaps between them are read and dropped)."""

    name: str
    start: int
    end: int
    segments: list[Piece]
    trackers: Sequence[Any] = field(default_factory=tuple)
    #: Called on the event loop once the chunk's bytes are in place (a record read by
    #: guessing where its tensor starts counts its chunks in). A chunk that has one is
    #: read on its own, never grouped with others.
    landed: Callable[[], None] | None = None

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def needs_pinned(self) -> bool:
        """Some piece goes to a device (see :attr:`Piece.pinned`)."""
        return any(s.pinned for s in self.segments)

    def tiles_into(self) -> bool:
        """Every byte of the chunk has a direct destination, in order, without gaps."""
        pos = self.start
        for s in self.segments:
            if s.into is None or s.start != pos:
                return False
            pos = s.end
        return pos == self.end
