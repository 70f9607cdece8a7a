"""One process's status line from Linux ``/proc``: the single parser of ``/proc/<pid>/stat`` that the run guard, the
service supervisor and the cuda_ipc pool's liveness check share.

Scope: Linux ``/proc`` on this node; a process that is gone, or a file that cannot be read, reads as no fields.
The command name (field 2) may hold spaces and parentheses, so the fields are split after its last ``)``.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["stat_fields"]


def stat_fields(pid: int, proc: Path = Path("/proc")) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name -- state first (index 0), then the parent's pid (1),
    the process group (2), ..., the start time in clock ticks (19); empty when there is no such process."""
    try:
        stat = (proc / str(pid) / "stat").read_bytes().decode(errors="replace")
    except OSError:
        return []
    return stat[stat.rindex(")") + 2 :].split() if ")" in stat else []
