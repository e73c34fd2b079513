"""Values read from the group's store are data to check, not trusted: a claim, a barrier's
watcher, the idle ranks' digest are parsed and range-checked here, and a value that is not
one this load could have written is a :class:`DistributedLoadError` naming the key and the
rank that wrote it (as far as the value tells), never a crash, a raw exception or a wait on a
rank outside the group (docs/distributed.md, "What a rank that lies can and cannot do")."""

from __future__ import annotations

import math
from collections.abc import Collection

from asyncload.common.errors import DistributedLoadError

__all__ = ["bad_store_value", "fresh_of", "parse_rank"]

#: Characters of a bad value shown in an error.
_SHOWN = 80


def _writer(value: str) -> str:
    """Who wrote ``value``, as far as it tells: the rank its first field names, if any."""
    head = value.partition("!")[0].partition("|")[0].strip()
    return f"rank {head} (as the value says)" if head.isdigit() else "an unknown writer"


def bad_store_value(
    key: str, value: bytes | str, why: str, *, writer: str | None = None, what: str = ""
) -> DistributedLoadError:
    """The error for ``value`` of store ``key`` that this load could not have written."""
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    shown = text if len(text) <= _SHOWN else text[:_SHOWN] + "..."
    by = writer if writer is not None else _writer(text)
    return DistributedLoadError(
        f"the process group's store holds {shown!r} at {key!r}{f' ({what})' if what else ''}, "
        f"written by {by}: {why}; a rank of this load never writes that (another job sharing "
        "the store, a rank running another asyncload version, or a rank that lies): nothing "
        "was taken from it",
        doing=f"reading {key!r} from the store",
    )


def _ranks(allowed: Collection[int]) -> str:
    if isinstance(allowed, range) and allowed.step == 1:
        return f"ranks {allowed.start} to {allowed.stop - 1}"
    return f"ranks {sorted(allowed)}"


def parse_rank(
    key: str,
    value: bytes | str,
    allowed: Collection[int],
    *,
    what: str = "",
    writer: str | None = None,
) -> int:
    """``value`` as a rank among ``allowed`` (ascending; named in the error otherwise)."""
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    s = text.strip()
    if not (s.isascii() and s.isdigit()) or len(s) > 9:
        raise bad_store_value(key, text, "not a rank", writer=writer, what=what)
    rank = int(s)
    if rank not in allowed:
        raise bad_store_value(
            key,
            text,
            f"rank {rank} is not one of the ranks that may write it ({_ranks(allowed)})",
            writer=writer if writer is not None else "an unknown writer",
            what=what,
        )
    return rank


def fresh_of(value: bytes) -> float | None:
    """The freshest progress (wall-clock seconds) a rank's status value
    ``"<counter>@<fresh>|<text>"`` tells of (:class:`~asyncload.distributed.monitor.PeerWait`);
    None for a value without one (not written yet, or not one this load writes: such a
    value moves no deadline)."""
    _, at, f = value.partition(b"|")[0].partition(b"@")
    if not at:
        return None
    try:
        x = float(f)
    except ValueError:
        return None
    return x if math.isfinite(x) else None
