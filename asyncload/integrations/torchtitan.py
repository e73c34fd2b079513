"""torchtitan's checkpoint manager with its loads through asyncload.

:class:`AsyncLoadCheckpointManager` is torchtitan's own DCP ``CheckpointManager`` (saves,
retention, step discovery, async modes: all unchanged) whose loads read through asyncload:
a resume (``checkpoint.folder/step-N``), an ``initial_load_path`` (DCP, or Hugging Face
safetensors with ``initial_load_in_hf``) and the Hugging Face import from
``model.hf_assets_path``, from local disk, S3, GCS or HTTP(S). It is selected in the
Python config like torchtitan's own managers, by its nested ``Config``::

    from asyncload import LoadOptions
    from asyncload.integrations.torchtitan import AsyncLoadCheckpointManager

    config = llama3_debugmodel()  # any torchtitan Trainer.Config
    config.checkpoint = AsyncLoadCheckpointManager.Config(
        enable=True,
        folder="s3://bucket/run-7/checkpoint",
        load_options=LoadOptions(concurrency=32),
        storage_options={"endpoint_url": "https://s3.example.com"},
    )

``load_options`` and ``storage_options`` govern asyncload's reads (as ``asyncload.load``'s
arguments of the same names); finding the latest step (``step-N`` folders holding a
``.metadata``) and every save go through torchtitan's own helpers, configured as for
torchtitan without asyncload (an S3 endpoint and credentials from the environment).

Importing this module imports torchtitan; ``import asyncload`` does not.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint import HuggingFaceStorageReader

try:
    from torchtitan.components.checkpoint import MODEL, CheckpointManager
except ModuleNotFoundError as exc:
    if exc.name != "torchtitan":
        raise
    raise ModuleNotFoundError(
        "asyncload.integrations.torchtitan needs torchtitan, which is not installed "
        "(tested with torchtitan 0.3.0: pip install torchtitan==0.3.0)",
        name="torchtitan",
    ) from exc

from asyncload.common.options import LoadOptions
from asyncload.common.stats import LoadStats
from asyncload.faces.api import load

__all__ = ["AsyncLoadCheckpointManager"]

log = logging.getLogger("asyncload.integrations.torchtitan")

#: Parts of a ``storage_options`` key that mark its value as a secret, kept out of ``to_dict``.
_SECRET_MARKS = ("key", "secret", "token", "password", "credential", "session")


def _redacted(options: Mapping[str, Any]) -> dict[str, Any]:
    """``storage_options`` for a log: values of secret-looking keys replaced, nested too."""
    out: dict[str, Any] = {}
    for name, value in options.items():
        if isinstance(value, Mapping):
            out[name] = _redacted(value)
        elif any(mark in str(name).lower() for mark in _SECRET_MARKS):
            out[name] = "<redacted>"
        else:
            out[name] = value
    return out


class AsyncLoadCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` whose loads go through asyncload.

    Saves, purging and step discovery are torchtitan's; :meth:`dcp_load` (every load the
    manager makes) reads with :func:`asyncload.load` under ``Config.load_options`` and
    ``Config.storage_options``. After a load, ``last_load_stats`` holds its
    :class:`~asyncload.LoadStats` (``None`` before the first, and after a load through a
    state-dict adapter's own special reader: a quantized Hugging Face checkpoint).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's ``CheckpointManager.Config`` plus the options of asyncload's reads."""

        load_options: LoadOptions = field(default_factory=LoadOptions)
        """asyncload's options for every load (concurrency, memory budget, timeouts, ...)."""

        storage_options: dict[str, Any] = field(default_factory=dict)
        """Options of the remote store for asyncload's reads (s3fs/gcsfs style:
        ``endpoint_url``, ``key``, ``secret``, ``token``, ...)."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            if not isinstance(self.load_options, LoadOptions):
                raise ValueError(
                    f"AsyncLoadCheckpointManager.Config.load_options={self.load_options!r} is invalid: "
                    "it must be an asyncload.LoadOptions"
                )
            # the values are never shown: they may be credentials
            if not isinstance(self.storage_options, Mapping):
                raise ValueError(
                    "AsyncLoadCheckpointManager.Config.storage_options is invalid: it must be a dict "
                    f"with str keys, not a {type(self.storage_options).__name__}"
                )
            bad = [k for k in self.storage_options if not isinstance(k, str)]
            if bad:
                raise ValueError(
                    f"AsyncLoadCheckpointManager.Config.storage_options is invalid: its key {bad[0]!r} is not a str"
                )
            self.storage_options = dict(self.storage_options)

        def to_dict(self) -> dict[str, Any]:
            """torchtitan's serialisation of the config (the trainer logs it), with the
            values of secret-looking ``storage_options`` keys replaced by ``<redacted>``."""
            out: dict[str, Any] = CheckpointManager.Config.to_dict(self)
            out["storage_options"] = _redacted(self.storage_options)
            return out

    def __init__(self, config: AsyncLoadCheckpointManager.Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.load_options: LoadOptions = config.load_options
        self.storage_options: dict[str, Any] = dict(config.storage_options)
        #: The :class:`LoadStats` of the last load through asyncload.
        self.last_load_stats: LoadStats | None = None

    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        """torchtitan's ``dcp_load`` with the reads through asyncload: the same state dict
        (flattened model tensors and the ``Stateful`` optimizer, LR scheduler, dataloader
        and train state) loaded in place, then the model updated as torchtitan does."""
        if not from_hf:
            self.last_load_stats = self._read(state_dict, checkpoint_id)
            if MODEL in self.states:
                self.states[MODEL].load_state_dict(state_dict)
            return
        if self.sd_adapter is None:
            raise ValueError(
                f"cannot load the Hugging Face checkpoint {checkpoint_id!r}: the model has no state-dict "
                "adapter (torchtitan's sd_adapter) to map its keys"
            )
        hf_state_dict = self.sd_adapter.to_hf(state_dict)
        reader = self.sd_adapter.get_hf_storage_reader(checkpoint_id, from_quantized)
        if type(reader) is HuggingFaceStorageReader:
            # the adapter reads the safetensors files as they are: the same files through asyncload
            self.last_load_stats = self._read(hf_state_dict, checkpoint_id)
        else:
            # a reader of the adapter's own (dequantizing, e.g. DeepSeek-V3's) transforms the data
            log.info(
                "loading %s with the state-dict adapter's own %s, not through asyncload",
                checkpoint_id,
                type(reader).__name__,
            )
            import torch.distributed.checkpoint as dcp

            self.last_load_stats = None
            dcp.load(hf_state_dict, storage_reader=reader)
        self.states[MODEL].load_state_dict(self.sd_adapter.from_hf(hf_state_dict))

    def _read(self, state_dict: dict[str, Any], checkpoint_id: str) -> LoadStats:
        stats = load(
            state_dict,
            checkpoint_id,
            options=self.load_options,
            storage_options=self.storage_options,
        )
        log.info(
            "asyncload read %d bytes of %s in %.2f s (%d files)",
            stats.bytes_read,
            checkpoint_id,
            stats.seconds,
            stats.files,
        )
        return stats
