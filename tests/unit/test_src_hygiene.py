"""``src/`` holds no dates and names seams and patches by name, not number.

Dates and measured numbers belong in ``bench/REPORT.md`` and the run archive, which code points at; a seam is
``registration``'s name for it (``checkpoint-save``), a patch ``SGLang patch spec-capture-cuda-ipc`` (its file keeps
the order prefix: ``patches/sglang/0.5.14/0005-spec-capture-cuda-ipc.patch``).
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "specforge_kimi"
#: code outside the package that also names patches (its help texts and docstrings are messages too)
CODE = [ROOT / "bench", ROOT / "scripts"]

DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
NUMBERED = re.compile(
    r"\bseams? ?\d+\b"  # "seam 9", "seams 9-11"
    r"|\bpatch(?:es)? 0\d{3}\b"  # "patch 0005"
    r"|\b(?:SGLang|SpecForge|our|sglang|specforge) 0\d{3}\b"  # "SGLang 0005", "our 0002"
    r"|\b0\d{3}'s\b"  # "0004's compact forms"
    r"|patches/[\w./-]*/0\d{3}\b(?!-)",  # "patches/specforge/0.2.0/0002" without the name
    re.IGNORECASE,
)


def _text_files():
    for path in sorted(SRC.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            try:
                yield path, path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue


def _hits(pattern: re.Pattern) -> list[str]:
    return [
        f"{path.relative_to(SRC.parent)}:{n}: {line.strip()[:100]}"
        for path, text in _text_files()
        for n, line in enumerate(text.splitlines(), 1)
        if pattern.search(line)
    ]


def test_no_dates_in_src():
    assert list(_text_files()), SRC
    assert _hits(DATE) == []


def test_seams_and_patches_by_name_in_src():
    assert _hits(NUMBERED) == []


def test_seams_and_patches_by_name_in_bench_and_scripts():
    hits = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
        for root in CODE
        for path in sorted(root.rglob("*"))
        if path.suffix in (".py", ".sh")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if NUMBERED.search(line)
    ]
    assert hits == []


def test_the_patterns_catch_what_they_guard():
    for bad in (
        "from 2026-12-01 on",
        "registration seam 7",
        "seams 9-11",
        "needs SGLang patch 0005",
        "our SpecForge patches 0003 and",
        "SGLang 0005 applied",
        "0004's compact forms",
        "patches/specforge/0.2.0/0002)",
    ):
        assert DATE.search(bad) or NUMBERED.search(bad), bad
    for good in (
        "SGLang patch spec-capture-cuda-ipc",
        "patches/sglang/0.5.14/0005-spec-capture-cuda-ipc.patch",
        "mode 0600",
        "epoch{e:04d}-prompt{i:012d}",
        "the checkpoint-save seam",
    ):
        assert not (DATE.search(good) or NUMBERED.search(good)), good
