"""The online GPU tests' check (d) reads ``gpu_after.csv`` for any number of GPUs (CPU: text only)."""

from __future__ import annotations

from gpu_checks import gpu_leftovers


def _leftovers():
    return gpu_leftovers


def test_clean_eight_gpu_box():
    text = "pid, used_memory [MiB]\nindex, memory.used [MiB]\n" + "".join(f"{i}, 0 MiB\n" for i in range(8))
    assert _leftovers()(text) == ([], [], 8)


def test_memory_held_on_a_high_index_and_a_process_left():
    text = "pid, used_memory [MiB]\n4242, 1200 MiB\nindex, memory.used [MiB]\n" + "".join(
        f"{i}, {'1200' if i == 6 else '0'} MiB\n" for i in range(8)
    )
    apps, held, gpus = _leftovers()(text)
    assert apps == ["4242, 1200 MiB"] and held == ["6, 1200 MiB"] and gpus == 8


def test_no_gpu_section_is_not_clean():
    assert _leftovers()("pid, used_memory [MiB]\n")[2] == 0
