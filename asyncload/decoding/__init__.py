"""The decoding wing: checkpoint pickles decoded without running code from them.

``vm`` is the pickle machine (it knows no names); ``allowlist`` is the policy of what may be
rebuilt (``safe_loads``), with its ``tables``, ``numpy_data``, ``structure`` walk and the DCP
``dcp_checks``; ``scan`` reads a refused pickle whole with stand-ins (nothing imported or
called) so that one refusal names everything it needs; ``work`` counts what a decode did and
stops it at its budget. Importing this package imports none of its modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncload.common.lazy import lazy_names

if TYPE_CHECKING:
    from asyncload.decoding.allowlist import (
        MAX_DEPTH,
        StorageRef,
        _CheckpointPolicy,
        check_metadata,
        record_globals,
        safe_loads,
    )
    from asyncload.decoding.dcp_checks import _check_coverage
    from asyncload.decoding.structure import _check_structure
    from asyncload.decoding.tables import TensorRef, _is_int, storage_persistent_load
    from asyncload.decoding.vm import PickleVM
    from asyncload.decoding.work import WorkBudget

#: The wing's interface: each name the other wings use, and its module, imported on
#: first use (PEP 562), so that importing the package imports none of its modules.
_LAZY = {
    "MAX_DEPTH": "asyncload.decoding.allowlist",
    "PickleVM": "asyncload.decoding.vm",
    "StorageRef": "asyncload.decoding.allowlist",
    "TensorRef": "asyncload.decoding.tables",
    "WorkBudget": "asyncload.decoding.work",
    "_CheckpointPolicy": "asyncload.decoding.allowlist",
    "_check_coverage": "asyncload.decoding.dcp_checks",
    "_check_structure": "asyncload.decoding.structure",
    "_is_int": "asyncload.decoding.tables",
    "check_metadata": "asyncload.decoding.allowlist",
    "record_globals": "asyncload.decoding.allowlist",
    "safe_loads": "asyncload.decoding.allowlist",
    "storage_persistent_load": "asyncload.decoding.tables",
}


__all__ = [
    "MAX_DEPTH",
    "PickleVM",
    "StorageRef",
    "TensorRef",
    "WorkBudget",
    "_CheckpointPolicy",
    "_check_coverage",
    "_check_structure",
    "_is_int",
    "check_metadata",
    "record_globals",
    "safe_loads",
    "storage_persistent_load",
]

__getattr__, __dir__ = lazy_names(__name__, globals(), _LAZY, __all__)
del lazy_names  # (not a name of the package)
