"""pytest plugin for a subprocess run of SpecForge's own tests (``tests/integration/test_register_invisible.py``).

Records every test report (setup, call, teardown; subtests by their parameters) and every collection
error as JSON lines in ``$SPECFORGE_KIMI_SUITE_OUT``; with ``SPECFORGE_KIMI_SUITE_REGISTER=1`` it calls
``specforge_kimi.register()`` before collection, as every SpecForge process of a run does through
``SPECFORGE_PLUGINS``, and records that the registration is in place.
"""

from __future__ import annotations

import json
import os


def _write(row: dict) -> None:
    with open(os.environ["SPECFORGE_KIMI_SUITE_OUT"], "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def pytest_configure(config):
    if os.environ.get("SPECFORGE_KIMI_SUITE_REGISTER") != "1":
        return
    import specforge_kimi

    specforge_kimi.register()
    from specforge.modeling.target.target_utils import TargetEmbeddingsAndHead
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    _write(
        {
            "registered": "kimi_k25" in CONFIG_MAPPING._extra_content,
            "wrapped": getattr(TargetEmbeddingsAndHead._load_weights, "__specforge_kimi_wrapped__", False),
        }
    )


def pytest_collectreport(report):
    if report.failed:
        _write({"id": report.nodeid, "sub": "", "when": "collect", "outcome": "failed"})


def pytest_runtest_logreport(report):
    context = getattr(report, "context", None)  # a subtest's report
    sub = f"{context.msg or ''} {sorted(context.kwargs.items())}" if context is not None else ""
    _write({"id": report.nodeid, "sub": sub, "when": report.when, "outcome": report.outcome})
