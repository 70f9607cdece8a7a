"""The console: bars on a terminal, plain lines elsewhere, other output sent to a log, known notices silenced."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import textwrap
import warnings

from specforge_kimi import console


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_when_not_a_terminal():
    stream = io.StringIO()
    bar = console.Progress("[5/6] train", 300, unit="step", stream=stream, interval_s=1e9)
    for i in range(300):
        bar.update(1, loss=f"{3 - i / 100:.3f}")
    bar.close()
    text = stream.getvalue()
    lines = text.splitlines()
    assert "\r" not in text
    # the first update, one per quarter (25/50/75 %), the end
    assert len(lines) == 5, lines
    assert lines[0].startswith("[5/6] train: 1/300 step (0%), loss 3.000")
    assert lines[2].startswith("[5/6] train: 150/300 step (50%)")
    assert lines[-1].startswith("[5/6] train: done, 300/300 step (100%), loss 0.010")


def test_plain_lines_also_by_time():
    stream = io.StringIO()
    bar = console.Progress("capture", 1000, stream=stream, interval_s=0.0)
    for _ in range(10):
        bar.update(1)
    bar.close()
    assert len(stream.getvalue().splitlines()) == 11  # every update is due when the interval is 0


def test_a_bar_on_a_terminal_sized_to_its_total():
    stream = _Tty()
    with console.Progress("[3/6] capture", 448, stream=stream) as bar:
        bar.update(16)
        bar.update(432, rows="all")
    text = stream.getvalue()
    assert "\r" in text and "448/448" in text and "rows all" in text
    assert "done" not in text  # the bar itself is the record


def test_disabled_writes_nothing():
    stream = io.StringIO()
    bar = console.Progress("x", 10, stream=stream, enabled=False)
    bar.update(10)
    bar.close()
    assert stream.getvalue() == ""


def test_output_to_log_keeps_the_console(tmp_path, capfd):
    log = tmp_path / "logs" / "run.log"
    seen = []
    handler = logging.StreamHandler(sys.stderr)  # bound to the stream before the block, as libraries do
    logger = logging.getLogger("specforge_kimi.test_console")
    logger.addHandler(handler)
    try:
        with console.output_to_log(log, on_line=seen.append):
            print("step 1: {'loss': 2.5}")
            print("step 2: {'loss': 2.4}", flush=True)
            os.write(2, b"written to fd 2\n")
            subprocess.run([sys.executable, "-c", "print('from a child')"], check=True)
            console.say("[5/6] training")
            print("to stderr", file=sys.stderr)
    finally:
        logger.removeHandler(handler)
    cap = capfd.readouterr()
    text = log.read_text()
    for line in ("step 1: {'loss': 2.5}", "written to fd 2", "from a child", "to stderr", "[5/6] training"):
        assert line in text, (line, text)
    assert seen == ["step 1: {'loss': 2.5}", "step 2: {'loss': 2.4}"]
    assert "[5/6] training" in cap.out
    assert "step 1" not in cap.out + cap.err and "from a child" not in cap.out + cap.err
    print("after")  # restored
    assert "after" in capfd.readouterr().out


def test_output_to_log_with_real_descriptors(tmp_path):
    """A process whose stdout/stderr are the real descriptors (a pipe here, a terminal for users):
    the console keeps a copy of them, everything else goes to the log."""
    script = textwrap.dedent(
        f"""
        import sys
        from specforge_kimi import console
        with console.output_to_log({str(tmp_path / "x.log")!r}):
            print("noise")
            console.say("kept")
            print("bar", file=console.err())
        print("back")
        """
    )
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert res.stdout.splitlines() == ["kept", "back"]
    assert res.stderr == "bar\n"
    assert (tmp_path / "x.log").read_text().splitlines() == ["noise", "kept"]


def test_quiet_known_notices(caplog):
    console.quiet_known_notices()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("default")
        console.quiet_known_notices()  # after simplefilter, as a caller's own filters may come first
        warnings.warn("flash_attn is not found, falling back to flex_attention.", UserWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)
    assert [str(w.message) for w in got] == ["something else"]
    with caplog.at_level(logging.WARNING, logger="torch.utils.cpp_extension"):
        logging.getLogger("torch.utils.cpp_extension").warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/x")
        logging.getLogger("torch.utils.cpp_extension").warning("a real problem")
    assert [r.getMessage() for r in caplog.records] == ["a real problem"]
