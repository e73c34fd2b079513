"""Sharing a load across ranks: the plan of who reads which bytes (:mod:`.share_plan`), the
policy a sharded load runs by (:mod:`.policy`), moving bytes between ranks (:mod:`.transport`;
over a gloo side group of the same ranks when the load's group matches sends by order, such
as NCCL: :mod:`.side_group`),
the read pipelines of static and adaptive sharing (:mod:`.shared`, :mod:`.adaptive`) with
adaptive sharing's claims (:mod:`.claims`), sends that outlive a load (:mod:`.sends`), the
ranks' agreement checks (:mod:`.identity`), one rank's part of a load (:mod:`.share_session`) and
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

from asyncload.common.errors import DistributedLoadError
from asyncload.common.lazy import lazy_names

if typing.TYPE_CHECKING:
    from asyncload.distributed.barrier import BarrierWait, arrive, present
    from asyncload.distributed.idle_watch import IDLE_KEY, IdlePoster, encode_idle, listed_after
    from asyncload.distributed.lateness import SHOWN_IN_FLIGHT, RankProgress, Rate, encode
    from asyncload.distributed.monitor import Monitor
    from asyncload.distributed.nodes import BLOCK_UNITS, plan_blocks
    from asyncload.distributed.policy import SHARING_MODES, SIDE_GROUP_AUTO, UNIT_SIZE
    from asyncload.distributed.sends import BackgroundSends, wait_for_background_sends
    from asyncload.distributed.share_plan import Transfer, plan_transfers
    from asyncload.distributed.share_session import _ShareSession, open_share
    from asyncload.storage import InFlightRequest

_LAZY = {
    "BLOCK_UNITS": "asyncload.distributed.nodes",
    "BarrierWait": "asyncload.distributed.barrier",
    "IDLE_KEY": "asyncload.distributed.idle_watch",
    "IdlePoster": "asyncload.distributed.idle_watch",
    "Monitor": "asyncload.distributed.monitor",
    "Rate": "asyncload.distributed.lateness",
    "SHARING_MODES": "asyncload.distributed.policy",
    "SHOWN_IN_FLIGHT": "asyncload.distributed.lateness",
    "SIDE_GROUP_AUTO": "asyncload.distributed.policy",
    "Transfer": "asyncload.distributed.share_plan",
    "UNIT_SIZE": "asyncload.distributed.policy",
    "_ShareSession": "asyncload.distributed.share_session",
    "arrive": "asyncload.distributed.barrier",
    "encode": "asyncload.distributed.lateness",
    "encode_idle": "asyncload.distributed.idle_watch",
    "listed_after": "asyncload.distributed.idle_watch",
    "open_share": "asyncload.distributed.share_session",
    "plan_blocks": "asyncload.distributed.nodes",
    "plan_transfers": "asyncload.distributed.share_plan",
    "present": "asyncload.distributed.barrier",
    "BackgroundSends": "asyncload.distributed.sends",
    "wait_for_background_sends": "asyncload.distributed.sends",
    "RankProgress": "asyncload.distributed.lateness",
    "InFlightRequest": "asyncload.storage.in_flight",
}


__all__ = [
    "BLOCK_UNITS",
    "IDLE_KEY",
    "SHARING_MODES",
    "SHOWN_IN_FLIGHT",
    "SIDE_GROUP_AUTO",
    "UNIT_SIZE",
    "BackgroundSends",
    "BarrierWait",
    "DistributedLoadError",
    "IdlePoster",
    "InFlightRequest",
    "Monitor",
    "RankProgress",
    "Rate",
    "Transfer",
    "_ShareSession",
    "arrive",
    "encode",
    "encode_idle",
    "listed_after",
    "open_share",
    "plan_blocks",
    "plan_transfers",
    "present",
    "wait_for_background_sends",
]

__getattr__, __dir__ = lazy_names(__name__, globals(), _LAZY, __all__)
del lazy_names  # (not a name of the package)
