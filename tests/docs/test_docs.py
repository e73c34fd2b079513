"""Every ```python block of README.md and docs/*.md runs here (issue 44, item 6).

How: Sybil 10 (``tests/docs/_blocks.py``) parses each page; its blocks run in order in one
namespace per page, which a per-page setup below fills with what the page calls yours
(``model``, ``state_dict``, ``url``, ``endpoint``...): a small model, and the checkpoints the
page reads, written for it on local disk (the test's working directory) and on the session's
loopback servers (moto S3 with ``AWS_ENDPOINT_URL``, fake-gcs-server with
``STORAGE_EMULATOR_HOST``). After a page runs, the model it loaded into holds the saved
tensors bit for bit.

Why Sybil: it is maintained (10.x, 2025-2026, used by large projects' docs), parses Markdown
fences with line numbers, keeps a namespace per document, and lets the evaluator be ours (top
level ``await``, the ``<!-- no-run REASON -->`` marker); pytest-markdown-docs and
pytest-codeblocks collect only files under the test path and read their own skip markers,
mktestdocs and pytest-examples are narrower (one block at a time, or formatting-oriented).

A block that cannot run here (a GPU, a cluster, a package outside the ``test`` extra) carries
``<!-- no-run REASON -->`` on the line right above it; at most one block in five
(:func:`test_every_block_runs_or_says_why`).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _blocks import PAGES, ROOT, blocks, fences, parse

import asyncload

#: torch's own note when dcp.save / dcp.load run without a process group (one process)
_TORCH_SINGLE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"


class Net(torch.nn.Module):
    """The page's ``model``: small, two layers, a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 8)
        self.head = torch.nn.Linear(8, 4)
        self.register_buffer("scale", torch.ones(4))


def _trained(seed: int = 1) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model.head(model.fc(torch.randn(3, 16))).sum().backward()
    opt.step()
    model.scale.mul_(3)
    return model, opt


def _fresh(seed: int = 2) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(
            got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)
        ), k


@dataclasses.dataclass
class Page:
    """What a page's setup has: the servers, a scratch directory (the working directory)."""

    s3: Any
    gcs: Any
    tmp: Path
    _n: Iterator[int] = dataclasses.field(default_factory=itertools.count)
    cleanups: list[Callable[[], Any]] = dataclasses.field(default_factory=list)

    def _scratch(self) -> Path:
        d = self.tmp / "_saved"
        d.mkdir(exist_ok=True)
        return d / str(next(self._n))

    def put(self, local: Path, url: str) -> str:
        """Copy a local file or directory to ``url`` (s3://, gs:// or a relative local path)."""
        scheme, _, rest = url.partition("://")
        if not rest:
            target = self.tmp / url
            if local.resolve() != target.resolve():
                target.parent.mkdir(parents=True, exist_ok=True)
                if local.is_dir():
                    shutil.copytree(local, target, dirs_exist_ok=True)
                else:
                    target.write_bytes(local.read_bytes())
            return url
        server = {"s3": self.s3, "gs": self.gcs}[scheme]
        bucket, _, key = rest.partition("/")
        if local.is_dir():
            return str(server.upload_dir(local, bucket, key))
        return str(server.put_object(bucket, key, local.read_bytes()))

    def dcp(self, state: dict[str, Any], *urls: str) -> None:
        """``dcp.save(state)`` once, then copied to every url."""
        d = self._scratch()
        d.mkdir()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_TORCH_SINGLE_PROCESS)
            dcp.save(state, checkpoint_id=d, no_dist=True)
        for url in urls:
            self.put(d, url)

    def file(self, data: bytes | Path, *urls: str) -> None:
        f = self._scratch()
        f.write_bytes(data if isinstance(data, bytes) else data.read_bytes())
        for url in urls:
            self.put(f, url)


def _common(page: Page) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    """Names every page may use as its own, and the check that the model was loaded."""
    saved, _ = _trained()
    want = {k: v.clone() for k, v in saved.state_dict().items()}
    model, opt = _fresh()
    ns: dict[str, Any] = {
        "torch": torch,
        "dcp": dcp,
        "dist": dist,
        "json": json,
        "time": time,
        "argparse": argparse,
        "log": logging.getLogger("docs"),
        "model": model,
        "opt": opt,
        "optimizer": opt,
        "state_dict": model.state_dict(),
        "state": {"model": model.state_dict(), "step": None},
        "url": "s3://bucket/run7/step-4000",
        "endpoint": page.s3.endpoint_url,
        "Net": Net,
        "build_model": Net,
    }

    def loaded(ns: dict[str, Any]) -> None:
        _equal(ns["model"].state_dict(), want)

    return ns, loaded


def _training_ckpt(page: Page, *urls: str) -> dict[str, Any]:
    saved, _ = _trained()
    page.dcp({"model": saved.state_dict(), "step": 4000}, *urls)
    return saved.state_dict()


# -- per-page setups: each returns the page's namespace and a check run after its blocks --------

Setup = Callable[[Page], tuple[dict[str, Any], Callable[[dict[str, Any]], None]]]


def _readme(page: Page) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    ns, loaded = _common(page)
    _training_ckpt(
        page,
        "s3://bucket/run7/step-4000",
        "ckpt/step-4000",
        "gs://bucket/ckpt",
        "s3://bucket/ckpt",
    )

    def check(ns: dict[str, Any]) -> None:
        loaded(ns)
        _equal(ns["state_dict"], ns["model"].state_dict())

    return ns, check


def _plain(page: Page) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    """A page whose blocks load the training checkpoint from ``url``."""
    ns, loaded = _common(page)
    _training_ckpt(page, "s3://bucket/run7/step-4000")
    return ns, loaded


def _errors(page: Page) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    ns, loaded = _plain(page)
    ns["opts"] = asyncload.LoadOptions(retries=2)
    return ns, loaded


def _tiny_llama(seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def _llama_names(page: Page) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``LlamaForCausalLM``, ``config``, and a tiny saved Llama at ``models/llama`` (one file)
    and ``s3://hub/llama`` (two shards and an index); returns its state dict too."""
    import transformers

    saved = _tiny_llama(11)
    saved.save_pretrained(page.tmp / "models/llama")
    sharded = page.tmp / "_saved/hub-llama"
    saved.save_pretrained(sharded, max_shard_size="10KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    page.put(sharded, "s3://hub/llama")
    ns = {
        "LlamaForCausalLM": transformers.LlamaForCausalLM,
        "LlamaForSequenceClassification": transformers.LlamaForSequenceClassification,
        "config": saved.config,
    }
    return ns, {k: v.clone() for k, v in saved.state_dict().items()}


def _quickstart(page: Page) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    ns, _ = _common(page)
    model, _ = _trained()  # block 1 saves it
    # a full resume's checkpoint (model and optimizer state as get_state_dict gives them), where
    # the page's blocks load `state` from remote storage: by then `state` is the full resume's
    from torch.distributed.checkpoint.state_dict import get_state_dict

    trained, trained_opt = _trained()
    _equal(model.state_dict(), trained.state_dict())
    msd, osd = get_state_dict(trained, trained_opt)
    page.dcp(
        {"model": msd, "optim": osd, "step": 4000},
        "ckpt/step-4001",
        "s3://bucket/run7/step-4000",
        "gs://bucket/run7/step-4000",
        "s3://bucket/ckpt",
    )
    llama, llama_sd = _llama_names(page)
    fresh_opt = torch.optim.Adam(model.parameters(), lr=0.1)
    ns.update(llama)
    ns.update(
        model=model,
        optimizer=fresh_opt,
        step=4000,
        latest_checkpoint="ckpt/step-4001",
        model_params={f"model.{k}": v for k, v in model.state_dict().items()},
        ckpt="ckpt/step-4000",
        build_model=Net,
        build_the_rest=lambda: (fresh_opt, None),
    )

    def check(ns: dict[str, Any]) -> None:
        _equal(ns["model"].state_dict(), llama_sd)  # the last load: models/llama
        assert ns["step"] == 4000
        # the full resume (get_state_dict / set_state_dict) gave the fresh optimizer its moments
        got, want_opt = ns["optimizer"].state_dict(), trained_opt.state_dict()
        assert sorted(got["state"]) == sorted(want_opt["state"]) == [0, 1, 2, 3]
        for i, moments in want_opt["state"].items():
            _equal(got["state"][i], moments)
        assert ns["sd"]["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16

    return ns, check


def _integrations(page: Page) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    ns, _ = _common(page)
    saved = _tiny_llama(12)
    saved.save_pretrained(page.tmp / "_saved/llama")
    page.file(
        page.tmp / "_saved/llama/model.safetensors",
        "s3://my-bucket/llama/model-00001-of-00004.safetensors",
    )
    ns.update(world_size=2, rank=1)
    want = saved.state_dict()

    def check(ns: dict[str, Any]) -> None:
        assert torch.equal(ns["norm"], want["model.norm.weight"])
        last = want[ns["name"]]
        rows = last.shape[0] // 2
        assert torch.equal(ns["shard"], last[rows:])

    return ns, check


def _distributed(page: Page) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    """One rank of a gloo group (loopback): the blocks that need no more than that run."""
    from asyncload.testing.servers import free_port

    ns, _ = _plain(page)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    page.cleanups.append(dist.destroy_process_group)

    def check(ns: dict[str, Any]) -> None:
        _equal(ns["state"]["model"], _trained()[0].state_dict())

    return ns, check


@dataclasses.dataclass
class RunConfig:
    """A config object a training script saves beside its weights (formats.md's safe_globals)."""

    lr: float = 0.1
    layers: int = 2


def _torch_checkpointing_dir(path: Path, state: dict[str, Any]) -> None:
    from torch_checkpointing import CheckpointManager, ItemSpec
    from torch_checkpointing.config import SyncCheckpointSaverConfig
    from torch_checkpointing.default_resharder import DefaultResharder
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    cfg = CheckpointManager.Config(
        items={"model": ItemSpec(resharder=DefaultResharder())},
        save=SyncCheckpointSaverConfig(),
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False),  # O_DIRECT: EINVAL here
    )
    mgr = CheckpointManager(cfg)
    try:
        assert mgr.save(str(path), state) is None
    finally:
        mgr.close()


def _formats(page: Page) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    import transformers.modeling_utils
    from torch.testing._internal.distributed.checkpoint_utils import Rot13Example

    ns, _ = _common(page)
    llama, want = _llama_names(page)
    ns.update(llama)
    saved = _tiny_llama(11)
    saved_opt = torch.optim.Adam(saved.parameters(), lr=0.1)
    saved(torch.arange(8).view(1, 8)).logits.sum().backward()
    saved_opt.step()
    saved.load_state_dict(want)  # the weights of models/llama again, the optimizer stepped
    trained = {"model": saved.state_dict(), "optimizer": saved_opt.state_dict(), "step": 7}
    page.file(_save_bytes(trained), "s3://runs/7/ckpt.pt", "gs://runs/7/ckpt.pt")
    with_args = {**trained, "args": argparse.Namespace(lr=0.1), "config": RunConfig()}
    page.file(_save_bytes(with_args), "s3://runs/8/ckpt.pt")
    page.file(_save_bytes({f"module.{k}": v for k, v in want.items()}), "ddp.pt")
    _torch_checkpointing_dir(page.tmp / "ckpt/step_1000", {"model": want, "step": 1000})
    page.put(page.tmp / "ckpt/step_1000", "s3://runs/7/step_1000")

    model = _tiny_llama(21)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.arange(8).view(1, 8)).logits.sum().backward()
    opt.step()  # so that "optimizer" holds moments for a fresh one to be filled with
    sched = torch.optim.lr_scheduler.StepLR(  # its own optimizer: StepLR adds initial_lr
        torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), step_size=10
    )
    for _ in range(3):
        sched.optimizer.step()
        sched.step()
    # block 1 loads s3://runs/7/ckpt.pt's optimizer into `opt`, block 3 saves it to ckpt.pt
    moments = {k: v.clone() for k, v in saved_opt.state_dict()["state"][0].items()}
    state_dict = model.state_dict()
    enc = {k: v.clone() for k, v in want.items()}
    d = page._scratch()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TORCH_SINGLE_PROCESS)
        dcp.save(
            enc,
            storage_writer=dcp.FileSystemWriter(d, _extensions=[Rot13Example()]),
            no_dist=True,
        )
    page.put(d, "s3://bucket/enc")

    def build() -> tuple[Any, torch.optim.Optimizer]:
        m = _tiny_llama(31)
        return m, torch.optim.Adam(m.parameters(), lr=0.1)

    ns.update(
        model=model,
        opt=opt,
        state_dict=state_dict,
        ck="ckpt/dcp",
        build=build,
        sched=sched,
        RunConfig=RunConfig,
        path="models/llama",
        MyCipher=Rot13Example,
    )
    original = transformers.modeling_utils.safe_open
    page.cleanups.append(lambda: setattr(transformers.modeling_utils, "safe_open", original))

    def check(ns: dict[str, Any]) -> None:
        _equal(ns["model"].state_dict(), want)
        _equal(ns["state_dict"], want)
        assert ns["dest"]["scheduler"] == sched.state_dict()
        assert ns["dest"]["scheduler"]["last_epoch"] == 3 and ns["dest"]["epoch"] == 3
        _equal(ns["opt"].state_dict()["state"][0], moments)  # the fresh optimizer, filled

    return ns, check


def _save_bytes(obj: Any) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


SETUPS: dict[str, Setup] = {
    "docs/formats.md": _formats,
    "README.md": _readme,
    "docs/distributed.md": _distributed,
    "docs/errors.md": _errors,
    "docs/integrations.md": _integrations,
    "docs/quickstart.md": _quickstart,
    "docs/remote.md": _plain,
    "docs/tuning.md": _plain,
}


@pytest.fixture
def page_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, s3_server: Any, gcs_server: Any
) -> Iterator[Page]:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint_url)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server.endpoint_url)
    page = Page(s3_server, gcs_server, tmp_path)
    try:
        yield page
    finally:
        for cleanup in reversed(page.cleanups):
            cleanup()


def _runnable(page: str) -> bool:
    return any(reason is None for _, reason in blocks(page))


@pytest.mark.parametrize("page", [p for p in PAGES if _runnable(p)])
def test_page_runs(page: str, page_dir: Page) -> None:
    """Every block of the page not marked no-run runs, in order, as a reader would run them."""
    assert page in SETUPS, f"{page} has python blocks to run: give it a setup in SETUPS"
    ns, check = SETUPS[page](page_dir)
    doc = parse(page)
    doc.namespace.update(ns)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TORCH_SINGLE_PROCESS)
        for example in doc:
            example.evaluate()
    check(doc.namespace)


def test_a_failing_block_fails_and_no_run_is_honoured(tmp_path: Path) -> None:
    """The harness is not vacuous: a block that raises fails the page, at the page's line; the
    block under a no-run line is not run; top-level await runs."""
    md = tmp_path / "page.md"
    md.write_text(
        "# t\n\n```python\nimport asyncio\nx = await asyncio.sleep(0, 5)\n```\n\n"
        "<!-- no-run: needs a GPU -->\n```python\nraise SystemExit(9)\n```\n\n"
        "```python\nassert x == 5\n1 / 0\n```\n",
        encoding="utf-8",
    )
    doc = parse(md)
    examples = list(doc)
    assert [ex.line for ex in examples] == [3, 9, 13]
    examples[0].evaluate()
    examples[1].evaluate()  # not run: SystemExit would propagate
    with pytest.raises(ZeroDivisionError) as info:
        examples[2].evaluate()
    assert (info.traceback[-1].path, info.traceback[-1].lineno + 1) == (md, 15)


def test_every_block_runs_or_says_why() -> None:
    """Sybil finds every ```python fence; a no-run block says why; at most one in five."""
    total = skipped = 0
    for page in PAGES:
        found = blocks(page)
        assert len(found) == fences(page), page
        for line, reason in found:
            total += 1
            if reason is not None:
                skipped += 1
                assert reason, f"{page}:{line}: `<!-- no-run` needs a reason"
    assert total >= 30
    assert skipped * 5 <= total, f"{skipped} of {total} blocks are not run: at most one in five"


def test_no_developer_machine_paths() -> None:
    """No doc or benchmark names a tool or path that exists only on a developer's machine."""
    pattern = re.compile(r"/work/bin|benchlock|/work/main|/home/\w+")
    files = [ROOT / p for p in PAGES] + sorted((ROOT / "benchmarks").rglob("*.py"))
    files += sorted((ROOT / "examples").rglob("*.py")) + sorted((ROOT / "scripts").iterdir())
    bad = [
        f"{f.relative_to(ROOT)}:{n}: {line.strip()}"
        for f in files
        if f.is_file()
        for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if pattern.search(line)
    ]
    assert not bad, "\n".join(bad)
