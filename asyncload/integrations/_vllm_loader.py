"""The vLLM model loader of ``load_format="asyncload"`` (registered by
:func:`asyncload.integrations.vllm.register`; importing this module imports vLLM).

:class:`AsyncLoadModelLoader` is vLLM's ``DefaultModelLoader`` with two methods replaced:
``_get_weights_iterator`` (where vLLM opens the safetensors files of one weight source) reads
through :func:`asyncload.iter_tensors`'s stream, and ``download_model`` checks that the weights
are there instead of downloading them. Everything else is vLLM's: ``load_weights`` (the model's
own weight loaders, the strict check that every parameter was loaded), the expert-parallel
filter (``_init_ep_weight_filter`` sets ``local_expert_ids``) and the model's
``is_unused_checkpoint_weight``. Both filters become the stream's ``keys=`` predicate, so the
tensors they drop are never read (vLLM's own loader drops unused weights by whole shard).

Local files in the page cache are handed over as views of leased mappings after asyncload has
read their headers (:mod:`._vllm_mapped`: vLLM copies each weight at once, and a tensor read
into fresh memory paid its page faults on top of that copy). A remote source's stream, when
``download_model`` opened it, is the one the weights read (its headers read once per process).
"""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import logging
import mmap
import os
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.ep_weight_filter import should_skip_weight

from asyncload.common.errors import AsyncLoadError, redact_url
from asyncload.common.loop import loop_thread, run_sync
from asyncload.common.stats import LoadStats
from asyncload.faces.streaming import CheckpointStream, _astream, select_keys, sync_iter
from asyncload.integrations._vllm_config import LOAD_FORMAT, parse_extra_config
from asyncload.integrations._vllm_mapped import map_weights
from asyncload.storage import is_local, local_root, mapped_copies_available

__all__ = ["AsyncLoadModelLoader", "weight_filter"]

log = logging.getLogger("asyncload.integrations.vllm")


def weight_filter(
    local_expert_ids: set[int] | None, is_unused_weight: Callable[[str], bool] | None
) -> Callable[[str], bool] | None:
    """The ``keys=`` predicate of one weight source: a checkpoint name is read unless vLLM's
    expert-parallel filter skips it (an expert of another rank, ``should_skip_weight``) or the
    model does not load it (``is_unused_checkpoint_weight``). ``None``: every name."""
    if local_expert_ids is None and is_unused_weight is None:
        return None

    def wanted(name: str) -> bool:
        if should_skip_weight(name, local_expert_ids):
            return False
        return is_unused_weight is None or not is_unused_weight(name)

    return wanted


class AsyncLoadModelLoader(DefaultModelLoader):
    """vLLM's ``DefaultModelLoader`` reading the weights through asyncload (see the module
    docstring and :mod:`asyncload.integrations.vllm` for ``model_loader_extra_config``).

    ``load_stats``: the :class:`~asyncload.LoadStats` of each weight source read, in order.
    """

    #: vLLM's (a class attribute there): when the first weight was asked for.
    counter_before_loading_weights: float = 0.0

    def __init__(self, load_config: LoadConfig) -> None:
        self.extra = parse_extra_config(load_config.model_loader_extra_config)
        # vLLM's own extra-config keys (multithread loading) do not apply: none passed on
        super().__init__(dataclasses.replace(load_config, model_loader_extra_config={}))
        self.load_stats: list[LoadStats] = []
        #: vLLM's ``model`` of the load in progress: the source that ``url`` replaces.
        self._model: str | None = None
        #: Streams ``download_model`` opened (remote URLs), by URL, until the weights take them.
        self._opened: dict[str, _WeightStream] = {}

    # --- where the weights are -------------------------------------------------------------

    def _url(self, model_or_path: str, subfolder: str | None) -> tuple[str, str]:
        """The weights' URL of a source, and what to call it in an error."""
        if self.extra.url is not None and model_or_path == self._model:
            base, what = self.extra.url, 'model_loader_extra_config["url"]'
        else:
            if not os.path.isdir(model_or_path):
                raise ValueError(
                    f"load_format={LOAD_FORMAT!r} reads a local directory or a URL; "
                    f"{model_or_path!r} is not a local directory: download it first, or "
                    'give the URL of its safetensors files in model_loader_extra_config["url"]'
                )
            base, what = model_or_path, "the model directory"
        if subfolder:
            base = base.rstrip("/") + "/" + subfolder
        return base, what

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to download: check that the weights' headers can be read (no tensor data
        is read), and that the files are as long as they claim. From a remote store the stream
        stays open for the weights (the headers read once per process, the objects' versions
        pinned by the same storage); a local one is closed (its headers cost nothing to read
        again, and the weights' read then checks the files unchanged from there)."""
        self._model = model_config.model
        url, what = self._url(model_config.model, None)
        stream = self._stream(url, None)
        loop = self._loop(url)
        try:
            run_sync(stream.aopen(), loop)
        except AsyncLoadError as exc:
            run_sync(stream.aclose(), loop)
            _naming(exc, what, url)
            raise
        except BaseException:
            run_sync(stream.aclose(), loop)
            raise
        if is_local(url):
            run_sync(stream.aclose(), loop)
            return
        old = self._opened.pop(url, None)
        self._opened[url] = stream
        if old is not None:
            run_sync(old.aclose(), loop)

    def _loop(self, url: str) -> asyncio.AbstractEventLoop:
        """The library loop a stream of ``url`` runs on: a remote one's, sync_iter's (the
        weights read it there); a local one's closes where it opened (no uvloop imported)."""
        return loop_thread(self.extra.options.use_uvloop, local=is_local(url))

    def close_opened(self) -> None:
        """Close the streams ``download_model`` left open that no weights read took."""
        opened, self._opened = self._opened, {}
        for url, stream in opened.items():
            run_sync(stream.aclose(), self._loop(url))

    # --- the weights ---------------------------------------------------------------------

    def get_all_weights(
        self, model_config: ModelConfig, model: torch.nn.Module
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        self._model = model_config.model
        self.load_stats = []
        try:
            yield from super().get_all_weights(model_config, model)
        finally:
            self.close_opened()

    def _get_weights_iterator(
        self, source: DefaultModelLoader.Source
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        url, what = self._url(source.model_or_path, source.subfolder)
        keys = weight_filter(self.local_expert_ids, source.is_unused_weight)
        if source.allow_patterns_overrides is not None:
            urls = self._matching_files(url, what, source.allow_patterns_overrides)
        else:
            urls = [url]
        if self.counter_before_loading_weights == 0.0:
            self.counter_before_loading_weights = time.perf_counter()
        prefix = source.prefix
        return (
            (prefix + name, tensor)
            for one in urls
            for name, tensor in self._tensors(one, what, keys)
        )

    @staticmethod
    def _matching_files(url: str, what: str, patterns: list[str]) -> list[str]:
        """The model's own file patterns (``allow_patterns_overrides``): local directories."""
        if not os.path.isdir(url):
            raise ValueError(
                f"this model loads only the files matching {patterns} of {what}; "
                f"load_format={LOAD_FORMAT!r} selects files by pattern in a local directory only, "
                f"and {redact_url(url)} is not one"
            )
        for pattern in patterns:  # the first pattern that matches, as vLLM's loader
            found = sorted(glob.glob(os.path.join(url, pattern)))
            if found:
                return found
        raise ValueError(f"no file of {what} ({url}) matches {patterns}")

    def _stream(self, url: str, keys: Callable[[str], bool] | None) -> _WeightStream:
        """The stream of ``url``: the one ``download_model`` opened, its keys selected again
        (no header read again), else a new one."""
        stream = self._opened.pop(url, None)
        if stream is not None:
            stream.keys = keys
            return stream
        return _WeightStream(
            url,
            keys=keys,
            options=self.extra.options_for(is_local(url)),
            storage_options=self.extra.storage_options,
        )

    def _tensors(
        self, url: str, what: str, keys: Callable[[str], bool] | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        options = self.extra.options_for(is_local(url))
        try:
            if options.local_mapped_copies and is_local(url):
                views = self._mapped(url, keys)
                if views is not None:
                    yield from views
                    return
            stream = self._stream(url, keys)
            yield from sync_iter(_astream(stream), options)
        except AsyncLoadError as exc:
            _naming(exc, what, url)
            raise
        self.load_stats.append(stream.stats)

    def _mapped(
        self, url: str, keys: Callable[[str], bool] | None
    ) -> Iterator[tuple[str, torch.Tensor]] | None:
        """The selected tensors of local ``url`` as views of leased mappings of the page cache
        (:mod:`._vllm_mapped`), after asyncload has read and checked the headers; ``None`` when
        they cannot be (then the stream reads them)."""
        if mapped_copies_available() is not None:
            return None
        options = self.extra.options
        stream = self._stream(url, keys)
        loop = self._loop(url)
        try:  # the claims are checked against each mapped file (its header, parsed again)
            run_sync(stream.aopen(check=False), loop)
            stats = stream.session.live_stats()
        finally:
            run_sync(stream.aclose(), loop)
        path = local_root(url)
        root = path if os.path.isdir(path) else os.path.dirname(path)
        assert stream.metadata is not None
        views = map_weights(root, stream.metadata, stream.tensors, options.max_metadata_size)
        if views is None:
            return None
        return self._counted(views, stats)

    def _counted(
        self, views: Iterator[tuple[str, torch.Tensor]], stats: LoadStats
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``views``, counted in ``stats`` (the bytes handed over are the bytes read)."""
        t0 = time.perf_counter()
        seconds = stats.seconds
        for name, tensor in views:
            n = tensor.numel() * tensor.element_size()
            stats.bytes_assembled += n
            stats.bytes_read += n
            yield name, tensor
            del tensor
        stats.seconds = seconds + time.perf_counter() - t0
        self.load_stats.append(stats)


class _WeightStream(CheckpointStream):
    """A weight source's stream, which may be opened twice: by ``download_model`` (headers
    read, claims checked), then by the weights' read, which selects its keys again from the
    same metadata, on the same session (the same storage, the objects' versions pinned when
    the headers were read), without reading the headers again."""

    async def aopen(self, *, check: bool = True) -> Metadata:
        md = self.metadata
        if md is None:
            return await super().aopen(check=check)
        self.session.begin()  # this read's statistics and clock; the storage stays open
        chosen = select_keys(md, self.keys, self.checkpoint)
        sdm = md.state_dict_metadata
        self.tensors = sorted(
            (k for k in chosen if isinstance(sdm[k], TensorStorageMetadata)), key=self._where
        )
        self.objects = [k for k in chosen if not isinstance(sdm[k], TensorStorageMetadata)]
        self._files_at_open = 0  # counted by the first open
        return md  # every key's claims were checked by the first open

    def allocate(self, fqns: list[str]) -> dict[str, Any]:
        """A batch's CPU tensors as views of one anonymous mapping of their own, which the
        kernel gets back once vLLM has copied and dropped the batch's last tensor. Fresh
        ``torch.empty`` tensors went back to the C heap instead, which kept them resident (a
        292 MiB model from S3 in 64 MiB batches, one probe each: peak 287 MiB and 207 MiB left
        above the start after the weights, against 257 and 166 MiB with a mapping per batch;
        docs/integrations.md). Each view starts on a 64-byte boundary."""
        if self.device.type != "cpu" or self.touch:
            return super().allocate(fqns)
        assert self.metadata is not None
        sdm = self.metadata.state_dict_metadata
        places: list[tuple[str, tuple[int, ...], torch.dtype, int, int]] = []
        out: dict[str, Any] = {}
        end = 0
        for fqn in fqns:
            smd = sdm[fqn]
            if not isinstance(smd, TensorStorageMetadata):
                out[fqn] = None
                continue
            shape, dtype = tuple(smd.size), self.dtype_of(smd)
            n = torch.Size(shape).numel() * dtype.itemsize
            places.append((fqn, shape, dtype, end, n))
            end += -(-n // 64) * 64
        if end == 0:
            return super().allocate(fqns)
        # private and anonymous: zero pages until written, never shared with a forked child
        memory = mmap.mmap(-1, end, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for fqn, shape, dtype, at, n in places:
            if n == 0:
                out[fqn] = torch.empty(shape, dtype=dtype)
            else:
                raw = torch.frombuffer(memory, dtype=torch.uint8, count=n, offset=at)
                out[fqn] = raw.view(dtype).view(shape)
        return out


def _naming(exc: AsyncLoadError, what: str, url: str) -> None:
    """Start ``exc``'s message with where the weights were configured (the same exception:
    class, attributes and cause unchanged)."""
    head = f"load_format={LOAD_FORMAT!r}, {what} = {redact_url(url)!r}: "
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (head + exc.args[0], *exc.args[1:])
    else:
        exc.args = (head + str(exc),)
