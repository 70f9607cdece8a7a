"""The text-only capture server: argv = SpecForge managed_local's, K2.5 forced text-only, lazy imports."""

import json
import os
import subprocess
import sys

import pytest

from specforge_kimi.servers import capture_server as cs


def test_import_does_not_pull_sglang_or_specforge():
    code = (
        "import sys, specforge_kimi.capture_server;"
        "print(','.join(m for m in ('sglang','specforge','torch','mooncake','transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def _specforge_managed_local(monkeypatch, tmp_path, *, tp, port, ids, mem=0.4, backend="triton", max_length=2048):
    """The capture-server and Mooncake services SpecForge 0.2.0's own launcher builds."""
    import specforge.launch_plan as launch_plan
    import specforge.training.capture_contract as capture_contract
    from specforge.config import Config

    # The contract normally comes from the target + draft configs; only its method/ids matter here.
    monkeypatch.setattr(
        capture_contract,
        "resolve_server_capture_contract",
        lambda cfg, algorithm: capture_contract.ServerCaptureContract(
            method="eagle3",
            aux_layer_ids=tuple(ids),
            target_hidden_size=64,
            target_vocab_size=163840,
            draft_vocab_size=32000,
        ),
    )
    cfg = Config.model_validate(
        {
            "model": {
                "target_model_path": "/ckpt/k25",
                "sglang_attention_backend": backend,
                "sglang_mem_fraction_static": mem,
            },
            "data": {"prompts_path": str(tmp_path / "p.jsonl"), "max_length": max_length},
            "deployment": {
                "mode": "disaggregated",
                "trainer": {"nproc_per_node": 1},
                "disaggregated": {
                    "control_dir": str(tmp_path / "ctl"),
                    "backend": "mooncake",
                    "managed_local": {
                        "trainer_cuda_visible_devices": [str(tp)],
                        "mooncake": {
                            "rpc_port": 41001,
                            "metadata_port": 41002,
                            "metrics_port": 41003,
                            "global_segment_size_bytes": 4 << 30,
                        },
                        "capture_servers": [
                            {"port": port, "tp_size": tp, "cuda_visible_devices": [str(i) for i in range(tp)]}
                        ],
                    },
                },
            },
        }
    )
    mooncake_svc, server_svc = launch_plan._managed_local_services(cfg, algorithm=None)
    return cfg, mooncake_svc.command, server_svc.command


@pytest.mark.parametrize("tp", [1, 2])
def test_argv_is_specforge_managed_local_argv(monkeypatch, tmp_path, tp):
    cfg, _, theirs = _specforge_managed_local(monkeypatch, tmp_path, tp=tp, port=30123, ids=[1, 3, 4])
    ours = cs.capture_server_argv(
        "/ckpt/k25", tp=tp, port=30123, aux_specforge_ids=[1, 3, 4], fusion=False, context_length=2048 + 7
    )
    theirs = list(theirs.argv)
    assert theirs[1:3] == ["-m", "sglang.launch_server"]
    assert ours[1:3] == ["-m", "specforge_kimi.capture_server"]
    # same flags in the same order; ours only appends
    assert ours[3 : len(theirs)] == theirs[3:]
    assert ours[len(theirs) :] == ["--disable-cuda-graph", "--enforce-disable-flashinfer-allreduce-fusion"]
    for needed in ("--enable-spec-capture", "--skip-tokenizer-init", "--disable-radix-cache"):
        assert needed in ours
    i = ours.index("--spec-capture-aux-layer-ids")
    assert ours[i + 1 : i + 4] == ["1", "3", "4"] and ours[i - 1] == "eagle3"
    assert ours[ours.index("--chunked-prefill-size") + 1] == "-1"


def test_env_is_specforge_service_env(monkeypatch, tmp_path):
    cfg, _, theirs = _specforge_managed_local(monkeypatch, tmp_path, tp=2, port=30123, ids=[1, 3, 4])
    mc = cfg.deployment.disaggregated.managed_local.mooncake
    ours = cs.capture_server_env(mc, cuda_visible_devices=[0, 1])
    expected = {k: v for k, v in theirs.env.items() if k != "DISAGG_SERVER_URLS"}
    assert {k: ours[k] for k in expected} == expected
    assert ours["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert ours["MOONCAKE_GLOBAL_SEGMENT_SIZE"] == str(4 << 30)
    # multicast stays off in anything we start
    assert ours["NCCL_NVLS_ENABLE"] == "0" and ours["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert "SGLANG_SPEC_CAPTURE_PUT_CLIENTS" not in ours  # one put client: the sink as SpecForge ships it
    split = cs.capture_server_env(mc, put_clients=4)
    assert split["SGLANG_SPEC_CAPTURE_PUT_CLIENTS"] == "4"
    assert split["MOONCAKE_GLOBAL_SEGMENT_SIZE"] == str(4 << 30)  # the sink splits it, the budget stays
    with pytest.raises(ValueError, match="put_clients"):
        cs.capture_server_env(mc, put_clients=0)


def test_mooncake_master_and_reader_match_specforge(monkeypatch, tmp_path):
    cfg, master, _ = _specforge_managed_local(monkeypatch, tmp_path, tp=1, port=30123, ids=[1, 3, 4])
    mc = cfg.deployment.disaggregated.managed_local.mooncake
    ours = cs.mooncake_master_argv(mc, python="/py")
    assert ours[:3] == ["/py", "-c", "from mooncake.cli import main; main()"]
    # SpecForge's master plus the two bind flags it leaves at Mooncake's 0.0.0.0 (docs/online.md, loopback)
    binds = ["--rpc_address=127.0.0.1", "--metrics_host=127.0.0.1"]
    assert master.argv[0] == "mooncake_master" and [a for a in ours[3:] if a not in binds] == list(master.argv[1:])
    assert set(binds) <= set(ours) and "--http_metadata_server_host=127.0.0.1" in ours
    kw = cs.mooncake_reader_setup_kwargs(mc)
    env = cs.mooncake_client_env(mc)
    assert kw["metadata_server"] == env["MOONCAKE_METADATA_SERVER"]
    assert kw["master_server_addr"] == env["MOONCAKE_MASTER_SERVER_ADDR"]
    assert kw["global_segment_size"] == 0  # readers own no segment: the server holds the features


def test_fusion_switch():
    on = cs.capture_server_argv("/m", tp=2, port=1, aux_specforge_ids=[1, 3, 4], fusion=True)
    off = cs.capture_server_argv("/m", tp=2, port=1, aux_specforge_ids=[1, 3, 4], fusion=False)
    assert "--enforce-disable-flashinfer-allreduce-fusion" in off and "--flashinfer-allreduce-fusion-backend" not in off
    assert "--enforce-disable-flashinfer-allreduce-fusion" not in on
    assert on[on.index("--flashinfer-allreduce-fusion-backend") + 1] == "trtllm"  # never mnnvl (multicast)


def test_knobs_and_validation():
    argv = cs.capture_server_argv(
        "/m",
        tp=1,
        port=9,
        aux_specforge_ids=[2, 30, 58],
        fusion=False,
        attention_backend="flashinfer",
        mem_fraction_static=0.7,
        disable_cuda_graph=False,
        extra=["--log-level", "debug"],
        python="/py",
    )
    assert argv[0] == "/py" and "--disable-cuda-graph" not in argv and "--context-length" not in argv
    assert argv[argv.index("--attention-backend") + 1] == "flashinfer"
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.7"
    assert argv[-2:] == ["--log-level", "debug"]
    with pytest.raises(ValueError):
        cs.capture_server_argv("/m", tp=0, port=9, aux_specforge_ids=[1], fusion=False)
    with pytest.raises(ValueError):
        cs.capture_server_argv("/m", tp=1, port=9, aux_specforge_ids=[], fusion=False)


def test_expert_and_attention_data_parallel_go_through_specforges_fields():
    plain = cs.capture_server_argv("/m", tp=8, port=9, aux_specforge_ids=[1, 3, 4], fusion=False)
    assert plain[plain.index("--ep-size") + 1] == "1"
    assert "--enable-dp-attention" not in plain and "--dp-size" not in plain
    ep = cs.capture_server_argv("/m", tp=8, port=9, aux_specforge_ids=[1, 3, 4], fusion=False, ep_size=8)
    assert ep[ep.index("--ep-size") + 1] == "8" and ep.count("--ep-size") == 1
    dp = cs.capture_server_argv("/m", tp=8, port=9, aux_specforge_ids=[1, 3, 4], fusion=False, dp_attention_size=8)
    assert "--enable-dp-attention" in dp and dp[dp.index("--dp-size") + 1] == "8"
    i = dp.index("--dp-size")
    assert [a for a in dp[:i] + dp[i + 2 :] if a != "--enable-dp-attention"] == plain  # adds only those flags
    one = cs.capture_server_argv("/m", tp=8, port=9, aux_specforge_ids=[1, 3, 4], fusion=False, dp_attention_size=1)
    assert one == plain  # one DP group is no DP attention
    for bad in ({"ep_size": 3}, {"ep_size": 0}, {"dp_attention_size": 16}):
        with pytest.raises(ValueError, match="divisor of tp=8"):
            cs.capture_server_argv("/m", tp=8, port=9, aux_specforge_ids=[1], fusion=False, **bad)


def test_detects_k25_checkpoints(tiny_dir, tmp_path):
    assert cs.is_kimi_k25_checkpoint(tiny_dir)
    plain = tmp_path / "dsv3"
    plain.mkdir()
    (plain / "config.json").write_text(
        json.dumps({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]})
    )
    assert not cs.is_kimi_k25_checkpoint(plain)
    assert not cs.is_kimi_k25_checkpoint("moonshotai/Kimi-K2.5")  # hub ids: not a local dir
    assert not cs.is_kimi_k25_checkpoint(None)


def _sglang_argv_without_spec_flags(model_dir, **kw):
    """Our argv minus the spec-capture flags, which only a patched sglang parses."""
    kw = {"tp": 1, **kw}
    argv = cs.capture_server_argv(model_dir, port=30000, aux_specforge_ids=[1, 3, 4], fusion=False, **kw)[3:]
    if not cs.spec_capture_supported():
        i = argv.index("--enable-spec-capture")
        argv = argv[:i] + argv[i + 7 :]
    return argv


@pytest.mark.slow
def test_sglang_parser_forces_text_only(tiny_dir, tmp_path, capsys):
    ns = cs.parse_text_only_args(_sglang_argv_without_spec_flags(tiny_dir))
    assert ns.enable_multimodal is False
    assert "set enable_multimodal=False" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="text-only"):
        cs.parse_text_only_args(_sglang_argv_without_spec_flags(tiny_dir) + ["--enable-multimodal"])
    # another checkpoint type is left to SGLang's own default (None)
    plain = tmp_path / "dsv3"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    argv = _sglang_argv_without_spec_flags(tiny_dir)
    argv[argv.index("--model-path") + 1] = str(plain)
    assert cs.parse_text_only_args(argv).enable_multimodal is None


@pytest.mark.slow
def test_server_args_model_config_is_text_only(tiny_dir):
    """``ServerArgs.__post_init__`` caches a ModelConfig; it must already see the text-only choice
    (CPU device so that no GPU is needed to build the arguments)."""
    args = cs.prepare_text_only_server_args(_sglang_argv_without_spec_flags(tiny_dir) + ["--device", "cpu"])
    assert args.enable_multimodal is False
    assert args.get_model_config().is_multimodal is False
    assert args.flashinfer_allreduce_fusion_backend is None


@pytest.mark.slow
def test_sglang_parses_the_tp8_layouts(tiny_dir):
    """The TP=8 parity layouts (expert parallel 8; attention data parallel 8) are flags SGLang 0.5.14's own
    parser takes as meant."""
    ep = cs.parse_text_only_args(_sglang_argv_without_spec_flags(tiny_dir, tp=8, ep_size=8))
    assert (ep.tp_size, ep.ep_size, ep.enable_dp_attention) == (8, 8, False)
    dp = cs.parse_text_only_args(_sglang_argv_without_spec_flags(tiny_dir, tp=8, dp_attention_size=8))
    assert (dp.tp_size, dp.dp_size, dp.enable_dp_attention, dp.ep_size) == (8, 8, True, 1)


@pytest.mark.slow
def test_deterministic_inference_is_accepted_for_the_tiny_target(tiny_dir):
    """``REGEN_DETERMINISTIC=1`` (scripts/gpu_online_run.sh's default) adds ``--enable-deterministic-inference`` to a server
    of this checkpoint with triton attention; SGLang 0.5.14's own argument handling takes it (and switches
    sampling to pytorch) rather than refusing the backend."""
    args = cs.prepare_text_only_server_args(
        _sglang_argv_without_spec_flags(tiny_dir) + ["--device", "cpu", "--enable-deterministic-inference"]
    )
    assert args.enable_deterministic_inference is True
    assert args.attention_backend == "triton" and args.sampling_backend == "pytorch"


# -- the server's distributed init listens on loopback only (issue 43) ----------------------------------------------
SERVER_DIST_INIT = r"""
import json, os, socket, sys, types
import sglang.launch_server
from specforge_kimi.servers import capture_server as cs

cs.prepare_text_only_server_args = lambda argv: types.SimpleNamespace(nnodes=1, dist_init_addr=None)


def listeners():
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            mine.add(link[8:-1])
    found = []
    for family, path in ((socket.AF_INET, "/proc/net/tcp"), (socket.AF_INET6, "/proc/net/tcp6")):
        for line in open(path).read().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in mine:
                raw = bytes.fromhex(f[1].split(":")[0])
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.append(socket.inet_ntop(family, raw))
    return found


def run_server(args):  # what SGLang's ModelRunner.init_torch_distributed does, with gloo on the CPU
    import torch.distributed as dist
    from sglang.srt.distributed.parallel_state import init_distributed_environment
    from sglang.srt.environ import envs

    method = envs.SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE.get() or f"tcp://127.0.0.1:{sys.argv[1]}"
    init_distributed_environment(
        backend="gloo", world_size=1, rank=0, local_rank=0, distributed_init_method=method, timeout=60
    )
    dist.new_group([0], backend="gloo")  # SGLang's CPU groups
    store = method[len("file://"):].rsplit("/", 1)[0] if method.startswith("file://") else None
    mode = oct(os.stat(store).st_mode & 0o777) if store else None
    print(json.dumps({"method": method, "store_mode": mode, "listeners": listeners(),
                      "ifnames": [os.environ.get("GLOO_SOCKET_IFNAME"), os.environ.get("NCCL_SOCKET_IFNAME")]}))
    dist.destroy_process_group()


sglang.launch_server.run_server = run_server
cs.main([])
"""


def test_the_servers_distributed_init_listens_on_loopback_only(tmp_path):
    """The capture server's entry point (``main``) sets SGLang's distributed-init override for a single node, so
    the rendezvous SGLang's model runner makes (here through SGLang's own ``init_distributed_environment``, on gloo
    as on the CPU) opens no TCPStore -- torch's would listen on every address -- and gloo's listeners are on
    loopback; the store's directory is private and gone after the server."""
    import ipaddress

    from specforge_kimi.run.services import free_ports

    pytest.importorskip("sglang")
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    env.pop(cs.DIST_INIT_OVERRIDE_ENV, None)
    env["TMPDIR"] = str(tmp_path)
    (port,) = free_ports(1)
    res = subprocess.run(
        [sys.executable, "-c", SERVER_DIST_INIT, str(port)], env=env, capture_output=True, text=True, timeout=240
    )
    assert res.returncode == 0, res.stderr[-3000:]
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    assert seen["method"].startswith("file://") and seen["store_mode"] == "0o700", seen
    assert seen["listeners"] and all(ipaddress.ip_address(a).is_loopback for a in seen["listeners"]), seen
    assert seen["ifnames"] == ["lo", "lo"]
    assert not list(tmp_path.glob("sfk-dist-*"))  # removed when the server ends


def test_loopback_env_only_for_a_single_node(tmp_path):
    import types

    one = cs.loopback_env(types.SimpleNamespace(nnodes=1, dist_init_addr=None), tmp_path)
    assert one == {
        cs.DIST_INIT_OVERRIDE_ENV: f"file://{tmp_path.resolve()}/dist-store",
        "GLOO_SOCKET_IFNAME": "lo",
        "NCCL_SOCKET_IFNAME": "lo",
    }
    assert cs.loopback_env(types.SimpleNamespace(nnodes=2, dist_init_addr="10.0.0.1:5000"), tmp_path) == {}
    assert cs.loopback_env(types.SimpleNamespace(nnodes=1, dist_init_addr="10.0.0.1:5000"), tmp_path) == {}
