"""Where a saved tensor's bytes are (:class:`TensorLocation`), and which store holds a file
checkpoint (:func:`split_file_url`): what every format answers, with nothing but torch and the
storage wing's URL helpers (no ``torch.distributed.checkpoint``), so that
``asyncload.safe_open`` imports no more than it needs. Re-exported by :mod:`.base`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from asyncload.common.errors import CheckpointFormatError
from asyncload.storage import is_local, local_root

__all__ = ["TensorLocation", "may_be_a_file", "split_file_url"]

#: Names whose URL is taken for a file first (before looking for ``.metadata`` under it).
_FILE_SUFFIXES = (
    ".safetensors",
    ".json",
    ".pt",
    ".pth",
    ".bin",
    ".ckpt",
    ".tar",
    ".pkl",
    ".pickle",
)


def may_be_a_file(checkpoint: str | os.PathLike[str]) -> bool:
    """Whether :func:`~asyncload.formats.probe.aprobe_first` can find a file checkpoint at
    ``checkpoint`` (a local file; a URL whose name ends in a file suffix): where not, a load
    goes to ``.metadata`` without importing the probing formats (its first request sooner)."""
    if is_local(checkpoint):
        return os.path.isfile(local_root(checkpoint))
    s = str(checkpoint)
    return not s.endswith("/") and s.split("?", 1)[0].lower().endswith(_FILE_SUFFIXES)


@dataclass(frozen=True)
class TensorLocation:
    """Where a saved tensor's elements are: the format-independent answer of every format module."""

    #: File name relative to the checkpoint root.
    name: str
    #: Absolute byte offset, in that file, of storage element 0.
    data_start: int
    #: Bytes of the storage.
    storage_nbytes: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    #: In elements.
    storage_offset: int = 0
    #: CRC-32 of the storage's bytes, where the format stores one.
    crc32: int | None = None
    #: Human description for messages, e.g. ``"record 'layers.0.w' at [4096, 8192) of
    #: __0_0.distcp"``.
    where: str = ""

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    def check(self) -> None:
        """Raise CheckpointFormatError unless every element lies inside the storage."""
        if (
            any(s < 0 for s in self.size)
            or any(s < 0 for s in self.stride)
            or self.storage_offset < 0
        ):
            raise CheckpointFormatError(f"{self.where}: negative size, stride or offset")
        if math.prod(self.size) == 0:
            return
        last = self.storage_offset + sum((n - 1) * s for n, s in zip(self.size, self.stride))
        if (last + 1) * self.itemsize > self.storage_nbytes:
            raise CheckpointFormatError(
                f"{self.where}: tensor of size {list(self.size)} and stride {list(self.stride)} at "
                f"offset "
                f"{self.storage_offset} needs {(last + 1) * self.itemsize} bytes, its storage has "
                f"{self.storage_nbytes}"
            )


def split_file_url(checkpoint: str | os.PathLike[str]) -> tuple[str, str]:
    """``(parent, file name)`` of a file checkpoint: a local path, ``file://`` or fsspec URL.

    The parent is what storage opens; the name is read relative to it.
    """
    if is_local(checkpoint):
        path = os.path.abspath(local_root(checkpoint))
        parent, name = os.path.split(path)
        return parent, name
    s = str(checkpoint)
    proto, rest = s.split("://", 1)
    rest = rest.split("?", 1)[0].split("#", 1)[0]
    if "/" in rest.rstrip("/"):
        head, name = rest.rstrip("/").rsplit("/", 1)
        return f"{proto}://{head}", name
    return f"{proto}://", rest.rstrip("/")
