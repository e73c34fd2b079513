"""Tied weights and partial loads, on every face (``load``, ``aload``, ``start_load``,
``dcp.load`` with asyncload's reader and planner) and every format, with checkpoints written
by the real tools: transformers' ``save_pretrained`` of a tiny Llama with tied embeddings
(one file, and sharded with an index), ``dcp.save``, ``torch.save``. Everything compared bit
for bit with what ``LlamaForCausalLM.from_pretrained`` gives, the logits included."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a tiny model from a seed: nothing from the hub

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _ckpt import assert_bitwise_equal, make_checkpoint, random_tensor, tensor_bytes
from _dist import all_ok, run_ranks
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import asyncload
from asyncload import (
    LoadOptions,
    PipelinedLoadPlanner,
    PipelinedReader,
    ShardedLoadPlanner,
    StateDictMismatchError,
)
from asyncload.engine.keys import MISSING_SHOWN, alias_groups, closest_keys

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM

CONFIG = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}
TIED, THROUGH = "lm_head.weight", "model.embed_tokens.weight"
SMALL = LoadOptions(chunk_size=4096, min_chunk_size=512, memory_budget=64 << 10, concurrency=4)


def llama(seed: int) -> LlamaForCausalLM:
    # imported here: the 2-rank test's ranks import this module without needing transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    model.eval()
    return model


def logits(model: LlamaForCausalLM) -> torch.Tensor:
    ids = torch.arange(12).reshape(2, 6) * 7 % CONFIG["vocab_size"]
    with torch.no_grad():
        return model(input_ids=ids).logits


def fresh_state(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    assert sd[TIED].data_ptr() == sd[THROUGH].data_ptr()  # the model ties them, as HF builds it
    return sd


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny tied Llama saved by ``save_pretrained`` (one file; sharded with an index), and
    what ``from_pretrained`` gives for it."""
    root = tmp_path_factory.mktemp("hf")
    model = llama(0)
    single, sharded = root / "single", root / "sharded"
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    from transformers import LlamaForCausalLM

    ref = LlamaForCausalLM.from_pretrained(single)
    ref.eval()
    want = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    return {"single": single, "sharded": sharded, "state": want, "logits": logits(ref)}


def check_loaded(
    model: LlamaForCausalLM, stats: asyncload.LoadStats, hf: dict[str, Any], where: str
) -> None:
    got = model.state_dict()
    assert list(got) == list(hf["state"])
    assert_bitwise_equal(dict(got), hf["state"], where)
    assert got[TIED].data_ptr() == got[THROUGH].data_ptr()  # still tied
    assert torch.equal(logits(model), hf["logits"]), where
    assert stats.tied_keys == {TIED: THROUGH}
    assert stats.missing_keys == []
    assert (
        "1 tied key (the same memory as another key's) filled through that key (lm_head.weight -> model.embed_tokens.weight)"
        in str(stats)
    )


def run_face(face: str, sd: dict[str, Any], checkpoint: Any, **kwargs: Any) -> asyncload.LoadStats:
    if face == "load":
        return asyncload.load(sd, checkpoint, **kwargs)
    if face == "aload":
        return asyncio.run(asyncload.aload(sd, checkpoint, **kwargs))
    if face == "start_load":
        return asyncload.start_load(sd, checkpoint, **kwargs).result(60)
    if face == "dcp.load":
        partial = kwargs.pop("allow_partial_load", False)
        opts = kwargs.pop("options", None)
        reader = PipelinedReader(
            checkpoint, options=opts, storage_options=kwargs.pop("storage_options", None)
        )
        assert not kwargs
        try:
            dcp.load(
                sd,
                storage_reader=reader,
                planner=PipelinedLoadPlanner(options=opts, allow_partial_load=partial),
            )
        except CheckpointException as exc:  # dcp.load wraps the planner's and reader's errors
            raise exc.failures[0][0] from exc
        assert reader.stats is not None
        return reader.stats
    raise AssertionError(face)


FACES = ["load", "aload", "start_load", "dcp.load"]


# --- tied weights: Hugging Face directories -------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_hf_tied_local(hf: dict[str, Any], face: str, layout: str) -> None:
    model = llama(1)
    assert not torch.equal(
        model.state_dict()[THROUGH], hf["state"][THROUGH]
    )  # other random weights
    stats = run_face(face, fresh_state(model), hf[layout], options=SMALL)
    check_loaded(model, stats, hf, f"{face} {layout}")


@pytest.mark.timeout(120)
def test_hf_tied_from_s3(hf: dict[str, Any], s3_server: Any, bucket_name: str) -> None:
    opts = s3_server.storage_options()
    for layout in ("single", "sharded"):
        url = s3_server.upload_dir(hf[layout], bucket_name, layout)
        for face in ("load", "aload"):
            model = llama(2)
            stats = run_face(face, fresh_state(model), url, options=SMALL, storage_options=opts)
            check_loaded(model, stats, hf, f"s3 {face} {layout}")
        model = llama(2)
        index = url + "/model.safetensors.index.json"
        if layout == "sharded":
            check_loaded(
                model, asyncload.load(fresh_state(model), index, storage_options=opts), hf, index
            )


@pytest.mark.timeout(120)
def test_hf_tied_through_sharded_planner(hf: dict[str, Any]) -> None:
    model = llama(3)
    stats = asyncload.load(
        fresh_state(model), hf["sharded"], planner=ShardedLoadPlanner(options=SMALL)
    )
    check_loaded(model, stats, hf, "ShardedLoadPlanner")


# --- tied weights: DCP and torch.save -------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("face", FACES)
def test_dcp_without_the_tied_key(tmp_path: Path, hf: dict[str, Any], face: str) -> None:
    """``dcp.save`` of a state dict without ``lm_head.weight`` (as a trainer that drops tied keys saves)."""
    saved = {k: v for k, v in hf["state"].items() if k != TIED}
    path = make_checkpoint(tmp_path / "ckpt", saved)
    assert TIED not in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    model = llama(4)
    check_loaded(model, run_face(face, fresh_state(model), path, options=SMALL), hf, face)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("face", ["load", "dcp.load"])
def test_dcp_with_both_tied_keys_equal(tmp_path: Path, hf: dict[str, Any], face: str) -> None:
    """``dcp.save`` of the tied model's own state dict writes both keys (same bytes): loaded
    once into the shared memory, the other compared with it."""
    path = make_checkpoint(tmp_path / "ckpt", llama(0).state_dict())
    assert {TIED, THROUGH} <= set(
        dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    )
    model = llama(5)
    stats = run_face(face, fresh_state(model), path, options=SMALL)
    got = model.state_dict()
    assert_bitwise_equal(dict(got), hf["state"], face)
    assert torch.equal(logits(model), hf["logits"])
    # the destination's first key of the pair (in sorted order) was written; the other compared
    assert stats.tied_keys == {THROUGH: TIED}
    assert stats.missing_keys == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("face", ["load", "dcp.load"])
def test_tied_keys_with_different_saved_values_refused(tmp_path: Path, face: str) -> None:
    a, b = random_tensor((8, 16), torch.float32, 1), random_tensor((8, 16), torch.float32, 2)
    b[:4] = a[:4]  # the first half agrees, the second does not
    path = make_checkpoint(
        tmp_path / "ckpt", {"a": a, "b": b, "c": random_tensor((3,), torch.float32, 3)}
    )
    shared = torch.zeros(8, 16)
    with pytest.raises(StateDictMismatchError) as err:
        run_face(face, {"a": shared, "b": shared, "c": torch.zeros(3)}, path, options=SMALL)
    msg = str(err.value)
    assert "keys 'b' and 'a' are one tensor in the destination (tied weights" in msg, msg
    assert "the checkpoint holds different values for them" in msg
    assert tensor_bytes(shared) == tensor_bytes(a)  # written once, with the first key's values

    # equal values under both keys: loaded, the pair named in tied_keys
    path2 = make_checkpoint(tmp_path / "ckpt2", {"a": a, "b": a.clone()})
    shared = torch.zeros(8, 16)
    stats = run_face(face, {"a": shared, "b": shared}, path2, options=SMALL)
    assert tensor_bytes(shared) == tensor_bytes(a)
    assert stats.tied_keys == {"b": "a"}


@pytest.mark.timeout(60)
def test_torch_save_tied(tmp_path: Path, hf: dict[str, Any]) -> None:
    without = tmp_path / "without.pt"
    torch.save({k: v for k, v in hf["state"].items() if k != TIED}, without)
    model = llama(6)
    check_loaded(
        model, asyncload.load(fresh_state(model), without, options=SMALL), hf, "torch.save without"
    )
    # a tied model saved as it is: both keys, one storage in the archive
    both = tmp_path / "both.pt"
    source = llama(0)
    torch.save(source.state_dict(), both)
    model = llama(7)
    stats = asyncload.load(fresh_state(model), both, options=SMALL)
    assert_bitwise_equal(dict(model.state_dict()), hf["state"], "torch.save both")
    assert stats.tied_keys == {THROUGH: TIED}
    # one storage in the archive: read and written once, not compared through scratch memory
    once = sum(v.numel() * v.element_size() for k, v in hf["state"].items() if k != THROUGH)
    assert stats.bytes_assembled == once


def _rank_tied(rank: int, world: int, checkpoints: list[str]) -> list[dict[str, Any]]:
    """A 2-rank load with ShardedLoadPlanner (bytes read once, shared) into a tied destination."""
    out = []
    for path in checkpoints:
        shared = torch.zeros(16, 8, dtype=torch.bfloat16)
        dest = {"embed": shared, "head": shared, "w": torch.zeros(8, 4)}
        stats = asyncload.load(
            dest, path, planner=ShardedLoadPlanner(options=SMALL, sharing="always")
        )
        # raw bytes, not tensors: tensors would travel as shared memory the exiting rank takes along
        out.append(
            {
                "embed": tensor_bytes(dest["head"]),
                "w": tensor_bytes(dest["w"]),
                "tied": stats.tied_keys,
            }
        )
    return out


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_two_rank_sharded_planner_tied(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    embed, w = random_tensor((16, 8), torch.bfloat16, 1), random_tensor((8, 4), torch.float32, 2)
    save_file({"embed": embed, "w": w}, str(tmp_path / "model.safetensors"))  # the head left out
    both = make_checkpoint(tmp_path / "dcp", {"embed": embed, "head": embed.clone(), "w": w})
    values = all_ok(
        run_ranks(_rank_tied, 2, [str(tmp_path / "model.safetensors"), str(both)], timeout=90)
    )
    for per_rank in values:
        without, with_both = per_rank
        assert without == {
            "embed": tensor_bytes(embed),
            "w": tensor_bytes(w),
            "tied": {"head": "embed"},
        }
        assert with_both == {
            "embed": tensor_bytes(embed),
            "w": tensor_bytes(w),
            "tied": {"head": "embed"},
        }


def test_views_that_only_overlap_are_not_tied() -> None:
    base = torch.zeros(4, 6)
    sd = {
        "whole": base,
        "same": base.view(4, 6),
        "rows": base[:2],  # overlaps, another shape
        "t": base.t(),  # the same memory, another stride
        "bytes": base.view(torch.int32),  # another dtype
        "param": torch.nn.Parameter(base),
        "empty1": torch.empty(0),
        "empty2": torch.empty(0),
        "other": torch.zeros(4, 6),
    }
    assert alias_groups(sd) == [["whole", "same", "param"]]


# --- partial loads and the names of missing keys ----------------------------------------------


def sentinel_like(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Destinations filled with a byte pattern that no saved tensor holds."""
    return {k: torch.full(v.shape, -7.25, dtype=v.dtype) for k, v in sd.items()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("face", FACES)
def test_missing_keys_named_with_closest_and_nothing_written(tmp_path: Path, face: str) -> None:
    saved = {
        "model.layers.0.mlp.gate_proj.weight": random_tensor((8, 4), torch.float32, 1),
        "encoder.norm.weight": random_tensor((4,), torch.float32, 2),
        "head.weight": random_tensor((5, 4), torch.float32, 3),
    }
    path = make_checkpoint(tmp_path / "ckpt", saved)
    dest = sentinel_like(
        {
            "layers.0.mlp.gate_proj.weight": saved[
                "model.layers.0.mlp.gate_proj.weight"
            ],  # "model." lost
            "model.encoder.norm.weight": saved["encoder.norm.weight"],  # "model." added
            "heads.weight": saved["head.weight"],  # renamed
            "head.weight": saved["head.weight"],
            "unrelated.zzz": torch.zeros(3),  # nothing close
        }
    )
    before = {k: tensor_bytes(v) for k, v in dest.items()}
    with pytest.raises(StateDictMismatchError) as err:
        run_face(face, dest, path, options=SMALL)
    msg = str(err.value)
    assert msg.startswith(
        f"{path}: 4 of the destination's 5 keys are missing from the checkpoint: "
    ), msg
    assert (
        "'heads.weight' (closest checkpoint key: 'head.weight')" not in msg
    )  # head.weight is loaded: not a suggestion
    assert (
        "'layers.0.mlp.gate_proj.weight' (closest checkpoint key: 'model.layers.0.mlp.gate_proj.weight')"
        in msg
    )
    assert "'model.encoder.norm.weight' (closest checkpoint key: 'encoder.norm.weight')" in msg
    assert "'unrelated.zzz'," in msg or "'unrelated.zzz'." in msg
    assert "pass allow_partial_load=True" in msg
    assert {k: tensor_bytes(v) for k, v in dest.items()} == before  # raised before any read


@pytest.mark.timeout(60)
def test_renamed_key_suggested_and_count_over_the_cap(tmp_path: Path) -> None:
    saved = {f"blocks.{i}.ffn.weight": random_tensor((2, 3), torch.float32, i) for i in range(30)}
    saved["blocks.0.attention.weight"] = random_tensor((4, 4), torch.float32, 99)
    path = make_checkpoint(tmp_path / "ckpt", saved)
    dest = {f"layers.{i:02d}.ffn.weight": torch.zeros(2, 3) for i in range(30)}
    dest["blocks.0.attn.weight"] = torch.zeros(4, 4)  # a renamed layer
    with pytest.raises(StateDictMismatchError) as err:
        asyncload.load(dest, path)
    msg = str(err.value)
    # nothing would load: no allow_partial_load advice (issue 44)
    assert msg.startswith(f"{path}: none of the destination's 31 keys is in the checkpoint: "), msg
    assert "allow_partial_load" not in msg
    assert "'blocks.0.attn.weight' (closest checkpoint key: 'blocks.0.attention.weight')" in msg
    assert f", and {31 - MISSING_SHOWN} more. " in msg
    assert msg.count("'layers.") == MISSING_SHOWN - 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("face", FACES)
def test_allow_partial_load_on_every_face(tmp_path: Path, face: str) -> None:
    saved = {f"w{i}": random_tensor((6, 5), torch.bfloat16, i) for i in range(4)}
    saved["obj"] = {"step": 3}
    path = make_checkpoint(tmp_path / "ckpt", saved)
    dest: dict[str, Any] = sentinel_like({k: v for k, v in saved.items() if k != "obj"})
    dest["extra.b"] = torch.full((7,), 3.5)
    dest["extra.a"] = random_tensor((2, 2), torch.float16, 9)
    prior = {k: v.clone() for k, v in dest.items() if k.startswith("extra.")}
    stats = run_face(face, dest, path, options=SMALL, allow_partial_load=True)
    for k in ("w0", "w1", "w2", "w3"):
        assert_bitwise_equal(dest[k], saved[k], k)
    for k, v in prior.items():
        assert_bitwise_equal(dest[k], v, k)  # kept its prior values
    assert stats.missing_keys == ["extra.a", "extra.b"]
    assert stats.unexpected_keys == ["obj.step"]  # flattened, as DCP names it
    assert stats.tied_keys == {}
    assert (
        "2 destination keys not in the checkpoint, left as they were (extra.a, extra.b)."
        in str(stats)
    )
    assert stats.to_dict()["missing_keys"] == ["extra.a", "extra.b"]


@pytest.mark.timeout(60)
def test_partial_hf_load_keeps_missing_tensors(hf: dict[str, Any]) -> None:
    """A destination with a layer the checkpoint lacks (a model built with one layer more)."""
    model = llama(8)
    sd = fresh_state(model)
    sd["extra.head.weight"] = torch.full((3, 3), 1.5)
    with pytest.raises(
        StateDictMismatchError,
        match=r"1 of the destination's 22 keys is missing from the checkpoint: 'extra.head.weight'\.",
    ):
        asyncload.load(sd, hf["single"])
    stats = asyncload.load(sd, hf["single"], allow_partial_load=True)
    assert stats.missing_keys == ["extra.head.weight"]
    assert stats.tied_keys == {TIED: THROUGH}
    assert torch.equal(sd["extra.head.weight"], torch.full((3, 3), 1.5))
    assert torch.equal(logits(model), hf["logits"])


@pytest.mark.timeout(60)
def test_allow_partial_load_with_a_planner(tmp_path: Path) -> None:
    saved = {"a": random_tensor((4,), torch.float32, 1)}
    path = make_checkpoint(tmp_path / "ckpt", saved)
    # the argument sets the planner's own attribute (it keeps it)
    planner = PipelinedLoadPlanner(options=SMALL)
    dest = {"a": torch.zeros(4), "b": torch.ones(2)}
    stats = asyncload.load(dest, path, planner=planner, allow_partial_load=True)
    assert planner.allow_partial_load is True
    assert stats.missing_keys == ["b"] and torch.equal(dest["b"], torch.ones(2))
    # a planner made partial loads partially with the argument left at its default
    stats = asyncload.load(
        {"a": torch.zeros(4), "c": torch.ones(1)},
        path,
        planner=ShardedLoadPlanner(allow_partial_load=True),
    )
    assert stats.missing_keys == ["c"]
    # and without either, the missing key is an error
    with pytest.raises(
        StateDictMismatchError,
        match=r"1 of the destination's 2 keys is missing from the checkpoint: 'b'\.",
    ):
        asyncload.load(
            {"a": torch.zeros(4), "b": torch.ones(2)}, path, planner=PipelinedLoadPlanner()
        )
    with pytest.raises(TypeError, match="allow_partial_load must be a bool, not str"):
        asyncload.load(dest, path, allow_partial_load="yes")  # type: ignore[arg-type]


def test_closest_keys_over_a_hundred_thousand_keys() -> None:
    """The suggestions stay right (and the work bounded) over a 100k-key checkpoint."""
    shape = TensorStorageMetadata.__new__(TensorStorageMetadata)
    object.__setattr__(shape, "size", torch.Size([8]))
    other = TensorStorageMetadata.__new__(TensorStorageMetadata)
    object.__setattr__(other, "size", torch.Size([8, 8]))
    saved: dict[str, Any] = {f"model.layers.{i}.mlp.up_proj.weight": other for i in range(50_000)}
    saved.update({f"model.layers.{i}.norm.weight": shape for i in range(50_000)})
    saved["model.layers.7.mlp.gate.weight"] = other
    dest = {
        "layers.123.norm.weight": torch.zeros(8),  # prefix lost
        "model.layers.7.mlp.gate_proj.weight": torch.zeros(8, 8),  # renamed
        "qqq": torch.zeros(1),
    }
    found = closest_keys(sorted(dest), dest, saved)
    assert found == {
        "layers.123.norm.weight": "model.layers.123.norm.weight",
        "model.layers.7.mlp.gate_proj.weight": "model.layers.7.mlp.gate.weight",
    }
