"""Checkpoint entries under a subtree the destination names: filled, or refused.

``dcp.load`` reads only the keys the destination holds, so a resume into
``{"model": model.state_dict(), "optimizer": opt.state_dict()}`` with a freshly built
optimizer (its ``state_dict()["state"]`` is ``{}``) would restore nothing of the optimizer's
state and say so only in ``LoadStats.unexpected_keys``. Here, before the plan is made
(:func:`place_entries`, called from the planner's ``set_up_planner``):

* a checkpoint key below an **empty container** of the destination (an empty dict: an
  optimizer's ``"state"``, a scheduler's or a callback's ``{}``; an empty list, filled by the
  saved indexes) is **filled** into it, nested
  as ``torch.load`` gives it: the saved keys (ints stay ints for torch.save files; for DCP,
  whose paths keep only strings, an optimizer state's parameter ids become the ints its
  ``param_groups`` name), the saved containers (dicts, lists), tensors as new CPU tensors of
  the saved dtype and shape (``torch.load(map_location="cpu")``; the owner's
  ``load_state_dict`` places and casts them, as an optimizer does), objects as decoded;
* any other checkpoint key below a container the destination holds (a non-empty dict or list,
  a tensor where the checkpoint has more below it) cannot be placed: :func:`unplaced_message`
  names them (the planner raises, or with ``allow_partial_load=True`` warns once and lists
  them in ``LoadStats.unexpected_keys``);
* keys outside every container of the destination (``optim.*`` when the destination is
  ``{"model": ...}``, or any key when it is a flat model state dict) stay as ``dcp.load``
  treats them: unexpected keys, not an error.

:func:`optimizer_ids_to_names` maps a torch.save'd optimizer's int parameter ids to the
parameter names of a destination made by ``torch.distributed.checkpoint.state_dict``'s
``get_state_dict`` (the i-th id of the saved ``param_groups`` is the i-th name of the
destination's, as ``set_state_dict`` matches them).
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

__all__ = ["Fills", "optimizer_ids_to_names", "place_entries", "unplaced_message"]

#: How many unplaced keys a message names; the rest are counted.
SHOWN = 20
_INT = re.compile(r"0|[1-9][0-9]*")


@dataclass
class Fills:
    """What :func:`place_entries` did: the keys it filled in, where each object goes
    (``slots``: flattened key -> (container, key)), and the keys it could not place."""

    filled: list[str] = field(default_factory=list)
    slots: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    unplaced: list[str] = field(default_factory=list)


def _containers(root: Any) -> dict[str, Any]:
    """Every dict and list of the destination below its root, by flattened name (DCP's
    ``str(key)`` joined by dots)."""
    found: dict[str, Any] = {}

    def walk(prefix: str, node: Any, depth: int) -> None:
        if depth > 64:
            return
        if isinstance(node, Mapping):
            items: Any = node.items()
        elif isinstance(node, list):
            items = enumerate(node)
        else:
            return
        if prefix:
            found[prefix] = node
        for k, v in items:
            if isinstance(v, (Mapping, list)):
                walk(f"{prefix}.{k}" if prefix else str(k), v, depth + 1)

    walk("", root, 0)
    return found


def _holder(key: str, containers: Mapping[str, Any]) -> str | None:
    """The deepest destination container whose flattened name is a dotted prefix of ``key``."""
    at = len(key)
    while True:
        at = key.rfind(".", 0, at)
        if at <= 0:
            return None
        if key[:at] in containers:
            return key[:at]


def _saved_path(md: Metadata, key: str) -> tuple[Any, ...] | None:
    """``key``'s path in the saved dict (DCP's ``planner_data``; the synthesised metadata of
    a torch.save file keeps the same), below the prefix a rebase stripped."""
    paths = md.planner_data
    if not isinstance(paths, dict):
        return None
    prefix = getattr(md, "prefix", "")
    path = paths.get(f"{prefix}.{key}" if prefix else key)
    if not isinstance(path, tuple) or not path:
        return None
    if prefix:
        n = 0
        joined = ""
        while n < len(path) and joined != prefix:
            joined = f"{joined}.{path[n]}" if joined else str(path[n])
            n += 1
        if joined != prefix:
            return None
        path = path[n:]
    return path if ".".join(map(str, path)) == key else None


def _template_node(
    md: Metadata, path: Sequence[Any], by_str: dict[int, dict[str, tuple[Any, Any]]]
) -> list[tuple[Any, bool]] | None:
    """The saved keys along ``path`` (str for dicts, index for lists) as a torch.save file's
    pickle holds them: ``[(key, parent is a list), ...]``; ``None`` without a template.
    ``by_str``: each template dict's keys by ``str(key)``, built once per dict (an
    optimizer's state holds one entry per parameter)."""
    prefix = getattr(md, "prefix", "")
    head: list[Any] = prefix.split(".") if prefix else []
    for layout in getattr(md, "templates", None) or ():
        node = getattr(layout, "obj", None)
        out: list[tuple[Any, bool]] = []
        ok = True
        for comp in [*head, *path]:
            if isinstance(node, dict):  # (a pickle's dicts: dict, OrderedDict)
                index = by_str.get(id(node))
                if index is None:
                    index = by_str[id(node)] = {}
                    for k, v in node.items():
                        index.setdefault(str(k), (k, v))
                hit = index.get(str(comp))
                if hit is None:
                    ok = False
                    break
                key, node = hit
                out.append((key, False))
            elif isinstance(node, list) and isinstance(comp, int) and comp < len(node):
                out.append((comp, True))
                node = node[comp]
            else:
                ok = False
                break
        if ok:
            return out[len(head) :]
    return None


def _optimizer_ids(holder_path: str, containers: Mapping[str, Any]) -> set[int] | None:
    """When the container ``holder_path`` is an optimizer's ``state`` (a dict beside a
    ``param_groups`` list of dicts with ``params``), the int parameter ids its groups name."""
    parent_name, _, last = holder_path.rpartition(".")
    if last != "state":
        return None
    parent = containers.get(parent_name) if parent_name else None
    groups = parent.get("param_groups") if isinstance(parent, Mapping) else None
    if not isinstance(groups, list):
        return None
    ids: set[int] = set()
    for g in groups:
        params = g.get("params") if isinstance(g, Mapping) else None
        if isinstance(params, list):
            ids.update(p for p in params if isinstance(p, int))
    return ids


def place_entries(state_dict: MutableMapping[str, Any], original: Any, md: Metadata) -> Fills:
    """Fill the checkpoint keys below empty containers of the destination into them (see the
    module docstring), adding each to the flattened ``state_dict`` (tensors allocated to be
    read in place, objects as ``None`` until they are decoded: ``Fills.slots`` says where
    they go in ``original``); list the other keys below a destination container."""
    fills = Fills()
    saved = md.state_dict_metadata
    extra = [k for k in saved if k not in state_dict and "." in k]
    if not extra:
        return fills
    containers = _containers(original)
    if not containers:
        return fills
    empty = {
        name for name, node in containers.items() if isinstance(node, (dict, list)) and not node
    }
    groups: dict[str, list[str]] = {}
    for key in extra:
        holder = _holder(key, containers)
        if holder is None:
            continue
        if holder in empty:
            groups.setdefault(holder, []).append(key)
        else:
            fills.unplaced.append(key)
    by_str: dict[int, dict[str, tuple[Any, Any]]] = {}
    for holder, keys in groups.items():
        ids = _optimizer_ids(holder, containers)
        into = containers[holder]
        for key in keys:
            rel = _relative(md, key, holder, ids, by_str)
            if isinstance(into, list) and not isinstance(rel[0][0], int):
                fills.unplaced.append(key)  # no index to put it at
                continue
            _put(into, rel, key, saved[key], state_dict, fills)
        template = _template_at(md, _holder_path(md, keys[0], holder))
        if template is not None:
            _mirror(into, template, 0)
        if into and state_dict.get(holder) is into:
            # an empty list is a leaf of DCP's flattening (it holds no tensor): filled now
            del state_dict[holder]
    fills.unplaced.sort()
    return fills


def _holder_path(md: Metadata, key: str, holder: str) -> tuple[Any, ...] | None:
    """The saved path of the container ``holder``, from the saved path of ``key`` below it."""
    path = _saved_path(md, key)
    if path is None:
        return None
    joined = ""
    for n, comp in enumerate(path):
        joined = f"{joined}.{comp}" if joined else str(comp)
        if joined == holder:
            return path[: n + 1]
    return None


def _template_at(md: Metadata, path: tuple[Any, ...] | None) -> Any:
    """The node of a torch.save file's pickle at the saved ``path`` (below a rebase's
    prefix); ``None`` without a template."""
    if path is None:
        return None
    prefix = getattr(md, "prefix", "")
    head: list[Any] = prefix.split(".") if prefix else []
    for layout in getattr(md, "templates", None) or ():
        node = getattr(layout, "obj", None)
        for comp in [*head, *path]:
            if isinstance(node, dict):
                match = [v for k, v in node.items() if str(k) == str(comp)]
                node = match[0] if match else None
            elif isinstance(node, list) and isinstance(comp, int) and comp < len(node):
                node = node[comp]
            else:
                node = None
            if node is None:
                break
        if isinstance(node, (dict, list)):
            return node
    return None


def _hollow(node: Any) -> bool:
    """A dict holding only (dicts holding only) empty dicts: DCP's flattening keeps no key of
    it, so no checkpoint entry fills it."""
    return isinstance(node, dict) and all(_hollow(v) for v in node.values())


def _empty_copy(node: dict[Any, Any]) -> dict[Any, Any]:
    out: dict[Any, Any] = (
        collections.OrderedDict() if isinstance(node, collections.OrderedDict) else {}
    )
    for k, v in node.items():
        out[k] = _empty_copy(v)
    return out


def _mirror(node: Any, template: Any, depth: int) -> None:
    """Give a filled container the saved one's shape, as ``torch.load`` gives it: the empty
    dicts the flattening dropped (a Lightning loop's ``"state_dict": {}``) put back, and the
    dict keys in the saved order. Container objects stay the same (``Fills.slots`` hold them)."""
    if depth > 64:
        return
    if isinstance(node, dict) and isinstance(template, dict):
        order: list[Any] = []
        for k, v in template.items():
            if k in node:
                _mirror(node[k], v, depth + 1)
                order.append(k)
            elif _hollow(v):
                node[k] = _empty_copy(v)
                order.append(k)
        seen = set(order)
        order += [k for k in node if k not in seen]
        if list(node) != order:
            items = [(k, node[k]) for k in order]
            node.clear()
            node.update(items)
    elif isinstance(node, list) and isinstance(template, list):
        for child, saved in zip(node, template):
            _mirror(child, saved, depth + 1)


def _relative(
    md: Metadata,
    key: str,
    holder: str,
    ids: set[int] | None,
    by_str: dict[int, dict[str, tuple[Any, Any]]],
) -> list[tuple[Any, bool]]:
    """``key``'s path below the container ``holder``: ``[(key, parent is a list), ...]``."""
    path = _saved_path(md, key)
    if path is not None:
        n, joined = 0, ""
        while n < len(path) and joined != holder:
            joined = f"{joined}.{path[n]}" if joined else str(path[n])
            n += 1
        if joined == holder:
            saved = _template_node(md, path, by_str)
            if saved is not None:
                return saved[n:]
            rel = [(comp, isinstance(comp, int)) for comp in path[n:]]
            head = rel[0][0] if rel else None
            # DCP keeps dict keys as str: an optimizer state's parameter ids become ints again
            if (
                ids is not None
                and isinstance(head, str)
                and _INT.fullmatch(head)
                and int(head) in ids
            ):
                rel[0] = (int(head), False)
            return rel
    return [(key[len(holder) + 1 :], False)]  # no saved path (safetensors): the rest is the key


def _put(
    container: Any,
    rel: list[tuple[Any, bool]],
    key: str,
    smd: Any,
    state_dict: MutableMapping[str, Any],
    fills: Fills,
) -> None:
    node = container
    for i, (comp, _) in enumerate(rel[:-1]):
        child_is_list = rel[i + 1][1]
        node = _child(node, comp, [] if child_is_list else {})
    last = rel[-1][0]
    if isinstance(smd, TensorStorageMetadata):
        value: Any = torch.empty(tuple(smd.size), dtype=smd.properties.dtype)
    else:
        value = None
        fills.slots[key] = (node, last)
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value
    state_dict[key] = value
    fills.filled.append(key)


def _child(node: Any, comp: Any, new: Any) -> Any:
    if isinstance(node, list):
        while len(node) <= comp:
            node.append(None)
        if node[comp] is None:
            node[comp] = new
        return node[comp]
    if comp not in node:
        node[comp] = new
    return node[comp]


def unplaced_message(keys: Sequence[str], source: str) -> str:
    """The sentence naming checkpoint entries below a destination container that the load
    cannot place."""
    shown = ", ".join(repr(k) for k in keys[:SHOWN])
    more = len(keys) - SHOWN
    listed = shown + (f", and {more} more" if more > 0 else "")
    what = "entry" if len(keys) == 1 else "entries"
    return (
        f"{source}: the checkpoint holds {len(keys)} {what} below containers the destination names "
        f"that the destination has no place for: {listed}. They would be dropped: add them to the "
        "destination (an empty dict is filled from the checkpoint), or pass allow_partial_load=True "
        "to load without them (LoadStats.unexpected_keys then lists them)"
    )


def optimizer_ids_to_names(md: Metadata, original: Any) -> Metadata | None:
    """A view of a torch.save file's metadata in which each optimizer saved with int
    parameter ids (``opt.state_dict()``) is keyed by parameter names, where the destination
    holds that optimizer as ``get_state_dict`` makes it (``param_groups[g]["params"]`` lists
    names); ``None`` when there is nothing to map. The i-th saved id is the i-th name, group
    by group, as ``set_state_dict`` matches them; groups of other lengths are not mapped."""
    if not isinstance(original, Mapping):
        return None
    saved = md.state_dict_metadata
    storage = md.storage_data if isinstance(md.storage_data, dict) else None
    if storage is None:
        return None
    renames: dict[str, str] = {}
    objects: dict[str, Any] = {}
    for name, node in _containers(original).items():
        if not isinstance(node, Mapping) or not isinstance(node.get("state"), Mapping):
            continue
        groups = node.get("param_groups")
        if not isinstance(groups, list) or not groups:
            continue
        names: list[list[str]] = []
        for g in groups:
            params = g.get("params") if isinstance(g, Mapping) else None
            if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
                break
            names.append(params)
        else:
            mapping: dict[int, str] = {}
            for gi, fqns in enumerate(names):
                key = f"{name}.param_groups.{gi}.params"
                entry: Any = storage.get(MetadataIndex(key)) if key in saved else None
                ids = getattr(entry, "obj", None)
                if not isinstance(ids, list) or len(ids) != len(fqns):
                    mapping = {}
                    break
                if not all(isinstance(i, int) for i in ids):
                    mapping = {}
                    break
                mapping.update(zip(ids, fqns))
                objects[key] = dataclasses.replace(entry, obj=list(fqns))
            if not mapping:
                continue
            head = f"{name}.state."
            for k in saved:
                if k.startswith(head):
                    pid, dot, rest = k[len(head) :].partition(".")
                    if dot and _INT.fullmatch(pid) and int(pid) in mapping:
                        renames[k] = f"{head}{mapping[int(pid)]}.{rest}"
    if not renames and not objects:
        return None
    sdm = {renames.get(k, k): v for k, v in saved.items()}
    for index, entry in list(storage.items()):
        new = renames.get(index.fqn)
        if new is not None:
            storage[MetadataIndex(new, index.offset, index.index)] = entry
    for key, entry in objects.items():
        storage[MetadataIndex(key)] = entry
    paths = md.planner_data if isinstance(md.planner_data, Mapping) else {}
    return dataclasses.replace(md, state_dict_metadata=sdm, planner_data=dict(paths))
