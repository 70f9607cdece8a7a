"""torchrun with its rendezvous store on loopback, for single-node runs.

Scope: the TCPStore servers the torchrun agent starts (the c10d rendezvous store and the agent store the ranks
join). torch's TCPStore server listens on ``::`` (else ``0.0.0.0``) whatever host it is given
(``torch/csrc/distributed/c10d/TCPStoreLibUvBackend.cpp``, ``UvTcpServer::makeWithPort``); only a socket handed
over as ``master_listen_fd`` (``makeWithSocket``) decides its address, and torchrun has no option for that. So
``python -m specforge_kimi.servers.loopback torch.distributed.run ARGS`` runs torchrun unchanged except that a
TCPStore server whose host is a loopback address (or ``localhost``) gets a socket bound to that address.
A recipe renders it for single-node consumers with ``--standalone --local-addr=127.0.0.1`` (so the ranks are
told 127.0.0.1); multi-node consumers run plain torchrun on the recipe's ``master_addr``.
"""

from __future__ import annotations

import ipaddress
import runpy
import socket
import sys

TORCHRUN = "torch.distributed.run"


def is_loopback(host: str) -> bool:
    """``localhost`` or a literal loopback address (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listening_socket(host: str, port: int) -> int:
    """A listening TCP socket on loopback ``host``:``port`` (``localhost`` -> 127.0.0.1); returns its fd."""
    addr = "127.0.0.1" if host == "localhost" else host
    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock.detach()


def install() -> None:
    """Make every TCPStore server on a loopback host in this process listen on that host only."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    base = dist.TCPStore
    if getattr(base, "specforge_kimi_loopback", False):
        return

    class LoopbackTCPStore(base):
        specforge_kimi_loopback = True

        def __init__(self, host_name, port, world_size=None, is_master=False, *args, **kwargs):
            # positional after is_master: timeout, wait_for_workers, multi_tenant, master_listen_fd, use_libuv
            if is_master and is_loopback(host_name) and len(args) < 4 and kwargs.get("master_listen_fd") is None:
                kwargs["master_listen_fd"] = listening_socket(host_name, port)
            super().__init__(host_name, port, world_size, is_master, *args, **kwargs)

    dist.TCPStore = LoopbackTCPStore
    c10d_rendezvous_backend.TCPStore = LoopbackTCPStore
    static_tcp_rendezvous.TCPStore = LoopbackTCPStore


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != TORCHRUN:
        raise SystemExit(f"usage: python -m specforge_kimi.servers.loopback {TORCHRUN} [torchrun args]")
    install()
    sys.argv = [TORCHRUN, *argv[1:]]
    runpy.run_module(TORCHRUN, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
