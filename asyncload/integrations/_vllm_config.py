"""``model_loader_extra_config`` of vLLM's ``load_format="asyncload"``, checked (no vLLM
import: :mod:`asyncload.integrations.vllm` and its loader both read it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from asyncload.common.options import LoadOptions, MiB

__all__ = [
    "EXTRA_CONFIG_KEYS",
    "LOAD_FORMAT",
    "REMOTE_DEFAULTS",
    "ExtraConfig",
    "parse_extra_config",
]

#: The ``load_format`` (``--load-format``) name vLLM knows asyncload's loader by.
LOAD_FORMAT = "asyncload"

#: The keys of ``model_loader_extra_config`` the loader reads.
EXTRA_CONFIG_KEYS = ("url", "storage_options", "options")

#: ``LoadOptions`` fields a remote source's stream takes from here unless ``"options"`` gives
#: them: vLLM copies each weight into its parameter at once, so the stream needs only its
#: read-ahead (batches of ``memory_budget / 2``), not the library's 512 MiB of tensors held;
#: 4 MiB reads keep a 64 MiB batch at 16 requests in flight (the default concurrency).
#: Local sources keep the library's defaults (their weights are views of the page cache).
REMOTE_DEFAULTS: dict[str, int] = {"memory_budget": 128 * MiB, "chunk_size": 4 * MiB}


@dataclass(frozen=True, kw_only=True)
class ExtraConfig:
    """``model_loader_extra_config`` of ``load_format="asyncload"``, checked
    (:func:`parse_extra_config`)."""

    url: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    options: LoadOptions = field(default_factory=LoadOptions)
    #: ``options`` with :data:`REMOTE_DEFAULTS` for the fields ``"options"`` did not give
    #: (``options`` itself when it was a ``LoadOptions``): what a remote source's stream uses.
    remote_options: LoadOptions = field(default_factory=lambda: _remote(LoadOptions(), ()))

    def options_for(self, local: bool) -> LoadOptions:
        """The options of a stream of a local (``True``) or remote source."""
        return self.options if local else self.remote_options


def _where(*path: str) -> str:
    return "model_loader_extra_config" + "".join(f"[{p!r}]" for p in path)


def parse_extra_config(extra: object) -> ExtraConfig:
    """``model_loader_extra_config`` as an :class:`ExtraConfig`; anything else (an unknown
    key, an unknown or bad ``LoadOptions`` field, a value of the wrong type) raises a
    ``ValueError`` that names the key."""
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise ValueError(
            f"model_loader_extra_config must be a dict for load_format={LOAD_FORMAT!r}, "
            f"not a {type(extra).__name__}"
        )
    for key in extra:
        if key not in EXTRA_CONFIG_KEYS:
            raise ValueError(
                f"{_where(str(key))}: unknown key for load_format={LOAD_FORMAT!r} "
                f"(it takes {', '.join(EXTRA_CONFIG_KEYS)})"
            )
    url = extra.get("url")
    if url is not None and (not isinstance(url, str) or not url):
        raise ValueError(
            f"{_where('url')} = {url!r}: give a local directory or an s3://, gs://, "
            "http(s):// URL of the safetensors files"
        )
    storage_options = extra.get("storage_options") or {}
    if not isinstance(storage_options, Mapping):
        raise ValueError(
            f"{_where('storage_options')} must be a dict, not a {type(storage_options).__name__}"
        )
    options = _load_options(extra)
    given = extra.get("options") or {}
    remote = options if isinstance(given, LoadOptions) else _remote(options, given)
    return ExtraConfig(
        url=url, storage_options=dict(storage_options), options=options, remote_options=remote
    )


def _remote(options: LoadOptions, given: Any) -> LoadOptions:
    """``options`` with :data:`REMOTE_DEFAULTS` for the fields not in ``given``."""
    unset: dict[str, Any] = {k: v for k, v in REMOTE_DEFAULTS.items() if k not in given}
    if "min_chunk_size" in given:  # the reads' size is the caller's then
        unset.pop("chunk_size", None)
    return dataclasses.replace(options, **unset) if unset else options


def _load_options(extra: Mapping[str, Any]) -> LoadOptions:
    given = extra.get("options") or {}
    if isinstance(given, LoadOptions):  # from Python: LLM(model_loader_extra_config=...)
        return given
    if not isinstance(given, Mapping):
        raise ValueError(
            f"{_where('options')} must be a dict of LoadOptions fields, not a "
            f"{type(given).__name__}"
        )
    known = {f.name for f in dataclasses.fields(LoadOptions)}
    values: dict[str, Any] = {}
    for name, value in given.items():
        if name not in known:
            raise ValueError(
                f"{_where('options', str(name))}: LoadOptions has no field {name!r} "
                f"(its fields: {', '.join(sorted(known))})"
            )
        values[name] = tuple(value) if isinstance(value, list) else value  # JSON arrays
    try:
        return LoadOptions(**values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{_where('options')}: {exc}") from exc
