"""The shape of a decoded checkpoint value: nesting and sharing bombs refused
(:func:`_check_structure`, over :func:`~asyncload.decoding.vm.check_structure` with the
children of checkpoint values, :func:`_children`).

Raised: :class:`UnsafeCheckpointError` for a value nested too deeply or expanding past the
work budget through shared references.
"""

from __future__ import annotations

import enum
import pathlib
from typing import Any

import torch

from asyncload.decoding.tables import StorageRef, TensorRef, loaded_dcp_types
from asyncload.decoding.vm import check_structure as _walk_structure
from asyncload.decoding.work import WorkBudget

_LEAF_TYPES = (
    str,
    bytes,
    bytearray,
    int,
    float,
    bool,
    complex,
    type(None),
    torch.dtype,
    torch.layout,
    torch.memory_format,
    torch.device,
    enum.Enum,
    pathlib.PurePath,
    TensorRef,
    StorageRef,
)


def _children(o: Any) -> list[Any] | None:
    if isinstance(o, _LEAF_TYPES):
        return None
    if isinstance(o, dict):
        kids = [*o.keys(), *o.values()]
        if type(o) is not dict and hasattr(o, "__dict__"):
            kids.extend(vars(o).values())  # OrderedDict attributes (state_dict()._metadata)
        return kids
    if isinstance(o, (list, tuple, set, frozenset)):
        return list(o)
    if type(o) is slice:
        return [o.start, o.stop, o.step]
    dcp = loaded_dcp_types()
    if dcp is not None and type(o) in dcp.classes:
        return list(vars(o).values())
    fields = getattr(o, "__dict__", None)
    if type(fields) is dict and not isinstance(o, type):  # an object of a class the user trusts
        return list(fields.values())
    return None


def _check_structure(
    obj: Any, what: str, max_depth: int, budget: int, work: WorkBudget | None = None
) -> None:
    """:func:`~asyncload.decoding.vm.check_structure` over checkpoint values (see
    :func:`_children`);
    the nodes walked are charged to ``work``."""
    if _flat_within(obj, max_depth, budget):
        units = 1 + len(obj) + sum(map(len, obj.values()))
    else:
        units = _walk_structure(obj, what, max_depth, budget, _children)
    if work is not None:
        work.charge(units, what)


def _flat_within(obj: Any, max_depth: int, budget: int) -> bool:
    """Whether ``obj`` is a plain dict of strings to tuples (or lists) of strings (DCP's
    ``planner_data``: each key's path) that the walk would accept: two levels deep, and
    ``1 + len + sum(1 + len(value))`` nodes with shared values counted each time, as the walk
    counts them. Anything else (or over the budget) is left to the walk and its messages."""
    if type(obj) is not dict or max_depth < 2:
        return False
    n = 1 + len(obj)
    for k, v in obj.items():
        if type(k) is not str or type(v) not in (tuple, list):
            return False
        for x in v:
            if type(x) is not str:
                return False
        n += 1 + len(v)
    return n <= budget
