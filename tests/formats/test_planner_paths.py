"""A forged ``planner_data`` in DCP's ``.metadata`` (issue 25, item 2(b)): the paths that nest
the flattened keys again are checked against the tree they build (step types, list bounds,
no path through or onto another key's value) when ``.metadata`` is decoded, before anything
is allocated: a :class:`CheckpointFormatError` naming the key, its path and the rule, never
an object written into a tensor's elements, an unbounded list, or a raw ``IndexError``.

Every case starts from a real ``dcp.save``; only ``planner_data`` is rewritten.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _ckpt import assert_bitwise_equal
from _corrupt import is_sentinel, mutate_metadata, sentinel_like

import asyncload
from asyncload import CheckpointFormatError

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore::UserWarning:torch.distributed"),
]

MiB = 1 << 20


def _state_dict() -> dict[str, Any]:
    return {
        "a": torch.arange(4.0),
        "b": {"c": torch.ones(3, dtype=torch.int32), "l": [torch.zeros(2), torch.full((2,), 7.0)]},
        "step": 5,
    }


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    sd = _state_dict()
    dcp.save(sd, checkpoint_id=tmp_path / "ck", no_dist=True)
    return tmp_path / "ck", sd


def _forge(ckpt: Path, **paths: Any) -> None:
    def change(md: Any) -> None:
        assert md.planner_data["b.l.0"] == ("b", "l", 0)  # what dcp.save wrote
        md.planner_data.update(paths)

    mutate_metadata(ckpt, change)


FORGED = {
    # the object "step" written into element 0 of tensor "a" (returned normally before)
    "into a tensor": (
        {"step": ("a", 0)},
        "'step' at ('a', 0), which runs through the value of key 'a'",
    ),
    "under a tensor": (
        {"b.c": ("a", "z")},
        "'b.c' at ('a', 'z'), which runs through the value of key 'a'",
    ),
    # a list index of 10**9: a list of a billion Nones (unbounded allocation before)
    "huge index": (
        {"b.l.1": ("b", "l", 10**9)},
        "'b.l.1' at ('b', 'l', 1000000000), which indexes a list at 1000000000, outside the 5 keys",
    ),
    "negative index": (
        {"b.l.1": ("b", "l", -1)},
        "which indexes a list at -1, outside the 5 keys",
    ),
    "int at the top": ({"a": (0,)}, "'a' at (0,), which does not start with a string"),
    "dict into a list": (
        {"b.l.1": ("b", "l", "x")},
        "which steps into a list that holds 0 with 'x'",
    ),
    "float step": (
        {"a": ("a", 1.5)},
        "which has a step of type float, neither a string nor an int",
    ),
    "bool step": (
        {"b.l.1": ("b", "l", True)},
        "which has a step of type bool, neither a string nor an int",
    ),
    "same path": ({"b.c": ("a",)}, "'b.c' at ('a',), which is the path of key 'a' too"),
    "onto a container": (
        {"step": ("b",)},
        "'step' at ('b',), which is a container of other keys' values",
    ),
    "a container onto a key": (
        {"a": ("b",)},
        "'b.c' at ('b', 'c'), which runs through the value of key 'a'",
    ),
}


@pytest.mark.parametrize("case", sorted(FORGED))
def test_read_state_dict_refuses_a_forged_path_before_allocating(
    saved: tuple[Path, Any], case: str
) -> None:
    ckpt, _ = saved
    paths, message = FORGED[case]
    _forge(ckpt, **paths)
    with pytest.raises(CheckpointFormatError) as info:
        asyncload.read_state_dict(ckpt)
    text = str(info.value)
    assert text.startswith(f"{ckpt / '.metadata'}: planner_data nests key ")
    assert message in text
    assert text.endswith("the metadata is damaged or forged")


@pytest.mark.parametrize("case", ["into a tensor", "huge index"])
def test_load_into_a_state_dict_touches_nothing_on_a_forged_path(
    saved: tuple[Path, Any], case: str
) -> None:
    """The check runs when ``.metadata`` is decoded: every entry point refuses, before any read."""
    ckpt, sd = saved
    _forge(ckpt, **FORGED[case][0])
    dest = sentinel_like(sd)
    dest["b"]["l"] = [sentinel_like(t) for t in sd["b"]["l"]]  # sentinel_like walks dicts only
    with pytest.raises(CheckpointFormatError, match="planner_data nests key"):
        asyncload.load(dest, ckpt)
    assert (
        is_sentinel(dest["a"]) and is_sentinel(dest["b"]["c"]) and is_sentinel(dest["b"]["l"][0])
    )
    assert is_sentinel(dest["b"]["l"][1])
    with pytest.raises(CheckpointFormatError, match="planner_data nests key"):
        list(asyncload.iter_tensors(ckpt))


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def test_a_huge_list_index_costs_no_memory(saved: tuple[Path, Any]) -> None:
    """Index ``len(keys) - 1`` is allowed, ``10**9`` (8 GB of list slots) is refused: the peak
    RSS of the refused load stays within a few MiB."""
    ckpt, _ = saved
    _forge(ckpt, **{"b.l.1": ("b", "l", 10**9)})
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status("VmRSS:")
    with pytest.raises(CheckpointFormatError, match="outside the 5 keys"):
        asyncload.read_state_dict(ckpt)
    assert _status("VmHWM:") - base < 32 * MiB


def test_valid_paths_nest_as_saved(saved: tuple[Path, Any]) -> None:
    """What dcp.save writes, a missing entry (the flat name) and a sparse list index within
    bounds are all accepted, and the tensors come back bit for bit."""
    ckpt, sd = saved
    got = asyncload.read_state_dict(ckpt)
    assert_bitwise_equal(got, sd)
    _forge(ckpt, **{"b.l.1": ("b", "l", 4)})  # the largest index allowed: 5 keys
    got = asyncload.read_state_dict(ckpt)
    assert got["b"]["l"][1:4] == [None, None, None]
    assert (
        torch.equal(got["b"]["l"][4], sd["b"]["l"][1]) and got["b"]["l"][4].dtype == torch.float32
    )


def test_planner_data_that_is_not_a_dict_leaves_the_names_flat(saved: tuple[Path, Any]) -> None:
    ckpt, sd = saved
    mutate_metadata(ckpt, lambda md: setattr(md, "planner_data", None))
    got = asyncload.read_state_dict(ckpt)
    assert sorted(got) == ["a", "b.c", "b.l.0", "b.l.1", "step"]
    assert torch.equal(got["b.c"], sd["b"]["c"]) and got["b.c"].dtype == torch.int32


def test_forged_paths_end_typed_or_nest_exactly(tmp_path: Path) -> None:
    """The fuzz surface of benchmarks/fuzz_long.py --forged-minutes, bounded: one to three
    forged paths a read; each ends in an AsyncLoadError or gives every key at its path."""
    import random

    from _ckpt import make_checkpoint
    from _corrupt import read_metadata
    from _forging import forge_state_dict, random_path_mutation, read_forged_paths
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    sd = forge_state_dict()
    base = make_checkpoint(tmp_path / "ck", forge_state_dict())
    original = read_metadata(base)
    seen: set[str] = set()

    @settings(
        max_examples=150,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(st.integers(0, 1 << 32))
    def run(seed: int) -> None:
        rng = random.Random(seed)
        seen.add(
            read_forged_paths(
                base, original, sd, [random_path_mutation(rng) for _ in range(rng.randint(1, 3))]
            )
        )

    run()
    assert seen == {"CheckpointFormatError", "loaded"}
