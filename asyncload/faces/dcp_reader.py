"""The torch.distributed.checkpoint faces: :class:`PipelinedReader` (a ``StorageReader``)
and :class:`PipelinedLoadPlanner` (a ``DefaultLoadPlanner``), thin over the async core
(:class:`asyncload.engine.session.LoadSession`).

Planner hooks (``resolve_tensor``, ``commit_tensor``, ``load_bytes``) run on the
caller's thread; only reads and copies run elsewhere.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint import LoadPlan, LoadPlanner, ReadItem, StorageReader
from torch.distributed.checkpoint._extension import ExtensionRegistry
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

import asyncload.formats as formats
from asyncload.common.errors import AsyncLoadError, CheckpointFormatError, StateDictMismatchError
from asyncload.common.options import LoadOptions
from asyncload.common.stats import LoadStats
from asyncload.engine import (
    PLAIN_TENSOR_TYPES,
    Fills,
    LoadSession,
    _rekey_pre_2_4,
    check_cast,
    check_destinations,
    check_missing_keys,
    decode_object,
    local_load_plan,
    optimizer_ids_to_names,
    place_entries,
    read_steps,
    resolve_config,
    run_sync,
    same_bits,
    unplaced_message,
)
from asyncload.faces.plain_planner import ties as _ties
from asyncload.faces.terms import TermsPlanner, planner_terms
from asyncload.formats import KNOWN_DCP_VERSIONS

__all__ = [
    "KNOWN_DCP_VERSIONS",
    "PLAIN_TENSOR_TYPES",
    "PipelinedLoadPlanner",
    "PipelinedReader",
    "decode_object",
]

_UNSET: Any = object()


class PipelinedLoadPlanner(DefaultLoadPlanner, TermsPlanner):
    """A ``DefaultLoadPlanner`` that carries the load's knobs, checks the destination
    against the checkpoint with clear errors, and decodes objects with the allow-list.

    ``chunk_size``, ``min_chunk_size`` and ``timeout`` override the same fields of
    ``options`` (a ``min_chunk_size`` not given follows ``chunk_size`` down, as in
    :class:`LoadOptions`); other keyword arguments go to ``DefaultLoadPlanner``.

    Which options govern a load: with ``asyncload.load`` / ``aload`` / ``start_load``, the
    ``options`` argument, else this planner's options when they were set explicitly, for
    everything. Under a plain ``dcp.load(storage_reader=PipelinedReader(...), planner=...)``,
    torch reads ``.metadata`` before it gives the reader the planner: the reader's options
    govern that read, and this planner's options, when set explicitly, everything after it
    (file sizes, probes, data); otherwise the reader's govern throughout.
    """

    def __init__(
        self,
        *,
        chunk_size: int | None = None,
        min_chunk_size: int | None = None,
        timeout: float | None = _UNSET,
        options: LoadOptions | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        changes: dict[str, Any] = {}
        if chunk_size is not None:
            changes["chunk_size"] = chunk_size
        if min_chunk_size is not None:
            changes["min_chunk_size"] = min_chunk_size
        if timeout is not _UNSET:
            changes["timeout"] = timeout
        base = options or LoadOptions()
        self.options: LoadOptions = dataclasses.replace(base, **changes) if changes else base
        #: Whether this planner's knobs were set explicitly (they then govern the load).
        self.has_options = options is not None or bool(changes)
        #: Keys the checkpoint holds that the destination lacks (filled by create_local_plan).
        self.unexpected_keys: list[str] = []
        #: Destination keys the checkpoint lacks, left as they were (``allow_partial_load=True``).
        self.missing_keys: list[str] = []
        #: Tied destination keys (one tensor's memory under two keys) -> the key they were loaded through.
        self.tied_keys: dict[str, str] = {}
        #: Tied keys the checkpoint holds too: (the key they are tied to, a scratch tensor their
        #: saved values are read into, items left to compare against what the other key loaded).
        self._tie_checks: dict[str, list[Any]] = {}
        #: The state dict ``asyncload.load`` checked before its first request (the same one
        #: ``set_up_planner`` gets next: not read twice).
        self._destinations_checked: Any = None
        #: Checkpoint entries filled into the destination's empty containers, and those below
        #: its containers that cannot be placed (set_up_planner).
        self._fills = Fills()
        self._keys_settled = False

    def set_up_planner(
        self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        if state_dict is not self._destinations_checked:  # (by asyncload.load, just before)
            check_destinations(state_dict)  # before torch's set-up, which fails on a meta tensor
        if metadata is not None:
            # before torch's set-up, which replaces values it does not know (a numpy array)
            # by None in the caller's own dict
            _refuse_non_tensors(state_dict, metadata)
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self._fills = Fills()
        self._keys_settled = False

    def _settle_keys(self) -> None:
        """Match the destination's final keys to the checkpoint's, once per set-up: at the
        start of ``create_local_plan``, so that a subclass that renames or drops keys in its
        own ``set_up_planner`` (examples/custom_planner.py) is matched by the keys it chose."""
        if self._keys_settled:
            return
        self._keys_settled = True
        # a checkpoint whose keys sit under a prefix ("model.", "module."): load the
        # destination from there (docs/formats.md)
        rebased = formats.rebase(self.metadata, list(self.state_dict.keys()))
        if rebased is not None:
            self.metadata = rebased
        # checkpoint entries below the destination's containers: an empty one is filled, the
        # others are refused below (asyncload.engine.fills)
        self._fills = Fills()
        if self.flatten_state_dict and self.metadata is not None:
            named = optimizer_ids_to_names(self.metadata, self.original_state_dict)
            if named is not None:
                self.metadata = named
            self._fills = place_entries(self.state_dict, self.original_state_dict, self.metadata)

    def create_local_plan(self) -> LoadPlan:
        self._settle_keys()
        md = self.metadata
        if md is None:  # pragma: no cover - dcp always sets it up
            raise CheckpointFormatError("the planner was not set up with metadata")
        saved = md.state_dict_metadata
        if self.flatten_state_dict:
            # older (torch < 2.4) checkpoints flatten differently: the destination's keys as they
            # were then
            _rekey_pre_2_4(self, md)
        tied, checked = _ties(self.state_dict, md)
        source = formats.source_of(md)
        missing = check_missing_keys(
            self.state_dict,
            saved,
            tied,
            allow_partial_load=self.allow_partial_load,
            source=source,
        )
        unplaced = self._fills.unplaced
        if unplaced:
            if not self.allow_partial_load:
                raise StateDictMismatchError(unplaced_message(unplaced, source))
            warnings.warn(unplaced_message(unplaced, source), UserWarning, stacklevel=2)
        cast_ok = self.options.allow_dtype_cast
        for fqn, obj in self.state_dict.items():
            smd = saved.get(fqn)
            if smd is None:
                continue
            if isinstance(smd, TensorStorageMetadata) and not isinstance(obj, torch.Tensor):
                raise StateDictMismatchError(
                    f"{source}, key {fqn!r}: the checkpoint holds a tensor of shape {list(smd.size)}, the "
                    f"destination holds a {type(obj).__name__}: a tensor is loaded in place, so the destination must be a "
                    "torch.Tensor of that shape"
                )
            if isinstance(obj, torch.Tensor):
                if not isinstance(smd, TensorStorageMetadata):
                    raise StateDictMismatchError(
                        f"{source}, key {fqn!r}: the destination is a tensor, the checkpoint holds an object"
                    )
                shape = list(obj.size())
                if list(smd.size) != shape:
                    raise StateDictMismatchError(
                        f"{source}, key {fqn!r}: the destination has shape {shape}, the checkpoint "
                        f"{list(smd.size)}"
                    )
                check_cast(
                    smd.properties.dtype,
                    obj.dtype,
                    allow_cast=cast_ok,
                    what=f"{source}, key {fqn!r}",
                )
        self.unexpected_keys = sorted(k for k in saved if k not in self.state_dict)
        self.missing_keys = sorted(missing)
        self.tied_keys = dict(sorted(tied.items()))
        skip = [k for k in tied if k not in checked]
        plan = self._default_plan(skip=skip)
        self._check_plan_covers(plan, skip)
        # a tied key the checkpoint holds too is read into scratch memory and compared with
        # what its twin loaded: the destination is written once, never twice with two values
        counts: dict[str, int] = {}
        for item in plan.items:
            if item.type != LoadItemType.BYTE_IO and item.dest_index.fqn in checked:
                counts[item.dest_index.fqn] = counts.get(item.dest_index.fqn, 0) + 1
        self._tie_checks = {
            k: [checked[k], torch.empty_like(self.state_dict[k].detach()), counts[k]]
            for k in counts
        }
        return plan

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        check = self._tie_checks.get(index.fqn)
        if check is not None:
            return check[1]  # a tied key the checkpoint holds too: its scratch memory
        return super().lookup_tensor(index)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        fqn = read_item.dest_index.fqn
        check = self._tie_checks.get(fqn)
        if check is None:
            super().commit_tensor(read_item, tensor)
            return
        twin, _, left = check
        loaded = self.transform_tensor(read_item, super().lookup_tensor(read_item.dest_index))
        if not same_bits(loaded, tensor):
            self._tie_checks.clear()
            raise StateDictMismatchError(
                f"{formats.source_of(self.metadata)}: keys {fqn!r} and {twin!r} are one tensor in the destination (tied weights: the same memory), "
                f"but the checkpoint holds different values for them (in the box at offsets "
                f"{list(read_item.dest_offsets)}, lengths {list(read_item.lengths)}): the destination holds "
                f"{twin!r}'s values; untie the two in the model (give one its own memory) to load both"
            )
        if left <= 1:
            del self._tie_checks[fqn]  # every part compared: the scratch memory goes
        else:
            check[2] = left - 1

    def _check_plan_covers(self, plan: LoadPlan, skip: list[str] | None = None) -> None:
        """Every element of every tensor destination is read by exactly one planned item:
        the items' volumes add up to the destination's (local) size. check_metadata proved
        the saved chunks disjoint; a shortfall here is a destination left partly unread.
        Keys in ``skip`` (tied keys filled through another) are not read."""
        planned: dict[str, int] = {}
        for item in plan.items:
            if item.type != LoadItemType.BYTE_IO:
                fqn = item.dest_index.fqn
                planned[fqn] = planned.get(fqn, 0) + math.prod(item.lengths)
        saved = self.metadata.state_dict_metadata if self.metadata is not None else {}
        skipped = set(skip or ())
        for fqn, obj in self.state_dict.items():
            if not isinstance(obj, torch.Tensor) or not isinstance(
                saved.get(fqn), TensorStorageMetadata
            ):
                continue
            if fqn in skipped:
                continue
            if callable(getattr(obj, "local_shards", None)):  # ShardedTensor: this rank's shards
                want = sum(sh.tensor.numel() for sh in obj.local_shards())  # type: ignore[attr-defined]
            elif callable(getattr(obj, "to_local", None)):  # DTensor: this rank's part
                want = obj.to_local().numel()  # type: ignore[attr-defined]
            else:
                want = obj.numel()
            got = planned.get(fqn, 0)
            if got != want:
                raise CheckpointFormatError(
                    f"{formats.source_of(self.metadata)}, key {fqn!r}: the checkpoint's chunks give {got} of "
                    f"the destination's {want} elements: "
                    "part of the tensor was not saved"
                )

    def _default_plan(self, skip: list[str] | None = None) -> LoadPlan:
        # torch's DefaultLoadPlanner.create_local_plan, its intersection done by a sorted
        # sweep (the same read items in the same order; docs/distributed.md, planning at scale)
        try:
            return local_load_plan(self, skip or ())
        except (RuntimeError, ValueError, TypeError, NotImplementedError) as exc:
            # torch's planner matching the destination against the (checked) metadata:
            # "Missing key", "Size mismatch", "Invalid checkpoint metadata", a destination
            # value it cannot plan for
            if isinstance(exc, AsyncLoadError):  # pragma: no cover - ours pass through
                raise
            raise StateDictMismatchError(
                f"{formats.source_of(self.metadata)}: the destination does not match the checkpoint: "
                f"{type(exc).__name__}: {exc}"[:2000]
            ) from exc

    @property
    def raw_objects(self) -> bool:
        """Whether this planner's class decodes DCP object records itself (it overrides
        :meth:`load_bytes`): the reader then hands it each raw record instead of the object
        the allow-list decoded (``asyncload.engine.records.AllowListPlanner``)."""
        return type(self).load_bytes is not PipelinedLoadPlanner.load_bytes

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Decode an object with the allow-list and ``options.safe_globals`` (torch's planner
        uses ``torch.load(weights_only=False)``). A subclass that overrides this gets each DCP
        object's raw record instead and decodes it itself (its safety is then the subclass's)."""
        obj = decode_object(
            value.getvalue(),
            what=f"object {read_item.dest_index.fqn!r}",
            max_pickle=self.options.max_metadata_size,
            safe_globals=self.options.safe_globals,
        )
        self.load_object(read_item, obj)

    def load_object(self, read_item: ReadItem, obj: Any) -> None:
        """Place an already decoded object (the reader calls this with what it decoded)."""
        from torch.distributed.checkpoint._nested_dict import unflatten_state_dict  # noqa: F401
        from torch.distributed.checkpoint._traverse import set_element

        slot = self._fills.slots.get(read_item.dest_index.fqn)
        if slot is not None:  # filled into an empty container of the destination
            slot[0][slot[1]] = obj
        elif self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _refuse_non_tensors(state_dict: Any, metadata: Metadata) -> None:
    """A destination value that is not a tensor where the checkpoint holds one (an int, a
    list, a numpy array): StateDictMismatchError, with the caller's dict untouched."""
    if isinstance(state_dict, dict) and all(
        type(v) in PLAIN_TENSOR_TYPES for v in state_dict.values()
    ):
        return  # a flat dict of plain tensors (most state dicts): nothing to refuse, nothing to flatten
    saved = metadata.state_dict_metadata
    flat, _ = flatten_state_dict(state_dict)
    for fqn, obj in flat.items():
        smd = saved.get(fqn)
        if isinstance(smd, TensorStorageMetadata) and not isinstance(obj, torch.Tensor):
            kind = type(obj)
            shown = (
                kind.__qualname__
                if kind.__module__ == "builtins"
                else f"{kind.__module__}.{kind.__qualname__}"
            )
            raise StateDictMismatchError(
                f"{formats.source_of(metadata)}, key {fqn!r}: the checkpoint holds a tensor of shape "
                f"{list(smd.size)}, the destination holds a {shown}: a tensor is loaded in place, so the destination must be a "
                "torch.Tensor of that shape"
            )


class PipelinedReader(StorageReader):
    """A ``torch.distributed.checkpoint.StorageReader`` that reads through asyncload's pipeline.

    ``checkpoint`` is a local path, a ``PathLike``, a ``file://`` URL or any fsspec URL;
    ``storage_options`` go to the fsspec filesystem. After a load, ``stats`` holds its
    :class:`LoadStats`. Which options govern a load: see :class:`PipelinedLoadPlanner`.

    ``_extension_registry`` (as torch's ``FileSystemReader``'s; default: torch's own registry,
    which knows ``ZStandard``) decodes records that ``dcp.save`` wrote with stream transforms
    (``FileSystemWriter(_extensions=[...])``); see docs/formats.md.
    """

    def __init__(
        self,
        checkpoint: str | os.PathLike[str],
        _extension_registry: ExtensionRegistry | None = None,
        *,
        options: LoadOptions | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.options = options or LoadOptions()
        self._progress: Any = None
        self.session = LoadSession(
            checkpoint,
            config=resolve_config(self.options),
            options=self.options,
            storage_options=storage_options,
            progress=self._report_progress,
            extension_registry=_extension_registry,
        )
        self.metadata: Metadata | None = None
        self.storage_data: dict[Any, Any] = {}
        self.rank: int | None = None
        self.is_coordinator = False

    def _report_progress(self, done: int, total: int) -> None:
        callback = self._progress
        if callback is not None:
            callback(done, total)

    # --- what the session holds ----------------------------------------------------------

    @property
    def checkpoint(self) -> str | os.PathLike[str]:
        return self.session.checkpoint

    @property
    def storage_options(self) -> dict[str, Any]:
        return self.session.storage_options

    @property
    def stats(self) -> LoadStats | None:
        """The :class:`LoadStats` of the last load, once it has finished."""
        return self.session.stats

    @property
    def progress(self) -> Any:
        """``progress(bytes_done, bytes_total)``, called from library threads as chunks land."""
        return self._progress

    @progress.setter
    def progress(self, callback: Any) -> None:
        self._progress = callback

    @property
    def metadata_error(self) -> BaseException | None:
        """The first error of ``read_metadata`` in this load (dcp.load hides it behind an AssertionError)."""
        return self.session.metadata_error

    def cancel(self) -> None:
        """Cancel the load in progress (from any thread); it raises CancelledError."""
        self.session.cancel()

    def live_stats(self) -> LoadStats:
        """The statistics so far (``seconds`` is the time since the load started); final once done."""
        return self.session.live_stats()

    async def aclose(self) -> None:
        """Close files and sessions and stop the I/O threads (waits for running reads)."""
        await self.session.aclose()

    def close(self) -> None:
        """Sync :meth:`aclose`."""
        self.session.close()

    # --- StorageReader -----------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.session.begin(checkpoint_id)

    @property
    def checkpoint_id(self) -> str | os.PathLike[str]:
        return self.session.checkpoint

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        session = self.session
        if not session.started or "rank" not in kwargs:
            # dcp.load's first call of every load (it calls reset() only when given a
            # checkpoint_id): a reader used for several loads reports each on its own, under the
            # reader's options
            session.begin()
        try:
            md = session.run(session.aread_metadata(rank=kwargs.get("rank")))
        finally:
            # no read_data follows a failed metadata read; and under a plain dcp.load nothing
            # would close the storage if planning fails next (StorageReader has no close
            # hook): read_data opens it again
            session.close_quietly()
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.metadata = metadata
        self.storage_data = metadata.storage_data
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        if self.storage_data is None:
            raise CheckpointFormatError(f"{self.checkpoint}: metadata has no storage table")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        session = self.session
        if self.metadata is None:
            raise CheckpointFormatError(
                f"{self.checkpoint}: read_data before set_up_storage_reader"
            )
        # dcp.load hands the planner over only now: its own options govern the rest of the
        # load (set before any read of tensor data)
        session.planner_arrived(planner_terms(planner))
        if not isinstance(planner, PipelinedLoadPlanner):  # checked when ours was set up
            check_destinations(getattr(planner, "state_dict", None))
        run_sync(read_steps(session, self.metadata, plan, planner), session)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut
