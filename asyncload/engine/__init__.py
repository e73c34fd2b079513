"""The engine wing: one load's async core, below the faces and the distributed wing.

``config`` resolves the options once (:func:`~asyncload.engine.config.resolve_config`:
policies and the memory plan); ``session`` is the load (:class:`LoadSession`, made with its
collaborators) with ``records``, ``reads``, ``checks`` and ``cost`` as its jobs and ``tally``
(statistics and clock) and ``cancellation`` (tasks, the library loop) as its parts; ``driver``
runs the planner sequence over a session for 1..N ranks; ``plan`` and ``chunks`` say what to
read; ``pipeline`` reads it under the meters (``meter``: the one :class:`Meter`);
``read_loop`` reads chunks into memory their caller owns (``safe_open``, integrations);
``assembly``, ``cuda_ring``, ``transforms`` and ``crc`` put the bytes in place and check them.
Importing this package imports none of its modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncload.common.lazy import lazy_names

if TYPE_CHECKING:
    from asyncload.engine.assembly import assemble, copy_bytes, track
    from asyncload.engine.changes import check_unchanged
    from asyncload.engine.chunks import Chunk, Piece
    from asyncload.engine.config import (
        LoadConfig,
        PlannerTerms,
        PlanReport,
        governing_options,
        open_boundary,
        resolve_config,
    )
    from asyncload.engine.cost import (
        LOCAL_BANDWIDTH,
        LOCAL_REQUEST_SECONDS,
        REMOTE_BANDWIDTH,
        REMOTE_REQUEST_SECONDS,
        ReadBudget,
    )
    from asyncload.engine.cuda_ring import DeviceCopier, use_copier
    from asyncload.engine.destinations import PLAIN_TENSOR_TYPES, check_destinations
    from asyncload.engine.driver import _in_thread, load_steps, read_steps, run_async, run_sync
    from asyncload.engine.fills import (
        Fills,
        optimizer_ids_to_names,
        place_entries,
        unplaced_message,
    )
    from asyncload.engine.intersect import (
        _rekey_pre_2_4,
        local_load_plan,
        read_items_for_chunks,
        state_dict_read_items,
    )
    from asyncload.engine.keys import alias_groups, check_missing_keys, closest_keys, same_bits
    from asyncload.engine.meter import Meter, MeterStatistics
    from asyncload.engine.pipeline import Pipeline, _aiter, _DirectRun, direct_run
    from asyncload.engine.plan import check_cast, make_chunks
    from asyncload.engine.read_loop import read_chunks
    from asyncload.engine.session import LoadSession, decode_object, in_flight

#: The wing's interface: each name the other wings use, and its module, imported on
#: first use (PEP 562), so that importing the package imports none of its modules.
_LAZY = {
    "Chunk": "asyncload.engine.chunks",
    "DeviceCopier": "asyncload.engine.cuda_ring",
    "Fills": "asyncload.engine.fills",
    "LOCAL_BANDWIDTH": "asyncload.engine.cost",
    "LOCAL_REQUEST_SECONDS": "asyncload.engine.cost",
    "LoadConfig": "asyncload.engine.config",
    "PlanReport": "asyncload.engine.config",
    "PlannerTerms": "asyncload.engine.config",
    "LoadSession": "asyncload.engine.session",
    "Meter": "asyncload.engine.meter",
    "MeterStatistics": "asyncload.engine.meter",
    "PLAIN_TENSOR_TYPES": "asyncload.engine.destinations",
    "Piece": "asyncload.engine.chunks",
    "Pipeline": "asyncload.engine.pipeline",
    "REMOTE_BANDWIDTH": "asyncload.engine.cost",
    "REMOTE_REQUEST_SECONDS": "asyncload.engine.cost",
    "ReadBudget": "asyncload.engine.cost",
    "_DirectRun": "asyncload.engine.pipeline",
    "_aiter": "asyncload.engine.pipeline",
    "_in_thread": "asyncload.engine.driver",
    "_rekey_pre_2_4": "asyncload.engine.intersect",
    "alias_groups": "asyncload.engine.keys",
    "assemble": "asyncload.engine.assembly",
    "check_cast": "asyncload.engine.plan",
    "check_destinations": "asyncload.engine.destinations",
    "check_missing_keys": "asyncload.engine.keys",
    "check_unchanged": "asyncload.engine.changes",
    "closest_keys": "asyncload.engine.keys",
    "copy_bytes": "asyncload.engine.assembly",
    "decode_object": "asyncload.engine.session",
    "direct_run": "asyncload.engine.pipeline",
    "in_flight": "asyncload.engine.session",
    "load_steps": "asyncload.engine.driver",
    "local_load_plan": "asyncload.engine.intersect",
    "make_chunks": "asyncload.engine.plan",
    "open_boundary": "asyncload.engine.config",
    "governing_options": "asyncload.engine.config",
    "optimizer_ids_to_names": "asyncload.engine.fills",
    "place_entries": "asyncload.engine.fills",
    "read_chunks": "asyncload.engine.read_loop",
    "read_items_for_chunks": "asyncload.engine.intersect",
    "read_steps": "asyncload.engine.driver",
    "resolve_config": "asyncload.engine.config",
    "run_async": "asyncload.engine.driver",
    "run_sync": "asyncload.engine.driver",
    "same_bits": "asyncload.engine.keys",
    "state_dict_read_items": "asyncload.engine.intersect",
    "track": "asyncload.engine.assembly",
    "unplaced_message": "asyncload.engine.fills",
    "use_copier": "asyncload.engine.cuda_ring",
}


__all__ = [
    "LOCAL_BANDWIDTH",
    "LOCAL_REQUEST_SECONDS",
    "PLAIN_TENSOR_TYPES",
    "REMOTE_BANDWIDTH",
    "REMOTE_REQUEST_SECONDS",
    "Chunk",
    "DeviceCopier",
    "Fills",
    "LoadConfig",
    "LoadSession",
    "Meter",
    "MeterStatistics",
    "Piece",
    "Pipeline",
    "PlanReport",
    "PlannerTerms",
    "ReadBudget",
    "_DirectRun",
    "_aiter",
    "_in_thread",
    "_rekey_pre_2_4",
    "alias_groups",
    "assemble",
    "check_cast",
    "check_destinations",
    "check_missing_keys",
    "check_unchanged",
    "closest_keys",
    "copy_bytes",
    "decode_object",
    "direct_run",
    "governing_options",
    "in_flight",
    "load_steps",
    "local_load_plan",
    "make_chunks",
    "open_boundary",
    "optimizer_ids_to_names",
    "place_entries",
    "read_chunks",
    "read_items_for_chunks",
    "read_steps",
    "resolve_config",
    "run_async",
    "run_sync",
    "same_bits",
    "state_dict_read_items",
    "track",
    "unplaced_message",
    "use_copier",
]

__getattr__, __dir__ = lazy_names(__name__, globals(), _LAZY, __all__)
del lazy_names  # (not a name of the package)
