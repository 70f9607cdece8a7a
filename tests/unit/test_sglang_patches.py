"""Our SGLang patches on top of SpecForge's capture patch: they apply in order, and the patched
capture sink writes byte-exact features into a real Mooncake store.

Needs a SpecForge checkout at the pinned commit (its capture patch is never copied into this
repository): ``SPECFORGE_KIMI_SPECFORGE_CHECKOUT``, else ``../shared/upstream``'s archive unpacked
(the ``specforge_checkout`` fixture); skipped without either. The SGLang files are copied from the
installed sglang 0.5.14 into a scratch tree, which is what gets patched.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest


@pytest.fixture()
def checkout(specforge_checkout) -> str:
    return str(specforge_checkout)


@pytest.fixture()
def patched_site(tmp_path, checkout):
    from specforge_kimi.setup import setup_patches as sp

    capture = Path(checkout) / sp.CAPTURE_PATCH
    site = sp._scratch_copy(sp.sglang_root(), sp._files(capture, 2), tmp_path / "site")
    statuses = sp.plan(checkout, sglang=True, sglang_site=site)
    sglang = [s for s in statuses if s.root == site]
    assert [s.patch.name for s in sglang][0] == "spec-capture.patch"
    assert len(sglang) >= 2 and all(s.state == "applicable" for s in sglang), [(s.patch.name, s.detail) for s in sglang]
    for s in sglang:
        sp.apply(s)
    again = [s for s in sp.plan(checkout, sglang=True, sglang_site=site) if s.root == site]
    assert all(s.state == "applied" for s in again)  # idempotent: a second setup changes nothing
    return site


def test_drift_in_our_patch_is_named(tmp_path, checkout):
    from specforge_kimi.setup import setup_patches as sp

    capture = Path(checkout) / sp.CAPTURE_PATCH
    site = sp._scratch_copy(sp.sglang_root(), sp._files(capture, 2), tmp_path / "site")
    sp.apply(sp.classify(capture, site, 2))
    sink = site / "sglang/srt/spec_capture_sink.py"
    sink.write_text(sink.read_text().replace("registered: List[torch.Tensor] = []", "registered = []"))
    ours = [s for s in sp.plan(checkout, sglang=True, sglang_site=site) if s.patch.parent.name == "0.5.14"]
    assert ours and ours[0].state == "drift" and "spec_capture_sink.py" in " ".join(ours[0].files)


@pytest.fixture(params=["staging-buffer", "stack", "stack, 2 put clients"])
def sink_site(request, tmp_path, checkout):
    """The sink as `setup` leaves it (capture patch, spec-capture-staging-buffer, -zero-copy,
    -parallel-put) with one put client (spec-capture-parallel-put's default) or two
    (``SGLANG_SPEC_CAPTURE_PUT_CLIENTS=2``), or with spec-capture-staging-buffer alone; -> (site, clients)."""
    from specforge_kimi.setup import setup_patches as sp

    if request.param.startswith("stack"):
        return request.getfixturevalue("patched_site"), 2 if "2 put" in request.param else 1
    capture = Path(checkout) / sp.CAPTURE_PATCH
    site = sp._scratch_copy(sp.sglang_root(), sp._files(capture, 2), tmp_path / "site-staging-buffer")
    sp.apply(sp.classify(capture, site, 2))
    status = sp.classify(sp.patch_file("sglang", "spec-capture-staging-buffer"), site, 2)
    assert status.state == "applicable", status.detail
    sp.apply(status)
    return site, 1


def test_staged_sink_writes_exact_bytes(sink_site, tmp_path):
    """Byte-exact objects across a staging-buffer regrowth; with 2 put clients (spec-capture-parallel-put) every batch's
    objects land in both writers' segments."""
    patched_site, clients = sink_site
    import torch
    from mooncake.store import MooncakeDistributedStore

    from specforge_kimi.run import services

    spec = importlib.util.spec_from_file_location("patched_sink", patched_site / "sglang/srt/spec_capture_sink.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with services.mooncake_master(tmp_path / "mooncake.log", segment_bytes=512 << 20) as mc:
        env = {
            "MOONCAKE_METADATA_SERVER": f"http://127.0.0.1:{mc.metadata_port}/metadata",
            "MOONCAKE_MASTER_SERVER_ADDR": f"127.0.0.1:{mc.rpc_port}",
            "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
            "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(256 << 20),
            "MOONCAKE_LOCAL_BUFFER_SIZE": str(64 << 20),
            "SGLANG_SPEC_CAPTURE_PUT_CLIENTS": str(clients),
        }
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            sink = module.SpecCaptureSink([1, 3, 4])
            reader = MooncakeDistributedStore()
            reader.setup(
                "127.0.0.1", env["MOONCAKE_METADATA_SERVER"], 0, 64 << 20, "tcp", "", env["MOONCAKE_MASTER_SERVER_ADDR"]
            )
            gen = torch.Generator().manual_seed(0)
            # two batches; the second is larger than the first staging buffer (re-registration)
            for batch, (n, length) in enumerate(((3, 37), (4, 9000))):
                samples = []
                # like the scheduler: per-request row slices of one host tensor per batch
                aux_batch = torch.randn(n * length, 96, generator=gen).to(torch.bfloat16)
                last_batch = torch.randn(n * length, 32, generator=gen).to(torch.bfloat16)
                for i in range(n):
                    aux = aux_batch[i * length : (i + 1) * length]
                    last = last_batch[i * length : (i + 1) * length]
                    samples.append(
                        (
                            {
                                "store_id": "t",
                                "sample_id": f"b{batch}-{i}",
                                "gen": 1,
                                "features": {"aux": "hidden_state", "last_hidden": "target"},
                                "passthrough": [
                                    {
                                        "name": "input_ids",
                                        "data": list(range(length)),
                                        "shape": [1, length],
                                        "dtype": "int64",
                                    },
                                    {
                                        "name": "mask",
                                        "data": [i % 2 == 0] * length,
                                        "shape": [1, length],
                                        "dtype": "bool",
                                    },
                                ],
                            },
                            aux,
                            last,
                        )
                    )
                results = sink.put_samples(samples)
                if hasattr(sink, "_writers"):  # spec-capture-parallel-put
                    assert len(sink._writers) == clients
                    ends = {
                        reader.get_replica_desc(f"t/{sp_['sample_id']}/g1/hidden_state")[0]
                        .get_memory_descriptor()
                        .buffer_descriptor.transport_endpoint
                        for sp_, _, _ in samples
                    }
                    assert ends == {w.get_hostname() for w, _ in sink._writers}, ends
                assert [r["features"]["hidden_state"]["shape"] for r in results] == [[1, length, 96]] * n
                for (spec_, aux, last), _ in zip(samples, results, strict=False):
                    key = f"t/{spec_['sample_id']}/g1/"
                    assert reader.get(key + "hidden_state") == aux.contiguous().view(torch.uint8).numpy().tobytes()
                    assert reader.get(key + "target") == last.contiguous().view(torch.uint8).numpy().tobytes()
                    assert reader.get(key + "input_ids") == torch.arange(length).numpy().tobytes()
                    assert reader.get(key + "mask") == torch.tensor(spec_["passthrough"][1]["data"]).numpy().tobytes()
            assert sink._stage is not None
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def test_compact_passthrough_matches_lists(patched_site, tmp_path, monkeypatch):
    """spec-capture-compact-passthrough: a request whose passthrough comes compactly (``source: input_ids``, ``fill``,
    ``data_b64`` in uint8 / int32), resolved by the patched scheduler hook and written by the
    patched sink, stores the same bytes as the same request with SpecForge's JSON lists."""
    import base64
    import sys
    import types

    import numpy as np
    import torch
    from mooncake.store import MooncakeDistributedStore

    from specforge_kimi.run import services

    def load(name, rel):
        spec = importlib.util.spec_from_file_location(name, patched_site / rel)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        return module

    sink_mod = load("sglang.srt.spec_capture_sink", "sglang/srt/spec_capture_sink.py")
    brp = load("patched_brp", "sglang/srt/managers/scheduler_components/batch_result_processor.py")
    processor = brp.SchedulerBatchResultProcessor
    length = 300
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 160_000, (length,), generator=gen).tolist()
    mask = [int(i % 3 != 0) for i in range(length)]
    pos = list(range(100_000, 100_000 + length))
    lists = [
        {"name": "input_ids", "data": ids, "shape": [1, length], "dtype": "int64"},
        {"name": "loss_mask", "data": mask, "shape": [1, length], "dtype": "int64"},
        {"name": "attention_mask", "data": [1] * length, "shape": [1, length], "dtype": "int64"},
        {"name": "positions", "data": pos, "shape": [1, length], "dtype": "int64"},
    ]
    b64 = lambda v, dt: base64.b64encode(np.asarray(v, dtype=dt).tobytes()).decode()  # noqa: E731
    compact = [
        {"name": "input_ids", "source": "input_ids", "shape": [1, length], "dtype": "int64"},
        {
            "name": "loss_mask",
            "data_b64": b64(mask, "<u1"),
            "data_dtype": "uint8",
            "shape": [1, length],
            "dtype": "int64",
        },
        {"name": "attention_mask", "fill": 1, "shape": [1, length], "dtype": "int64"},
        {
            "name": "positions",
            "data_b64": b64(pos, "<i4"),
            "data_dtype": "int32",
            "shape": [1, length],
            "dtype": "int64",
        },
    ]
    with services.mooncake_master(tmp_path / "mooncake.log", segment_bytes=256 << 20) as mc:
        for k, v in {
            "MOONCAKE_METADATA_SERVER": f"http://127.0.0.1:{mc.metadata_port}/metadata",
            "MOONCAKE_MASTER_SERVER_ADDR": f"127.0.0.1:{mc.rpc_port}",
            "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
            "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(128 << 20),
            "MOONCAKE_LOCAL_BUFFER_SIZE": str(32 << 20),
        }.items():
            monkeypatch.setenv(k, v)
        sink = sink_mod.SpecCaptureSink([1, 3, 4])
        monkeypatch.setattr(sink_mod, "get_sink", lambda: sink)
        this = types.SimpleNamespace(
            output_streamer=types.SimpleNamespace(ps=types.SimpleNamespace(attn_tp_rank=0)),
            _coalesce_spec_capture_chunks=lambda chunks: chunks[0] if chunks else None,
            _resolve_spec_capture_source=processor._resolve_spec_capture_source,
        )
        aux = torch.randn(length, 24, generator=gen).to(torch.bfloat16)
        last = torch.randn(length, 8, generator=gen).to(torch.bfloat16)
        samples = []
        for name, passthrough in (("lists", lists), ("compact", compact)):
            req = types.SimpleNamespace(
                origin_input_ids=ids,
                spec_capture_aux=[aux],
                spec_capture_last_hidden=[last],
                spec_capture={
                    "store_id": "t",
                    "sample_id": name,
                    "gen": 1,
                    "features": {"aux": "hidden_state", "last_hidden": "target"},
                    "passthrough": passthrough,
                },
            )
            _, spec, a, lh, _, _ = processor._sink_spec_capture(this, req)
            samples.append((spec, a, lh))
        assert all("source" in i for i in compact[:1])  # the request's own spec is left as it came
        results = sink.put_samples(samples)
        assert results[0]["features"] == results[1]["features"]
        reader = MooncakeDistributedStore()
        reader.setup(
            "127.0.0.1",
            f"http://127.0.0.1:{mc.metadata_port}/metadata",
            0,
            32 << 20,
            "tcp",
            "",
            f"127.0.0.1:{mc.rpc_port}",
        )
        for item in lists:
            want = torch.tensor(item["data"], dtype=torch.int64).numpy().tobytes()
            assert reader.get(f"t/lists/g1/{item['name']}") == want
            assert reader.get(f"t/compact/g1/{item['name']}") == want, item["name"]
        # a source the scheduler does not know is left for the sink, which fails that capture (on its own
        # thread, where a batch's errors are caught) rather than the scheduler's loop; no values fail too
        unknown = {"name": "x", "source": "labels", "shape": [1], "dtype": "int64"}
        assert processor._resolve_spec_capture_source(types.SimpleNamespace(origin_input_ids=ids), unknown) is unknown
        with pytest.raises(RuntimeError, match="unknown source 'labels'"):
            sink_mod._passthrough_tensor(unknown, torch.int64)
        with pytest.raises(RuntimeError, match="none of data, fill, data_b64"):
            sink_mod._passthrough_tensor({"name": "x", "shape": [1]}, torch.int64)


def test_compact_gaps_clear_on_the_patched_sglang(patched_site):
    """Once SpecForge's capture patch and ours are in, ``compact_passthrough_gaps`` no longer names SGLang
    patch spec-capture-compact-passthrough (the launch preflight's check for ``server.compact_passthrough``)."""
    from specforge_kimi.setup import setup_patches as sp

    gaps = sp.compact_passthrough_gaps(sglang_site=patched_site)
    assert not any(g.startswith("SGLang patch spec-capture-compact-passthrough ") for g in gaps), gaps


def test_half_applied_stack_is_finished(tmp_path, checkout):
    """The capture patch and our spec-capture-staging-buffer in, the rest not (an interrupted setup, or one from an older
    specforge-kimi): setup reads the applied prefix and finishes the stack instead of calling it drift."""
    from specforge_kimi.setup import setup_patches as sp

    capture = Path(checkout) / sp.CAPTURE_PATCH
    stack = [capture, *sp.our_sglang_patches()]
    site = sp._scratch_copy(sp.sglang_root(), {f for p in stack for f in sp._files(p, 2)}, tmp_path / "site")
    for p in stack[:2]:
        status = sp.classify(p, site, 2)
        assert status.state == "applicable", status.detail
        sp.apply(status)
    states = [(s.patch.name, s.state) for s in sp.plan(checkout, sglang=True, sglang_site=site) if s.root == site]
    assert [st for _, st in states] == ["applied"] * 2 + ["applicable"] * (len(stack) - 2), states
    for s in sp.plan(checkout, sglang=True, sglang_site=site):
        if s.root == site and s.state == "applicable":
            sp.apply(s)
    assert {s.state for s in sp.plan(checkout, sglang=True, sglang_site=site) if s.root == site} == {"applied"}
    assert sp.classify_stack(sp.our_sglang_patches(), site)[-1].state == "applied"  # doctor's reading


def test_drift_error_names_the_file_that_fails(tmp_path, checkout):
    """The capture patch touches many files; the error names the one whose hunk fails, not the first listed."""
    import argparse

    from specforge_kimi.errors import KimiInputError
    from specforge_kimi.setup import setup_patches as sp

    capture = Path(checkout) / sp.CAPTURE_PATCH
    site = sp._scratch_copy(sp.sglang_root(), sp._files(capture, 2), tmp_path / "site")
    batch = site / "sglang/srt/managers/schedule_batch.py"
    old = "        return_pooled_hidden_states: bool = False,\n"
    assert batch.read_text().count(old) == 1
    batch.write_text(batch.read_text().replace(old, "        return_pooled_hidden_states: bool = True,\n"))
    status = sp.classify(capture, site, 2)
    assert status.state == "drift" and status.failed == ["sglang/srt/managers/schedule_batch.py"], status.detail
    import unittest.mock as um

    with (
        um.patch.object(sp, "sglang_root", return_value=site),
        pytest.raises(KimiInputError, match=r"spec-capture.patch does not apply to \S*/schedule_batch.py:"),
    ):
        sp.run(argparse.Namespace(specforge_checkout=checkout, check=True, no_sglang=False))


def _load(patched_site, monkeypatch, name: str, rel: str):
    import sys

    spec = importlib.util.spec_from_file_location(name, patched_site / rel)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def test_cuda_ipc_gaps_clear_on_the_patched_sglang(patched_site, tmp_path, checkout):
    """spec-capture-cuda-ipc in the stack: ``cuda_ipc_gaps`` (the launch preflight for ``server.transport:
    cuda_ipc``) is empty, and the earlier patches still read as applied (spec-capture-cuda-ipc edits lines
    spec-capture-compact-passthrough wrote: read as a stack, not alone)."""
    from specforge_kimi.setup import setup_patches as sp

    assert sp.cuda_ipc_gaps(sglang_site=patched_site) == []
    compact = sp.compact_passthrough_gaps(sglang_site=patched_site)
    assert not any(g.startswith("SGLang patch spec-capture-compact-passthrough ") for g in compact), compact
    capture = Path(checkout) / sp.CAPTURE_PATCH
    stack = [capture, *sp.our_sglang_patches()]
    site = sp._scratch_copy(sp.sglang_root(), {f for p in stack for f in sp._files(p, 2)}, tmp_path / "to0004")
    for p in stack[:-1]:
        sp.apply(sp.classify(p, site, 2))
    gaps = sp.cuda_ipc_gaps(sglang_site=site)
    assert [g.split(" is not applied")[0] for g in gaps] == [f"SGLang patch {sp.CUDA_IPC_SGLANG_PATCH}"], gaps


def test_cuda_ipc_sink_routes_samples_to_the_pool(patched_site, tmp_path, monkeypatch):
    """The patched sink with a cuda_ipc pool (the CPU backend of specforge_kimi's writer in the GPU pool's place):
    samples go to the pool, read back bit for bit through SpecForge-side store, passthrough in every spec-capture-compact-passthrough form;
    a request naming ``transport: mooncake`` still goes to Mooncake; a server without a pool refuses cuda_ipc."""
    import base64

    import numpy as np
    import torch
    from mooncake.store import MooncakeDistributedStore

    from specforge_kimi.run import services
    from specforge_kimi.transport.descriptor import with_descriptor
    from specforge_kimi.transport.store import CudaIpcFeatureStore
    from specforge_kimi.transport.writer import IpcCaptureWriter

    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_TRANSPORT", "cuda_ipc")
    sink_mod = _load(patched_site, monkeypatch, "sglang.srt.spec_capture_sink", "sglang/srt/spec_capture_sink.py")
    assert sink_mod.states_on_gpu()
    length = 50
    gen = torch.Generator().manual_seed(3)
    rows = [
        (
            torch.randn(length, 24, generator=gen).to(torch.bfloat16),
            torch.randn(length, 8, generator=gen).to(torch.bfloat16),
        )
        for _ in range(3)
    ]
    mask = [i % 2 for i in range(length)]

    def spec(sample_id, **extra):
        return {
            "store_id": "t",
            "sample_id": sample_id,
            "gen": 1,
            "features": {"aux": "hidden_state", "last_hidden": "target"},
            "passthrough": [
                {"name": "input_ids", "data": list(range(length)), "shape": [1, length], "dtype": "int64"},
                {
                    "name": "loss_mask",
                    "data_b64": base64.b64encode(np.asarray(mask, dtype="<u1").tobytes()).decode(),
                    "data_dtype": "uint8",
                    "shape": [1, length],
                    "dtype": "int64",
                },
                {"name": "attention_mask", "fill": 1, "shape": [1, length], "dtype": "int64"},
            ],
            **extra,
        }

    with services.mooncake_master(tmp_path / "mooncake.log", segment_bytes=256 << 20) as mc:
        for k, v in {
            "MOONCAKE_METADATA_SERVER": f"http://127.0.0.1:{mc.metadata_port}/metadata",
            "MOONCAKE_MASTER_SERVER_ADDR": f"127.0.0.1:{mc.rpc_port}",
            "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
            "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(128 << 20),
            "MOONCAKE_LOCAL_BUFFER_SIZE": str(32 << 20),
        }.items():
            monkeypatch.setenv(k, v)
        sink = sink_mod.SpecCaptureSink([1, 3, 4])
        sink._ipc = IpcCaptureWriter(pool_bytes=8 << 20, pool_dir=tmp_path / "ipc", device="cpu")
        try:
            samples = [
                (spec("a"), *rows[0]),
                (spec("m", transport="mooncake"), *rows[1]),
                (spec("b"), *rows[2]),
            ]
            results = sink.put_samples(samples)
            assert [("cuda_ipc" in r) for r in results] == [True, False, True]
            assert all(r["aux_layer_ids"] == [1, 3, 4] for r in results)
            store = CudaIpcFeatureStore(store_id="t", pool_dir=tmp_path / "ipc")
            from specforge.runtime.contracts import FeatureSpec, SampleRef

            for (sp_, aux, last), res in zip(samples, results, strict=True):
                if "cuda_ipc" not in res:
                    continue
                specs = {
                    n: FeatureSpec(name=n, shape=tuple(m["shape"]), dtype=m["dtype"])
                    for n, m in res["features"].items()
                }
                ref = SampleRef(sp_["sample_id"], "r", None, "x", {n: n for n in specs}, specs, "eagle3")
                out, _ = store.get(with_descriptor(ref, res["cuda_ipc"]))
                assert torch.equal(out["hidden_state"][0], aux) and torch.equal(out["target"][0], last)
                assert out["loss_mask"].tolist() == [mask] and out["attention_mask"].sum() == length
            reader = MooncakeDistributedStore()
            reader.setup(
                "127.0.0.1",
                os.environ["MOONCAKE_METADATA_SERVER"],
                0,
                32 << 20,
                "tcp",
                "",
                os.environ["MOONCAKE_MASTER_SERVER_ADDR"],
            )
            assert reader.get("t/m/g1/hidden_state") == rows[1][0].contiguous().view(torch.uint8).numpy().tobytes()
            assert reader.get("t/a/g1/hidden_state") in (b"", None)  # pool samples never reach Mooncake
        finally:
            sink._ipc.close()
        plain = sink_mod.SpecCaptureSink([1, 3, 4])
        with pytest.raises(RuntimeError, match="no cuda_ipc pool"):
            plain.put_samples([(spec("c", transport="cuda_ipc"), *rows[0])])
    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_TRANSPORT", "rdma")
    bad = _load(patched_site, monkeypatch, "sglang.srt.spec_capture_sink", "sglang/srt/spec_capture_sink.py")
    with pytest.raises(ValueError, match="mooncake or cuda_ipc"):
        bad.maybe_init_sink(type("A", (), {"enable_spec_capture": True, "spec_capture_aux_layer_ids": [1]})())


@pytest.mark.parametrize("transport", ["mooncake", "cuda_ipc"])
def test_cuda_ipc_keeps_captured_rows_where_they_are(patched_site, monkeypatch, transport):
    """spec-capture-cuda-ipc in the scheduler: with cuda_ipc ``copy_to_cpu`` leaves the hidden states on the device, giving them
    storage of their own on the forward's stream (a clone: the sink reads them beside the next forward), and
    ``_append_spec_capture_states`` hands the sink views of those rows (cloning first when no ``copy_to_cpu`` ran:
    the non-overlap scheduler); with mooncake both behave as before (async D2H; one host tensor per batch, cached on
    the logits output)."""
    import types

    import torch

    monkeypatch.setenv("SGLANG_SPEC_CAPTURE_TRANSPORT", transport)
    _load(patched_site, monkeypatch, "sglang.srt.spec_capture_sink", "sglang/srt/spec_capture_sink.py")
    utils = _load(patched_site, monkeypatch, "sglang.srt.managers.utils", "sglang/srt/managers/utils.py")
    calls = []

    class Rows:  # records .to() (the D2H) and .clone() instead of doing them
        def __init__(self, name):
            self.name = name

        def to(self, *a, **k):
            calls.append(("to", self.name))
            return self

        def clone(self):
            calls.append(("clone", self.name))
            return Rows(self.name + "'")

    logits = types.SimpleNamespace(
        hidden_states=Rows("hidden_states"), last_hidden_states=Rows("last_hidden_states"), next_token_logprobs=None
    )
    result = utils.GenerationBatchResult(
        logits_output=logits, next_token_ids=torch.zeros(2), copy_done=types.SimpleNamespace(record=lambda: None)
    )
    result.copy_to_cpu(return_logprob=False, return_hidden_states=True)
    if transport == "cuda_ipc":
        assert calls == [("clone", "hidden_states"), ("clone", "last_hidden_states")] and logits._spec_capture_owned
        assert logits.hidden_states.name == "hidden_states'"
    else:
        assert calls == [("to", "last_hidden_states"), ("to", "hidden_states")]

    brp = _load(
        patched_site,
        monkeypatch,
        "patched_brp_0005",
        "sglang/srt/managers/scheduler_components/batch_result_processor.py",
    )
    this = types.SimpleNamespace(output_streamer=types.SimpleNamespace(ps=types.SimpleNamespace(attn_tp_rank=0)))

    def append(out):
        reqs, offset = [], 0
        for n in (5, 7):
            req = types.SimpleNamespace(
                origin_input_ids=list(range(n)),
                spec_capture={"features": {"aux": "hidden_state", "last_hidden": "target"}},
                spec_capture_aux=[],
                spec_capture_last_hidden=[],
            )
            offset = brp.SchedulerBatchResultProcessor._append_spec_capture_states(
                this, req=req, logits_output=out, hidden_state_offset=offset
            )
            reqs.append(req)
        assert offset == 12
        return reqs

    hidden, last = torch.randn(12, 6), torch.randn(12, 2)
    for owned in (False, True):
        out = types.SimpleNamespace(hidden_states=hidden, last_hidden_states=last)
        if owned:
            out._spec_capture_owned = True  # copy_to_cpu ran (overlap scheduler)
        reqs = append(out)
        assert torch.equal(reqs[1].spec_capture_aux[0], hidden[5:12])
        assert torch.equal(reqs[1].spec_capture_last_hidden[0], last[5:])
        assert hasattr(out, "_spec_capture_aux_cpu") == (transport == "mooncake")
        if transport == "cuda_ipc":  # views of the batch's own rows: the clone, unless copy_to_cpu made it
            assert reqs[0].spec_capture_aux[0].data_ptr() == out.hidden_states.data_ptr()
            assert (out.hidden_states is hidden) == owned and (out.last_hidden_states is last) == owned
