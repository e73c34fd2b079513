"""Known byte ranges of one file (:class:`ByteWindow`), the request for more
(:class:`NeedBytes`) and the probe sizes: what the engine keeps per record, apart from the
archive parser (:mod:`.archive`), so that loads of formats without archives do not import
the parser."""

from __future__ import annotations

__all__ = ["HEAD_PROBE", "TAIL_PROBE", "ByteWindow", "NeedBytes"]

#: Bytes read at a large record's start and end to find its layout (one request each,
#: and the tail of one record is read together with the head of the next).
HEAD_PROBE = 4096
#: The tail probe is the span searched for a zip's end-of-central-directory record
#: (:data:`asyncload.formats.zip.EOCD_SEARCH`, the same 4096 bytes).
TAIL_PROBE = 4096


class NeedBytes(Exception):
    """The parser needs file bytes ``[start, end)`` it does not have yet."""

    def __init__(self, start: int, end: int) -> None:
        super().__init__(start, end)
        self.start, self.end = start, end


class ByteWindow:
    """Known byte ranges of one file; ``get`` returns a range or raises NeedBytes."""

    def __init__(self) -> None:
        self._parts: list[tuple[int, bytes | memoryview]] = []

    def add(self, start: int, data: bytes | memoryview) -> None:
        self._parts.append((start, data))

    def get(self, start: int, end: int) -> memoryview:
        for s, d in self._parts:
            if s <= start and end <= s + len(d):
                return memoryview(d)[start - s : end - s]
        raise NeedBytes(start, end)
