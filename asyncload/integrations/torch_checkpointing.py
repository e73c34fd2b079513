"""asyncload as a (read-only) storage backend of torch-checkpointing 0.1 (``torch_checkpointing``).

torch-checkpointing selects its storage with a ``StorageConfig`` (``CheckpointManager.Config(
storage_config=...)``, ``CheckpointReader(storage_config=...)``); the ``Storage`` it creates
is asked for ``exists``, ``getsize``, ``ls``, ``isdir`` and ``stream_read`` (a seekable raw
stream that the reader fills its buffers from, or reads ``torch.load``'s zip records from).
:class:`AsyncloadStorageConfig` gives it a :class:`AsyncloadStorage` that answers all of them
through asyncload's engine: S3, GCS, HTTP(S) or local files, each read with asyncload's
per-chunk timeouts, retries with backoff, hedging and error translation (typed
:class:`~asyncload.AsyncLoadError` s naming the URL, byte range and attempts), large reads
split into ``LoadOptions.chunk_size`` requests in flight together (at most
``LoadOptions.max_in_flight``)::

    from torch_checkpointing import CheckpointManager
    from asyncload.integrations.torch_checkpointing import AsyncloadStorageConfig

    storage = AsyncloadStorageConfig(root="s3://bucket/run1", storage_options={...})
    manager = CheckpointManager(CheckpointManager.Config(storage_config=storage))
    state = manager.load("step_1000", into={"model": model.state_dict(), "step": 0})

Checkpoint ids are paths under ``root`` (``"step_1000"``); a full URL under ``root`` works too.

What this backend cannot change: torch-checkpointing decodes what it reads itself, with
``pickle.loads`` (``metadata.pkl``) and ``torch.load(weights_only=False)`` (every item file),
so a checkpoint's pickles still run code through it. For checkpoints you do not trust, load
with asyncload's own faces (``asyncload.load``, ``read_state_dict``: every pickle decoded by
the allow-list), which read torch-checkpointing directories directly (docs/formats.md).
Writing is not offered (``write``, ``rename`` ... raise ``NotImplementedError``): save with
torch-checkpointing's own storage.
"""

from __future__ import annotations

import concurrent.futures
import io
import os
import re
import threading
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from torch_checkpointing.storage.base_storage import ReadArgs, Storage, StorageConfig

from asyncload.common.errors import AsyncLoadError, CheckpointNotFoundError
from asyncload.common.latency import LoadClock
from asyncload.common.loop import loop_thread, run_sync
from asyncload.common.options import LoadOptions
from asyncload.common.paths import check_relative_path
from asyncload.common.stats import LoadStats, StatsRecorder
from asyncload.engine import Chunk, Piece, read_chunks, resolve_config
from asyncload.storage import RetryingStorage, is_local, local_root, open_storage

__all__ = ["AsyncloadStorage", "AsyncloadStorageConfig"]

T = TypeVar("T")

#: ``pathlib`` turns ``s3://b/k`` into ``s3:/b/k``; this finds the scheme again.
_MANGLED_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*):/(?!/)")

#: Bytes read at least per request of a stream (``torch.load`` reads a zip's records in
#: many small pieces: one request each would be one round trip each).
_READ_AHEAD = 256 << 10


# Not frozen: torch-checkpointing's StorageConfig is a plain dataclass, and a frozen
# dataclass cannot derive from one. Validated on construction all the same.
@dataclass(kw_only=True)
class AsyncloadStorageConfig(StorageConfig):
    """Where the checkpoints are, and how asyncload reads them.

    ``root``: a local directory, ``file://``, ``s3://``, ``gs://``/``gcs://`` or
    ``http(s)://`` URL under which checkpoint ids are resolved. ``storage_options``: the
    store's options (as for ``asyncload.load``: fsspec-style keyword arguments).
    ``options``: timeouts, retries, hedging, chunking (:class:`~asyncload.LoadOptions`).
    """

    root: str
    storage_options: Mapping[str, Any] | None = None
    options: LoadOptions = field(default_factory=LoadOptions)

    def __post_init__(self) -> None:
        if not isinstance(self.root, (str, os.PathLike)) or not str(self.root):
            raise ValueError(
                f"AsyncloadStorageConfig.root must be a path or URL, got {self.root!r}"
            )
        if not isinstance(self.options, LoadOptions):
            raise TypeError(
                f"AsyncloadStorageConfig.options must be a LoadOptions, got {type(self.options).__name__}"
            )
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise TypeError(
                f"AsyncloadStorageConfig.storage_options must be a mapping, got {type(self.storage_options).__name__}"
            )

    def create_storage(self) -> AsyncloadStorage:
        return AsyncloadStorage(self)


class AsyncloadStorage(Storage):
    """torch-checkpointing's ``Storage`` over asyncload's engine (see the module docstring).

    Mutable state: the opened stores (one per directory asked about), their I/O threads and
    the statistics of every read (:meth:`stats`); :meth:`close` closes them all.
    """

    def __init__(self, config: AsyncloadStorageConfig) -> None:
        self._config = config
        #: ``config.options`` resolved once (:func:`asyncload.engine.resolve_config`).
        self._load_config = resolve_config(config.options)
        self._root = (
            str(local_root(config.root)) if is_local(config.root) else str(config.root).rstrip("/")
        )
        self._recorder = StatsRecorder()
        self._clock = LoadClock()  # one for every store: the timeout's progress, hedging's history
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._stores: dict[str, RetryingStorage] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"AsyncloadStorage(root={self._root!r}, stores={sorted(self._stores)})"

    # --- paths -----------------------------------------------------------------------------

    def _relative(self, path: Path | str) -> str:
        """``path`` relative to ``root`` (``""``: the root itself)."""
        s = str(path)
        m = _MANGLED_URL.match(s)
        if m:
            s = f"{m.group(1)}://{s[m.end() :]}"
        root = self._root
        if s == root or s == root + "/":
            return ""
        if s.startswith(root + "/"):
            s = s[len(root) + 1 :]
        elif "://" in s or os.path.isabs(s):
            raise ValueError(
                f"{path} is not under this storage's root {root} (AsyncloadStorageConfig.root)"
            )
        return check_relative_path(s.strip("/"), root) if s.strip("/") else ""

    def _url(self, rel: str) -> str:
        return f"{self._root}/{rel}" if rel else self._root

    def remap_path(self, path: Path) -> str:
        return self._url(self._relative(path))

    # --- the engine ------------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return run_sync(coro, loop_thread(self._load_config.use_uvloop))

    def _store(self, directory: str) -> RetryingStorage:
        with self._lock:
            store = self._stores.get(directory)
            if store is None:
                if self._executor is None:
                    self._executor = concurrent.futures.ThreadPoolExecutor(
                        4, thread_name_prefix="asyncload-tc"
                    )
                cfg = self._load_config
                raw = open_storage(
                    self._url(directory),
                    self._config.storage_options,
                    self._executor,
                    transport=cfg.storage.transport,
                    mapped_copies=False,
                )
                store = RetryingStorage(
                    raw,
                    retry=cfg.retry,
                    hedge=cfg.hedge,
                    stats=self._recorder,
                    executor=self._executor,
                    clock=self._clock,
                )
                self._stores[directory] = store
            return store

    def _split(self, path: Path | str) -> tuple[RetryingStorage, str]:
        rel = self._relative(path)
        directory, _, name = rel.rpartition("/")
        return self._store(directory), name

    async def _asize(self, path: Path | str) -> int | None:
        store, name = self._split(path)
        if not name:
            return None
        try:
            return int(await store.size(name))
        except CheckpointNotFoundError:
            return None
        except AsyncLoadError as exc:
            if isinstance(exc.__cause__, (NotADirectoryError, IsADirectoryError)):
                return None
            raise

    def _listing(self, path: Path | str) -> list[str]:
        return self._run(self._store(self._relative(path)).listdir())

    def stats(self) -> LoadStats:
        """What this storage has read so far (bytes, requests, retries, timeouts...)."""
        return self._recorder.snapshot()

    def close(self) -> None:
        """Close the stores and stop the I/O threads."""
        with self._lock:
            stores, self._stores = list(self._stores.values()), {}
            executor, self._executor = self._executor, None

        async def aclose() -> None:
            for s in stores:
                await s.aclose()

        if stores:
            self._run(aclose())
        if executor is not None:
            executor.shutdown(wait=True)

    # --- the Storage interface -----------------------------------------------------------------

    def stream_read(self, path: Path, read_args: ReadArgs | None = None) -> io.RawIOBase:
        size = self._run(self._asize(path))
        if size is None:
            raise FileNotFoundError(f"{self.remap_path(path)} does not exist")
        store, name = self._split(path)
        stream = _RangedStream(self, store, name, size)
        if read_args is None or read_args.pre_read_full_file:
            data = bytearray(size)
            stream.readinto(memoryview(data))
            stream.close()
            return io.BytesIO(data)  # type: ignore[return-value]  # what its own local storage returns too
        return stream

    def exists(self, path: Path) -> bool:
        return self._run(self._asize(path)) is not None or self.isdir(path)

    def getsize(self, path: Path) -> int:
        size = self._run(self._asize(path))
        if size is None:
            raise FileNotFoundError(f"{self.remap_path(path)} does not exist")
        return size

    def ls(self, path: Path) -> list[str]:
        return self._listing(path)

    def isdir(self, path: Path) -> bool:
        return bool(self._listing(path))

    def _read_only(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "AsyncloadStorage only reads: save with torch-checkpointing's own storage (LocalFileSystemStorageConfig ...)"
        )

    stream_write = write = delete = mkdir = rmdir = rename = _read_only


class _RangedStream(io.RawIOBase):
    """A seekable raw stream over one file: each read is a ranged read of the engine (at least
    ``_READ_AHEAD`` bytes, kept for the small reads that follow; a large one split into
    ``chunk_size`` requests in flight together)."""

    def __init__(
        self, owner: AsyncloadStorage, store: RetryingStorage, name: str, size: int
    ) -> None:
        super().__init__()
        self._owner, self._store, self._name, self._size = owner, store, name, size
        self._pos = 0
        self._window: tuple[int, bytes | bytearray | memoryview] = (0, b"")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = min(len(out), max(0, self._size - self._pos))
        if n == 0:
            return 0
        start, data = self._window
        if not (start <= self._pos and self._pos + n <= start + len(data)):
            end = min(self._size, max(self._pos + n, self._pos + _READ_AHEAD))
            data = self._owner._run(self._aread(self._pos, end))
            start = self._pos
            if end - start <= 4 * _READ_AHEAD:  # keep small windows only
                self._window = (start, data)
        off = self._pos - start
        out[:n] = memoryview(data)[off : off + n]
        self._pos += n
        return n

    async def _aread(self, start: int, end: int) -> bytes | bytearray | memoryview:
        cfg = self._owner._load_config
        step = max(1, cfg.chunking.chunk_size)
        if end - start <= step:
            return await self._store.read(self._name, start, end)
        buf = bytearray(end - start)
        view = memoryview(buf)
        chunks = []
        for lo in range(start, end, step):
            hi = min(end, lo + step)
            piece = Piece(self._name, lo, hi, into=view[lo - start : hi - start])
            chunks.append(Chunk(self._name, lo, hi, [piece]))
        # the engine's read loop: the first failure raised as one read's, the others cancelled
        await read_chunks(
            self._store,
            chunks,
            memory_budget=cfg.memory.budget,
            max_in_flight=cfg.concurrency.max_in_flight,
        )
        return buf
