"""``asyncload.safe_open``: the ``safetensors.safe_open`` interface over any store.

One ``.safetensors`` file (a local path or ``file://`` URL, ``s3://``, ``gs://``,
``http(s)://``...) opened lazily: the header is read once, when the file is opened (the
hostile-header checks of :mod:`asyncload.formats.safetensors`), and each ``get_tensor`` or
``get_slice(name)[...]`` reads only the bytes it returns: a block of rows is one range, a
block of columns one range per row, neighbours joined through small gaps under the
over-read bound (``LoadOptions.max_over_read_ratio`` and ``min_chunk_size``, as a load
joins them), large ranges split at ``chunk_size`` and read concurrently, at most
``memory_budget`` bytes buffered.

Every read goes through the file's storage boundary (:class:`asyncload.storage.RetryingStorage`,
made from the options resolved once, as a load's: timeouts, retries, hedging, the object's
version pinned at first sight, typed errors naming the file, range and attempts), on the
library's loop thread (:mod:`asyncload.common.loop`); a local file changed while it is read is a
:class:`~asyncload.CheckpointChangedError`.

What it imports is what it needs: the storage wing, the header parser
(:mod:`asyncload.formats.safetensors_header`) and the engine's chunking and read loop
(:mod:`asyncload.engine.read_loop`), never
``torch.distributed.checkpoint`` or a load's planning (a fresh process's first ``safe_open``
paid 0.76 s for them).

Indexing is torch's own: an index of ints, slices (any positive step), ``...`` and ``None``
reads the box it touches (an index out of range raises torch's error before anything is
read); any other index (lists, tensors, booleans) reads the whole tensor and indexes it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import operator
import os
import time
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from itertools import product
from types import TracebackType
from typing import Any, TypeVar

import torch

from asyncload.common.errors import StateDictMismatchError, redact_url
from asyncload.common.latency import LoadClock
from asyncload.common.loop import close_through_interrupt, loop_thread, run_sync
from asyncload.common.options import LoadOptions
from asyncload.common.stats import LoadStats, StatsRecorder
from asyncload.engine import (
    LoadConfig,
    Piece,
    ReadBudget,
    check_unchanged,
    closest_keys,
    make_chunks,
    open_boundary,
    read_chunks,
    resolve_config,
)
from asyncload.faces.arguments import check_source_arguments
from asyncload.formats import (
    HEADER_PROBE,
    SAFETENSORS_DTYPES,
    SafetensorsHeader,
    TensorLocation,
    aread_header,
    memory_of,
    split_file_url,
)
from asyncload.storage import RetryingStorage, Storage, is_local

__all__ = ["SafetensorsFile", "SafetensorsSlice", "TensorNotFoundError", "safe_open"]

log = logging.getLogger("asyncload.safe_open")
T = TypeVar("T")

#: ``backend=`` values ``safetensors.safe_open`` (0.8) takes; asyncload reads the same way
#: for both (ranged reads through its storage boundary), so the tensors are the same.
_BACKENDS = ("mmap", "pread")
#: ``framework=`` values that mean torch tensors (safetensors' own spellings).
_TORCH = ("pt", "torch", "pytorch")
#: The dtype names safetensors writes, by torch dtype (``get_dtype()``).
_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


class TensorNotFoundError(StateDictMismatchError, KeyError):
    """The file holds no tensor of the name asked for (a ``KeyError`` too, as a mapping's
    missing key). The message names the key and the file's closest key."""

    def __str__(self) -> str:  # KeyError's own would quote the message
        return str(self.args[0]) if self.args else ""


def _device(device: str | int | torch.device) -> torch.device:
    dev: torch.device | None
    if isinstance(device, int) and not isinstance(device, bool):
        dev = torch.device("cuda", device)
    else:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(
            f"device={device!r}: asyncload.safe_open gives tensors on 'cpu' or 'cuda'/'cuda:N'"
        )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: torch sees no CUDA device here")
    return dev


def _as_int(item: Any) -> int | None:
    """``item`` as torch indexes with it like an int (a Python int, a 0-d integer tensor),
    else None (booleans are not ints to torch's indexing: they add a dimension)."""
    if isinstance(item, bool):
        return None
    if isinstance(item, int):
        return item
    if isinstance(item, torch.Tensor):
        if item.dim() == 0 and not item.is_floating_point() and not item.is_complex():
            return None if item.dtype == torch.bool else int(item)
        return None
    if type(item).__name__ in ("bool", "bool_") or not hasattr(type(item), "__index__"):
        return None
    try:  # a numpy integer
        return operator.index(item)
    except TypeError:
        return None


def plan_index(
    index: Any, shape: Sequence[int], dtype: torch.dtype
) -> tuple[list[tuple[int, int]], tuple[Any, ...]] | None:
    """For basic indexing (ints, slices, ``...``, ``None``): the box ``[lo, hi)`` per
    dimension that ``tensor[index]`` touches, and the index that gives the same result from
    the box. None for any other index (read the whole tensor). An index torch refuses (out of
    range, a step below 1, too many indices) raises torch's own error here, before a read."""
    items = index if isinstance(index, tuple) else (index,)
    parsed: list[Any] = []
    for item in items:
        if item is None or item is Ellipsis:
            parsed.append(item)
        elif isinstance(item, slice):
            if not all(
                v is None or _as_int(v) is not None for v in (item.start, item.stop, item.step)
            ):
                return None
            parsed.append(
                slice(
                    *(
                        None if v is None else _as_int(v)
                        for v in (item.start, item.stop, item.step)
                    )
                )
            )
        else:
            i = _as_int(item)
            if i is None:
                return None
            parsed.append(i)
    if sum(1 for p in parsed if p is Ellipsis) > 1:
        return None  # torch takes several (as one); its own indexing says how
    try:  # torch's errors, on a tensor without memory
        torch.empty(tuple(shape), dtype=dtype, device="meta")[tuple(parsed)]
    except NotImplementedError:
        return None
    used = sum(1 for p in parsed if p is not None and p is not Ellipsis)
    fill = [slice(None)] * (len(shape) - used)
    at = next((k for k, p in enumerate(parsed) if p is Ellipsis), None)
    parsed = parsed + fill if at is None else parsed[:at] + fill + parsed[at + 1 :]
    box: list[tuple[int, int]] = []
    rel: list[Any] = []
    d = 0
    for p in parsed:
        if p is None:
            rel.append(None)
            continue
        size = shape[d]
        d += 1
        if isinstance(p, int):
            i = p + size if p < 0 else p
            box.append((i, i + 1))
            rel.append(0)
            continue
        start, stop, step = p.indices(size)
        n = len(range(start, stop, step))
        if n == 0:
            box.append((0, 0))
            rel.append(slice(0, 0))
        else:
            box.append((start, start + (n - 1) * step + 1))
            rel.append(slice(None, None, step))
    return box, tuple(rel)


def box_runs(
    shape: Sequence[int], box: Sequence[tuple[int, int]], itemsize: int, start: int
) -> Iterator[tuple[int, int]]:
    """The contiguous byte runs ``(file offset, bytes)`` of ``box`` in a row-major tensor of
    ``shape`` whose bytes start at ``start``, in file order (the box's own order)."""
    if any(hi <= lo for lo, hi in box):
        return
    k = len(shape)
    while k > 0 and tuple(box[k - 1]) == (0, shape[k - 1]):
        k -= 1  # dimensions k.. are whole: each run covers them
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    if k == 0:
        yield start, math.prod(shape) * itemsize
        return
    run_dim = k - 1
    lo, hi = box[run_dim]
    run = (hi - lo) * strides[run_dim] * itemsize
    first = lo * strides[run_dim]
    for idx in product(*(range(a, b) for a, b in box[:run_dim])):
        elem = first + sum(i * s for i, s in zip(idx, strides))
        yield start + elem * itemsize, run


class _FileStore:
    """The store of one open file, as a load's session holds it (without a load's planning):
    the storage at ``parent`` behind the retrying boundary, both made from ``config`` (the
    options resolved once), the I/O threads, the statistics and clock, and the library loop
    it runs on (chosen once: the store's clients belong to it).

    Mutable state, all of it: what is open (``_raw``, ``_boundary``, ``_executor``) and the
    loop (``_loop``, ``_pid``)."""

    def __init__(
        self, parent: str, config: LoadConfig, storage_options: Mapping[str, Any] | None
    ) -> None:
        self.checkpoint = parent
        self._config = config
        self._storage_options = dict(storage_options or {})
        self._recorder = StatsRecorder()
        self._clock = LoadClock(time.monotonic)
        self._t0 = time.monotonic()
        self._recorder.started = self._t0
        self._loop = loop_thread(config.use_uvloop, local=is_local(parent))
        self._pid = os.getpid()
        self._raw: Storage | None = None
        self._boundary: RetryingStorage | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def run(self, coro: Coroutine[Any, Any, T], *, shield: bool = False) -> T:
        """Run ``coro`` on the store's loop and wait (:func:`asyncload.common.loop.run_sync`; a
        Ctrl-C does not cancel it when ``shield``); the loop is chosen again in a forked
        child, or once it has stopped (as a session's)."""
        return run_sync(coro, self._current_loop, shield=shield)

    def _current_loop(self) -> asyncio.AbstractEventLoop:
        if self._pid != os.getpid() or not self._loop.is_running():
            self._loop = loop_thread(self._config.use_uvloop, local=is_local(self.checkpoint))
            self._pid = os.getpid()
        return self._loop

    async def storage(self) -> RetryingStorage:
        """The storage behind the retrying boundary (opened on first use)."""
        if self._boundary is None:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    self._config.io_threads, thread_name_prefix="asyncload-io"
                )
            self._boundary = open_boundary(
                self._config,
                self.checkpoint,
                self._storage_options,
                self._executor,
                self._recorder,
                self._clock,
            )
            self._raw = self._boundary.raw
        return self._boundary

    def live_stats(self) -> LoadStats:
        snap = self._recorder.snapshot()
        snap.seconds = time.monotonic() - self._t0
        return snap

    async def _aclose_storage(self) -> None:
        raw, self._raw, self._boundary = self._raw, None, None
        if raw is not None:
            await raw.aclose()

    def close(self) -> None:
        """Close the storage (on the loop), then stop the I/O threads (here: a read still
        running ends first)."""
        try:
            close_through_interrupt(
                lambda: self._raw is not None,
                lambda: self.run(self._aclose_storage(), shield=True),
            )
        finally:
            executor, self._executor = self._executor, None
            if executor is not None:
                executor.shutdown(wait=True, cancel_futures=True)

    def close_quietly(self) -> None:
        try:
            self.close()
        except Exception:
            log.debug(
                "closing the storage of %s failed", redact_url(self.checkpoint), exc_info=True
            )


class _Reader:
    """The async core of one open file: its store (storage, threads, statistics), its
    header, and the reads of boxes of its tensors. Runs on the store's loop."""

    def __init__(self, session: _FileStore, name: str, config: LoadConfig) -> None:
        self.session = session
        self.name = name
        self.config = config
        self.header: SafetensorsHeader | None = None
        #: The file's fingerprint when its header was read (a local file: a changed file is
        #: an error, not a torn tensor); remote objects are pinned by the store itself.
        self.fingerprints: dict[str, object] = {}

    async def aopen(self) -> SafetensorsHeader:
        storage = await self.session.storage()
        name = self.name
        head, size = await storage.read_prefix(name, HEADER_PROBE)
        header = await aread_header(
            lambda lo, hi: storage.read(name, lo, hi),
            name=name,
            base=0,
            blob_size=size,
            where=storage.url(name),
            max_header_size=self.config.checks.max_metadata_size,
            head=head,
        )
        if storage.raw.calls_inline:
            fp = await storage.fingerprint(name)
            if fp is not None:
                self.fingerprints[name] = fp
        storage.stats.add(files=1)
        self.header = header
        return header

    async def aread_box(self, loc: TensorLocation, box: Sequence[tuple[int, int]]) -> torch.Tensor:
        """``box`` of the tensor at ``loc``, read into a new CPU tensor of the box's shape."""
        out = torch.empty([hi - lo for lo, hi in box], dtype=loc.dtype)
        if out.numel() == 0:
            return out
        storage = await self.session.storage()
        config = self.config
        chunking = config.chunking
        dest = memory_of(out)
        pieces: list[Piece] = []
        pos = 0
        for start, n in box_runs(loc.size, box, loc.dtype.itemsize, loc.data_start):
            for a in range(0, n, chunking.chunk_size):
                m = min(chunking.chunk_size, n - a)
                pieces.append(Piece(self.name, start + a, start + a + m, into=dest[pos : pos + m]))
                pos += m
        assert pos == len(dest)
        ratio = None if config.checks.verify else config.checks.max_over_read_ratio
        budget = ReadBudget(ratio, not is_local(self.session.checkpoint), pos, 0)
        chunks = make_chunks(
            pieces,
            chunk_size=chunking.chunk_size,
            min_chunk_size=budget.join_gap(chunking.min_chunk_size),
            max_over_read=budget.gap_allowance(0, pieces),
        )
        await read_chunks(
            storage,
            chunks,
            memory_budget=config.memory.budget,
            max_in_flight=config.concurrency.max_in_flight,
        )
        if self.fingerprints:
            await check_unchanged(storage, self.fingerprints)
        storage.stats.add(bytes_assembled=pos, chunks=len(chunks))
        return out


class SafetensorsSlice:
    """One tensor of an open file, read when indexed (safetensors' ``PySafeSlice``):
    ``get_shape()``, ``get_dtype()`` and ``slice[...]``, which reads only the bytes of the
    result (see :mod:`asyncload.faces.safe_open`)."""

    def __init__(self, file: SafetensorsFile, name: str, loc: TensorLocation) -> None:
        self._file = file
        self._name = name
        self._loc = loc

    def get_shape(self) -> list[int]:
        """The whole tensor's shape."""
        return list(self._loc.size)

    def get_dtype(self) -> str:
        """The tensor's dtype as the file names it (``"F32"``, ``"BF16"``, ``"F8_E4M3"``...)."""
        return _DTYPE_NAMES[self._loc.dtype]

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._file._index(self._loc, index)

    def __repr__(self) -> str:
        return (
            f"SafetensorsSlice({self._name!r}, shape={self.get_shape()}, dtype={self.get_dtype()})"
        )


class SafetensorsFile:
    """An open ``.safetensors`` file (:func:`safe_open`): ``keys()``, ``offset_keys()``,
    ``metadata()``, ``get_tensor(name)``, ``get_slice(name)``; a context manager that closes
    its storage on exit (or call :meth:`close`). Safe to use from several threads."""

    def __init__(
        self,
        url: str | os.PathLike[str],
        framework: str = "pt",
        device: str | int | torch.device = "cpu",
        *,
        backend: str = "mmap",
        storage_options: Mapping[str, Any] | None = None,
        options: LoadOptions | None = None,
    ) -> None:
        check_source_arguments(url, options, storage_options, face="asyncload.safe_open")
        if backend not in _BACKENDS:
            raise ValueError(
                f"backend={backend!r} is invalid (expected one of: {', '.join(map(repr, _BACKENDS))}, "
                "as safetensors.safe_open takes)"
            )
        if framework not in _TORCH:
            raise ValueError(
                f"framework={framework!r}: asyncload.safe_open gives torch tensors only "
                "(framework='pt')"
            )
        self.device = _device(device)
        config = resolve_config(options)
        self.url = url
        parent, name = split_file_url(url)
        self._session = _FileStore(parent, config, storage_options)
        self._reader = _Reader(self._session, name, config)
        self._closed = False
        try:
            self._header = self._session.run(self._reader.aopen())
        except BaseException:
            self._closed = True
            self._session.close_quietly()
            raise

    # --- the file --------------------------------------------------------------------------

    def _open_header(self) -> SafetensorsHeader:
        if self._closed:
            raise ValueError(f"{self._header.where} is closed (asyncload.safe_open)")
        return self._header

    def keys(self) -> list[str]:
        """The tensors' names, sorted (as safetensors gives them)."""
        return sorted(self._open_header().tensors)

    def offset_keys(self) -> list[str]:
        """The tensors' names in the order of their bytes in the file."""
        tensors = self._open_header().tensors
        return sorted(tensors, key=lambda k: (tensors[k].data_start, k))

    def metadata(self) -> dict[str, str] | None:
        """The header's ``__metadata__`` (None when it has none)."""
        header = self._open_header()
        return dict(header.metadata) if header.has_metadata else None

    def _location(self, name: str) -> TensorLocation:
        header = self._open_header()
        loc = header.tensors.get(name)
        if loc is None:
            raise TensorNotFoundError(_missing(name, header))
        return loc

    def get_tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name``, whole."""
        loc = self._location(name)
        out = self._session.run(self._reader.aread_box(loc, [(0, s) for s in loc.size]))
        return self._place(out)

    def get_slice(self, name: str) -> SafetensorsSlice:
        """Tensor ``name``, read when indexed."""
        return SafetensorsSlice(self, name, self._location(name))

    def _index(self, loc: TensorLocation, index: Any) -> torch.Tensor:
        self._open_header()
        plan = plan_index(index, loc.size, loc.dtype)
        if plan is None:  # advanced indexing: torch's, on the whole tensor
            whole = self._session.run(self._reader.aread_box(loc, [(0, s) for s in loc.size]))
            return self._place(whole[index])
        box, rel = plan
        part = self._session.run(self._reader.aread_box(loc, box))
        return self._place(part[rel].contiguous())

    def _place(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device.type == "cpu" else t.to(self.device)

    @property
    def stats(self) -> LoadStats:
        """What the file's reads did so far (``bytes_read`` counts the header too)."""
        return self._session.live_stats()

    # --- closing ---------------------------------------------------------------------------

    def close(self) -> None:
        """Close the file's storage and threads (again: nothing)."""
        if self._closed:
            return
        self._closed = True
        self._session.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._header.tensors)} tensors"
        return f"<asyncload.safe_open {self._header.where} ({state})>"


def _missing(name: str, header: SafetensorsHeader) -> str:
    names = header.tensors
    hit = closest_keys([name], {}, dict.fromkeys(names)).get(name)
    if hit is not None:
        hint = f" (closest key: {hit!r})"
    else:
        some = sorted(names)[:5]
        hint = f" (it holds {len(names)} tensors, e.g. {some})" if some else " (it holds none)"
    return f"{header.where} holds no tensor {name!r}{hint}"


def safe_open(
    url: str | os.PathLike[str],
    framework: str = "pt",
    device: str | int | torch.device = "cpu",
    *,
    backend: str = "mmap",
    storage_options: Mapping[str, Any] | None = None,
    options: LoadOptions | None = None,
) -> SafetensorsFile:
    """Open one ``.safetensors`` file on any store, as ``safetensors.safe_open`` opens a local
    one::

        with asyncload.safe_open("s3://bucket/model.safetensors") as f:
            for name in f.keys():
                w = f.get_slice(name)[rank * n : (rank + 1) * n]  # reads only these rows

    ``url``: a local path or ``file://`` URL, or ``s3://``, ``gs://``, ``http(s)://``... of
    one file (``storage_options`` go to the store, as for :func:`asyncload.load`).
    ``framework``: ``"pt"`` (torch tensors; ``"torch"`` and ``"pytorch"`` too); ``device``:
    ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or ``N``. ``options``: :class:`LoadOptions` (timeouts,
    retries, hedging, chunk sizes, ``memory_budget``, ``max_over_read_ratio``).

    The header is read here, once (a damaged or hostile header is a
    :class:`~asyncload.CheckpointFormatError`, a missing file a
    :class:`~asyncload.CheckpointNotFoundError`); ``get_tensor`` and ``get_slice(name)[...]``
    read only the bytes they return, through the same storage boundary as a load. The result
    is bit for bit what ``safetensors.safe_open(..., framework="pt")`` gives (a contiguous
    tensor). An unknown name is a :class:`TensorNotFoundError` (a ``KeyError`` and a
    :class:`~asyncload.StateDictMismatchError`) naming the closest key.

    ``backend`` (keyword-only, as in safetensors 0.8: ``"mmap"`` or ``"pread"``) is accepted
    and has no effect: asyncload never maps the file, it reads each tensor's bytes with ranged
    reads (``pread`` locally) through its storage boundary, so both give the same tensors,
    bit for bit; so ``transformers``' ``from_pretrained``, which passes
    ``backend="mmap"``, works with this ``safe_open`` in place of safetensors' (see
    docs/formats.md). Another value is a ``ValueError``, as in safetensors.

    Raised: ``ValueError`` for a ``framework`` other than torch, a ``device`` other than
    CPU or an available CUDA device, or a ``backend`` safetensors does not know.
    """
    return SafetensorsFile(
        url,
        framework,
        device,
        backend=backend,
        storage_options=storage_options,
        options=options,
    )
