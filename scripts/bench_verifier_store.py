"""What one accepted message costs the receiver's authentication state on disk, with S senders in the state: the
whole state rewritten atomically (what each accept cost before the journal), the journal
(``device_runtime.auth.VerifierStore``) with an fsync per accept (a receiver that sends something after every
message), and the journal group-committed, one fsync per ``--batch`` accepts (a server reading a round's updates:
it syncs before it seals anything or writes a checkpoint).

    .venv/bin/python scripts/bench_verifier_store.py                  # docs/results/verifier_store/bench_verifier_store.json
    .venv/bin/python scripts/bench_verifier_store.py --senders 100 --accepts 50

Both write to a temporary directory on the file system of ``--dir`` (default: the system's temporary directory):
put it where the server's state directory lives, since the fsync is most of the cost. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import numpy as np  # noqa: E402

from device_runtime.auth import VERIFIER_FILE, Direction, KeyRing, Verifier, VerifierStore, write_json_atomic  # noqa: E402
from device_runtime.envelope import Message, MessageType, decode, seal  # noqa: E402
from server.outputs.machine import cpu_name  # noqa: E402

RUN = "bench"


def filled_verifier(senders: int) -> tuple[Verifier, list[str]]:
    """A server-side Verifier that has accepted one message from each of ``senders`` devices."""
    keys = {f"dev_{i:05d}": i.to_bytes(4, "big") * 8 for i in range(senders)}
    verifier = Verifier(KeyRing(keys), {Direction.UP, Direction.STATUS})
    for counter, (device_id, key) in enumerate(keys.items(), 1):
        msg = Message(MessageType.UPDATE, RUN, 1, device_id, f"m-{counter}", {}, {"w": np.zeros(1, np.float32)})
        assert verifier.check(decode(seal(msg, key, Direction.UP, counter), max_bytes=1 << 16), {RUN}).accepted
    return verifier, list(keys)


def per_accept_ms(senders: int, accepts: int, batch: int, where: str | None) -> dict[str, float]:
    verifier, devices = filled_verifier(senders)
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        store = VerifierStore(tmp)
        store.compact(verifier)
        started = time.perf_counter()
        for _ in range(accepts):
            write_json_atomic(Path(tmp) / VERIFIER_FILE, verifier.to_state())
        rewrite = (time.perf_counter() - started) / accepts
        started = time.perf_counter()
        for i in range(accepts):
            store.record(verifier, devices[i % senders])
            store.sync()
        journal = (time.perf_counter() - started) / accepts
        started = time.perf_counter()
        for i in range(accepts):
            store.record(verifier, devices[i % senders])
            if (i + 1) % batch == 0:
                store.sync()
        store.close()
        grouped = (time.perf_counter() - started) / accepts
    return {"senders": senders, "rewrite_ms": 1e3 * rewrite, "journal_ms": 1e3 * journal,
            "grouped_ms": 1e3 * grouped, "ratio": journal / rewrite, "grouped_ratio": grouped / rewrite}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--senders", default="100,1000,10000", help="comma-separated sender counts")
    p.add_argument("--accepts", type=int, default=300, help="accepted messages timed per arm")
    p.add_argument("--batch", type=int, default=100, help="accepts per fsync in the group-committed arm")
    p.add_argument("--dir", default=None, help="where the temporary state directory goes")
    p.add_argument("--out", default="docs/results/verifier_store/bench_verifier_store.json")
    args = p.parse_args(argv)
    rows = [per_accept_ms(int(s), args.accepts, args.batch, args.dir) for s in args.senders.split(",")]
    print(f"{'senders':>8s} {'whole rewrite ms':>17s} {'journal ms':>11s} {'journal/rewrite':>16s} "
          f"{'grouped ms':>11s} {'grouped/rewrite':>16s}")
    for r in rows:
        print(f"{r['senders']:>8d} {r['rewrite_ms']:>17.2f} {r['journal_ms']:>11.2f} {r['ratio']:>16.2f} "
              f"{r['grouped_ms']:>11.3f} {r['grouped_ratio']:>16.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "accepts": args.accepts, "batch": args.batch, "machine": {
        "cpu": cpu_name(), "loadavg": list(os.getloadavg())}}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
