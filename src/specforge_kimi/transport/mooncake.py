"""The ``mooncake`` strategy: SpecForge's own transport, GPU -> host -> Mooncake over TCP/RDMA -> host -> GPU, for
any topology.

The capture server's Mooncake segment (``mooncake.global_segment_gib``, or the segment keeper's) holds the
features in flight until acknowledged. SpecForge's default watermark counts refs only (256 high, 192 low), which at
K2.5 width and 4k-token samples exceeds the default segment, and a put into a full segment fails (``BatchPut ...
insufficient space``) and the producer's channel with it. So the producer gets a byte watermark at
:data:`~.strategy.WATERMARK_FRACTION` of the segment less its overshoot (SpecForge hard-pins every object it puts,
so Mooncake cannot evict one), and a segment smaller than one optimizer window plus the overshoot is refused.
"""

from __future__ import annotations

import urllib.error
import urllib.request

from specforge_kimi.transport.strategy import FeatureSizing, Finding, store_refusal

#: What Mooncake's transfer engine logs for the listener it binds to every address (docs/online.md, loopback)
ANY_ADDRESS_LOG = "Transfer Engine RPC using new RPC mapping, listening on <address>:<port>"


class Mooncake:
    name = "mooncake"
    runs_mooncake_master = True
    sglang_patch = None

    def refusal(self, r, s: FeatureSizing) -> str | None:
        return store_refusal(f"mooncake.global_segment_gib {r.mooncake.global_segment_gib:g}", s.segment_bytes, s)

    def store_bytes(self, s: FeatureSizing) -> int:
        return s.segment_bytes

    def memory_terms(self, s: FeatureSizing) -> dict[str, int]:
        return {"pool": 0, "server_rows": 0, "prefetch": 0}  # features wait on the host

    def memory_report(self, s: FeatureSizing, writer_room_gib: float) -> dict[str, float]:
        return {}

    def server_env(self, r, s: FeatureSizing) -> dict[str, str]:
        return {}  # SpecForge's sink is the capture server's default

    def process_env(self, r) -> dict[str, str]:
        return {}  # SpecForge's Mooncake store is its processes' default

    def why_chosen(self, s: FeatureSizing) -> str | None:
        return None

    def preflight(self, gpus: str, patch_gaps: list[str]) -> list[str]:
        return []  # the launch checks the mooncake package with the master's service

    def doctor_findings(self, r, s: FeatureSizing, gpus: str, patch_gaps: list[str]) -> list[Finding]:
        return [master_finding(r.mooncake), listeners_finding(r.mooncake)]

    def remove_stale(self, output_dir: str) -> list[str]:
        return []  # the master's segment goes with its process


MOONCAKE = Mooncake()


def master_finding(mc) -> Finding:
    """Whether the recipe's Mooncake master answers on its metadata port (a warning when not: launch starts it)."""
    url = f"http://{mc.host}:{mc.metadata_port}/metadata?key=specforge-kimi-doctor"
    try:
        urllib.request.urlopen(url, timeout=3)
        ok = True
    except urllib.error.HTTPError as exc:
        ok = 400 <= exc.code < 500  # a missing-key answer means the metadata server is up
    except OSError:
        ok = False
    fix = (
        "started by `specforge-kimi launch`; to start by hand: mooncake_master "
        f"--enable_http_metadata_server=true --rpc_port={mc.rpc_port} --http_metadata_server_port={mc.metadata_port}"
    )
    return Finding(
        "mooncake master", "ok" if ok else "warn", f"{url} {'answers' if ok else 'is not reachable'}", "" if ok else fix
    )


def listeners_finding(mc) -> Finding:
    """The listeners no setting of Mooncake 0.3.x keeps on the recipe's address (always a warning)."""
    return Finding(
        "mooncake listeners",
        "warn",
        f"Mooncake binds these to every address, not {mc.host}: the master's HTTP metadata server (port "
        f"{mc.metadata_port}; its --http_metadata_server_host only reaches the log line) and, in the capture "
        "server, the producer and each trainer rank, the transfer engine's handshake RPC and TCP transport "
        f"(random ports, logged as '{ANY_ADDRESS_LOG}' and 'TcpTransport: listen on port <port>')",
        f"on a host others can reach, firewall port {mc.metadata_port} and the transfer engine's range "
        "(MC_MIN_RPC_PORT..MC_MAX_RPC_PORT, 15000-17000 by default) from outside; every other listener of the run "
        "is on loopback (docs/online.md, 'Ports and GPUs')",
    )
