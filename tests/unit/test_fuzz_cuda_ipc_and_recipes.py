"""Generated bad input (hypothesis) for two surfaces that take data from elsewhere (issue 32):

- cuda_ipc descriptors, as a trainer rank's store reads them from a ``SampleRef``: random JSON, and mutations of
  a real one (wrong types, missing or unknown keys, huge or negative numbers, another sample's places, other pool
  ids). Each ends in the bytes of a live lend, read from inside the region its slot lent, or in one one-line
  ``ValueError`` / ``KeyError`` / ``FileNotFoundError``; no read leaves a lease or a release behind.
- ``specforge-kimi recipe validate`` on mutated copies of ``recipes/*.yaml``: wrong types, unknown and missing keys,
  huge values, broken YAML, bytes that are not UTF-8. Each ends in the JSON answer or in one ``error:`` line, never
  an exception out of the CLI (a traceback), and writes nothing.

Example counts are bounded (``settings(max_examples=...)``) so both run in well under a minute on a CPU; each
surface's count shows in pytest's summary (``tests/fuzz_counts.py``).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
from pathlib import Path

import pytest
import torch
import yaml
from fuzz_counts import record
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow], "database": None}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
interesting_ints = st.sampled_from([0, 1, -1, 255, 256, 2**31, 2**62, 2**63, 2**64, -(2**63)]) | st.integers(
    -(2**66), 2**66
)


# -- cuda_ipc descriptors --------------------------------------------------------------------------------------------
def _sample(writer, sample_id: str, length: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    spec = {
        "store_id": "run",
        "sample_id": sample_id,
        "gen": 1,
        "features": {"aux": "hidden_state", "last_hidden": "target"},
        "passthrough": [{"name": "input_ids", "shape": [1, length], "dtype": "int64"}],
    }
    aux, last = torch.randn(length, 24, generator=g).bfloat16(), torch.randn(length, 8, generator=g).bfloat16()
    ids = torch.arange(length, dtype=torch.int64).reshape(1, length)
    (res,) = writer.put_samples([(spec, aux, last)], passthrough_tensor=lambda _item: ids, aux_layer_ids=None)
    return res


def _ref(res: dict, desc):
    from specforge.runtime.contracts import FeatureSpec, SampleRef

    specs = {n: FeatureSpec(name=n, shape=tuple(m["shape"]), dtype=m["dtype"]) for n, m in res["features"].items()}
    return SampleRef(
        sample_id=res["sample_id"],
        run_id="run",
        source_task_id="t",
        feature_store_uri="cudaipc://x/y",
        feature_keys={n: n for n in specs},
        feature_specs=specs,
        strategy="eagle3",
        metadata={"cuda_ipc": desc},
    )


def _mutations(descs: list[dict], pool_ids: list[str]):
    """A real descriptor (of ``descs[0]``) with one to three of its parts broken."""
    base = descs[0]
    names = sorted(base["features"])
    places = [p for d in descs for p in d["features"].values()]
    field = st.sampled_from(["v", "pool", "slot", "alloc", "features", "extra"])
    value = st.one_of(
        json_values,
        interesting_ints,
        st.sampled_from(pool_ids + ["0" * 16, "f" * 32, "ABCDEF0123456789", pool_ids[0] + "\n"]),
        st.sampled_from([d["slot"] for d in descs] + [d["alloc"] for d in descs]),
    )
    place = st.one_of(
        st.sampled_from(places),
        st.tuples(interesting_ints, interesting_ints).map(list),
        st.sampled_from(places).flatmap(lambda p: st.integers(-512, 512).map(lambda d: [p[0] + d, p[1]])),
        st.sampled_from(places).flatmap(lambda p: st.integers(-512, 512).map(lambda d: [p[0], p[1] + d])),
        json_values,
    )
    feature_edit = st.tuples(st.sampled_from(names + ["unknown"]), st.sampled_from(["drop", "set"]), place)
    edit = st.one_of(
        st.tuples(field, st.sampled_from(["drop", "set"]), value),
        st.tuples(st.just("features"), st.just("feature"), feature_edit),
    )

    def apply(edits) -> dict:
        d = copy.deepcopy(base)
        for key, how, what in edits:
            if how == "feature":
                name, fhow, fplace = what
                if not isinstance(d.get("features"), dict):
                    continue
                if fhow == "drop":
                    d["features"].pop(name, None)
                else:
                    d["features"][name] = fplace
            elif how == "drop":
                d.pop(key, None)
            else:
                d[key] = what
        return d

    return st.one_of(json_values, st.lists(edit, min_size=1, max_size=3).map(apply))


def _one_line(exc: BaseException) -> bool:
    text = str(exc)
    return bool(text.strip()) and "\n" not in text.strip("'\"").replace("\\n", "")


def test_fuzz_cuda_ipc_descriptors(tmp_path):
    """Whatever a ref's descriptor says, a read answers a live lend's bytes from inside its slot's region, or one
    clear error; reads leave no lease and release nothing."""
    from specforge_kimi.transport.store import CudaIpcFeatureStore
    from specforge_kimi.transport.writer import IpcCaptureWriter

    ipc = tmp_path / "ipc"
    kw = {"pool_dir": ipc, "device": "cpu", "lease_s": 3600, "max_slots": 8}
    writers = [IpcCaptureWriter(pool_bytes=64 << 10, **kw), IpcCaptureWriter(pool_bytes=32 << 10, **kw)]
    try:
        lends = [
            _sample(writers[0], "run:a", 7, 0),
            _sample(writers[0], "run:b", 11, 1),
            _sample(writers[1], "run:c", 5, 2),
        ]
        by_pool = {w.pool_id: w for w in writers}
        pools = {w.pool_id: w.memory.clone() for w in writers}  # the bytes every lend holds, fixed from here
        store = CudaIpcFeatureStore(store_id="run", pool_dir=ipc, retain_on_release=True)
        descs = [r["cuda_ipc"] for r in lends]
        before = [w.table._a.copy() for w in writers]

        @settings(max_examples=600, **SETTINGS)
        @given(desc=_mutations(descs, list(by_pool)))
        def check(desc):
            record("cuda_ipc descriptors")
            ref = _ref(lends[0], desc)
            try:
                out, handle = store.get(ref)
            except (ValueError, KeyError, FileNotFoundError) as exc:
                assert _one_line(exc), repr(exc)
            else:
                store.release(handle)
                # only a live lend, read from inside the region its slot lent, and exactly the pool's bytes there
                writer = by_pool[desc["pool"]]
                lent = writer._lent[desc["slot"]]
                assert lent.alloc_id == desc["alloc"]
                for name, t in out.items():
                    offset, nbytes = desc["features"][name]
                    assert lent.offset <= offset and offset + nbytes <= lent.offset + lent.nbytes
                    raw = pools[desc["pool"]][offset : offset + nbytes]
                    assert torch.equal(t.reshape(-1).view(torch.uint8), raw)
            assert store.health()["active_leases"] == 0
            for w, rows in zip(writers, before, strict=True):
                assert (w.table._a == rows).all()  # no release written, no row changed
            assert all(w.lent()["samples"] == n for w, n in zip(writers, (2, 1), strict=True))

        check()
        # the real descriptors still read back whole
        for res in lends:
            out, _ = store.get(_ref(res, res["cuda_ipc"]))
            assert out["input_ids"].tolist() == [list(range(res["features"]["input_ids"]["shape"][1]))]
        store.close()
    finally:
        for w in writers:
            w.close()


def test_fuzz_descriptor_parsing_alone():
    """``Descriptor.from_json`` and ``with_descriptor`` on random JSON: a descriptor or one ValueError line."""
    from specforge_kimi.transport.descriptor import Descriptor

    @settings(max_examples=600, **SETTINGS)
    @given(raw=json_values | st.dictionaries(st.sampled_from(["v", "pool", "slot", "alloc", "features"]), json_values))
    def check(raw):
        record("cuda_ipc descriptors")
        try:
            d = Descriptor.from_json(raw)
        except ValueError as exc:
            assert _one_line(exc)
        else:
            assert Descriptor.from_json(json.loads(json.dumps(d.to_json()))) == d

    check()


# -- recipe validate -------------------------------------------------------------------------------------------------
def _paths(node, prefix=()):
    """Every key path of a parsed recipe (dict keys and list indexes)."""
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


RECIPE_TEXTS = {p.name: p.read_text() for p in sorted(RECIPES.glob("*.yaml"))}
_DRAFT = ("trainer", "draft")
#: key paths each kind edits: "draft" the draft's config (handed on to SpecForge unchecked; a known defect), "tree"
#: everything else
RECIPE_PATHS = {
    kind: {
        name: [p for p in _paths(yaml.safe_load(text)) if p and (p[:2] == _DRAFT and len(p) > 2) == (kind == "draft")]
        for name, text in RECIPE_TEXTS.items()
    }
    for kind in ("tree", "draft")
}
RECIPE_PATHS["huge"] = RECIPE_PATHS["tree"]
#: text in tree edits has no line breaks (an echoed line break is a known defect, the "control" kind below)
PRINTABLE = st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp"))
#: values a tree edit sets: wrong types, huge and negative numbers; floats stay finite and below 1e200 here
RECIPE_VALUES = {
    "tree": st.one_of(
        st.recursive(
            st.none()
            | st.booleans()
            | st.integers(-(2**70), 2**70)
            | st.floats(-1e200, 1e200)
            | st.text(PRINTABLE, max_size=12),
            lambda inner: (
                st.lists(inner, max_size=4) | st.dictionaries(st.text(PRINTABLE, max_size=8), inner, max_size=4)
            ),
            max_leaves=8,
        ),
        st.sampled_from([10**30, -(10**30), 2**63, -1, 0, "", "x" * 300]),
    ),
    # a known defect: an infinite float, or one whose GiB count overflows, raises OverflowError out of the pool sizing
    "huge": st.sampled_from([1e308, -1e308, float("inf"), float("-inf"), float("nan")]),
}


#: unknown keys: printable text in the tree mutations; with control characters in their own kind (a known defect)
KEY_CHARS = {
    "tree": PRINTABLE,
    "control": st.characters(whitelist_categories=("Cc", "Zl", "Zp", "Lu")),
}


@st.composite
def mutated_recipes(draw, kinds: tuple[str, ...]) -> bytes:
    name = draw(st.sampled_from(sorted(RECIPE_TEXTS)))
    text = RECIPE_TEXTS[name]
    kind = draw(st.sampled_from(kinds))
    if kind == "text":  # broken YAML: cut short, or a stray character spliced in
        at = draw(st.integers(0, len(text)))
        return (text[:at] + draw(st.sampled_from(["", ":", "[", "{", "\t", "- ", "*x", "&", "'", "\x00"]))).encode()
    if kind == "bytes":  # not UTF-8
        raw = text.encode()
        at = draw(st.integers(0, len(raw)))
        return (
            raw[:at] + draw(st.sampled_from([b"\xff", b"\xfe\xff", b"\xc3", b"\x80\x80", b"\xed\xa0\x80"])) + raw[at:]
        )
    tree = yaml.safe_load(text)  # "tree" and "control": edits of the parsed recipe
    if kind == "control":  # an unknown top-level key with a line break in it
        key = draw(st.text(KEY_CHARS["control"], max_size=6)) + draw(st.sampled_from(["\r", "\n", "\u2028"]))
        tree[key] = draw(RECIPE_VALUES["huge" if kind == "huge" else "tree"])
        return yaml.safe_dump(tree, allow_unicode=True).encode()
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(RECIPE_PATHS[kind][name]))
        parent = tree
        try:
            for k in path[:-1]:
                parent = parent[k]
            how = draw(st.sampled_from(["drop", "set", "unknown"]))
            if how == "drop" and isinstance(parent, (dict, list)):
                del parent[path[-1]]
            elif how == "unknown" and isinstance(parent, dict):
                parent[draw(st.text(KEY_CHARS["tree"], min_size=1, max_size=10))] = draw(
                    RECIPE_VALUES["huge" if kind == "huge" else "tree"]
                )
            else:
                parent[path[-1]] = draw(RECIPE_VALUES["huge" if kind == "huge" else "tree"])
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit removed or replaced this path
    return yaml.safe_dump(tree, allow_unicode=True).encode()


def _validate_once(tmp_path, data: bytes) -> None:
    """``recipe validate`` on ``data``: the JSON answer (exit 0) or one ``error:`` line (exit 2), nothing raised out
    of the CLI (which would be a traceback), nothing written beside the recipe."""
    from specforge_kimi.cli import main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(data)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["recipe", "validate", str(recipe)])
    if rc == 0:
        assert "memory_plan" in json.loads(out.getvalue()), out.getvalue()
    else:
        lines = err.getvalue().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), err.getvalue()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


def test_fuzz_recipe_validate(tmp_path, monkeypatch):
    """Mutated recipe trees (wrong types, unknown and missing keys, huge values) through ``recipe validate``."""
    monkeypatch.chdir(tmp_path)  # a recipe's relative output_dir would land here

    @settings(max_examples=800, **SETTINGS)
    @given(data=mutated_recipes(("tree",)))
    def check(data):
        record("recipe validate")
        _validate_once(tmp_path, data)

    check()


def test_fuzz_recipe_validate_broken_text(tmp_path, monkeypatch):
    """Recipes cut short, with a stray character, with bytes that are not UTF-8, with unknown keys holding
    control characters, with the draft's config edited, or with infinite / ~1e308 floats."""
    monkeypatch.chdir(tmp_path)

    @settings(max_examples=250, **SETTINGS)
    @example(data=b"\xff" + RECIPE_TEXTS["tiny-k25-tp1-h200.yaml"].encode())
    @example(data=b":")
    @given(data=mutated_recipes(("text", "bytes", "control", "draft", "huge")))
    def check(data):
        record("recipe validate")
        _validate_once(tmp_path, data)

    check()


@pytest.mark.parametrize("name", sorted(RECIPE_TEXTS))
def test_unmutated_recipes_validate(tmp_path, monkeypatch, name):
    """The fuzz's starting points themselves validate (else every mutation would only test one refusal)."""
    from specforge_kimi.cli import main

    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["recipe", "validate", str(RECIPES / name)]) == 0
    assert json.loads(out.getvalue())["name"]
