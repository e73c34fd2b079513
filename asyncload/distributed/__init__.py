"""Sharing a load across ranks: the plan of who reads which bytes (:mod:`.plan`), the
policy a sharded load runs by (:mod:`.policy`), moving bytes between ranks (:mod:`.transport`;
over a gloo side group of the same ranks when the load's group matches sends by order, such
as NCCL: :mod:`.side_group`),
the read pipelines of static and adaptive sharing (:mod:`.shared`, :mod:`.adaptive`) with
adaptive sharing's claims (:mod:`.claims`), sends that outlive a load (:mod:`.sends`), the
ranks' agreement checks (:mod:`.identity`), one rank's part of a load (:mod:`.session`) and
the bounded waits on other ranks (:mod:`.monitor`). The planner that turns it on is the face
``asyncload.ShardedLoadPlanner``."""
