"""Updates an aggregator process pushes out half-received, asked for again: what they cost a round (issue 44).

    .venv/bin/python scripts/bench_member_lost.py --devices 200 --aggregators 2 --rounds 2 --out FILE.json

Two runs on one fresh Debian mosquitto (tests/support/burst_fleet.py: the real broker loop with ``--aggregators N``
member processes, scripts/fleet_load.py's simulated devices at tiers 1 and 0.25, FedAvgCNN 3×32×32, every round's
training updates published at once, their frames interleaved): ``roomy``, the members as they run (8 largest updates
in memory, past that the spill), and ``tight``, each member with room for 2 incomplete updates and no spill
(tests/support/tight_member.py: a full disk, or its spill budget used up), so most of each burst is pushed out there,
named to the engine (aggregation_wire's ``lost``) and asked again. scripts/fleet_load.py cannot force a member's
budgets (its server is a process of its own), hence this harness. Each run is a process of its own.

Writes ``{"roomy": {...}, "tight": {...}}`` (and the load average at the end): per run ``wall_s`` and per round
``selected``, ``folded`` (updates folded), ``seconds`` (open to close), ``update_bytes`` (the updates' tensor bytes),
``server_bytes_in``, ``tasks_sent_again`` (the server's log), ``aggregators_bytes_in``, ``aggregators_pushed_out``
(device updates and engine messages) and ``aggregators_spilled`` (the members' logs, summed: scripts/fleet_load.py's
``aggregator_reads``); prints a table.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

MB = 1e6
RUNS = ("roomy", "tight")


def measure(name: str, url: str, folder: str, devices: int, aggregators: int, rounds: int, deadline_s: float,
            result: str) -> None:
    """One run (in a process of its own: a stopped endpoint's sockets are the process's until it exits)."""
    from tests.support.burst_fleet import FLEET, fleet_run
    started = time.monotonic()
    out = fleet_run(Path(folder) / name, Path(folder) / "cache", url, devices=devices, aggregators=aggregators,
                    rounds=rounds, deadline_s=deadline_s, tight=name == "tight")
    wall = time.monotonic() - started
    asked = FLEET.held_and_asked(out / "server.log")
    members = FLEET.aggregator_reads(out)
    rows = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        r = record["round"]
        rows.append({"round": r, "selected": record["selected"], "folded": record["participants"],
                     "seconds": record["seconds"], "update_bytes": record["bytes_up"],
                     "server_bytes_in": record.get("wire_bytes_in"),
                     "tasks_sent_again": asked.get(r, {}).get("tasks_sent_again", 0),
                     **{k: members.get(r, {}).get(k) for k in ("aggregators_bytes_in", "aggregators_pushed_out",
                                                               "aggregators_spilled")}})
    Path(result).write_text(json.dumps({"wall_s": wall, "rounds": rows}))


def table(results: dict) -> str:
    lines = ["| members | round | folded / asked | round s | tasks sent again | members pushed out | members spilled "
             "| MB into the members | × the updates | server MB in |", "|---|" + "---:|" * 9]
    for name, run in results.items():
        for r in run["rounds"]:
            members_in = r["aggregators_bytes_in"] or 0
            lines.append(f"| {name} | {r['round']} | {r['folded']} / {r['selected']} | {r['seconds']:.1f} | "
                         f"{r['tasks_sent_again']} | {r['aggregators_pushed_out']} | {r['aggregators_spilled']} | "
                         f"{members_in / MB:.1f} | {members_in / r['update_bytes']:.2f} | "
                         f"{(r['server_bytes_in'] or 0) / MB:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", type=int, default=200, help="simulated devices")
    p.add_argument("--aggregators", type=int, default=2, help="aggregator processes")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--round-deadline", type=float, default=600.0)
    p.add_argument("--out", required=True, help="the JSON file to write")
    args = p.parse_args(argv)
    if args.devices < 1 or args.aggregators < 1 or args.rounds < 1:
        print("error: --devices, --aggregators and --rounds must be >= 1", file=sys.stderr)
        return 2
    import bench_aggregators as bench  # starts the broker
    spawn = mp.get_context("spawn")
    results = {}
    with tempfile.TemporaryDirectory(prefix="member-lost-") as tmp, bench.broker_of("mosquitto",
                                                                                    Path(tmp) / "broker") as url:
        for name in RUNS:
            result = Path(tmp) / f"{name}.json"
            proc = spawn.Process(target=measure, args=(name, url, tmp, args.devices, args.aggregators, args.rounds,
                                                       args.round_deadline, str(result)))
            proc.start()
            proc.join()
            if proc.exitcode != 0 or not result.exists():
                print(f"error: the {name} run failed (exit {proc.exitcode})", file=sys.stderr)
                return 1
            results[name] = json.loads(result.read_text())
    Path(args.out).write_text(json.dumps({"devices": args.devices, "aggregators": args.aggregators,
                                          "rounds": args.rounds, "load_average": os.getloadavg(), **results},
                                         indent=1))
    print(table(results))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
