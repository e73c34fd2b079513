"""What a planner brings to a load, said by the faces that know their planners:
:func:`planner_terms` turns a planner into the engine's
:class:`~asyncload.engine.config.PlannerTerms`, the one channel through which a planner
reaches the engine's configuration (:func:`asyncload.engine.config.resolve_config`), the
session (:meth:`asyncload.engine.session.LoadSession.planner_arrived`) and the driver.

asyncload's planners (:class:`asyncload.PipelinedLoadPlanner`, its subclass
:class:`asyncload.ShardedLoadPlanner`, and
:class:`~asyncload.faces.plain_planner.PlainLoadPlanner`) derive from :class:`TermsPlanner`
and say what they bring in ``_load_terms``; any other planner (torch's
``DefaultLoadPlanner``) brings nothing.
"""

from __future__ import annotations

from typing import Any

from asyncload.common.options import LoadOptions
from asyncload.engine import PlannerTerms, PlanReport

__all__ = ["TermsPlanner", "planner_terms"]


class TermsPlanner:
    """The part of asyncload's planners that says what each brings to a load: its options
    when set explicitly, the note that the load checked its destinations, and the report of
    what it planned. ``ShardedLoadPlanner`` adds its collective timeout and sharing."""

    options: LoadOptions
    #: Whether the options were set explicitly (they then govern a load given none).
    has_options: bool
    #: The planner's view of the metadata (None until it is set up).
    metadata: Any = None
    missing_keys: list[str]
    tied_keys: dict[str, str]
    unexpected_keys: list[str]
    #: The state dict the load checked before its first request (``set_up_planner`` then
    #: does not check it again).
    _destinations_checked: Any

    def _load_terms(self) -> PlannerTerms:
        return PlannerTerms(
            options=self.options if self.has_options else None,
            destinations_checked=self._note_checked,
            report=self._report,
        )

    def _note_checked(self, state_dict: Any) -> None:
        self._destinations_checked = state_dict

    def _report(self) -> PlanReport:
        return PlanReport(self.metadata, self.missing_keys, self.tied_keys, self.unexpected_keys)


def planner_terms(planner: object) -> PlannerTerms:
    """What ``planner`` brings to a load (``None``, or a planner that is not asyncload's:
    nothing). Made where the planner meets the load: ``asyncload.load`` and its twins before
    the session is made, ``PipelinedReader.read_data`` when ``dcp.load`` hands the planner
    over, a stream for each batch's planner."""
    if isinstance(planner, TermsPlanner):
        return planner._load_terms()
    return PlannerTerms()
