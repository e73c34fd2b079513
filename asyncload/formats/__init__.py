"""Checkpoint formats behind one small interface (:class:`FormatEntry`).

asyncload reads four layouts through the same pipeline:

``dcp`` (:mod:`.dcp`)
    a directory with ``.metadata`` + ``*.distcp`` (what ``dcp.save`` writes). Records are
    torch.save archives located when read, or, for files written with
    ``FileSystemWriter(serialization_format=SerializationFormat.SAFETENSORS)``, a safetensors
    blob after the objects (:class:`~.safetensors.BlobTensor`).
``safetensors`` (:mod:`.safetensors`)
    one ``*.safetensors`` file, a directory holding ``model.safetensors``, or several
    ``*.safetensors`` files (``model.safetensors.index.json`` names them; torch's
    ``HuggingFaceStorageWriter(save_distributed=True)`` shards carry their chunk offsets).
``torch.save`` (:mod:`.torchsave`, zip container in :mod:`.zip`)
    one zip-format ``torch.save`` file (or HF ``pytorch_model.bin.index.json`` shards of them).
``torch-checkpointing`` (:mod:`.dcpv2`)
    a directory of ``<item>_<rank>.pt`` files (+ ``metadata.pkl``), what torch-checkpointing's
    ``CheckpointManager`` writes; pickled DTensors are assembled from every rank's shard.

For the non-DCP formats :func:`aprobe_first` / :func:`aprobe_fallback` (:mod:`.probe`)
synthesise a DCP ``Metadata`` (one chunk per tensor, or the chunks the shards name) whose
``storage_data`` maps each ``MetadataIndex`` to a :class:`FormatEntry`, so that
``dcp.load``'s planning - including DTensor and sharded destinations that read only their
slice - works unchanged, and the reader reads each tensor's bytes straight into the
destination.

Keys of a nested ``torch.save`` dict are flattened the way DCP flattens a state dict
(``{"model": {"w": t}}`` -> ``"model.w"``). When none of the destination's keys is found
but all of those found sit under one prefix (``model.``, ``module.``, ``state_dict.``),
the planner loads from under that prefix (:func:`rebase`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncload.common.lazy import lazy_names

if TYPE_CHECKING:
    from asyncload.formats.archive import own_head_len, parse_archive
    from asyncload.formats.buffers import copy_bytes, memory_of, tensor_over
    from asyncload.formats.dcp import KNOWN_DCP_VERSIONS, decode_metadata, warm_decoders
    from asyncload.formats.entries import (
        HF_INDEX,
        HF_SINGLE,
        Fetcher,
        FormatEntry,
        FormatMetadata,
        KnownTensor,
        rebase,
        source_of,
        split_file_url,
    )
    from asyncload.formats.location import TensorLocation, may_be_a_file
    from asyncload.formats.plain import is_byte_io, is_metadata, is_tensor_md, to_dcp
    from asyncload.formats.probe import aprobe_fallback, aprobe_first
    from asyncload.formats.safetensors import (
        BlobTensor,
        header_length,
        mark_dcp_safetensors,
        parse_header,
    )
    from asyncload.formats.safetensors_header import (
        HEADER_PROBE,
        SAFETENSORS_DTYPES,
        SafetensorsHeader,
        aread_header,
    )
    from asyncload.formats.torchsave import (
        KnownObject,
        aparse_archive,
        materialize,
        nest_saved,
        object_bytes,
        tensor_location,
    )
    from asyncload.formats.window import HEAD_PROBE, TAIL_PROBE, ByteWindow

#: The wing's names, imported on first use (PEP 562): a module that needs one format
#: (``asyncload.safe_open``: :mod:`.safetensors_header`, :mod:`.location`) imports only it.
_LAZY = {
    "HEADER_PROBE": "safetensors_header",
    "HEAD_PROBE": "window",
    "SAFETENSORS_DTYPES": "safetensors_header",
    "SafetensorsHeader": "safetensors_header",
    "TAIL_PROBE": "window",
    "TensorLocation": "location",
    "aparse_archive": "torchsave",
    "aread_header": "safetensors_header",
    "copy_bytes": "buffers",
    "header_length": "safetensors",
    "is_byte_io": "plain",
    "is_metadata": "plain",
    "is_tensor_md": "plain",
    "materialize": "torchsave",
    "memory_of": "buffers",
    "nest_saved": "torchsave",
    "own_head_len": "archive",
    "parse_header": "safetensors",
    "tensor_location": "torchsave",
    "tensor_over": "buffers",
    "to_dcp": "plain",
    "ByteWindow": "window",
    "parse_archive": "archive",
    "HF_INDEX": "entries",
    "HF_SINGLE": "entries",
    "Fetcher": "entries",
    "FormatEntry": "entries",
    "FormatMetadata": "entries",
    "KnownTensor": "entries",
    "rebase": "entries",
    "source_of": "entries",
    "split_file_url": "location",
    "may_be_a_file": "location",
    "KNOWN_DCP_VERSIONS": "dcp",
    "decode_metadata": "dcp",
    "warm_decoders": "dcp",
    "aprobe_fallback": "probe",
    "aprobe_first": "probe",
    "BlobTensor": "safetensors",
    "mark_dcp_safetensors": "safetensors",
    "KnownObject": "torchsave",
    "object_bytes": "torchsave",
}


__all__ = [
    "HEADER_PROBE",
    "HEAD_PROBE",
    "HF_INDEX",
    "HF_SINGLE",
    "KNOWN_DCP_VERSIONS",
    "SAFETENSORS_DTYPES",
    "TAIL_PROBE",
    "BlobTensor",
    "ByteWindow",
    "Fetcher",
    "FormatEntry",
    "FormatMetadata",
    "KnownObject",
    "KnownTensor",
    "SafetensorsHeader",
    "TensorLocation",
    "aparse_archive",
    "aprobe_fallback",
    "aprobe_first",
    "aread_header",
    "copy_bytes",
    "decode_metadata",
    "header_length",
    "is_byte_io",
    "is_metadata",
    "is_tensor_md",
    "mark_dcp_safetensors",
    "materialize",
    "may_be_a_file",
    "memory_of",
    "nest_saved",
    "object_bytes",
    "own_head_len",
    "parse_archive",
    "parse_header",
    "rebase",
    "source_of",
    "split_file_url",
    "tensor_location",
    "tensor_over",
    "to_dcp",
    "warm_decoders",
]

__getattr__, __dir__ = lazy_names(
    __name__, globals(), {k: f".{m}" for k, m in _LAZY.items()}, __all__
)
del lazy_names  # (not a name of the package)
