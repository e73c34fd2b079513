"""DCP checkpoints (what ``torch.distributed.checkpoint.save`` writes): the ``.metadata``
file, decoded with the allow-list and checked field by field. Its records (a torch.save
archive per item in the ``.distcp`` files) are located when read, by
:mod:`asyncload.engine.session` with :mod:`asyncload.formats.torchsave`'s parser.
"""

from __future__ import annotations

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from asyncload.common.errors import CheckpointFormatError
from asyncload.common.paths import short_repr
from asyncload.decoding import WorkBudget, check_metadata, record_globals, safe_loads
from asyncload.formats.safetensors import mark_dcp_safetensors

__all__ = ["KNOWN_DCP_VERSIONS", "decode_metadata", "warm_decoders"]

#: DCP metadata versions this reader understands (``None``: written before versions existed).
KNOWN_DCP_VERSIONS = (None, "1.0.0")


def warm_decoders() -> None:
    """Build the allow-lists ``.metadata`` and the records are decoded with (1-2 ms of a
    process's first load), ahead of the bytes: a remote load calls it while its first
    requests are on the wire; and the header length its ``torch.save`` writes, the guess
    of :mod:`asyncload.engine.streamed` before any record's headers are known."""
    from asyncload.formats.archive import own_head_len

    record_globals()
    own_head_len()


def decode_metadata(
    raw: bytes | bytearray | memoryview, url: str, *, max_size: int, work: WorkBudget | None = None
) -> Metadata:
    """``.metadata``'s bytes as DCP ``Metadata``: allow-listed decoding, a known version, every
    field of the type and range DCP writes; entries of files saved as safetensors marked.
    ``work``: charged with the decode's and the checks' units (its limit, if any, ends them)."""
    md = safe_loads(
        raw, what=url, max_size=max_size, check_structure=False, expect=Metadata, work=work
    )
    if not isinstance(md, Metadata):
        raise CheckpointFormatError(
            f"{url} does not hold DCP Metadata (found {type(md).__name__})"
        )
    version = getattr(md, "version", None)
    if version not in KNOWN_DCP_VERSIONS:
        raise CheckpointFormatError(
            f"{url} was written by an unknown DCP version {short_repr(version)}; "
            f"asyncload reads versions {[v for v in KNOWN_DCP_VERSIONS if v]}"
        )
    check_metadata(md, url, work)  # every field has the type and range DCP writes
    if not isinstance(getattr(md, "state_dict_metadata", None), dict) or not isinstance(
        getattr(md, "storage_data", None), dict
    ):
        raise CheckpointFormatError(f"{url}: metadata lacks its key or storage tables")
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = StorageMeta()
    mark_dcp_safetensors(md)  # files saved with SerializationFormat.SAFETENSORS
    # the checkpoint's directory, for messages of the planner (formats.source_of)
    md._asyncload_source = url.rsplit("/", 1)[0] if url.endswith("metadata") else url  # type: ignore[attr-defined]
    return md
