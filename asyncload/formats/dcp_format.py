""":class:`FormatMetadata`: DCP's ``Metadata`` synthesised for a non-DCP checkpoint (its own
module, as it imports ``torch.distributed.checkpoint``: a load that needs no DCP builds
:class:`asyncload.formats.plain.PlainFormatMetadata` instead)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["FormatMetadata"]


@dataclass
class FormatMetadata(Metadata):
    """DCP ``Metadata`` synthesised for a non-DCP checkpoint."""

    #: ``"safetensors"`` or ``"torch.save"``.
    format: str = "dcp"
    #: What was found, for messages (``"s3://b/model.safetensors"``).
    source: str = ""
    #: The key prefix the planner stripped (:func:`rebase`), or ``""``.
    prefix: str = ""
    #: torch.save files: each file's layout (its decoded pickle, tensors as ``TensorRef``), in
    #: file order: the exact structure a loaded state dict is rebuilt into
    #: (:func:`asyncload.formats.torchsave.nest_saved`).
    templates: list[Any] = field(default_factory=list)
