"""Fuzzing the record parser and the metadata decoder with hypothesis, on mutated real
bytes (records and .metadata written by torch's own dcp.save). Bounded: a fixed number
of derandomized examples per target (about 10-20 s in all); ``benchmarks/fuzz_long.py``
runs the open-ended campaign. Only asyncload's own errors may escape a target, and each
example's decoding work, counted in units (``WorkBudget``, not seconds: a busy machine
cannot fail it), stays within a linear bound of its size (``_fuzzing.work_bound``).
"""

from __future__ import annotations

import random

import pytest
from _fuzzing import TARGETS, Seeds, make_seeds, mutate, work_bound
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncload import CheckpointFormatError, UnsafeCheckpointError
from asyncload.decoding.work import WorkBudget

pytestmark = pytest.mark.timeout(180)

_SEEDS: Seeds | None = None


def _seeds() -> Seeds:
    global _SEEDS
    if _SEEDS is None:
        _SEEDS = make_seeds()
    return _SEEDS


_EXAMPLES = {
    "record parser (parse_archive + tensor_location/materialize)": 4000,
    "record parser, probed (aparse_archive)": 1500,
    "metadata decoder (safe_loads + check_metadata)": 3000,
    "record pickle decoder (safe_loads, record allow-list)": 4000,
}


@pytest.mark.parametrize("target", list(TARGETS))
def test_only_our_errors_escape(target: str) -> None:
    fn, seed_attr, pickle_aware = TARGETS[target]
    seeds: list[bytes] = getattr(_seeds(), seed_attr)
    costliest = [0, 0]  # units of work, input bytes
    outcomes = {"ok": 0, "error": 0}

    @settings(
        max_examples=_EXAMPLES[target],
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        seed_index=st.integers(0, len(seeds) - 1),
        rng_seed=st.integers(0, 2**32 - 1),
        rounds=st.integers(1, 8),
    )
    def run(seed_index: int, rng_seed: int, rounds: int) -> None:
        data = mutate(
            random.Random(rng_seed), seeds[seed_index], pickle_aware=pickle_aware, rounds=rounds
        )
        work = WorkBudget()  # counts only: a decode over its budget would look like an error
        try:
            fn(data, work)
            outcomes["ok"] += 1
        except (CheckpointFormatError, UnsafeCheckpointError):
            outcomes["error"] += 1
        assert work.spent <= work_bound(len(data)), (
            f"{target}: {work.spent} units for {len(data)} bytes"
        )
        costliest[:] = max(costliest, [work.spent, len(data)])

    run()
    assert sum(outcomes.values()) >= _EXAMPLES[target]
    assert outcomes["error"] > _EXAMPLES[target] // 4  # the mutations do break things
    assert 0 < costliest[0] <= work_bound(costliest[1])  # the work is counted, within bounds


@pytest.mark.parametrize("target", list(TARGETS))
def test_unmutated_seeds_decode(target: str) -> None:
    """The seeds themselves are valid: the fuzzer starts from inputs that go deep."""
    fn, seed_attr, _ = TARGETS[target]
    for data in getattr(_seeds(), seed_attr):
        fn(data)


@given(data=st.binary(max_size=512))
@settings(max_examples=500, deadline=None, derandomize=True, database=None)
def test_random_bytes_as_metadata_and_records(data: bytes) -> None:
    """Bytes from nowhere: not a single real structure to lean on."""
    for fn, _, _ in TARGETS.values():
        try:
            fn(data)
        except (CheckpointFormatError, UnsafeCheckpointError):
            pass


# --- the decoder agrees with CPython's unpickler on legitimate data -----------------

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.complex_numbers(allow_nan=False, allow_infinity=False),
)
_keys = st.one_of(
    st.text(max_size=10),
    st.integers(-(2**40), 2**40),
    st.tuples(st.integers(0, 9), st.text(max_size=3)),
)
_data = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.tuples(inner, inner),
        st.dictionaries(_keys, inner, max_size=6),
        st.frozensets(st.integers(-5, 5), max_size=5),
        st.sets(st.text(max_size=4), max_size=5),
    ),
    max_leaves=40,
)


@given(obj=_data)
@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
def test_decoder_agrees_with_pickle_on_every_protocol(obj: object) -> None:
    import pickle

    from asyncload.decoding.allowlist import record_globals, safe_loads

    for proto in range(6):
        data = pickle.dumps(obj, protocol=proto)
        got = safe_loads(data, what=f"protocol {proto}", allowed=record_globals())
        assert got == obj and type(got) is type(obj), (proto, obj, got)
