"""Serve a model with vLLM whose weights load through asyncload: ``load_format="asyncload"``.

    python examples/vllm_load.py [MODEL_DIR] [WEIGHTS_URL]

Installing asyncload registers the load format in every vLLM process (the
``vllm.general_plugins`` entry point): nothing to import. ``MODEL_DIR`` holds the model's
config and tokenizer (and, by default, its weights); ``WEIGHTS_URL`` (optional) is where the
``*.safetensors`` are: a local directory or an ``s3://``, ``gs://``, ``http(s)://`` directory.
Without arguments the script writes a tiny random Llama with a tokenizer trained on the spot
(no hub) and loads it from disk, once with vLLM's own ``safetensors`` and once with
``asyncload``, and checks that both generate the same greedy tokens.

The command-line equivalent::

    vllm serve MODEL_DIR --load-format asyncload \\
        --model-loader-extra-config '{"url": "s3://bucket/llama/", "options": {"concurrency": 32}}'

Needs: vLLM (its CPU build works: ``bash scripts/setup_vllm.sh`` builds ``.venv-vllm``),
transformers and tokenizers (vLLM's dependencies). On a CPU-only machine set
``VLLM_CPU_KVCACHE_SPACE=1``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: a quicker start

from vllm import LLM, SamplingParams


def tiny_llama(directory: Path) -> Path:
    """A random 4-layer Llama and a byte-level BPE tokenizer trained here."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    words = ["the quick brown fox jumps over the lazy dog", "weights stream into the model"]
    tok.train_from_iterator(
        words * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(directory)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if p.dim() == 1 else p.normal_(0, 0.08)
    model.save_pretrained(directory)
    return directory


def generate(model: str, load_format: str, extra: dict[str, object]) -> list[list[int]]:
    import torch

    llm = LLM(
        model=model,
        load_format=load_format,
        model_loader_extra_config=extra,
        enforce_eager=True,
        max_model_len=256,
        # the model's own dtype on a GPU; float32 on CPU: vLLM's CPU build died with SIGILL in
        # its bfloat16 kernels (this config's dtype) on a CPU with AMX, before any weight
        # was loaded by asyncload
        dtype="auto" if torch.cuda.is_available() else "float32",
    )
    outs = llm.generate(["the quick brown fox"], SamplingParams(max_tokens=8, temperature=0))
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    llm.llm_engine.engine_core.shutdown()
    return tokens


def main() -> None:
    if len(sys.argv) > 1:
        extra = {"url": sys.argv[2]} if len(sys.argv) > 2 else {}
        print("asyncload:", generate(sys.argv[1], "asyncload", extra))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = str(tiny_llama(Path(tmp)))
        theirs = generate(model, "safetensors", {})
        ours = generate(model, "asyncload", {"options": {"concurrency": 8}})
        print("safetensors:", theirs)
        print("asyncload:  ", ours)
        assert ours == theirs, "the two loads generated different tokens"


if __name__ == "__main__":
    main()
