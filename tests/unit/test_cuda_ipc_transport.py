"""The cuda_ipc transport's logic on the CPU: the pool's allocator, the slot table (the release channel), the
descriptor, the server's writer and SpecForge's store, on the shared-memory backend (a pool whose "GPU" is a
file in /dev/shm: the same writer, reader and copy code as the CUDA backend, without the CUDA IPC handle,
which ``tests/gpu/test_cuda_ipc.py`` covers). Readers and writers run in separate processes where the point is
the crossing (release seen by the server, a dead writer refused)."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from specforge_kimi.transport.descriptor import Descriptor, with_descriptor
from specforge_kimi.transport.regions import RegionAllocator, aligned
from specforge_kimi.transport.slots import SlotTable, sample_key


# -- regions ---------------------------------------------------------------------------------------------------
def test_regions_first_fit_aligned_and_coalescing():
    r = RegionAllocator(4096, align=256)
    a, b, c = r.alloc(1), r.alloc(300), r.alloc(256)
    assert (a, b, c) == (0, 256, 768)  # 1 -> 256, 300 -> 512
    assert r.used_bytes == 1024 and r.free_bytes == 3072
    assert r.free(b) == 512
    assert r.alloc(512) == 256  # first fit reuses the hole
    r.free(256)
    r.free(a)  # coalesces with the hole after it
    assert r.ranges()[0] == (0, 768)
    r.free(c)
    assert r.ranges() == [(0, 4096)] and r.used_bytes == 0
    assert r.alloc(4097) is None
    with pytest.raises(KeyError):
        r.free(0)
    with pytest.raises(ValueError):
        RegionAllocator(1000, align=256)


def test_regions_random_against_a_byte_map():
    """Random alloc/free against an explicit byte map: no overlap, totals add up, all free -> one range."""
    rng = random.Random(0)
    cap, align = 1 << 16, 256
    r = RegionAllocator(cap, align=align)
    owner = [None] * (cap // align)
    live: dict[int, int] = {}
    for step in range(3000):
        if live and rng.random() < 0.45:
            start = rng.choice(list(live))
            size = live.pop(start)
            assert r.free(start) == size
            for i in range(start // align, (start + size) // align):
                owner[i] = None
        else:
            n = rng.randrange(1, 4000)
            start = r.alloc(n)
            if start is None:
                # first fit fails only when no free run of that size exists
                run = best = 0
                for o in owner:
                    run = run + 1 if o is None else 0
                    best = max(best, run)
                assert best * align < aligned(n, align)
                continue
            size = aligned(n, align)
            assert start % align == 0 and start + size <= cap
            for i in range(start // align, (start + size) // align):
                assert owner[i] is None, f"overlap at step {step}"
                owner[i] = start
            live[start] = size
        assert r.used_bytes + r.free_bytes == cap
    for start in list(live):
        r.free(start)
    assert r.ranges() == [(0, cap)]


# -- slot table ------------------------------------------------------------------------------------------------
def test_slot_table_lend_release_reclaim(tmp_path):
    t = SlotTable.create(tmp_path / "t.slots", max_slots=3, capacity=1 << 20)
    s1 = t.claim(alloc_id=7, key=sample_key("a"), offset=0, nbytes=100, t_ns=1)
    s2 = t.claim(alloc_id=8, key=sample_key("b"), offset=256, nbytes=50, t_ns=2)
    assert (s1, s2) == (1, 2) and t.live() == {"slots": 2, "bytes": 150, "oldest_t_ns": 1}
    reader = SlotTable.attach(tmp_path / "t.slots")  # what another process maps
    assert reader.capacity == 1 << 20 and reader.current(s1) == 7
    assert not reader.release(s1, 99)  # not what the slot holds: no effect
    assert reader.release(s1, 7) and t.released() == [s1]
    assert t.find(sample_key("b")) == [(s2, 8)] and t.find(sample_key("a")) == []  # released rows are not "live"
    t.free(s1)
    assert t.released() == [] and reader.current(s1) == 0 and not reader.release(s1, 7)
    # round robin: the freed row 1 is reused only after row 3
    assert t.claim(alloc_id=9, key=1, offset=0, nbytes=1, t_ns=3) == 3
    assert t.claim(alloc_id=10, key=1, offset=0, nbytes=1, t_ns=3) == 1
    assert t.claim(alloc_id=11, key=1, offset=0, nbytes=1, t_ns=3) is None  # every row lent
    (tmp_path / "junk").write_bytes(b"\0" * 128)
    with pytest.raises(ValueError, match="not a specforge-kimi slot table"):
        SlotTable.attach(tmp_path / "junk")


def test_slot_release_crosses_processes(tmp_path):
    t = SlotTable.create(tmp_path / "t.slots", max_slots=4, capacity=4096)
    slot = t.claim(alloc_id=5, key=sample_key("x"), offset=0, nbytes=10, t_ns=0)
    code = (
        "import sys; from specforge_kimi.transport.slots import SlotTable; "
        "print(SlotTable.attach(sys.argv[1]).release(int(sys.argv[2]), 5))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "t.slots"), str(slot)], capture_output=True, text=True
    )
    assert out.stdout.strip() == "True", out.stderr
    assert t.released() == [slot]


# -- descriptor --------------------------------------------------------------------------------------------------
def _ref(specs: dict, sample_id: str = "run:t0"):
    from specforge.runtime.contracts import FeatureSpec, SampleRef

    fs = {n: FeatureSpec(name=n, shape=tuple(shape), dtype=dtype) for n, (shape, dtype) in specs.items()}
    return SampleRef(
        sample_id=sample_id,
        run_id="run",
        source_task_id="t0",
        feature_store_uri=f"mooncake://run/{sample_id}",
        feature_keys={n: f"{sample_id}/{n}" for n in fs},
        feature_specs=fs,
        strategy="eagle3",
        metadata={"generation": 1},
    )


def test_descriptor_round_trip_and_refusals():
    from specforge.runtime.data_plane.ref_serialization import ref_from_dict, ref_to_dict

    d = Descriptor("0123abcd0123abcd", 3, 41, {"hidden_state": (0, 96), "input_ids": (256, 80)})
    assert Descriptor.from_json(json.loads(json.dumps(d.to_json()))) == d and d.nbytes == 176
    for bad, match in (
        ({**d.to_json(), "v": 2}, "version"),
        ({**d.to_json(), "pool": "../x"}, "hex id"),
        ({**d.to_json(), "slot": 0}, "positive"),
        ({**d.to_json(), "features": {}}, "no feature"),
        ({**d.to_json(), "features": {"a": [1]}}, "offset, nbytes"),
        ([1, 2], "not an object"),
    ):
        with pytest.raises(ValueError, match=match):
            Descriptor.from_json(bad)
    ref = _ref({"hidden_state": ((1, 2, 24), "float16"), "input_ids": ((1, 10), "int64")})
    out = with_descriptor(ref, d.to_json())
    assert out.feature_store_uri == "cudaipc://0123abcd0123abcd/run:t0" and out.metadata["generation"] == 1
    again = ref_from_dict(json.loads(json.dumps(ref_to_dict(out))))  # refs.jsonl / the ledger keep it
    assert Descriptor.from_json(again.metadata["cuda_ipc"]) == d
    with pytest.raises(ValueError, match="needs 80"):
        with_descriptor(ref, {**d.to_json(), "features": {"hidden_state": [0, 96], "input_ids": [256, 8]}})
    with pytest.raises(ValueError, match="places"):
        with_descriptor(ref, {**d.to_json(), "features": {"hidden_state": [0, 96]}})


# -- writer + store on the shared-memory backend ------------------------------------------------------------------
AUX_W, LAST_W = 24, 8


def _spec(sample_id: str, length: int, **extra) -> dict:
    return {
        "store_id": "run",
        "sample_id": sample_id,
        "gen": 1,
        "features": {"aux": "hidden_state", "last_hidden": "target"},
        "passthrough": [
            {"name": "input_ids", "data": list(range(length)), "shape": [1, length], "dtype": "int64"},
            {"name": "loss_mask", "fill": 1, "shape": [1, length], "dtype": "int64"},
        ],
        **extra,
    }


def _passthrough(item: dict):
    if "fill" in item:
        return torch.full(item["shape"], item["fill"], dtype=getattr(torch, item["dtype"]))
    return torch.tensor(item["data"], dtype=getattr(torch, item["dtype"])).reshape(item["shape"])


def _rows(length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(length, AUX_W, generator=g).to(torch.bfloat16), torch.randn(length, LAST_W, generator=g).to(
        torch.bfloat16
    )


def _put(writer, specs_rows):
    return writer.put_samples(
        [(spec, aux, last) for spec, (aux, last) in specs_rows], passthrough_tensor=_passthrough, aux_layer_ids=[1, 2]
    )


def _ref_for(result: dict):
    ref = _ref({n: (m["shape"], m["dtype"]) for n, m in result["features"].items()}, result["sample_id"])
    return with_descriptor(ref, result["cuda_ipc"])


@pytest.fixture()
def writer(tmp_path):
    from specforge_kimi.transport.writer import IpcCaptureWriter

    clock = {"t": 0.0}
    w = IpcCaptureWriter(
        pool_bytes=64 << 10, pool_dir=tmp_path / "ipc", device="cpu", lease_s=100, wait_s=0.2, clock=lambda: clock["t"]
    )
    w.test_clock = clock
    yield w
    w.close()


def _store(writer, **kw):
    from specforge_kimi.transport.store import CudaIpcFeatureStore

    return CudaIpcFeatureStore(store_id="run", pool_dir=writer.pool_dir, **kw)


def test_written_samples_read_back_bit_for_bit(writer):
    rows = [_rows(37, 0), _rows(5, 1)]
    results = _put(writer, [(_spec("run:a", 37), rows[0]), (_spec("run:b", 5), rows[1])])
    assert [r["features"]["hidden_state"]["shape"] for r in results] == [[1, 37, AUX_W], [1, 5, AUX_W]]
    assert results[0]["aux_layer_ids"] == [1, 2] and results[0]["store_id"] == "run"
    places = results[0]["cuda_ipc"]["features"]
    assert all(o % 256 == 0 for o, _ in places.values())  # each feature's view starts aligned
    store = _store(writer, retain_on_release=True)
    for (aux, last), res in zip(rows, results, strict=True):
        out, handle = store.get(_ref_for(res))
        assert torch.equal(out["hidden_state"][0], aux) and torch.equal(out["target"][0], last)
        assert out["hidden_state"].dtype == torch.bfloat16 and out["input_ids"].dtype == torch.int64
        assert out["input_ids"].tolist() == [list(range(aux.shape[0]))] and out["loss_mask"].sum() == aux.shape[0]
        store.release(handle)
    assert store.health()["resident_samples"] == 2 and store.health()["active_leases"] == 0
    # retain_on_release (the consumer): release kept the slots lent; the optimizer-step ack (abort) gives them back
    assert writer.reclaim() == 0 and writer.lent()["samples"] == 2
    store.abort("run:a", reason="optimizer-boundary-durable-ack")
    store.abort("run:a", reason="again")  # idempotent
    assert writer.reclaim() == 1 and writer.lent()["samples"] == 1
    with pytest.raises(KeyError, match="use-after-free"):
        store.get(_ref_for(results[0]))
    with pytest.raises(KeyError, match="no longer holds"):  # another process's view of the same freed sample
        _store(writer).get(_ref_for(results[0]))
    store.close()  # drops the mapping; a later read maps the pool again
    assert torch.equal(store.get(_ref_for(results[1]))[0]["target"][0], rows[1][1])


def test_consume_once_store_releases_on_release(writer):
    (res,) = _put(writer, [(_spec("run:a", 4), _rows(4, 0))])
    store = _store(writer, retain_on_release=False)
    _, handle = store.get(_ref_for(res))
    store.release(handle)
    assert writer.reclaim() == 1


def test_lease_expiry_is_logged_and_reclaimed(writer, caplog):
    (res,) = _put(writer, [(_spec("run:slow", 3), _rows(3, 0))])
    writer.test_clock["t"] = 99.0
    assert writer.reclaim() == 0
    writer.test_clock["t"] = 101.0
    with caplog.at_level(logging.WARNING, logger="specforge_kimi.transport.writer"):
        assert writer.reclaim() == 1
    assert "run:slow" in caplog.text and "lease" in caplog.text and writer.lent()["expired"] == 1
    with pytest.raises(KeyError):
        _store(writer).get(_ref_for(res))


def test_replace_frees_the_previous_capture(writer):
    (old,) = _put(writer, [(_spec("run:a", 6), _rows(6, 0))])
    (new,) = _put(writer, [(_spec("run:a", 6, replace=True), _rows(6, 1))])  # SpecForge's retry, same id
    assert writer.lent()["samples"] == 1 and writer.lent()["replaced"] == 1
    store = _store(writer)
    with pytest.raises(KeyError):
        store.get(_ref_for(old))
    out, _ = store.get(_ref_for(new))
    assert torch.equal(out["hidden_state"][0], _rows(6, 1)[0])


def test_full_pool_waits_for_a_release_then_fails_after_the_wait(writer):
    big = 600  # one sample of 600 tokens: 600 x (24 + 8) x 2 + 2 x 600 x 8 bytes = 48 KB of the 64 KB pool
    (first,) = _put(writer, [(_spec("run:a", big), _rows(big, 0))])
    with pytest.raises(RuntimeError, match="full for"):
        _put(writer, [(_spec("run:b", big), _rows(big, 1))])
    assert writer.lent()["samples"] == 1  # the failed batch left nothing lent
    # backpressure: a reader's release during the wait lets the batch through. The reader (another thread)
    # releases only once the writer has found the pool full, so the batch is known to have waited.
    writer.wait_s = 30.0
    store = _store(writer)
    store.adopt(_ref_for(first))
    full = threading.Event()
    alloc = writer.regions.alloc

    def observed_alloc(nbytes):
        start = alloc(nbytes)
        if start is None:
            full.set()
        return start

    writer.regions.alloc = observed_alloc
    reader = threading.Thread(target=lambda: full.wait(30) and store.abort("run:a", reason="ack"))
    reader.start()
    (second,) = _put(writer, [(_spec("run:b", big), _rows(big, 1))])
    reader.join()
    assert full.is_set() and writer.lent()["released"] == 1 and writer.lent()["samples"] == 1
    assert torch.equal(store.get(_ref_for(second))[0]["target"][0], _rows(big, 1)[1])
    with pytest.raises(RuntimeError, match="the whole pool is"):
        _put(writer, [(_spec("run:huge", 2000), _rows(2000, 2))])


def test_a_batch_never_expires_its_own_slots(writer):
    """A batch waiting for space past the lease must not reclaim the slots it just lent itself (it would answer
    descriptors of freed slots): it waits, then fails whole."""
    big = 600
    late = []

    def clock():  # the lease (100 s) runs out as soon as the batch holds a slot, i.e. while it waits for room
        if writer._batch:
            late.append(1)
            return 1000.0
        return 0.0

    writer._clock = clock
    with pytest.raises(RuntimeError, match="full for"):
        _put(writer, [(_spec("run:a", big), _rows(big, 0)), (_spec("run:b", big), _rows(big, 1))])
    assert late, "the wait never saw the lease run out"
    assert writer.lent()["expired"] == 0 and writer.lent()["samples"] == 0


def test_a_failing_batch_lends_nothing(writer):
    def bad(item):
        if item["name"] == "loss_mask":
            raise RuntimeError("bad passthrough")
        return _passthrough(item)

    with pytest.raises(RuntimeError, match="bad passthrough"):
        writer.put_samples([(_spec("run:a", 3), *_rows(3, 0))], passthrough_tensor=bad, aux_layer_ids=None)
    assert writer.lent()["samples"] == 0 and writer.regions.free_bytes == writer.regions.capacity
    with pytest.raises(RuntimeError, match="no aux hidden states"):
        writer.put_samples([(_spec("run:a", 3), None, None)], passthrough_tensor=_passthrough, aux_layer_ids=None)


def test_read_refuses_a_slot_reclaimed_during_the_copy(writer):
    (res,) = _put(writer, [(_spec("run:a", 3), _rows(3, 0))])
    store = _store(writer)
    ref = _ref_for(res)
    reader = store._reader(res["cuda_ipc"]["pool"])
    real = reader.table.current
    calls = []

    def current(slot):  # the server reclaims between the check before and the one after the copy
        calls.append(slot)
        return real(slot) if len(calls) == 1 else 0

    reader.table.current = current
    with pytest.raises(KeyError, match="during the read"):
        store.get(ref)
    assert len(calls) == 2


def test_unanswered_capture_is_released_by_key(writer):
    """The producer tracks each attempt before its HTTP call; an answer that never came has no descriptor, so
    discard_external_attempts finds the server's row by the sample id's key."""
    producer = _store(writer)
    producer.track_external_attempt("run:lost", generation=1, feature_names=["hidden_state"])
    producer.track_external_attempt("run:ok", generation=1, feature_names=["hidden_state"])
    lost, ok = _put(writer, [(_spec("run:lost", 3), _rows(3, 0)), (_spec("run:ok", 3), _rows(3, 1))])
    producer.adopt(_ref_for(ok))
    assert producer.discard_external_attempts() == 1
    assert writer.reclaim() == 1 and writer.lent()["samples"] == 1
    producer.abort("run:never-captured")  # no descriptor, no row: nothing happens
    assert writer.reclaim() == 0


def test_server_side_routing_and_env(tmp_path, monkeypatch):
    from specforge_kimi.transport.writer import IpcCaptureWriter, server_transport

    assert IpcCaptureWriter.wants({}) and not IpcCaptureWriter.wants({"transport": "mooncake"})
    assert IpcCaptureWriter.from_env(device="cpu", environ={}) is None
    with pytest.raises(ValueError, match="SGLANG_SPEC_CAPTURE_IPC_POOL_BYTES"):
        IpcCaptureWriter.from_env(device="cpu", environ={"SGLANG_SPEC_CAPTURE_TRANSPORT": "cuda_ipc"})
    with pytest.raises(ValueError, match="expected one of"):
        server_transport({"SGLANG_SPEC_CAPTURE_TRANSPORT": "nvlink"})
    w = IpcCaptureWriter.from_env(
        device="cpu",
        environ={
            "SGLANG_SPEC_CAPTURE_TRANSPORT": "cuda_ipc",
            "SGLANG_SPEC_CAPTURE_IPC_POOL_BYTES": str(1 << 20),
            "SGLANG_SPEC_CAPTURE_IPC_DIR": str(tmp_path / "ipc"),
            "SGLANG_SPEC_CAPTURE_IPC_LEASE_S": "12",
            "SGLANG_SPEC_CAPTURE_IPC_MAX_SLOTS": "8",
        },
    )
    info = json.loads(w.pool_file.read_text())
    assert (
        info["nbytes"] == 1 << 20 and info["lease_s"] == 12 and info["backend"] == "shm" and info["pid"] == os.getpid()
    )
    assert w.table.max_slots == 8 and w.wait_s == 72
    files = [w.pool_file, w.info.slots_path, w.info.handle["path"]]
    w.close()
    assert not any(os.path.exists(f) for f in files)  # a clean stop leaves nothing in /dev/shm


WRITER_PROCESS = textwrap.dedent(
    """
    import json, sys, time, torch
    from specforge_kimi.transport.writer import IpcCaptureWriter
    w = IpcCaptureWriter(pool_bytes=1 << 20, pool_dir=sys.argv[1], device="cpu", lease_s=600)
    spec = {"store_id": "run", "sample_id": "run:x", "gen": 1, "features": {"aux": "hidden_state"}, "passthrough": []}
    aux = torch.arange(40, dtype=torch.float32).reshape(10, 4).to(torch.bfloat16)
    (res,) = w.put_samples([(spec, aux, None)], passthrough_tensor=None, aux_layer_ids=None)
    print(json.dumps(res), flush=True)
    while not w.reclaim():
        time.sleep(0.05)
    print(json.dumps(w.lent()), flush=True)
    time.sleep(600)
    """
)


def test_reader_in_another_process_and_a_dead_writer(tmp_path):
    """A writer process lends a sample; this process maps the pool, reads it, releases it, the writer sees the
    release; then the writer is SIGKILLed: the pool is refused (its features are gone) and remove_stale clears
    what it left."""
    from specforge_kimi.transport.pool import remove_stale

    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER_PROCESS, str(tmp_path / "ipc")], stdout=subprocess.PIPE, text=True
    )
    try:
        res = json.loads(proc.stdout.readline())
        from specforge_kimi.transport.store import CudaIpcFeatureStore

        store = CudaIpcFeatureStore(store_id="run", pool_dir=tmp_path / "ipc", retain_on_release=True)
        ref = _ref_for(res)
        out, _ = store.get(ref)
        want = torch.arange(40, dtype=torch.float32).reshape(1, 10, 4).to(torch.bfloat16)
        assert torch.equal(out["hidden_state"], want)
        store.abort(ref.sample_id, reason="ack")
        assert json.loads(proc.stdout.readline())["released"] == 1
        info = json.loads((tmp_path / "ipc" / f"{res['cuda_ipc']['pool']}.json").read_text())
        assert remove_stale(tmp_path / "ipc") == []  # alive: kept
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        reader = store._reader(info["pool_id"])
        reader._checked = 0.0
        with pytest.raises(RuntimeError, match="is gone"):
            reader.check_alive()
        assert remove_stale(tmp_path / "ipc") == [info["pool_id"]]
        assert not os.path.exists(info["slots_path"]) and not os.path.exists(info["handle"]["path"])
        assert not list((tmp_path / "ipc").glob("*.json"))
    finally:
        proc.kill()
        proc.wait()


# -- the SpecForge seams register() installs -----------------------------------------------------------------------
def test_store_seam_answers_for_online_runs_on_cuda_ipc(monkeypatch, tmp_path):
    import types

    from specforge.training import disaggregated

    import specforge_kimi
    from specforge_kimi.transport.store import CudaIpcFeatureStore

    specforge_kimi.register()
    wrapped = disaggregated._mooncake_store
    specforge_kimi.register()
    assert disaggregated._mooncake_store is wrapped  # idempotent
    online = types.SimpleNamespace(mode="online", run_id="r1")
    monkeypatch.setenv("SPECFORGE_KIMI_TRANSPORT", "cuda_ipc")
    monkeypatch.setenv("SPECFORGE_KIMI_IPC_DIR", str(tmp_path))
    store = disaggregated._mooncake_store(online, retain_on_release=True)
    assert isinstance(store, CudaIpcFeatureStore) and store.retain_on_release and store.store_id == "r1"
    monkeypatch.delenv("SPECFORGE_KIMI_IPC_DIR")
    with pytest.raises(ValueError, match="SPECFORGE_KIMI_IPC_DIR"):
        disaggregated._mooncake_store(online)
    # offline runs and mooncake keep SpecForge's own store (which wants its Mooncake endpoints)
    monkeypatch.delenv("MOONCAKE_METADATA_SERVER", raising=False)
    for env, cfg in (("cuda_ipc", types.SimpleNamespace(mode="offline", run_id="r1")), ("mooncake", online)):
        monkeypatch.setenv("SPECFORGE_KIMI_TRANSPORT", env)
        with pytest.raises(ValueError, match="MOONCAKE_METADATA_SERVER"):
            disaggregated._mooncake_store(cfg)
    monkeypatch.setenv("SPECFORGE_KIMI_TRANSPORT", "tcp")
    with pytest.raises(ValueError, match="expected one of"):
        disaggregated._mooncake_store(online)


def test_producer_refs_carry_the_descriptor(writer):
    """SpecForge's own capture adapter (its HTTP call answered from the writer's results): with the seam, a
    cuda_ipc result becomes a cudaipc:// ref with its descriptor; a Mooncake result stays a mooncake:// ref."""
    from specforge.algorithms.eagle3.providers import create_registration
    from specforge.inference.adapters.server_capture import ServerCaptureSchema, SGLangServerCaptureAdapter
    from specforge.inference.capture import CaptureConfig
    from specforge.runtime.contracts import PromptTask

    import specforge_kimi

    specforge_kimi.register()
    algorithm = create_registration()
    layout = algorithm.providers.server_streaming_for("text").layout
    contract = algorithm.spec.feature_contract("streaming", "text")
    cfg = CaptureConfig.from_strategy(
        required_features=contract.required_tensors,
        aux_hidden_state_layer_ids=(1, 2, 3),
        target_repr=algorithm.providers.server_streaming_for("text").target_representation,
        target_hidden_size=LAST_W,
        target_vocab_size=256,
    )
    store = _store(writer)

    def post(url, json_body, timeout):
        rows = []
        for ids, spec in zip(json_body["input_ids"], json_body["spec_capture"], strict=True):
            aux = torch.randn(len(ids), 3 * LAST_W).to(torch.bfloat16)
            last = torch.randn(len(ids), LAST_W).to(torch.bfloat16)
            (res,) = writer.put_samples([(spec, aux, last)], passthrough_tensor=_passthrough, aux_layer_ids=[1, 2, 3])
            rows.append({"meta_info": {"spec_capture": res}})
            answers.append(res)
        return rows

    answers: list = []

    schema = ServerCaptureSchema(
        layout.aux_feature, layout.last_hidden_feature, layout.passthrough, layout.attention_mask_feature
    )
    adapter = SGLangServerCaptureAdapter(
        "http://x", store, run_id="run", algorithm="eagle3", schema=schema, post_fn=post
    )
    tasks = [
        PromptTask(
            task_id=f"t{i}",
            run_id="run",
            source_id="s",
            payload={"input_ids": [5] * 7, "loss_mask": [1] * 7},
            max_length=8,
        )
        for i in range(2)
    ]
    refs = adapter.produce_refs(tasks, capture=cfg)
    assert all(r.feature_store_uri.startswith("cudaipc://") and "cuda_ipc" in r.metadata for r in refs)
    out, _ = store.get(refs[0])  # adopted by the adapter, read by the consumer's store
    assert out["input_ids"].tolist() == [[5] * 7] and set(out) == set(refs[0].feature_specs)
    assert store.health()["resident_samples"] == 2
    mooncake = {k: v for k, v in answers[1].items() if k != "cuda_ipc"}  # what the Mooncake sink answers
    ref = adapter._ref_from_result(tasks[1], mooncake, cfg)
    assert ref.feature_store_uri == "mooncake://run/run:t1" and "cuda_ipc" not in ref.metadata
    with pytest.raises(ValueError, match="needs"):  # a descriptor that disagrees with the capture's specs
        bad = json.loads(json.dumps(answers[1]))
        bad["cuda_ipc"]["features"]["target"][1] += 2
        adapter._ref_from_result(tasks[1], bad, cfg)


# -- the pool's files: owner-only, never through a link, cleanup of its own names only (issue 31) --------------------
def _mode(path) -> int:
    return os.lstat(path).st_mode & 0o777


@pytest.mark.parametrize(("umask", "existing_dir"), [(0o000, False), (0o022, False), (0o000, True)])
def test_pool_files_are_owner_only_whatever_the_umask(tmp_path, umask, existing_dir):
    """The pool file carries the CUDA IPC handle: another user must read none of the pool's files."""
    from specforge_kimi.transport.writer import IpcCaptureWriter

    if existing_dir:
        (tmp_path / "ipc").mkdir(mode=0o777)  # left by an older run, or made by someone's wide umask
        os.chmod(tmp_path / "ipc", 0o777)
    old = os.umask(umask)
    try:
        w = IpcCaptureWriter(pool_bytes=1 << 16, pool_dir=tmp_path / "ipc", device="cpu", max_slots=4)
    finally:
        os.umask(old)
    try:
        assert _mode(tmp_path / "ipc") == 0o700
        for path in (w.pool_file, w.info.slots_path, w.info.handle["path"]):
            assert _mode(path) == 0o600, path
    finally:
        w.close()


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a directory of another user needs root")
OTHER_UID = 65534  # nobody


@needs_root
def test_pool_files_are_owner_only_not_in_another_users_directory(tmp_path):
    """A pool directory of another user (even one only it may read) is refused: the writer would hand it the
    pool file and its IPC handle. Nothing is written into it."""
    from specforge_kimi.transport.writer import IpcCaptureWriter

    ipc = tmp_path / "ipc"
    ipc.mkdir(mode=0o700)
    os.chown(ipc, OTHER_UID, OTHER_UID)
    with pytest.raises(PermissionError, match=f"belongs to uid {OTHER_UID}") as err:
        IpcCaptureWriter(pool_bytes=1 << 16, pool_dir=ipc, device="cpu", max_slots=4)
    assert "\n" not in str(err.value)
    assert list(ipc.iterdir()) == [] and _mode(ipc) == 0o700 and os.lstat(ipc).st_uid == OTHER_UID


def _dead_pool(ipc, pool_id: str) -> list:
    """A pool file in ``ipc`` whose writer is gone, and its slot table and shared-memory file; returns those."""
    info = {
        "version": 1,
        "pool_id": pool_id,
        "backend": "shm",
        "nbytes": 1,
        "slots_path": str(slots_path(pool_id)),
        "pid": _dead_pid(),
        "pid_start": None,
        "lease_s": 1.0,
        "created": 0.0,
        "device": {},
        "handle": {"path": str(shm_pool_path(pool_id))},
    }
    files = [ipc / f"{pool_id}.json", slots_path(pool_id), shm_pool_path(pool_id)]
    files[0].write_text(json.dumps(info))
    for p in files[1:]:
        p.write_bytes(b"\0")
    return files


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("kind", ["another_user", "group_writable", "world_writable", "link_to_ours"])
def test_stale_cleanup_refuses_a_directory_that_is_not_privately_ours(tmp_path, caplog, kind):
    """Stale-pool cleanup trusts the pool files it reads only in a private directory of this user -- the check
    the writer makes -- so a directory of another user (its pools' slot tables in /dev/shm are live to it), a
    directory others may write to, or a link is refused with one warning and nothing is removed."""
    from specforge_kimi.transport.pool import remove_stale

    if kind == "another_user" and os.geteuid() != 0:
        pytest.skip("making a directory of another user needs root")
    real = tmp_path / "ipc"
    real.mkdir(mode=0o700)
    files = _dead_pool(real, "00112233aabbccdd")
    ipc = real
    if kind == "another_user":
        for p in files:
            os.chown(p, OTHER_UID, OTHER_UID)
        os.chown(real, OTHER_UID, OTHER_UID)
    elif kind == "link_to_ours":
        ipc = tmp_path / "link"
        ipc.symlink_to(real)
    else:
        os.chmod(real, 0o770 if kind == "group_writable" else 0o777)
    try:
        with caplog.at_level(logging.WARNING, logger="specforge_kimi.transport.pool"):
            assert remove_stale(ipc) == []
        assert all(os.path.lexists(p) for p in files), kind
        (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert str(ipc) in warning and "removing nothing" in warning and "\n" not in warning
    finally:
        for p in files[1:]:
            p.unlink(missing_ok=True)
    os.chmod(real, 0o700)
    os.chown(real, os.geteuid(), os.getegid())
    for p in files[:1]:
        os.chown(p, os.geteuid(), os.getegid())
    # the same pool, now in a private directory of ours: it goes
    for p in files[1:]:
        p.write_bytes(b"\0")
    assert remove_stale(real) == ["00112233aabbccdd"] and not any(os.path.lexists(p) for p in files)


@needs_root
def test_stale_cleanup_leaves_another_users_shared_memory_file_of_the_same_name(tmp_path):
    """The names in /dev/shm are derived from the pool id; where another user's file holds one, it stays (root
    could unlink it through the sticky bit): only this user's files go."""
    from specforge_kimi.transport.pool import remove_stale

    ipc = tmp_path / "ipc"
    ipc.mkdir(mode=0o700)
    files = _dead_pool(ipc, "ffeeddccbbaa9988")
    os.chown(files[1], OTHER_UID, OTHER_UID)  # another user's live slot table under the same name
    try:
        assert remove_stale(ipc) == ["ffeeddccbbaa9988"]
        assert not files[0].exists() and not files[2].exists()
        assert files[1].read_bytes() == b"\0"
    finally:
        for p in files[1:]:
            p.unlink(missing_ok=True)


def test_a_reused_pid_is_not_taken_for_the_pools_writer(writer):
    """The pool file names its writer by pid and start time: a live process at that pid that started at another
    time (the pid reused after the writer died) is not the writer -- the pool is refused and the cleanup removes
    it; the real writer, same pid and start time, keeps it."""
    from specforge_kimi.transport.pool import process_start, remove_stale

    (res,) = _put(writer, [(_spec("run:a", 3), _rows(3, 0))])
    raw = json.loads(writer.pool_file.read_text())
    assert raw["pid"] == os.getpid() and raw["pid_start"] == process_start(os.getpid())
    store = _store(writer)
    store.get(_ref_for(res))  # the writer as it is: alive
    assert remove_stale(writer.pool_dir) == []
    raw["pid_start"] = str(int(raw["pid_start"]) + 1)  # same pid, another start: a process that reused the pid
    writer.pool_file.write_text(json.dumps(raw))
    reader = _store(writer)._reader(raw["pool_id"])
    with pytest.raises(RuntimeError, match="is gone"):
        reader.check_alive()
    assert remove_stale(writer.pool_dir) == [raw["pool_id"]]
    assert not writer.pool_file.exists() and not os.path.exists(raw["slots_path"])


def slots_path(pool_id: str):
    from specforge_kimi.transport.slots import shm_dir

    return shm_dir() / f"sfk-ipc-{pool_id}.slots"


def shm_pool_path(pool_id: str):
    from specforge_kimi.transport.slots import shm_dir

    return shm_dir() / f"sfk-ipc-{pool_id}.pool"


def _fixed_pool_id(monkeypatch, pool_id: str = "0123456789abcdef") -> str:
    import uuid

    monkeypatch.setattr(uuid, "uuid4", lambda: uuid.UUID(hex=pool_id + "0" * 16))
    return pool_id


@pytest.mark.parametrize("planted", ["slots", "pool", "pool_file", "pool_dir"])
def test_a_link_planted_at_a_pool_path_is_refused_not_written_through(tmp_path, monkeypatch, planted):
    from specforge_kimi.transport.writer import IpcCaptureWriter

    pool_id = _fixed_pool_id(monkeypatch)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    ipc = tmp_path / "ipc"
    link = {
        "slots": slots_path(pool_id),
        "pool": shm_pool_path(pool_id),
        "pool_file": ipc / f"{pool_id}.json",
        "pool_dir": ipc,
    }[planted]
    if planted == "pool_file":
        ipc.mkdir(mode=0o700)
    if planted == "pool_dir":
        (tmp_path / "elsewhere").mkdir()
        link.symlink_to(tmp_path / "elsewhere")
    else:
        link.symlink_to(victim)
    try:
        with pytest.raises(OSError, match="refus") as err:
            IpcCaptureWriter(pool_bytes=1 << 16, pool_dir=ipc, device="cpu", max_slots=4)
        assert str(link) in str(err.value) and "\n" not in str(err.value)
        assert victim.read_bytes() == b"precious" and os.path.islink(link)
        assert not list((tmp_path / "elsewhere").iterdir()) if planted == "pool_dir" else True
        # nothing the refused writer made is left behind
        left = [p for p in (slots_path(pool_id), shm_pool_path(pool_id)) if p != link and os.path.lexists(p)]
        assert left == []
        assert [p.name for p in ipc.glob("*")] == ([f"{pool_id}.json"] if planted == "pool_file" else [])
    finally:
        if link != ipc:
            os.unlink(link)


def test_stale_cleanup_removes_only_its_own_names(tmp_path):
    """A pool file of a dead writer names paths; cleanup removes the names it derives from the pool id, never
    those paths, and ignores files whose name is not a pool id."""
    from specforge_kimi.transport.pool import remove_stale

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    ipc = tmp_path / "ipc"
    ipc.mkdir(mode=0o700)
    victims = [tmp_path / "victim-a", tmp_path / "victim-b", tmp_path / "victim-c"]
    for v in victims:
        v.write_text("precious")
    pool_id = "fedcba9876543210"
    own = [slots_path(pool_id), shm_pool_path(pool_id)]
    for p in own:
        p.write_bytes(b"\0")
    forged = {
        "version": 1,
        "pool_id": pool_id,
        "backend": "shm",
        "nbytes": 1,
        "slots_path": str(victims[0]),
        "pid": dead_pid,
        "pid_start": None,
        "lease_s": 1.0,
        "created": 0.0,
        "device": {},
        "handle": {"path": str(victims[1])},
    }
    (ipc / f"{pool_id}.json").write_text(json.dumps(forged))
    # not a pool id (the writer makes 16 hex digits): kept, and what it names untouched
    (ipc / "victim-c.json").write_text(json.dumps({**forged, "pool_id": "victim-c", "slots_path": str(victims[2])}))
    (ipc / "0123.json").write_text(json.dumps({**forged, "pool_id": "0123", "slots_path": str(victims[2])}))
    try:
        assert remove_stale(ipc) == [pool_id]
        assert all(v.read_text() == "precious" for v in victims)
        assert not any(os.path.lexists(p) for p in own) and not (ipc / f"{pool_id}.json").exists()
        assert sorted(p.name for p in ipc.iterdir()) == ["0123.json", "victim-c.json"]
    finally:
        for p in own:
            p.unlink(missing_ok=True)


# -- descriptors the slot table does not back (issue 31) -----------------------------------------------------------
def test_a_descriptor_outside_its_slots_region_is_refused(writer):
    """A descriptor whose offsets point into another sample's bytes (or past the pool) is refused with the
    region the slot lent, not answered with those bytes."""
    a, b = _put(writer, [(_spec("run:a", 5), _rows(5, 0)), (_spec("run:b", 5), _rows(5, 1))])
    store = _store(writer)
    desc = a["cuda_ipc"]
    b_off = b["cuda_ipc"]["features"]["hidden_state"][0]
    n = desc["features"]["hidden_state"][1]
    ref = _ref_for(a)
    for place in ([b_off, n], [writer.regions.capacity - 256, n], [writer.regions.capacity, n]):
        bad = {**desc, "features": {**desc["features"], "hidden_state": place}}
        wrong = dataclasses_replace(ref, bad)
        with pytest.raises(ValueError, match="outside the region the slot lent"):
            store.get(wrong)
    off, n = desc["features"]["target"]
    for place, match in (([off + 1, n], "aligned"), ([off, n - 2], "needs"), ([off, n + 2], "needs")):
        # inside the region, but mid-element or not the spec's size (found by the fuzz: a RuntimeError from torch)
        bad = {**desc, "features": {**desc["features"], "target": place}}
        with pytest.raises(ValueError, match=match):
            store.get(dataclasses_replace(ref, bad))
    bad_slot = dataclasses_replace(ref, {**desc, "slot": writer.table.max_slots + 1})
    with pytest.raises(ValueError, match="outside pool"):
        store.get(bad_slot)
    # the honest descriptor still reads its own bytes
    assert torch.equal(store.get(ref)[0]["hidden_state"][0], _rows(5, 0)[0])


def dataclasses_replace(ref, desc_json):
    import dataclasses

    return dataclasses.replace(ref, metadata={**ref.metadata, "cuda_ipc": desc_json})


@pytest.mark.parametrize(
    "place",
    [[-1, 8], [0, -8], [True, 8], [0, 1.5], [2**63, 8], [0, 2**64], [2**61, 2**61], ["0", 8], [None, 8], [0, 8, 0]],
)
def test_descriptor_offsets_must_be_sane_integers(place):
    d = Descriptor("0123abcd0123abcd", 3, 41, {"hidden_state": (0, 96)}).to_json()
    with pytest.raises(ValueError, match="offset, nbytes"):
        Descriptor.from_json({**d, "features": {"hidden_state": place}})
    for field, value in (("slot", True), ("alloc", 2**64), ("slot", -3), ("pool", "0123abcd0123abcd\n")):
        with pytest.raises(ValueError):
            Descriptor.from_json({**d, field: value})


# -- release by key against a slot reused under it (issue 31) --------------------------------------------------------
def test_release_by_key_never_frees_a_slots_new_occupant(tmp_path):
    """The server frees a row and lends it to another sample at any point of a reader's by-key release -- before
    each read of the table :meth:`SlotTable.find` makes, or between ``find`` and ``release``: the release reaches
    the old occupant or nothing. It never names the new occupant's alloc id (``find``'s two reads of the alloc
    column around the key), never writes a release into the new row and never reports success
    (``release``'s alloc check)."""
    import numpy as np

    state = {"n": 0, "at": None, "fired": False}

    def reuse():
        server.free(1)
        server.claim(alloc_id=2, key=sample_key("run:new"), offset=0, nbytes=8, t_ns=2)
        state["fired"] = True

    class Hooked(np.ndarray):
        def __getitem__(self, idx):
            state["n"] += 1
            if state["n"] == state["at"]:
                reuse()
            return super().__getitem__(idx)

    def by_key(at):
        path = tmp_path / f"t{at}.slots"
        nonlocal server
        server = SlotTable.create(path, max_slots=1, capacity=4096)
        server.claim(alloc_id=1, key=sample_key("run:old"), offset=0, nbytes=8, t_ns=1)
        reader = SlotTable.attach(path)
        reader._a = reader._a.view(Hooked)
        state.update(n=0, at=at, fired=False)
        found = reader.find(sample_key("run:old"))
        if at == "between":
            reuse()
        return found, [reader.release(slot, alloc_id) for slot, alloc_id in found]

    server = None
    assert by_key(None) == ([(1, 1)], [True]) and server.released() == [1]  # no reuse: the old occupant goes
    reads = state["n"]  # the reads of the table a by-key release makes (find's four, release's check)
    assert reads >= 5
    for at in [*range(1, reads + 1), "between"]:
        found, released = by_key(at)
        assert state["fired"]
        assert (1, 2) not in found, f"find named the new occupant (reuse before read {at})"
        assert True not in released, f"release reported success on a reused row (reuse at {at})"
        assert server.row(1)["release"] == 0 and server.released() == [], f"new row released (reuse at {at})"


# -- the store's record of freed samples stays bounded (issue 31) -----------------------------------------------------
def test_freed_record_is_bounded_and_still_refuses_recent_use_after_free(writer):
    store = _store(writer, retain_on_release=True)
    store.FREED_KEPT = 16
    for i in range(200):
        (res,) = _put(writer, [(_spec(f"run:s{i}", 3), _rows(3, i))])
        _, handle = store.get(_ref_for(res))
        store.release(handle)
        store.abort(f"run:s{i}", reason="ack")
        assert len(store._freed) <= store.FREED_KEPT
        if i % 2:  # the server reclaims some of them only later
            writer.reclaim()
    # a recent release whose slot the server has not freed yet: the record is what refuses a late read
    (res,) = _put(writer, [(_spec("run:late", 3), _rows(3, 999))])
    ref = _ref_for(res)
    store.get(ref)
    store.abort("run:late", reason="ack")
    assert writer.table.current(res["cuda_ipc"]["slot"]) == res["cuda_ipc"]["alloc"]  # still lent
    with pytest.raises(KeyError, match="use-after-free"):
        store.get(ref)
    assert len(store._freed) == store.FREED_KEPT
