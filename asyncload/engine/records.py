"""Records: the plan's read items grouped by the saved record they read, and handed back.

A :class:`Record` is one saved item (a torch.save archive inside a ``.distcp`` file, or an
entry a format module located: a safetensors tensor, a torch.save file's tensor or object)
and the reads that need it. :func:`collect` groups a DCP ``LoadPlan`` into records, with
the destinations resolved through the planner; :func:`commit` hands every tensor and
decoded object back to it. The planner is met through :class:`AllowListPlanner` (the
engine imports no face): asyncload's own planners take objects decoded by the allow-list
and apply its dtype rule; any other planner (torch's ``DefaultLoadPlanner``) gets raw
object records, and torch's casts.
"""

from __future__ import annotations

import asyncio
import io
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

import asyncload.formats as formats
from asyncload.common.errors import CheckpointFormatError, StateDictMismatchError
from asyncload.common.options import CheckPolicy
from asyncload.common.paths import check_relative_path
from asyncload.common.stats import LoadStats
from asyncload.engine import transforms as _transforms
from asyncload.engine.chunks import Piece
from asyncload.formats import (
    HEAD_PROBE,
    TAIL_PROBE,
    ByteWindow,
    is_byte_io,
    is_metadata,
    is_tensor_md,
)

if TYPE_CHECKING:
    from torch.distributed.checkpoint import LoadPlan, LoadPlanner, ReadItem
    from torch.distributed.checkpoint.metadata import Metadata

    from asyncload.engine.config import PlanReport

__all__ = [
    "AllowListPlanner",
    "Record",
    "collect",
    "commit",
    "decode_object",
    "dense",
    "expected_storage",
    "needed",
    "note_keys",
    "probes",
    "refuse_a_dcp_file",
    "store",
    "then",
    "torch_casts",
    "trim_probed",
]


def decode_object(
    raw: bytes | memoryview,
    *,
    what: str,
    max_pickle: int = 1 << 30,
    safe_globals: tuple[Any, ...] = (),
) -> Any:
    """A non-tensor object saved by DCP (a torch.save archive), decoded with the allow-list
    (and the globals the user trusts: ``LoadOptions.safe_globals``)."""
    win = ByteWindow()
    win.add(0, raw)
    layout = formats.parse_archive(  # the archive parser: imported by the first DCP object
        win, 0, len(raw), what, max_pickle=max_pickle, safe_globals=safe_globals
    )
    return formats.materialize(layout, win)


@runtime_checkable
class AllowListPlanner(Protocol):
    """What the engine asks of asyncload's own planners (``PipelinedLoadPlanner``): objects
    arrive decoded by the allow-list (``load_object``), unless ``raw_objects`` (its class
    decodes DCP object records itself, in its own ``load_bytes``); destinations follow
    asyncload's dtype rule (lossless widening only, ``LoadOptions.allow_dtype_cast``)."""

    raw_objects: bool

    def load_object(self, read_item: ReadItem, obj: Any) -> None: ...


@dataclass
class Record:
    """One saved item (a torch.save archive inside a .distcp file) and the reads that need it."""

    name: str
    offset: int
    length: int
    fqn: str
    tensor_items: list[tuple[ReadItem, torch.Tensor]] = field(default_factory=list)
    byte_items: list[ReadItem] = field(default_factory=list)
    chunk_md: Any = None
    dtype: torch.dtype | None = None
    window: ByteWindow = field(default_factory=ByteWindow)
    raw: bytes | None = None
    #: A ``formats.FormatEntry`` (KnownTensor, BlobTensor, KnownObject): bytes located by a
    #: format module.
    entry: Any = None
    #: The located tensor of ``entry`` (a TensorLocation), and the decoded object of a KnownObject.
    known: Any = None
    value: Any = None
    #: Stream transforms the record was saved with (descriptors) and the extensions decoding them.
    transforms: tuple[str, ...] = ()
    extensions: Any = None

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def where(self) -> str:
        return f"record {self.fqn!r} at [{self.offset}, {self.end}) of {self.name}"


def refuse_a_dcp_file(checkpoint: str | os.PathLike[str]) -> None:
    """Raise :class:`CheckpointFormatError` when ``checkpoint`` names a file inside a DCP
    checkpoint (a ``.distcp`` data file or the ``.metadata``) instead of its directory."""
    path = str(checkpoint).split("?", 1)[0].split("#", 1)[0].rstrip("/")
    name = path.rsplit("/", 1)[-1]
    if (
        name.endswith(".distcp")
        or name == ".metadata"
        or (name.startswith("__") and name.endswith(".metadata"))
    ):
        parent = path[: -len(name)].rstrip("/") or "/"
        raise CheckpointFormatError(
            f"{checkpoint} is a file of a DCP checkpoint, not the checkpoint: pass the checkpoint "
            "directory "
            f"({parent}) that holds it and the .metadata"
        )


def collect(
    plan: LoadPlan,
    planner: LoadPlanner,
    md: Metadata,
    checkpoint: object,
    registry: Any,
    report: PlanReport | None = None,
) -> list[Record]:
    """Group the plan's read items by saved record; resolve destinations (caller's thread).
    ``registry`` decodes stream transforms (None: torch's default). ``report``: what the
    planner planned (:class:`~asyncload.engine.config.PlanReport`), its view of ``md``
    where it loads keys from under a prefix (:func:`asyncload.formats.rebase`)."""
    view: Any = report.metadata if report is not None else None
    storage_data = md.storage_data
    records: dict[tuple[str, int, int], Record] = {}
    checked: set[str] = set()  # file names already found to be plain relative paths
    located: list[Record] = []
    for item in plan.items:
        sinfo = storage_data.get(item.storage_index)
        if sinfo is None:
            raise CheckpointFormatError(
                f"{checkpoint}: metadata has no storage entry for {item.storage_index}"
            )
        if isinstance(sinfo, formats.FormatEntry):
            # safetensors / torch.save files, DCP saved as safetensors: one record per item
            rec = Record(
                sinfo.relative_path,
                sinfo.offset,
                sinfo.length,
                item.storage_index.fqn,
                entry=sinfo,
            )
            if is_byte_io(item):
                rec.byte_items.append(item)
            else:
                rec.tensor_items.append((item, planner.resolve_tensor(item).detach()))
            located.append(rec)
            continue
        name, offset, length = (
            getattr(sinfo, "relative_path", None),
            getattr(sinfo, "offset", None),
            getattr(sinfo, "length", None),
        )
        if not isinstance(offset, int) or not isinstance(length, int) or offset < 0 or length <= 0:
            raise CheckpointFormatError(
                f"{checkpoint}: malformed storage entry {sinfo!r:.200} for "
                f"{item.storage_index.fqn!r}"
            )
        if type(name) is not str or name not in checked:
            name = check_relative_path(
                name, f"{checkpoint}: storage entry of {item.storage_index.fqn!r:.200}"
            )
            checked.add(name)
        key = (name, offset, length)
        found = records.get(key)
        if found is None:
            found = records[key] = Record(name, offset, length, item.storage_index.fqn)
            descriptors = getattr(sinfo, "transform_descriptors", None)
            if descriptors:  # checked now: an unknown transform fails before any read
                if registry is None:  # torch's default, made once (it imports DCP's modules)
                    registry = _transforms.default_registry()
                found.transforms = tuple(descriptors)
                found.extensions = _transforms.extensions_for(
                    registry,
                    found.transforms,
                    what=f"key {found.fqn!r} in {checkpoint}, {found.where}",
                )
        rec = found
        if is_byte_io(item):
            rec.byte_items.append(item)
        else:
            smd: Any = md.state_dict_metadata.get(item.storage_index.fqn)
            if smd is None and is_metadata(view):  # a key the planner took from under a
                # prefix (formats.rebase)
                smd = view.state_dict_metadata.get(item.storage_index.fqn)
            if is_tensor_md(smd):
                rec.dtype = smd.properties.dtype
                idx = item.storage_index.index
                if (
                    idx is not None
                    and 0 <= idx < len(smd.chunks)
                    and smd.chunks[idx].offsets == item.storage_index.offset
                ):
                    rec.chunk_md = smd.chunks[idx]
                else:
                    rec.chunk_md = next(
                        (c for c in smd.chunks if c.offsets == item.storage_index.offset), None
                    )
            dest = planner.resolve_tensor(item).detach()
            rec.tensor_items.append((item, dest))
    return sorted(records.values(), key=lambda r: (r.name, r.offset)) + located


def commit(records: list[Record], planner: LoadPlanner, checks: CheckPolicy) -> None:
    """Hand every tensor and decoded object to the planner (its hooks: caller's thread).

    Objects: asyncload's own planners (:class:`AllowListPlanner`) get them decoded by the
    allow-list (``load_object``), unless ``raw_objects`` (its class overrides
    ``load_bytes``): that one gets each DCP object's raw record (an ``io.BytesIO``, as
    torch's ``FileSystemReader`` gives it) and decodes it itself. Any other planner (torch's
    ``DefaultLoadPlanner`` decodes with ``torch.load(weights_only=False)``) gets the raw
    record only after the allow-list has decoded it. Objects of a torch.save file are part
    of its one pickle, decoded when its layout was read: ``load_bytes`` gets them saved
    again with ``torch.save``."""
    ours = planner if isinstance(planner, AllowListPlanner) else None
    raw_bytes = ours is not None and ours.raw_objects
    safe_globals = checks.safe_globals
    for rec in records:
        for item, dest in rec.tensor_items:
            planner.commit_tensor(item, dest)
    for rec in records:
        for item in rec.byte_items:
            if rec.entry is not None:  # decoded by a format module (a torch.save pickle)
                if ours is not None and not raw_bytes:
                    ours.load_object(item, rec.value)
                else:
                    planner.load_bytes(item, formats.object_bytes(rec.value))
                continue
            if rec.raw is None:  # pragma: no cover - every object record is read whole
                raise CheckpointFormatError(f"{rec.where}: the object was not read")
            if (
                raw_bytes
            ):  # the planner's own decode (docs/distributed.md): its safety is the user's
                planner.load_bytes(item, io.BytesIO(rec.raw))
                continue
            obj = decode_object(
                rec.raw,
                what=f"object {rec.fqn!r} in {rec.where}",
                max_pickle=checks.max_metadata_size,
                safe_globals=safe_globals,
            )
            if ours is not None:
                ours.load_object(item, obj)
            else:  # checked by the allow-list above; the planner decodes them its own way
                planner.load_bytes(item, io.BytesIO(rec.raw))


def note_keys(report: PlanReport | None, stats: LoadStats, *, strict: bool) -> None:
    """The missing, tied and unexpected keys the planner reports (asyncload's planners:
    :class:`~asyncload.engine.config.PlanReport`; any other reports none) into ``stats``.

    Raised: :class:`StateDictMismatchError` for unexpected keys under ``strict``
    (``LoadOptions.strict_unexpected_keys``)."""
    if report is None:
        return
    stats.missing_keys = list(report.missing_keys)
    stats.tied_keys = dict(report.tied_keys)
    prefix = getattr(report.metadata, "prefix", "")
    if isinstance(prefix, str):
        stats.key_prefix = prefix
    unexpected = report.unexpected_keys
    stats.unexpected_keys = list(unexpected)
    if unexpected and strict:
        raise StateDictMismatchError(
            f"the checkpoint holds {len(unexpected)} keys the destination lacks: "
            f"{unexpected[:10]} (LoadOptions.strict_unexpected_keys=True)"
        )


def torch_casts(planner: LoadPlanner) -> bool:
    """The plan comes from a planner that is not asyncload's (torch's DefaultLoadPlanner):
    convert dtypes as torch does, without asyncload's lossless-widening rule."""
    return not isinstance(planner, AllowListPlanner)


def expected_storage(rec: Record) -> int | None:
    """Bytes of the tensor a record holds, as the metadata claims them (``None``: an object,
    or a chunk the metadata does not describe)."""
    if not rec.tensor_items or rec.chunk_md is None or rec.dtype is None:
        return None
    return int(torch.Size(rec.chunk_md.sizes).numel()) * rec.dtype.itemsize


def needed(rec: Record) -> int:
    """Bytes of ``rec`` the load's destinations need: an object's whole record, a tensor's boxes."""
    if rec.byte_items and not rec.tensor_items:
        return rec.length
    saved = rec.dtype if rec.dtype is not None else getattr(rec.known, "dtype", None)
    n = 0
    for item, dest in rec.tensor_items:
        size = saved.itemsize if isinstance(saved, torch.dtype) else dest.element_size()
        n += int(torch.Size(item.lengths).numel()) * size
    return n


def probes(rec: Record) -> tuple[tuple[int, int], tuple[int, int]]:
    """The head and tail probes of a record: the byte ranges whose layout they hold."""
    return (rec.offset, rec.offset + min(HEAD_PROBE, rec.length)), (
        rec.end - min(TAIL_PROBE, rec.length),
        rec.end,
    )


def trim_probed(
    rec: Record, pieces: list[Piece], out: list[tuple[memoryview, memoryview]]
) -> list[Piece]:
    """Direct pieces trimmed of the bytes the record's probes already read (a rank that needs
    the first or last rows of a tensor); those bytes are copied from the probes (``out``)."""
    kept: list[Piece] = []
    for p in pieces:
        if p.into is not None and p.deliver is None and not p.pinned:
            for lo, hi in probes(rec):
                if p.start >= lo and p.start < hi:  # a prefix of the piece was probed
                    k = min(p.end, hi) - p.start
                    out.append((p.into[:k], rec.window.get(p.start, p.start + k)))
                    p.into, p.start = p.into[k:], p.start + k
                elif p.start < lo < p.end <= hi:  # a suffix was probed
                    k = p.end - lo
                    out.append((p.into[len(p.into) - k :], rec.window.get(lo, p.end)))
                    p.into, p.end = p.into[: len(p.into) - k], lo
                if p.start >= p.end:
                    break
            if p.start >= p.end:
                continue
        kept.append(p)
    return kept


def dense(records: list[Record]) -> bool:
    """Plain DCP records (no format entries, no stream transforms), each tensor record
    needed whole by one destination: no narrow read, nothing for the over-read bound to
    weigh across records."""
    for rec in records:
        if rec.entry is not None or rec.transforms:
            return False
        if rec.tensor_items:
            if rec.byte_items or len(rec.tensor_items) != 1:
                return False
            expected = expected_storage(rec)
            if expected is None or needed(rec) != expected:
                return False
    return True


def then(
    deliver: Callable[[memoryview], None] | None,
    loop: asyncio.AbstractEventLoop,
    after: Callable[[], None],
) -> Callable[[memoryview], None]:
    """``deliver``, then ``after`` scheduled on ``loop`` (deliveries run on assembly threads)."""

    def both(data: memoryview) -> None:
        if deliver is not None:
            deliver(data)
        loop.call_soon_threadsafe(after)

    return both


def store(win: ByteWindow, start: int) -> Callable[[memoryview], None]:
    def deliver(data: memoryview) -> None:
        win.add(start, bytes(data))

    return deliver
