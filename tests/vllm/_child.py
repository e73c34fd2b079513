"""Run vLLM in a fresh process: ``python _child.py SPEC_JSON`` with SPEC a list of runs, each
``{"model": DIR, "load_format": NAME, "extra": {...}}``, made one after the other in this
process. For each run one line ``RESULT {json}`` on stdout: the greedy tokens of
:data:`PROMPTS` and a SHA-256 of every parameter's bytes as the model holds them after
loading, or ``{"error": class name, "message": ...}`` when ``LLM()`` raised.

The environment (the vLLM variables of tests/vllm/conftest.py) comes from the parent.
"""

from __future__ import annotations

import gc
import json
import sys
from typing import Any

from _digests import digests  # this folder is sys.path[0]

#: Greedy completions of these prompts are compared.
PROMPTS = ["the quick brown fox", "weights stream through", "a tiny random"]
MAX_TOKENS = 8


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    try:
        llm = LLM(
            model=spec["model"],
            load_format=spec["load_format"],
            model_loader_extra_config=spec.get("extra") or {},
            enforce_eager=True,
            max_model_len=256,
            dtype="float32",
            seed=0,
        )
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    try:
        outs = llm.generate(
            PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), use_tqdm=False
        )
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        params = llm.apply_model(digests)[0]
        return {"tokens": tokens, "params": params}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main() -> int:
    for spec in json.loads(sys.argv[1]):
        print("RESULT " + json.dumps(run(spec)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
