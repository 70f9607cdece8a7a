"""Output directories a command owns and may replace: the demo's ``--out``, the CPU benches' ``--work``.

Scope: one rule, so a typo in ``--out`` never deletes someone's data. A directory is replaced
only when it is empty or carries the owner's marker file (written when the owner created it);
anything else is refused with :class:`KimiInputError`.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from specforge_kimi.errors import KimiInputError


def reset_owned_dir(path: Path, *, marker: str, kind: str, owner: str, flag: str) -> None:
    """Make ``path`` an empty directory marked as ``owner``'s (``kind``: what the error calls it,
    ``flag``: the option that chooses another path)."""
    if path.exists() and any(path.iterdir()):
        if not (path / marker).exists():
            raise KimiInputError(f"{path} exists, is not empty and is not a {kind} directory; choose {flag}")
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / marker).write_text(f"written by {owner}; safe to delete\n")
