"""Sharing a load across ranks: the plan of who reads which bytes (:mod:`.plan`), the
policy a sharded load runs by (:mod:`.policy`), moving bytes between ranks (:mod:`.transport`;
over a gloo side group of the same ranks when the load's group matches sends by order, such
as NCCL: :mod:`.side_group`),
the read pipelines of static and adaptive sharing (:mod:`.shared`, :mod:`.adaptive`) with
adaptive sharing's claims (:mod:`.claims`), sends that outlive a load (:mod:`.sends`), the
ranks' agreement checks (:mod:`.identity`), one rank's part of a load (:mod:`.session`) and
the bounded waits on other ranks (:mod:`.monitor`). The planner that turns it on is the face
``asyncload.ShardedLoadPlanner``.

Public names, for a load on several ranks (imported on first use, like ``asyncload``'s: this
package imports no ``torch.distributed`` until one is asked for):

- :class:`DistributedLoadError`: raised on every rank when another rank failed or stalled;
- :class:`RankProgress` (``LoadHandle.rank_progress()``) and its :class:`InFlightRequest`
  elements: each rank's progress and oldest storage requests;
- :class:`BackgroundSends` (``ShardedLoadPlanner.background_sends``) and
  :func:`wait_for_background_sends` (also ``asyncload.wait_for_background_sends``): sends
  that outlive a load under ``wait_for_peers=False``.
"""

import typing

from asyncload._errors import DistributedLoadError

if typing.TYPE_CHECKING:
    from asyncload.distributed.lateness import RankProgress
    from asyncload.distributed.sends import BackgroundSends, wait_for_background_sends
    from asyncload.storage.in_flight import InFlightRequest

_LAZY = {
    "BackgroundSends": "asyncload.distributed.sends",
    "wait_for_background_sends": "asyncload.distributed.sends",
    "RankProgress": "asyncload.distributed.lateness",
    "InFlightRequest": "asyncload.storage.in_flight",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncload.distributed' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "BackgroundSends",
    "DistributedLoadError",
    "InFlightRequest",
    "RankProgress",
    "wait_for_background_sends",
]
