"""torchrun's rendezvous store on loopback (``servers/loopback.py``) and the recipe's single-node consumer."""

from __future__ import annotations

import datetime
import socket
from pathlib import Path

import pytest


def _listen_address(port: int) -> set[str]:
    """Addresses a TCP socket of this host listens on at ``port`` (/proc/net/tcp{,6})."""
    out = set()
    for family, path in ((socket.AF_INET, "/proc/net/tcp"), (socket.AF_INET6, "/proc/net/tcp6")):
        for line in Path(path).read_text().splitlines()[1:]:
            f = line.split()
            addr, p = f[1].split(":")
            if f[3] == "0A" and int(p, 16) == port:
                raw = bytes.fromhex(addr)
                out.add(socket.inet_ntop(family, b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))))
    return out


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1"])
def test_tcpstore_server_listens_on_loopback_only(host, monkeypatch):
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    from specforge_kimi.servers import loopback

    for module in (dist, c10d_rendezvous_backend):  # install() rebinds these names; undo after the test
        monkeypatch.setattr(module, "TCPStore", module.TCPStore)
    loopback.install()
    loopback.install()  # idempotent
    store = c10d_rendezvous_backend.TCPStore(
        host, 0, is_master=True, multi_tenant=True, timeout=datetime.timedelta(seconds=10)
    )
    store.set("k", "v")
    client = dist.TCPStore("127.0.0.1", store.port, None, False, datetime.timedelta(seconds=10))
    assert client.get("k") == b"v" and store.port > 0
    assert _listen_address(store.port) == {"127.0.0.1"}  # torch alone: "::" (every address)


def test_not_loopback_is_left_to_torch():
    from specforge_kimi.servers.loopback import is_loopback

    assert is_loopback("localhost") and is_loopback("127.0.0.2") and is_loopback("::1")
    assert not is_loopback("10.0.0.1") and not is_loopback("node0")


def test_single_node_consumer_runs_through_loopback(tmp_path):
    import yaml

    from specforge_kimi.plan.recipes import Recipe
    from specforge_kimi.plan.run_plan import compile_plan

    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "recipes" / "tiny-k25-tp1-h200.yaml").read_text())
    raw["output_dir"] = str(tmp_path)
    sheet = compile_plan(Recipe.model_validate(raw), rendered_dir=tmp_path / "r").rendered()
    consumer = sheet["launch"]["consumer"]
    assert consumer[:7] == [
        "python",
        "-m",
        "specforge_kimi.servers.loopback",
        "torch.distributed.run",
        "--standalone",
        "--local-addr=127.0.0.1",
        consumer[6],
    ] and consumer[6].startswith("--nproc_per_node=")


@pytest.mark.parametrize(
    ("recipe", "loopback"),
    [("tiny-k25-tp1-h200.yaml", True), ("kimi-k25-8xb200-lowered.yaml", True), ("kimi-k25-2x8xb300.yaml", False)],
)
def test_single_node_processes_bind_gloo_and_nccl_to_loopback(recipe, loopback):
    """A single node's trainer ranks and producer get ``lo`` for gloo's and NCCL's socket listeners (NCCL's
    bootstrap and proxy listeners otherwise bind the host's first interface: seen on a GPU box as the trainer's
    listeners off loopback); a multi-node run's ranks must reach each other, so neither is set."""
    from specforge_kimi.plan.run_plan import compile_plan

    env = dict(compile_plan(Path(__file__).resolve().parents[2] / "recipes" / recipe).process_env)
    got = {k: env.get(k) for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    assert got == ({"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"} if loopback else dict.fromkeys(got))
