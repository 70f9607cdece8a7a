"""The package's source files by dotted module name, for tests that read ``src/specforge_kimi`` as text or AST.

Import it as ``from package_modules import PKG, modules`` (``tests/`` is on ``sys.path`` through its conftest).
"""

from __future__ import annotations

from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "specforge_kimi"


def modules() -> dict[str, Path]:
    """``{"run.services": .../run/services.py, ...}``; a package's ``__init__`` is the package's name, the
    top-level ``__init__`` is ``""``."""
    mods = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods
