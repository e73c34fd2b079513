"""Local weights for vLLM as views of leased mappings (``load_format="asyncload"``, local files).

vLLM copies every weight it is given into its own parameter (the model's ``weight_loader``):
a tensor read into fresh memory costs that memory's first-touch page faults (about 1 GiB/s
here) on top of vLLM's copy: a local 424 MiB model's weights load 3x slower that way than
through vLLM's own safetensors loader, whose tensors are views of a memory map of the page cache.
So for local files that are wholly in the page cache, the loader hands vLLM views of a mapping
too, after asyncload has read and checked the headers (:class:`~asyncload.faces.streaming.
CheckpointStream`'s metadata: index, hostile-header checks, the keys selected); anything else
(a remote store, a file that cannot be leased or brought into the page cache, a tensor saved in
several chunks) is read through the stream.

What could go wrong with a mapping, and what stops it (as :mod:`asyncload.storage.mapped`):

- **The file shrinks while a view is alive** (``SIGBUS``). Each file is mapped only while this
  process holds a read lease on it (``F_SETLEASE``, ``F_RDLCK``): the kernel grants none while
  the file is open for writing, and makes a writer or a truncation wait until the lease is let
  go (``/proc/sys/fs/lease-break-time``, 45 s by default). The lease is let go, and the file
  closed, when the last view of its mapping is gone (vLLM copies each view at once, so that
  is milliseconds after the file's last tensor was handed over).
- **A page must come from the disk and the disk fails.** A file is mapped only when every one
  of its pages is in the page cache (``cachestat``), checked under the lease; one that is not
  is read through once first (a disk error is then an ``OSError``, and the stream reads the
  file and names the error). Left: a page evicted after that check whose read then fails.
- **The file was replaced between the header read and the lease.** The header is parsed again
  from the mapping and every selected tensor's place must be the one the metadata gave.
- **A consumer writes into a view.** The mapping is private (copy on write): the file and
  the page cache are never written.

``LoadOptions(local_mapped_copies=False)`` turns it off, as it turns off the mapped copies.
"""

from __future__ import annotations

import fcntl
import logging
import math
import mmap
import os
import weakref
from collections.abc import Iterator, Sequence

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from asyncload.formats import KnownTensor, TensorLocation, header_length, parse_header
from asyncload.storage import mapped

__all__ = ["map_weights"]

log = logging.getLogger("asyncload.integrations.vllm")

#: The buffer a file not wholly in the page cache is read through (once) before it is mapped.
_POPULATE = 8 << 20


def _let_go(fd: int) -> None:
    """End the lease and close the file (the last view of its mapping is gone)."""
    try:
        mapped._let_go(fd)
    finally:
        os.close(fd)


def _contiguous(loc: TensorLocation) -> bool:
    """A tensor whose bytes are its whole storage, row-major (every safetensors tensor)."""
    stride = tuple(math.prod(loc.size[d + 1 :]) for d in range(len(loc.size)))
    return (
        loc.storage_offset == 0
        and tuple(loc.stride) == stride
        and loc.storage_nbytes == math.prod(loc.size) * loc.itemsize
    )


def _same_place(a: TensorLocation, b: TensorLocation) -> bool:
    return (a.data_start, a.storage_nbytes, a.dtype, tuple(a.size)) == (
        b.data_start,
        b.storage_nbytes,
        b.dtype,
        tuple(b.size),
    )


def _in_page_cache(fd: int, size: int) -> bool:
    """Whether every page of the file is in the page cache, after reading through once the
    windows that are not (into a small reused buffer: a disk error here is an ``OSError``,
    never a ``SIGBUS`` later)."""
    libc = mapped._get_libc()
    buf: bytearray | None = None
    try:
        for at in range(0, size, _POPULATE):
            n = min(_POPULATE, size - at)
            if libc.cached_pages(fd, at, n) != (n + mmap.PAGESIZE - 1) // mmap.PAGESIZE:
                buf = buf if buf is not None else bytearray(_POPULATE)
                os.preadv(fd, [memoryview(buf)[:n]], at)
    except OSError as exc:
        log.debug("reading fd %d into the page cache failed: %s", fd, exc)
        return False
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    return buf is None or libc.cached_pages(fd, 0, size) == pages


def _map_file(
    path: str, wanted: dict[str, TensorLocation], max_header_size: int
) -> mmap.mmap | None:
    """``path`` mapped (private: copy on write) under a read lease that ends when the mapping
    is collected; ``None`` (nothing held) when the file cannot be leased or mapped, is not
    wholly in the page cache, or its header no longer places ``wanted`` (name -> location)
    where the metadata did. A damaged header raises :class:`~asyncload.CheckpointFormatError`."""
    assert mapped._F_SETLEASE is not None and mapped._F_SETSIG is not None
    assert mapped._SIGNAL is not None  # mapped_copies_available() said so
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:  # the stream reads it, and names the error
        log.debug("%s: not opened (%s): read, not mapped", path, exc)
        return None
    try:
        # before the lease: letting one go resets the signal to SIGIO, which ends the process
        fcntl.fcntl(fd, mapped._F_SETSIG, mapped._SIGNAL)
        fcntl.fcntl(fd, mapped._F_SETLEASE, fcntl.F_RDLCK)
    except OSError as exc:
        os.close(fd)
        log.debug("%s: no read lease (%s): read, not mapped", path, exc)
        return None
    mm: mmap.mmap | None = None
    keep = False
    try:
        size = os.fstat(fd).st_size
        if size < 8 or not _in_page_cache(fd, size):
            log.debug("%s: not wholly in the page cache: read, not mapped", path)
            return None
        try:
            mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        except OSError as exc:
            log.debug("%s: not mapped (%s): read", path, exc)
            return None
        n = header_length(mm[:8], blob_size=size, where=path, max_header_size=max_header_size)
        header = parse_header(
            mm[8 : 8 + n], name=os.path.basename(path), base=0, blob_size=size, where=path
        )
        for key, loc in wanted.items():
            now = header.tensors.get(key)
            if now is None or not _same_place(now, loc):
                log.debug("%s: changed since its header was read: read, not mapped", path)
                return None
        weakref.finalize(mm, _let_go, fd)
        keep = True
        return mm
    finally:
        if not keep:
            if mm is not None:
                mm.close()
            _let_go(fd)


def map_weights(
    root: str, metadata: Metadata, names: Sequence[str], max_header_size: int
) -> Iterator[tuple[str, torch.Tensor]] | None:
    """The tensors ``names`` of a local safetensors checkpoint (directory ``root``, metadata
    read by asyncload) as views of leased mappings, in ``names``' order; ``None`` (nothing
    held) when any of them cannot be (see the module docstring)."""
    by_file: dict[str, dict[str, TensorLocation]] = {}
    for fqn in names:
        smd = metadata.state_dict_metadata.get(fqn)
        if not isinstance(smd, TensorStorageMetadata) or len(smd.chunks) != 1:
            return None
        chunk = smd.chunks[0]
        if any(chunk.offsets) or tuple(chunk.sizes) != tuple(smd.size):
            return None
        entry = (metadata.storage_data or {}).get(MetadataIndex(fqn, chunk.offsets))
        if not isinstance(entry, KnownTensor) or not _contiguous(entry.location):
            return None
        by_file.setdefault(entry.location.name, {})[fqn] = entry.location
    maps: dict[str, mmap.mmap] = {}
    for name, wanted in by_file.items():
        mm = _map_file(os.path.join(root, name), wanted, max_header_size)
        if mm is None:
            return None  # the files mapped so far are let go when ``maps`` is collected
        maps[name] = mm
    return _views(list(names), by_file, maps)


def _views(
    names: list[str], by_file: dict[str, dict[str, TensorLocation]], maps: dict[str, mmap.mmap]
) -> Iterator[tuple[str, torch.Tensor]]:
    left = {name: len(locs) for name, locs in by_file.items()}
    where = {fqn: (name, loc) for name, locs in by_file.items() for fqn, loc in locs.items()}
    del by_file
    for fqn in names:
        name, loc = where.pop(fqn)
        count = math.prod(loc.size)
        if count == 0:
            tensor = torch.empty(loc.size, dtype=loc.dtype)
        else:
            tensor = torch.frombuffer(
                maps[name], dtype=loc.dtype, count=count, offset=loc.data_start
            ).view(loc.size)
        left[name] -= 1
        if left[name] == 0:
            del maps[name]  # its last tensor: the lease ends with the views
        yield fqn, tensor
        del tensor
