"""What ``_child.py`` asks each vLLM worker (``LLM.apply_model``): an importable module, so
the function pickles by reference into the engine core process of the multiprocess mode."""

from __future__ import annotations

import hashlib
from typing import Any


def digests(model: Any) -> dict[str, str]:
    """Every parameter and buffer of the model: dtype, shape and SHA-256 of its bytes."""
    import torch

    out = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        out[name] = (
            f"{t.dtype}:{tuple(t.shape)}:"
            + hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()
        )
    return out
