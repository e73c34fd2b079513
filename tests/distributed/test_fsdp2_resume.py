"""An FSDP2 job resumes from S3 on more ranks than saved it, as a trainer would.

Two gloo ranks train a small model wrapped with ``fully_shard`` and AdamW for two steps and
save model, optimizer and trainer state with ``dcp.save`` (``get_state_dict``, as
torchtitan and accelerate do). Three ranks then resume it twice side by side: once with
torch's own loader (``dcp.load`` from the directory) and once with ``asyncload.load`` from a
moto bucket, each rank through a fault proxy of its own so that its requests can be counted.
Each rank checks, bit for bit:

- every value asyncload loaded equals what torch's loader gave (DTensor shards, the
  optimizer's moments and steps, the trainer's RNG state and counters);
- the resumed parameters equal the parameters the saving job held (so neither loader can
  pass by loading nothing);
- after ``set_state_dict`` and one more training step on the same batch, both models hold
  the same parameters.

Also with an output head tied to the embedding (one parameter under two names, as Llama
3.2 1B and Gemma have): it stays one parameter.

The ``.metadata`` is read once for the group (rank 0's proxy log alone holds its GET).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import RankResult, run_ranks
from test_distributed import same_bits

pytestmark = [pytest.mark.timeout(240), pytest.mark.distributed]

SAVED_ON = 2
RESUMED_ON = 3


class _TiedLM(torch.nn.Module):
    """An embedding, a block and an output head that shares the embedding's weight, as
    Llama 3.2 1B, Gemma and GPT-2 do (one parameter under two names in the state dict)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(40, 24)
        self.block = torch.nn.Sequential(
            torch.nn.Linear(24, 48), torch.nn.GELU(), torch.nn.Linear(48, 24)
        )
        self.norm = torch.nn.LayerNorm(24)
        self.head = torch.nn.Linear(24, 40, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(self.norm(h + self.block(h)))


def _model(tied: bool) -> torch.nn.Module:
    if tied:
        return _TiedLM()
    # dims 48, 40 and 24 do not divide by 3: FSDP2 pads the last rank's shard
    return torch.nn.Sequential(
        torch.nn.Embedding(40, 24),
        torch.nn.Linear(24, 48),
        torch.nn.GELU(),
        torch.nn.LayerNorm(48),
        torch.nn.Linear(48, 40),
    )


def _fsdp2(
    seed: int, world: int, tied: bool = False
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = _model(tied)
    mesh = init_device_mesh("cpu", (world,))
    if tied:  # the tied weight stays in the root's unit, as torchtitan wraps it
        fully_shard(model.block, mesh=mesh)
    else:
        for layer in model:
            if any(p.requires_grad for p in layer.parameters()):
                fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, 40, (4, 6), generator=g)
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 40), tokens.roll(1).reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {
        "model": msd,
        "optim": osd,
        "trainer": {"step": 0, "rng": torch.zeros_like(torch.get_rng_state())},
    }


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().clone() for n, p in model.named_parameters()}


def w_save(rank: int, world: int, path: str, full_path: str, tied: bool) -> None:
    import torch.distributed.checkpoint as dcp

    model, opt = _fsdp2(0, world, tied)
    for step in range(2):
        _step(model, opt, rank, step)
    state = _state(model, opt)
    state["trainer"] = {"step": 2, "rng": torch.get_rng_state()}
    dcp.save(state, checkpoint_id=path)
    full = _full_params(model)
    if rank == 0:
        torch.save(full, full_path)


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_leaves(v, f"{prefix}{k}."))
        return out
    if isinstance(tree, list | tuple):
        out = {}
        for i, v in enumerate(tree):
            out.update(_leaves(v, f"{prefix}{i}."))
        return out
    return {prefix.rstrip("."): tree}


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    la, lb = _leaves(a), _leaves(b)
    if la.keys() != lb.keys():
        return [f"keys: {sorted(la.keys() ^ lb.keys())}"]
    bad = []
    for k, va in la.items():
        va, vb = _local(va), _local(lb[k])
        if isinstance(va, torch.Tensor):
            if not (isinstance(vb, torch.Tensor) and same_bits(va, vb)):
                bad.append(k)
        elif va != vb or type(va) is not type(vb):
            bad.append(k)
    return bad


def w_resume(
    rank: int,
    world: int,
    path: str,
    full_path: str,
    url: str,
    options: list[dict[str, Any]],
    sharded: bool,
    tied: bool,
) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    import asyncload

    theirs_model, theirs_opt = _fsdp2(1, world, tied)
    ours_model, ours_opt = _fsdp2(1, world, tied)
    theirs, ours = _state(theirs_model, theirs_opt), _state(ours_model, ours_opt)

    dcp.load(theirs, checkpoint_id=path)
    planner = asyncload.ShardedLoadPlanner() if sharded else None
    stats = asyncload.load(ours, url, storage_options=options[rank], planner=planner)
    out: dict[str, Any] = {
        "differ": _differences(theirs, ours),
        "shared": stats.metadata_shared,
        "trainer": [ours["trainer"]["step"], theirs["trainer"]["step"]],
    }

    for model, opt, state in ((theirs_model, theirs_opt, theirs), (ours_model, ours_opt, ours)):
        set_state_dict(
            model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    saved = torch.load(full_path, weights_only=True)
    resumed = _full_params(ours_model)
    out["not_saved"] = [n for n, t in saved.items() if not same_bits(resumed[n], t)]

    _step(theirs_model, theirs_opt, rank, 2)
    _step(ours_model, ours_opt, rank, 2)
    if tied:  # still one parameter under two names after the load and the step
        out["untied"] = ours_model.head.weight is not ours_model.embed.weight
    after = {n: p.to_local() for n, p in ours_model.named_parameters()}
    out["after_step"] = [
        n for n, p in theirs_model.named_parameters() if not same_bits(after[n], p.to_local())
    ]
    return out


def _ok(results: list[RankResult]) -> list[dict[str, Any]]:
    for r in results:
        assert r.ok, (r.rank, r.error_type, r.message, r.traceback)
    return [r.value for r in results]


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def saved(request: Any, tmp_path_factory: Any) -> tuple[Path, Path, bool]:
    tied = bool(request.param)
    root = tmp_path_factory.mktemp("fsdp2")
    path, full = root / "ck", root / "full.pt"
    _ok(run_ranks(w_save, SAVED_ON, str(path), str(full), tied, timeout=150))
    return path, full, tied


def _metadata_gets(proxy: Any) -> int:
    return sum(1 for e in proxy.log if e.method == "GET" and e.path.endswith("/.metadata"))


@pytest.mark.parametrize("sharded", [False, True], ids=["pipelined", "sharded"])
def test_fsdp2_resume_from_s3_on_more_ranks_matches_torch(
    s3_server: Any, fault_proxy: Any, saved: tuple[Path, Path, bool], sharded: bool
) -> None:
    path, full, tied = saved
    url = s3_server.upload_dir(path, f"fsdp2-{uuid.uuid4().hex[:12]}", "ckpt")
    proxies = [fault_proxy(s3_server) for _ in range(RESUMED_ON)]
    options = [s3_server.storage_options(endpoint_url=p.endpoint_url) for p in proxies]
    values = _ok(
        run_ranks(
            w_resume, RESUMED_ON, str(path), str(full), url, options, sharded, tied, timeout=200
        )
    )
    for rank, v in enumerate(values):
        assert v["differ"] == [], (rank, v["differ"])
        assert v["not_saved"] == [], (rank, v["not_saved"])
        assert v["after_step"] == [], (rank, v["after_step"])
        assert v["trainer"] == [2, 2], (rank, v["trainer"])
        assert not v.get("untied"), rank
    assert [v["shared"] for v in values] == [False, True, True]
    assert [_metadata_gets(p) for p in proxies] == [1, 0, 0]


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(48, 32)
        self.up = torch.nn.Linear(32, 64)
        self.down = torch.nn.Linear(64, 32)
        self.out = torch.nn.Linear(32, 48)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        return self.out(h + self.down(torch.nn.functional.gelu(self.up(h))))


def _parallel(seed: int, world: int, layout: str) -> tuple[torch.nn.Module, Any, Any]:
    """``hsdp``: FSDP2 on a (replicate 2, shard world/2) mesh; ``tp-fsdp``: tensor parallel
    (``up`` column-wise, ``down`` row-wise) on the inner dimension, FSDP2 on the outer, as
    torchtitan composes them. AdamW and a LambdaLR scheduler."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(seed)
    model = _MLP()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "inner"))
    if layout == "tp-fsdp":
        parallelize_module(
            model, mesh["inner"], {"up": ColwiseParallel(), "down": RowwiseParallel()}
        )
        fully_shard(model, mesh=mesh["dp"])
    else:
        for part in (model.emb, model.up, model.down):
            fully_shard(part, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _parallel_state(model: torch.nn.Module, opt: Any, sched: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "sched": sched.state_dict()}


def w_parallel_layouts(
    rank: int, world: int, path: str, saved_as: str, loaded_as: str, sharded: bool
) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import asyncload

    model, opt, sched = _parallel(0, world, saved_as)
    for step in range(3):  # the same batch on both ranks of a tensor-parallel pair
        g = torch.Generator().manual_seed(100 * step + rank // 2)
        tokens = torch.randint(0, 48, (3, 5), generator=g)
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.reshape(-1, 48), tokens.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    dcp.save(_parallel_state(model, opt, sched), checkpoint_id=path)
    dist.barrier()
    theirs = _parallel_state(*_parallel(1, world, loaded_as))
    ours = _parallel_state(*_parallel(1, world, loaded_as))
    dcp.load(theirs, checkpoint_id=path)
    planner = asyncload.ShardedLoadPlanner() if sharded else None
    asyncload.load(ours, path, planner=planner)
    return {
        "differ": _differences(theirs, ours),
        "sched": [ours["sched"]["last_epoch"], ours["sched"]["_last_lr"]],
        "want": [sched.state_dict()["last_epoch"], sched.state_dict()["_last_lr"]],
    }


@pytest.mark.parametrize(
    "saved_as, loaded_as, sharded",
    [("hsdp", "tp-fsdp", False), ("tp-fsdp", "hsdp", True)],
    ids=["hsdp-to-tp-fsdp-pipelined", "tp-fsdp-to-hsdp-sharded"],
)
def test_2d_layouts_from_torch_parallelism_reshard_like_torch(
    tmp_path: Path, saved_as: str, loaded_as: str, sharded: bool
) -> None:
    """4 ranks save HSDP (FSDP2 on a 2 x 2 mesh) or tensor parallel + FSDP2 (as torchtitan
    composes them) with AdamW and an LR scheduler, and load into the other layout: every
    value equals what torch's ``dcp.load`` gives, bit for bit, the scheduler's state too."""
    results = run_ranks(
        w_parallel_layouts, 4, str(tmp_path / "ck"), saved_as, loaded_as, sharded, timeout=200
    )
    for rank, v in enumerate(_ok(results)):
        assert v["differ"] == [], (rank, v["differ"])
        assert v["sched"] == v["want"] and v["want"][0] == 3, (rank, v)
