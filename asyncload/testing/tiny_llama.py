"""A tiny random Llama and a tokenizer trained here, saved as Hugging Face directories (no hub):
what ``tests/vllm`` and ``benchmarks/bench_vllm.py`` load through vLLM.

:func:`save_tiny_llama` writes ``config.json``, ``generation_config.json``, the tokenizer files
and the weights: one ``model.safetensors``, or (``max_shard_size``) shards and
``model.safetensors.index.json``. Same seed, same weights: the sharded and the single-file
directories hold the same tensors. Needs ``transformers`` and ``tokenizers`` (imported when
called; importing this module imports neither, nor vLLM).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

#: Words the tokenizer is trained on (and prompts are made of).
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "asyncload reads checkpoints from local disk and object storage",
    "a tiny random llama generates tokens greedily",
    "weights stream through the pipeline into the model",
] * 20


def train_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer trained on :data:`CORPUS`, saved as a
    ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + 64, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(directory)


def save_tiny_llama(
    directory: Path,
    *,
    hidden_size: int = 256,
    layers: int = 4,
    intermediate_size: int | None = None,
    vocab_size: int = 512,
    max_shard_size: str | int | None = None,
    seed: int = 0,
) -> Path:
    """A random ``LlamaForCausalLM`` (float32) with a trained tokenizer, in ``directory``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    train_tokenizer(directory)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init: greedy tokens that vary
        for p in model.parameters():
            if p.dim() == 1:  # norms
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    for f in directory.iterdir():  # save_pretrained writes shards 0600
        os.chmod(f, 0o644)
    return directory
