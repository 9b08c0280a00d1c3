"""scripts/bench_verifier_store.py on a tiny configuration: one row per sender count, both arms timed."""
from __future__ import annotations

import json

from tests.support.scripts import load_script


def test_writes_one_row_per_sender_count_with_both_arms(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert load_script("bench_verifier_store").main(["--senders", "3,20", "--accepts", "4", "--batch", "2", "--dir", str(tmp_path),
                                                      "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["senders"] for r in rows] == [3, 20]
    assert all(r["rewrite_ms"] > 0 and r["journal_ms"] > 0 and r["grouped_ms"] > 0 for r in rows)
    assert "journal/rewrite" in capsys.readouterr().out
