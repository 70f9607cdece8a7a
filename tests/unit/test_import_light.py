"""Importing specforge_kimi must not pull in sglang, mooncake, specforge, torch or CUDA code."""

import subprocess
import sys


def test_import_is_light():
    code = (
        "import sys, specforge_kimi, specforge_kimi.cli, specforge_kimi.targets.layer_ids, specforge_kimi.errors;"
        "heavy=[m for m in ('sglang','mooncake','specforge','torch','transformers','triton') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"heavy modules imported: {out.stdout}"


def test_help_is_fast_and_light():
    out = subprocess.run([sys.executable, "-m", "specforge_kimi", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for cmd in ("tiny", "demo", "export-check"):
        assert cmd in out.stdout
