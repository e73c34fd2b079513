"""The decoder's work budget: what a decode did, counted, and where it must stop.

A unit is one step of work whose cost does not grow with the input: a byte of pickle read
(every opcode is at least one), an object built or a key hashed by the pickle VM, a
container walked by the structure check, a chunk dimension or chunk pair compared by
:func:`~asyncload.decoding.dcp_checks.check_metadata`. A decode given a :class:`WorkBudget`
charges it as it goes, so that how much work an input costs is a number (tests assert it
instead of seconds) and a caller can cap it.

Raised: :class:`CheckpointFormatError` by :meth:`WorkBudget.charge` once the units spent pass
the limit, naming the limit (the pickle VM's own limit, proportional to the pickle's size,
stays an :class:`UnsafeCheckpointError`).
"""

from __future__ import annotations

from asyncload.common.errors import CheckpointFormatError

__all__ = ["WorkBudget"]


class WorkBudget:
    """Units of decoding work spent (:attr:`spent`) and allowed (:attr:`limit`, ``None``: no
    limit, count only). One budget may be handed to several decodes in turn (the pickle,
    then the checks of what it holds): they add up."""

    __slots__ = ("limit", "spent")

    def __init__(self, limit: int | None = None) -> None:
        if limit is not None and limit < 0:
            raise ValueError(f"WorkBudget.limit={limit!r}: must be >= 0 or None")
        self.limit = limit
        self.spent = 0

    def room(self) -> int | None:
        """Units left before the limit (``None``: no limit)."""
        return None if self.limit is None else max(0, self.limit - self.spent)

    def charge(self, units: int, what: str) -> None:
        """Spend ``units`` on the decode of ``what``; raises CheckpointFormatError once more
        than :attr:`limit` units are spent in all."""
        self.spent += units
        if self.limit is not None and self.spent > self.limit:
            raise self.exceeded(what)

    def exceeded(self, what: str) -> CheckpointFormatError:
        """The error for ``what`` needing more work than :attr:`limit`."""
        return CheckpointFormatError(
            f"{what} needs more than the {self.limit} units of decoding work allowed (its work "
            f"budget); "
            "nothing more of it was decoded"
        )

    def __repr__(self) -> str:
        return f"WorkBudget(limit={self.limit!r}, spent={self.spent})"
