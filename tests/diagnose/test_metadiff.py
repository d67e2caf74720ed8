"""The metadata diff is DeepDiff's, in the reading order the report promises.

diagnose/metadiff.py calls DeepDiff (imported only when the metadata differ) with
``threshold_to_diff_deeper=0`` and sorts its entries into the reference's key order. These
tests hold it, entry for entry and in order, to a plain walk of the two trees written
here as the specification (dicts key by key, the reference's keys first, what only the
candidate has last; lists atomic), on random trees of the only shape it is given, and
check the report through a real compare: the order does not change with the hash seed,
deepdiff is imported only when something differs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consistency.diagnose import metadiff

KEYS = st.sampled_from(["a", "b", "c", "d", "stride", "aux", "x y", "1", "__p"])
LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False, width=64),
                   st.sampled_from([0.0, -0.0, 1.0, 2.5]), st.text(max_size=4), st.sampled_from(["[0, 3]", "[3, 7]"]))
TREES = st.recursive(LEAVES, lambda kids: st.dictionaries(KEYS, kids, max_size=5), max_leaves=14)


def _spec(a: object, b: object, path: list | None = None) -> list[tuple]:
    """The specification: a walk in reading order (not the implementation, which is DeepDiff's)."""
    path = path or []
    if type(a) is not type(b):  # 1 vs 1.0, True vs 1, None vs a value, a dict vs a string
        return [("type_changes", path, a, b)]
    if not isinstance(a, dict):
        return [] if a == b else [("values_changed", path, a, b)]
    out: list[tuple] = []
    for k in a:
        out += _spec(a[k], b[k], [*path, k]) if k in b else [("dictionary_item_removed", [*path, k], a[k], None)]
    return out + [("dictionary_item_added", [*path, k], None, b[k]) for k in b if k not in a]


def _same(x: list[tuple], y: list[tuple]) -> bool:
    """Entry by entry, in order; values compared with their types (repr: 1 is not 1.0)."""
    return [(k, tuple(p), repr(u), repr(v)) for k, p, u, v in x] == [(k, tuple(p), repr(u), repr(v)) for k, p, u, v in y]


def _mutate(a: object, data: st.DataObject) -> object:
    """A tree near ``a`` (most keys shared), so the walk goes deep rather than stopping at the root."""
    if not isinstance(a, dict) or data.draw(st.integers(0, 9)) == 0:
        return data.draw(TREES)
    out = {k: (_mutate(v, data) if data.draw(st.booleans()) else v) for k, v in a.items()
           if data.draw(st.integers(0, 5))}
    for k in data.draw(st.lists(KEYS, max_size=2)):
        out.setdefault(k, data.draw(LEAVES))
    return out


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(a=TREES, data=st.data())
def test_diff_is_the_specified_walk_in_order_on_random_trees(a: object, data: st.DataObject) -> None:
    b = _mutate(a, data) if data.draw(st.booleans()) else data.draw(TREES)
    assert _same(metadiff.changes(a, b), _spec(a, b))
    assert _same(metadiff.changes(b, a), _spec(b, a))


def test_every_kind_by_construction_and_no_collapse() -> None:
    a = {"runtime": {"name": "t", "version": "5"}, "aux": {"stream_ids": "[0, 3]", "convention": "stream"},
         "x": 1, "y": True, "z": None, "t": {"p": 1, "q": 2, "r": 3}}
    b = {"runtime": {"name": "s"}, "aux": {"stream_ids": "[3, 7]", "convention": "stream", "n": 2},
         "x": 1.0, "y": 1, "z": "a", "t": {"u": 1, "v": 2, "w": 3}}
    got = metadiff.changes(a, b)
    assert got == [
        ("values_changed", ["runtime", "name"], "t", "s"),
        ("dictionary_item_removed", ["runtime", "version"], "5", None),
        ("values_changed", ["aux", "stream_ids"], "[0, 3]", "[3, 7]"),
        ("dictionary_item_added", ["aux", "n"], None, 2),
        ("type_changes", ["x"], 1, 1.0),  # an int and a float are two types to DeepDiff too
        ("type_changes", ["y"], True, 1),
        ("type_changes", ["z"], None, "a"),
        # no key shared: still key by key (DeepDiff's default would make this one changed value)
        ("dictionary_item_removed", ["t", "p"], 1, None), ("dictionary_item_removed", ["t", "q"], 2, None),
        ("dictionary_item_removed", ["t", "r"], 3, None), ("dictionary_item_added", ["t", "u"], None, 1),
        ("dictionary_item_added", ["t", "v"], None, 2), ("dictionary_item_added", ["t", "w"], None, 3),
    ]
    assert _same(got, _spec(a, b))
    assert metadiff.changes(a, a) == []
    # a private-looking key is a difference like any other (DeepDiff skips them by default)
    assert metadiff.changes({"__k": 1}, {"__k": 2}) == [("values_changed", ["__k"], 1, 2)]


def _pair(tmp_path, ref_ids: list[int], cand_ids: list[int]):  # noqa: ANN202
    from consistency.contract.models import AuxInfo, DumpMetadata, ModelInfo, RuntimeInfo
    from consistency.dump.writer import write_dump

    rng = np.random.default_rng(0)
    x = {f"hidden.{s}": rng.standard_normal((8, 16)).astype(np.float32) for s in range(4)}
    model = ModelInfo(num_layers=3, hidden_size=16)
    a = write_dump(tmp_path / "a.npz", x, DumpMetadata(side="training", model=model, aux=AuxInfo(stream_ids=ref_ids),
                                                        runtime=RuntimeInfo(name="transformers", version="5.19.0")))
    b = write_dump(tmp_path / "b.npz", {f"aux.{i}": x[f"hidden.{s}"] for i, s in enumerate(cand_ids)},
                   DumpMetadata(side="serving", model=model, aux=AuxInfo(stream_ids=cand_ids),
                                runtime=RuntimeInfo(name="sglang")))
    return a, b


def test_report_diff_through_a_real_compare(tmp_path) -> None:
    """Stream ids that differ are one warning (the list is one value); the runtime's name and
    version are information; the order is the metadata's own, whatever the hash seed."""
    from consistency.pipeline.compare import compare as run

    a, b = _pair(tmp_path, [0, 1, 2], [1, 2, 3])
    rep = run(str(a), str(b))
    got = [(d.path, d.reference, d.candidate, d.change, d.severity.value) for d in rep.metadata_diff]
    assert got == [("runtime.name", "transformers", "sglang", "values changed", "info"),
                   ("runtime.version", "5.19.0", None, "dictionary item removed", "info"),
                   ("aux.stream_ids", [0, 1, 2], [1, 2, 3], "values changed", "warning")]
    assert [f.message for f in rep.findings if f.code == "METADATA_DIFF"] == \
        ["metadata aux.stream_ids: reference [0, 1, 2], candidate [1, 2, 3]"]
    code = ("import sys; from consistency.pipeline.compare import compare as run; "
            "print([d.path for d in run(sys.argv[1], sys.argv[2]).metadata_diff])")
    seen = {subprocess.run([sys.executable, "-c", code, str(a), str(b)], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2, 3)}
    assert len(seen) == 1, seen


def test_a_changed_claim_is_a_warning_even_when_little_else_is_shared() -> None:
    """Two dumps that share few top-level fields (ignored ones count too): DeepDiff's default
    would fold everything into one root entry of information and hide the changed stream ids."""
    from consistency.contract.models import AuxInfo, DumpMetadata, ModelInfo, RuntimeInfo

    a = DumpMetadata(aux=AuxInfo(stream_ids=[0, 1, 2]), created="t1", tool_version="1")
    b = DumpMetadata(aux=AuxInfo(stream_ids=[1, 2, 3]), runtime=RuntimeInfo(name="sglang"),
                     model=ModelInfo(num_layers=3), prompt="p", side="serving")
    got = {(d.path, d.severity.value) for d in metadiff.diff(a, b, {})}
    assert ("aux.stream_ids", "warning") in got and all(path for path, _ in got)


def _imports_deepdiff(a, b) -> bool:  # noqa: ANN001
    code = ("import sys; from consistency.cli import run\ntry:\n    run(['compare', sys.argv[1], sys.argv[2], '-q'])\n"
            "except SystemExit:\n    pass\nprint('deepdiff' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(a), str(b)], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1] == "True"


def test_deepdiff_is_imported_only_when_metadata_differ(tmp_path) -> None:
    a, b = _pair(tmp_path, [0, 1, 2], [1, 2, 3])
    assert _imports_deepdiff(a, b)  # the runtime and the stream ids differ: DeepDiff diffs them
    same = tmp_path / "same.npz"
    shutil.copy(a, same)
    assert not _imports_deepdiff(a, same)  # equal metadata, equal per-tensor entries: no import


def test_deepdiff_is_imported_without_pandas_and_pandas_still_imports_after(tmp_path) -> None:
    """deepdiff probes for pandas at import (0.75 s where installed); the diff hides that probe
    only while deepdiff imports, so a user's own ``import pandas`` afterwards still works."""
    pytest.importorskip("pandas")
    a, b = _pair(tmp_path, [0, 1, 2], [1, 2, 3])
    code = ("import sys; from consistency.pipeline.compare import compare as run\n"
            "rep = run(sys.argv[1], sys.argv[2]); assert rep.metadata_diff\n"
            "print('deepdiff' in sys.modules, 'pandas' in sys.modules)\n"
            "import pandas; print(pandas.DataFrame({'x': [1]}).shape)")
    out = subprocess.run([sys.executable, "-c", code, str(a), str(b)], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["True False", "(1, 1)"], out.stdout
