"""The names of a torch-checkpointing directory (``metadata.pkl``, ``<item>_<rank>.pt``):
whether a listing is one, apart from the reader (:mod:`.dcpv2`), so that probing a
checkpoint's format does not import the archive parser."""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["ITEM_FILE", "METADATA_FILE", "is_torch_checkpointing", "item_file_hint"]

#: The file torch-checkpointing writes when an item declares a resharder.
METADATA_FILE = "metadata.pkl"

#: ``<item>_<rank>.pt``: torch-checkpointing's default layout (``default_torch_layout_info``).
ITEM_FILE = re.compile(r"^(?P<item>[A-Za-z0-9_.\-]+?)_(?P<rank>0|[1-9][0-9]{0,6})\.pt$")


def is_torch_checkpointing(names: Sequence[str]) -> bool:
    """Whether a directory listing is a torch-checkpointing checkpoint: a ``metadata.pkl``
    or rank-0 item files (``<item>_0.pt``), and no ``.pt`` file of another name (a
    ``metadata.pkl`` alone is one whose item files are missing: it says which)."""
    pts = [n for n in names if n.endswith(".pt")]
    if not all(ITEM_FILE.match(n) for n in pts):
        return False
    return METADATA_FILE in names or any(n.endswith("_0.pt") for n in pts)


def item_file_hint(name: str) -> str | None:
    """What to say when a file named like one torch-checkpointing item file cannot be read
    alone (an int item, a DTensor shard): load its directory."""
    base = name.rsplit("/", 1)[-1]
    if not ITEM_FILE.match(base):
        return None
    return (
        f"{base} is named like one item file of a torch-checkpointing checkpoint "
        f"(<item>_<rank>.pt): "
        "load the checkpoint's directory instead, which asyncload reads whole"
    )
