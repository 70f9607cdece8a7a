"""The CLI's command table: every command declared once and loaded lazily; a command whose module fails to
import is still listed and fails on its own with one line naming the module and the reason."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from specforge_kimi import cli


def test_every_declared_command_loads():
    names = [c.name for c in cli.COMMANDS]
    assert len(names) == len(set(names)), "each command declared once"
    for command in cli.COMMANDS:
        add_arguments, handler = command.load()
        assert callable(add_arguments) and callable(handler), command.name


def test_top_level_help_imports_no_command_module():
    modules = sorted({c.arguments.partition(":")[0] for c in cli.COMMANDS} - {"specforge_kimi.cli"})
    code = (
        "import sys; from specforge_kimi import cli\n"
        "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
        f"print('loaded:' + ','.join(m for m in {modules!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[-1] == "loaded:", out.stdout.splitlines()[-1]


def _break_import(monkeypatch, module: str, how: str) -> None:
    if how == "missing":  # what a missing dependency looks like: ImportError
        monkeypatch.setitem(sys.modules, module, None)
        return
    real = importlib.import_module

    def import_module(name, *args, **kwargs):
        if name == module:
            raise RuntimeError("broken at import\nsecond line of the reason")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(cli.importlib, "import_module", import_module)


@pytest.mark.parametrize("how", ["missing", "raises"])
def test_a_command_whose_module_fails_to_import_fails_loudly_alone(monkeypatch, capsys, how):
    _break_import(monkeypatch, "specforge_kimi.run.stop", how)

    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    assert "\n    stop " in capsys.readouterr().out, "--help still lists it"

    assert cli.main(["stop", "recipe.yaml"]) == 1
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and not captured.out, captured
    assert lines[0].startswith("specforge-kimi stop: cannot import specforge_kimi.run.stop: "), lines[0]
    assert ("broken at import" in lines[0]) if how == "raises" else ("specforge_kimi.run.stop" in lines[0][60:])

    assert cli.main(["stop", "--help"]) == 1  # its own help cannot be built either: the same line
    assert capsys.readouterr().err.splitlines() == lines

    assert cli.main(["layer-ids", "1,29,57"]) == 0, "another command still runs"
    assert "put [1, 29, 57]" in capsys.readouterr().out

    parser = cli.build_parser()  # the whole parser (every command's arguments) still builds
    args = parser.parse_args(["stop", "recipe.yaml"])
    assert args.func(args) == 1 and capsys.readouterr().err.splitlines() == lines
