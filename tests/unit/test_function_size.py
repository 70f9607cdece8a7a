"""No function in src/ or bench/ over 100 lines: a longer one holds two ideas (docs/STYLE: split by idea)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
BENCH = REPO / "bench"  # the bench scripts: parse / measure / write, each under the limit
LIMIT = 100


def long_functions(root: Path, limit: int = LIMIT) -> list[str]:
    """``path:line name (N lines)`` for every function or method under ``root`` longer than ``limit`` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_in_src_over_100_lines():
    assert not long_functions(SRC), "split these by idea:\n" + "\n".join(long_functions(SRC))


def test_no_function_in_bench_over_100_lines():
    assert not long_functions(BENCH), "split these by idea:\n" + "\n".join(long_functions(BENCH))


def test_the_walk_finds_a_long_function_and_a_nested_one(tmp_path):
    body = "".join(f"        x{i} = {i}\n" for i in range(LIMIT))  # LIMIT lines, two levels in
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\nclass C:\n    def long(self):\n{body}")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "n.py").write_text(f"def outer():\n    def inner():\n{body}")
    assert long_functions(tmp_path) == [
        f"m.py:6 long ({LIMIT + 1} lines)",
        f"pkg/n.py:1 outer ({LIMIT + 2} lines)",
        f"pkg/n.py:2 inner ({LIMIT + 1} lines)",
    ]
