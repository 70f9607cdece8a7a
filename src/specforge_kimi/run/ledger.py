"""SpecForge's consumer ledger of an online run: where it is, its durable step, what it recorded.

Scope: the SQLite/WAL ledger SpecForge 0.2.0's consumer rank 0 keeps (``consumer.sqlite``:
``committed`` = refs the consumer accepted, with their ``num_tokens``; ``acked`` = samples whose
optimizer step became durable; ``marker.global_step``). Read-only: SpecForge writes it.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from pathlib import Path


def ledger_db(run_dir: Path) -> Path:
    """The consumer ledger: ``<run_dir>/consumer-state/consumer.sqlite`` (the default, wherever the run
    directory now is), or the directory a recipe's ``trainer.consumer_state_dir`` named, as the run's
    rendered SpecForge config records it."""
    import yaml

    default = run_dir / "consumer-state" / "consumer.sqlite"
    cfg = run_dir / "rendered" / "specforge_run.yaml"
    if cfg.is_file():
        raw = yaml.safe_load(cfg.read_text()) or {}
        state = raw.get("deployment", {}).get("disaggregated", {}).get("consumer_state_dir")
        if state and state != str(Path(raw.get("output_dir", "")) / "consumer-state"):
            return Path(state) / "consumer.sqlite"
    return default


def durable_step(run_dir: Path) -> int | None:
    """The consumer ledger's durable optimizer step (``marker.global_step``), if any."""
    db = ledger_db(run_dir)
    if not db.is_file():
        return None
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        row = con.execute("select v from marker where k = 'global_step'").fetchone()
    finally:
        con.close()
    return int(row[0]) if row and row[0] is not None else None


def ledger(run_dir: Path) -> dict:
    """SpecForge's consumer ledger: trained samples, duplicates, tokens, durable step."""
    db = ledger_db(run_dir)
    if not db.is_file():
        return {"present": False}
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        acked = [r[0] for r in con.execute("select sample_id from acked")]
        committed = {sid: json.loads(ref) for sid, ref in con.execute("select sample_id, ref_json from committed")}
        marker = dict(con.execute("select k, v from marker"))
    finally:
        con.close()
    dup = [s for s, n in Counter(acked).items() if n > 1]
    tokens = sum(int(committed[s].get("num_tokens", 0)) for s in set(acked) if s in committed)
    return {
        "present": True,
        "acked": len(acked),
        "acked_unique": len(set(acked)),
        "duplicates": len(dup),
        "acked_not_committed": len(set(acked) - set(committed)),
        "committed": len(committed),
        "trained_tokens": tokens,
        "global_step": int(marker.get("global_step", 0) or 0),
        "feature_bytes_trained": sum(int(committed[s].get("estimated_bytes", 0)) for s in set(acked) if s in committed),
    }


def counts(run_dir: Path) -> dict:
    """The ledger's running totals, cheap enough to poll while the run writes it: trained (acked)
    samples and their tokens, committed refs, durable step. SQL only (SQLite's JSON functions), so a
    poll of a long run does not parse every ref; ``{"present": False}`` before SpecForge made it."""
    db = ledger_db(run_dir)
    if not db.is_file():
        return {"present": False}
    try:
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=2.0)
        try:
            acked = con.execute("select count(*) from acked").fetchone()[0]
            committed = con.execute("select count(*) from committed").fetchone()[0]
            tokens = con.execute(
                "select coalesce(sum(json_extract(c.ref_json, '$.num_tokens')), 0) "
                "from acked a join committed c on c.sample_id = a.sample_id"
            ).fetchone()[0]
            row = con.execute("select v from marker where k = 'global_step'").fetchone()
        finally:
            con.close()
    except sqlite3.Error:  # tables not created yet, or a writer holding the schema lock
        return {"present": False}
    return {
        "present": True,
        "acked": int(acked),
        "committed": int(committed),
        "trained_tokens": int(tokens),
        "global_step": int(row[0]) if row and row[0] is not None else 0,
    }
