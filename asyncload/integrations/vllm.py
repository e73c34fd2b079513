"""vLLM's weights through asyncload: ``load_format="asyncload"``.

The distribution declares the entry point ``asyncload = "asyncload.integrations.vllm:register"``
in vLLM's plugin group ``vllm.general_plugins``; vLLM calls :func:`register` once in each of its
processes (the front end, the engine core, every worker), which registers the load format
``"asyncload"``. Then::

    vllm serve /models/llama --load-format asyncload \\
        --model-loader-extra-config '{"url": "s3://bucket/llama/", "options": {"concurrency": 32}}'

or ``vllm.LLM(model=..., load_format="asyncload", model_loader_extra_config={...})``.

``model_loader_extra_config`` (all keys optional):

``"url"``
    Where the weights are: a local directory, or an ``s3://``, ``gs://``, ``http(s)://``
    directory of ``*.safetensors`` (with or without ``model.safetensors.index.json``).
    Default: the model directory (vLLM's ``model``, which still gives config and tokenizer).
``"storage_options"``
    The store's options (as ``asyncload.load``'s ``storage_options``).
``"options"``
    :class:`~asyncload.LoadOptions` fields, e.g. ``{"concurrency": 32, "timeout": 60}``.
    A remote source reads with ``memory_budget`` 128 MiB and ``chunk_size`` 4 MiB unless
    they are given here (``_vllm_config.REMOTE_DEFAULTS``: vLLM copies each weight at once,
    so the stream holds only its read-ahead); a ``LoadOptions`` object is used as it is.

The loader (:class:`asyncload.integrations._vllm_loader.AsyncLoadModelLoader`) is vLLM's own
``DefaultModelLoader`` whose weight iterator is :func:`asyncload.iter_tensors`: the model's
``load_weights``, vLLM's strict "every parameter loaded" check, the expert-parallel weight
filter (a rank reads only its experts' tensors) and the model's list of unused checkpoint
weights are vLLM's; only the selected tensors' bytes are read.

Importing this module imports neither vLLM nor the engine: :func:`register` does.
"""

from __future__ import annotations

from asyncload.integrations._vllm_config import LOAD_FORMAT

__all__ = ["LOAD_FORMAT", "register"]

_registered = False


def register() -> None:
    """Register ``load_format="asyncload"`` with vLLM (its ``vllm.general_plugins`` entry
    point; vLLM calls it once per process, and a second call does nothing)."""
    global _registered
    if _registered:
        return
    from vllm.model_executor.model_loader import register_model_loader

    from asyncload.integrations._vllm_loader import AsyncLoadModelLoader

    register_model_loader(LOAD_FORMAT)(AsyncLoadModelLoader)
    _registered = True
