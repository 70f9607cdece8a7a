"""Every TCP listener a command's process tree opens while it runs, sampled from ``/proc``.

usage: ``python3 tests/listeners_during.py --out FILE.json [--interval S] -- CMD [ARG...]``

Runs CMD (its exit code becomes this script's), lists the LISTEN sockets (``/proc/net/tcp{,6}``) of CMD and every
descendant every ``--interval`` seconds (a listener that lives shorter than one interval can be missed: the interval
is in the JSON), and writes one JSON document: the command, the samples taken, and each distinct listener (address,
port, the process's command line, first and last seen) with its verdict: ``loopback`` (127.0.0.0/8, ::1) or
``all-or-external`` (0.0.0.0, ::, or an interface address). Used on the GPU box to list the sockets of a whole
co-located run (capture server, Mooncake master where the recipe has one, producer, trainer ranks).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path


def listening() -> dict[int, tuple[str, int]]:
    """socket inode -> (address, port) of every TCP socket in LISTEN state on this host."""
    rows = {}
    for family, path in ((socket.AF_INET, "/proc/net/tcp"), (socket.AF_INET6, "/proc/net/tcp6")):
        try:
            lines = Path(path).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 10 or f[3] != "0A":
                continue
            addr, port = f[1].split(":")
            raw = bytes.fromhex(addr)
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            rows[int(f[9])] = (socket.inet_ntop(family, raw), int(port, 16))
    return rows


def descendants(root: int) -> list[int]:
    """``root`` and every live process below it (by ``/proc/<pid>/stat``'s parent field)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        parent[int(entry)] = int(fields[1])
    tree, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        for child, par in parent.items():
            if par == p and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sorted(tree)


def verdict(address: str) -> str:
    ip = ipaddress.ip_address(address)
    if ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback):
        return "loopback"
    return "all-or-external"


def sample(root: int, seen: dict, now: float) -> None:
    sockets = listening()
    for pid in descendants(root):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        for link in links:
            if not link.startswith("socket:["):
                continue
            inode = int(link[8:-1])
            if inode not in sockets:
                continue
            address, port = sockets[inode]
            key = (address, port, cmd[:300])
            row = seen.setdefault(
                key,
                {
                    "address": address,
                    "port": port,
                    "pid": pid,
                    "command": cmd[:300],
                    "verdict": verdict(address),
                    "first_seen_s": now,
                },
            )
            row["last_seen_s"] = now


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("no command given after --")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd)
    seen: dict = {}
    samples = 0
    while proc.poll() is None:
        sample(proc.pid, seen, round(time.monotonic() - t0, 1))
        samples += 1
        time.sleep(args.interval)
    rows = sorted(seen.values(), key=lambda r: (r["verdict"], r["port"]))
    result = {
        "command": " ".join(cmd),
        "returncode": proc.returncode,
        "interval_s": args.interval,
        "samples": samples,
        "listeners": rows,
        "off_loopback": [r for r in rows if r["verdict"] != "loopback"],
        "host": socket.gethostname(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"listeners: {len(rows)} distinct, {len(result['off_loopback'])} off loopback -> {args.out}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
