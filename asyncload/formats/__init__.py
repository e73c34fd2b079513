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
``torch-checkpointing`` (:mod:`.torch_checkpointing`)
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

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncload.formats.archive import ByteWindow, parse_archive
    from asyncload.formats.base import (
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
    from asyncload.formats.dcp import KNOWN_DCP_VERSIONS, decode_metadata, warm_decoders
    from asyncload.formats.location import may_be_a_file
    from asyncload.formats.probe import aprobe_fallback, aprobe_first
    from asyncload.formats.safetensors import BlobTensor, mark_dcp_safetensors
    from asyncload.formats.torchsave import KnownObject, object_bytes

#: The wing's names, imported on first use (PEP 562): a module that needs one format
#: (``asyncload.safe_open``: :mod:`.safetensors_header`, :mod:`.location`) imports only it.
_LAZY = {
    "ByteWindow": "archive",
    "parse_archive": "archive",
    "HF_INDEX": "base",
    "HF_SINGLE": "base",
    "Fetcher": "base",
    "FormatEntry": "base",
    "FormatMetadata": "base",
    "KnownTensor": "base",
    "rebase": "base",
    "source_of": "base",
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


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncload.formats' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"asyncload.formats.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "HF_INDEX",
    "HF_SINGLE",
    "KNOWN_DCP_VERSIONS",
    "BlobTensor",
    "ByteWindow",
    "Fetcher",
    "FormatEntry",
    "FormatMetadata",
    "KnownObject",
    "KnownTensor",
    "aprobe_fallback",
    "aprobe_first",
    "decode_metadata",
    "mark_dcp_safetensors",
    "may_be_a_file",
    "object_bytes",
    "parse_archive",
    "rebase",
    "source_of",
    "split_file_url",
    "warm_decoders",
]
