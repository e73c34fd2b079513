"""Destination keys against the checkpoint's: tied destinations (two keys, one tensor's
memory), the keys the checkpoint lacks, and the checkpoint key closest to each of them.

Pure functions over the (flattened) destination state dict and the checkpoint's key table;
:class:`asyncload.PipelinedLoadPlanner` calls them while it plans, before any read.
"""

from __future__ import annotations

import bisect
import difflib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from asyncload.common.errors import StateDictMismatchError
from asyncload.formats import is_tensor_md

__all__ = [
    "MISSING_SHOWN",
    "alias_groups",
    "closest_keys",
    "missing_keys_message",
    "prefix_fix",
    "same_bits",
]

#: How many missing keys an error names (with their closest checkpoint keys); the rest are counted.
MISSING_SHOWN = 20
#: Checkpoint keys compared character by character with one missing key, at most: those
#: nearest to it in sorted order (most share a long prefix with it), among the keys of its shape.
_WINDOW = 64


#: Plain tensor types (a subclass may be a DTensor or a wrapper without storage of its own).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _address(value: Any) -> int:
    """The address of a plain tensor's first element; 0 for anything that cannot be tied
    (not a plain tensor: a DTensor or ShardedTensor, an object; a tensor without memory)."""
    if type(value) not in _PLAIN:
        if not isinstance(value, torch.Tensor) or callable(getattr(value, "to_local", None)):
            return 0
        if callable(getattr(value, "local_shards", None)):
            return 0
    try:
        return int(value.data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):  # a wrapper subclass without storage
        return 0


def _alias_identity(value: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two destination tensors one and the same memory: device, storage address,
    storage offset, shape, stride and dtype; ``None`` for an empty or meta tensor."""
    if value.numel() == 0 or value.device.type == "meta":
        return None
    return (
        str(value.device),
        value.untyped_storage().data_ptr(),
        value.storage_offset(),
        tuple(value.shape),
        tuple(value.stride()),
        value.dtype,
    )


def alias_groups(state_dict: Mapping[str, Any]) -> list[list[str]]:
    """The groups of two or more keys of ``state_dict`` whose tensors are one and the same
    memory (tied weights: ``lm_head.weight`` and ``model.embed_tokens.weight``), each in the
    state dict's order. Tensors that merely overlap (a view of part of another) are not tied.
    Cheap for large state dicts: only tensors that start at the same address are compared."""
    first: dict[int, str] = {}
    shared: dict[
        int, list[str]
    ] = {}  # (no list per key: 100k small lists cost garbage collections)
    for key, value in state_dict.items():
        address = _address(value)
        if address:
            other = first.setdefault(address, key)
            if other is not key:
                shared.setdefault(address, [other]).append(key)
    groups: list[list[str]] = []
    for keys in shared.values():
        seen: dict[tuple[Any, ...], list[str]] = {}
        for key in keys:
            identity = _alias_identity(state_dict[key])
            if identity is not None:
                seen.setdefault(identity, []).append(key)
        groups.extend(g for g in seen.values() if len(g) > 1)
    return groups


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one dtype and shape hold the same bytes (NaNs with the same bits equal)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(
        a.detach().contiguous().reshape(-1).view(torch.uint8),
        b.detach().contiguous().reshape(-1).view(torch.uint8),
    )


def _strip_first(key: str) -> str | None:
    head, dot, rest = key.partition(".")
    return rest if dot and head and rest else None


def closest_keys(
    missing: Sequence[str],
    destination: Mapping[str, Any],
    saved: Mapping[str, Any],
) -> dict[str, str]:
    """For each of ``missing`` (destination keys the checkpoint lacks), the checkpoint key
    that most likely holds it, where one is close: among the checkpoint keys the destination
    lacks, first one that differs only by a first component added, removed or replaced
    (``model.``, ``module.``), else the closest by ``difflib`` among the keys whose tensor
    has the destination's shape. The cost is bounded: one pass over the checkpoint's keys,
    then at most ``_WINDOW`` comparisons per missing key."""
    candidates = sorted(k for k in saved if k not in destination)
    if not candidates or not missing:
        return {}
    by_stripped: dict[str, str] = {}
    by_shape: dict[Any, list[str]] = {}
    # DCP's class or asyncload.formats.plain's (safe_open's keys: None, neither)
    for k in candidates:
        head, dot, rest = k.partition(".")
        if dot and head and rest and rest not in by_stripped:
            by_stripped[rest] = k
        smd = saved[k]
        shape = smd.size if is_tensor_md(smd) else None
        same = by_shape.get(shape)
        if same is None:
            by_shape[shape] = [k]
        else:
            same.append(k)  # sorted, as candidates are
    exact = set(candidates)
    found: dict[str, str] = {}
    for key in missing:
        tail = _strip_first(key)
        hit = by_stripped.get(key)  # the checkpoint has a prefix more ("model." + key)
        if hit is None and tail is not None:
            if tail in exact:  # the checkpoint has a prefix less
                hit = tail
            else:  # another first component ("module." where the destination has "model.")
                hit = by_stripped.get(tail)
        if hit is None:
            value = destination.get(key)
            shape = value.shape if isinstance(value, torch.Tensor) else None
            pool = by_shape.get(shape) or candidates
            at = bisect.bisect_left(pool, key)
            window = pool[max(0, at - _WINDOW // 2) : at + _WINDOW // 2]
            close = difflib.get_close_matches(key, window, n=1, cutoff=0.75)
            hit = close[0] if close else None
        if hit is not None:
            found[key] = hit
    return found


def check_missing_keys(
    state_dict: Mapping[str, Any],
    saved: Mapping[str, Any],
    tied: Mapping[str, Any],
    *,
    allow_partial_load: bool,
    source: str,
) -> list[str]:
    """The destination keys the checkpoint lacks (``saved``: its entries; ``tied``: keys
    loaded through another), sorted; unless ``allow_partial_load``, a
    :class:`StateDictMismatchError` naming them, each with its closest checkpoint key."""
    missing = sorted(fqn for fqn in state_dict if fqn not in saved and fqn not in tied)
    if missing and not allow_partial_load:
        closest = closest_keys(missing[:MISSING_SHOWN], state_dict, saved)
        raise StateDictMismatchError(
            f"{source}: " + missing_keys_message(missing, len(state_dict), closest)
        )
    return missing


def missing_keys_message(
    missing: Sequence[str], n_destination: int, closest: Mapping[str, str]
) -> str:
    """The sentence of the error for destination keys the checkpoint lacks: each of the first
    :data:`MISSING_SHOWN` with its closest checkpoint key, the count, and the option to pass."""
    shown = []
    for key in missing[:MISSING_SHOWN]:
        hit = closest.get(key)
        shown.append(
            f"{key!r} (closest checkpoint key: {hit!r})" if hit is not None else repr(key)
        )
    more = len(missing) - len(shown)
    listed = ", ".join(shown) + (f", and {more} more" if more > 0 else "")
    verb = "is" if len(missing) == 1 else "are"
    if len(missing) >= n_destination:
        # nothing would load: allow_partial_load is no answer, the keys' names are
        what = (
            "the destination's one key is missing from the checkpoint"
            if n_destination == 1
            else f"none of the destination's {n_destination} keys is in the checkpoint"
        )
        return f"{what}: {listed}. " + prefix_fix(missing, closest)
    return (
        f"{len(missing)} of the destination's {n_destination} keys {verb} missing from the checkpoint: {listed}. "
        "To load the keys it has and leave these as they are, "
        "pass allow_partial_load=True (to asyncload.load / aload / start_load, or to the planner); "
        "LoadStats.missing_keys then lists them"
    )


def prefix_fix(missing: Sequence[str], closest: Mapping[str, str]) -> str:
    """The advice for a destination whose keys differ from the checkpoint's by a first
    component: the prefix to nest the destination under, or to strip from its keys."""
    add: dict[str, int] = {}
    strip: dict[str, int] = {}
    rename: dict[tuple[str, str], int] = {}
    for key in missing:
        hit = closest.get(key)
        if hit is None:
            continue
        head, dot, tail = key.partition(".")
        other, dot2, rest = hit.partition(".")
        if dot and dot2 and rest == tail:  # another first component
            rename[(head, other)] = rename.get((head, other), 0) + 1
        elif hit.endswith("." + key):
            p = hit[: -len(key) - 1]
            add[p] = add.get(p, 0) + 1
        elif key.endswith("." + hit):
            p = key[: -len(hit) - 1]
            strip[p] = strip.get(p, 0) + 1
    if add:
        p = max(add, key=lambda k: add[k])
        return (
            f"The checkpoint holds them under {p!r}: load into {{{p!r}: state_dict}} "
            "(or save the model's state dict alone)"
        )
    if strip:
        p = max(strip, key=lambda k: strip[k])
        return (
            f"The destination's keys carry the prefix {p + '.'!r} where the checkpoint's do not: strip it "
            f"(torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(state_dict, {p + '.'!r})), "
            "or load the unwrapped model's state dict (model.module.state_dict()); keys then "
            "found under one top-level name of the checkpoint load from there"
        )
    if rename:
        head, other = max(rename, key=lambda k: rename[k])
        return (
            f"The destination's keys start with {head!r} where the checkpoint's start with {other!r}: "
            f"rename that first component of the destination's keys (or, for a wrapper's prefix such as "
            f"'module', load the unwrapped model's state dict: model.module.state_dict())"
        )
    return (
        "Is it the right checkpoint? Compare the key names (asyncload inspect lists the "
        "checkpoint's); where they differ by a prefix, rename the destination's keys to match"
    )
