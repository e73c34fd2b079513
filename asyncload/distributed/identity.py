"""What the ranks of a sharded load must agree on before they share bytes: the files'
identities (:func:`file_identities`: digests of what the metadata says each file holds,
independent of the URL) and how the load ends (:func:`_check_same_ending`)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from asyncload.common.errors import DistributedLoadError

__all__ = ["checkpoint_identity", "file_identities"]


def file_identities(metadata: Any) -> dict[str, str]:
    """Per file of the checkpoint, a digest of what the metadata says it holds: the saved
    items in it (key, saved chunk, byte range, and the key's dtype and shape) and the save's
    id. Independent of the URL the checkpoint was reached through: two ranks share the bytes
    of a file only when they agree on its digest."""
    if metadata is None:
        return {}
    sdm = metadata.state_dict_metadata
    save_id = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
    per_file: dict[str, list[str]] = {}
    for index, info in metadata.storage_data.items():
        name = str(getattr(info, "relative_path", ""))
        md = sdm.get(index.fqn)
        props = getattr(md, "properties", None)
        shape = (str(props.dtype), tuple(md.size)) if props is not None else type(md).__name__
        item = (
            index.fqn,
            tuple(index.offset or ()),
            index.index,
            getattr(info, "offset", 0),
            info.length,
            shape,
        )
        per_file.setdefault(name, []).append(repr(item))
    out = {}
    for name, items in per_file.items():
        h = hashlib.sha256(repr(save_id).encode())
        for text in sorted(items):
            h.update(text.encode())
        out[name] = h.hexdigest()[:32]
    return out


def checkpoint_identity(metadata: Any) -> str:
    """One digest of :func:`file_identities`: the same for every URL of one checkpoint."""
    h = hashlib.sha256()
    for name, digest in sorted(file_identities(metadata).items()):
        h.update(f"{name}={digest};".encode())
    return h.hexdigest()


def _check_identities(identities: Sequence[dict[str, str]], rank: int) -> None:
    """Ranks that need bytes of one file agree on what it holds (the same checkpoint, any
    URL); raise DistributedLoadError otherwise."""
    by_file: dict[str, dict[str, list[int]]] = {}
    for r, files in enumerate(identities):
        for name, digest in files.items():
            by_file.setdefault(name, {}).setdefault(digest, []).append(r)
    for name in sorted(by_file):
        groups = by_file[name]
        if len(groups) <= 1:
            continue
        ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
        odd = ordered[1][1]
        shown = "; ".join(f"ranks {rs}: {digest[:12]}" for digest, rs in ordered)
        raise DistributedLoadError(
            "the ranks are not loading the same checkpoint: their metadata says different "
            f"things about {name} ({shown}, as digests of what it holds); ShardedLoadPlanner "
            "shares bytes between ranks that load identical metadata, through whatever URL each "
            f"reaches it: point rank(s) {odd} at the same checkpoint",
            rank=odd[0],
            doing="comparing the checkpoint's metadata",
        )


#: Where the docs say which settings must match (errors point there).
MUST_MATCH = "asyncload docs: Distributed > What must match across ranks"


def _check_settings(settings: Sequence[Any]) -> None:
    """Every rank shapes the shared plan and the rings from the same settings
    (``settings[r]``: rank r's ``(name, value)`` pairs, :meth:`_ShareSession.settings`): a
    difference raises DistributedLoadError on every rank (each runs this on the same
    all-gathered values), naming the setting, the ranks and their values, before any byte
    is shared."""
    by_name: dict[str, dict[str, list[int]]] = {}
    for r, pairs in enumerate(settings):
        if not isinstance(pairs, (tuple, list)):
            pairs = (("asyncload's sharing protocol", f"unknown ({type(pairs).__name__})"),)
        for item in pairs:
            name, value = item
            by_name.setdefault(str(name), {}).setdefault(repr(value), []).append(r)
    names = list(by_name)
    for name in names:
        groups = by_name[name]
        missing = [r for r in range(len(settings)) if all(r not in rs for rs in groups.values())]
        if missing:
            groups = {**groups, "(not sent)": missing}
        if len(groups) <= 1:
            continue
        ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
        odd = ordered[-1][1]
        shown = "; ".join(f"rank(s) {rs}: {value}" for value, rs in ordered)
        raise DistributedLoadError(
            f"the ranks' settings disagree on {name} ({shown}): every rank of a sharded load "
            "must shape the shared plan alike, or ranks would exchange different bytes under one "
            f"name; give every rank the same LoadOptions and ShardedLoadPlanner settings "
            f"({MUST_MATCH})",
            rank=odd[0],
            doing="comparing the ranks' planner settings",
        )


def _check_same_ending(early: Sequence[bool]) -> None:
    """Every rank ends the load the same way: returning before its peers, or waiting for
    all (a rank that waits would otherwise wait at the end for ranks that never come)."""
    if len(set(early)) <= 1:
        return
    waits = [r for r, e in enumerate(early) if not e]
    odd = waits if len(waits) <= len(early) - len(waits) else [r for r, e in enumerate(early) if e]
    raise DistributedLoadError(
        f"the ranks' ShardedLoadPlanner disagree on wait_for_peers (rank(s) {waits} wait for "
        "all ranks at the end of the load, the others return before their peers): give every "
        "rank the same planner settings",
        rank=odd[0],
        doing="comparing the ranks' planner settings",
    )
