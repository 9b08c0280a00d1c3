"""Secure aggregation benchmark: SecAgg+ against the plain engine on the same federation, paired by seed.

    nice -n 5 .venv/bin/python scripts/bench_secagg.py                      # 5 seeds + the dropout run (long)
    .venv/bin/python scripts/bench_secagg.py --seeds 2 --rounds 20          # a slice
    .venv/bin/python scripts/bench_secagg.py --render-only                  # the tables again from the JSON
    .venv/bin/python scripts/bench_secagg.py --mqtt 20 --rounds 2 --out docs/results/secagg/secagg_mqtt.json
    .venv/bin/python scripts/bench_secagg.py --drop-only                    # only the dropout run, checked

Each run is one ``python -m server.simulate`` command (a child process): digits, ``--clients`` devices, FedARA
under ``--aggregate updates`` with rank tiers 1/0.5/0.25 round-robin, once plain and once with
``--secure-aggregation`` per seed; then one secure run per seed in ``--drop-seeds`` with ``--secagg-drop`` (and the
same ``--secagg-dropout-rate``, so k and t are chosen for it), in this process: after every round it checks that
a round with at least t survivors was aggregated and that its step equals the plain engine's aggregate of the
survivors' changes (Σ n_i·clip(Δ_i, R) / Σ n_i, computed here from the updates in the clear, which only a
benchmark holds) within the round's quantization bound plus one float32 rounding. Prints (1) final accuracy, plain
vs secure, the paired difference, and the largest difference between the two final models; (2) bytes up per device
per tier (factors vs masked integers); (3) the dropout run's rounds: survivors, dropped, recovered, k, t,
aggregated, the step's error against its bound; (4) the noise multiplier z that ε = 8 needs on bench_privacy's
schedule under the central Gaussian (PLD) and the distributed Skellam accountant (computed, not trained); (5) the
k and t the rule chooses for rounds of 10 to 1,000 devices, their bytes per device and a device's measured
masking time. Writes the JSON.

``--mqtt N`` measures the cost over MQTT instead: ``python -m server.broker_loop`` with N real device processes on
this machine (embedded broker, digits, memory budgets ``--memory-mb`` round-robin, which give the devices their rank
tiers), plain and ``--secure-aggregation`` on the same seed, ``--rounds`` rounds each. Prints per run the round time,
the CPU seconds of the server process and of the devices (each process's user + system time, sampled every 0.2 s
until it exits: a device's last fraction of a second may be missed), the bytes through the server, each tier's
device peak RSS and the server's (the largest sample: a peak shorter than 0.2 s may be missed), and for the secure
run the bytes and seconds of each SecAgg+ phase.
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from server.engine.accountant import SkellamAccountant, noise_multiplier_for  # noqa: E402
from server.engine.secagg_parameters import DEFAULT_CORRUPT_RATE, choose  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--drop", type=float, default=0.3, help="--secagg-drop of the dropout runs")
    p.add_argument("--drop-seeds", type=int, default=1, help="secure runs with --secagg-drop (seeds 0..)")
    p.add_argument("--out", default="docs/results/secagg/secagg.json")
    p.add_argument("--render-only", action="store_true")
    p.add_argument("--costs-only", action="store_true", help="only the per-tier step costs and the z table (seconds)")
    p.add_argument("--mqtt", type=int, default=0, metavar="N",
                   help="measure the cost over MQTT with N device processes, plain vs secure, --rounds rounds")
    p.add_argument("--max-samples", type=int, default=1797, help="--mqtt: the digits samples shared by the devices")
    p.add_argument("--memory-mb", default="128,94,84",
                   help="--mqtt: the devices' memory budgets (--local-memory-mb, round-robin): their rank tiers")
    p.add_argument("--drop-only", action="store_true",
                   help="only the dropout runs (checked), kept beside the pairs already in --out")
    return p.parse_args(argv)


def run_argv(a: argparse.Namespace, seed: int) -> list[str]:
    return ["--dataset", "digits", "--algo", "fedara", "--aggregate", "updates", "--clients", str(a.clients),
            "--rounds", str(a.rounds), "--rank-tiers", "1.0,0.5,0.25", "--seed", str(seed)]


def execute(argv: list[str]) -> dict:
    """One simulate run in a child process: its records and its final shared model."""
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "server.simulate", *argv, "--out", tmp],
                              capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)} failed: {done.stderr.strip()[-2000:]}")
        records = [json.loads(line) for line in Path(tmp, "metrics.jsonl").read_text().splitlines()]
        with np.load(Path(tmp, "checkpoint.npz")) as saved:
            model = {k: saved[k] for k in saved.files if k.startswith("fe.") or k.startswith("head.")}
    accuracies = [r["accuracy"] for r in records if r.get("accuracy") is not None]
    return {"command": shlex.join(["python", "-m", "server.simulate", *argv]), "wall_s": time.perf_counter() - start,
            "final_accuracy": accuracies[-1] if accuracies else None, "records": records, "model": model}


def up_per_device(records: list[dict]) -> dict[str, float]:
    """Mean bytes up per device per round, by tier."""
    out: dict[str, list[float]] = {}
    for r in records:
        for tier, values in r.get("bytes_by_tier", {}).items():
            devices = sum(1 for v in r.get("per_device", {}).values() if v.get("tier") == tier) or 1
            out.setdefault(tier, []).append(values.get("up", 0) / devices)
    return {t: float(np.mean(v)) for t, v in sorted(out.items())}


def noise_table() -> list[dict]:
    """z for ε = 8 on bench_privacy's schedule (N = 3,000, q = 0.1, 10 rounds, δ = N^-1.1; fedavgcnn on
    Fashion-MNIST, d = its shared FE's size): the central Gaussian (PLD) and the distributed Skellam mechanism."""
    from device_runtime.dense_delta import dimension
    from server.engine.run_config import DpSettings
    from server.engine.secure_rounds import dp_noise, skellam_noise_multiplier_for
    from fedcore.models import build_model
    model = build_model("fedavgcnn", (1, 28, 28), 10)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if k.startswith("fe.")}
    d, n, q, rounds, target = dimension(shapes), 3000, 0.1, 10, 8.0
    delta = n ** -1.1
    central = noise_multiplier_for(target, rounds, q, delta, "pld")
    distributed = skellam_noise_multiplier_for(target, rounds, q, delta, d)
    mu, l2 = dp_noise(DpSettings(distributed, q, n, 0.5), d)
    return [{"mechanism": "central Gaussian, PLD", "z": central, "dimension": d},
            {"mechanism": "distributed Skellam, RDP (Zhu-Wang subsampling)", "z": distributed, "dimension": d,
             "epsilon_at_z": SkellamAccountant(q, mu, l2, d, delta).epsilon_after(rounds)}]


def step_costs(devices: int = 10, dropped: int = 3) -> list[dict]:
    """Per tier of fedavgcnn on Fashion-MNIST: the factors' bytes, the masked upload's, the device's secure step
    (Δ, quantization, masking against the rule's k neighbours: seconds and tracemalloc peak) and the server's
    unmasking of ``devices`` of which ``dropped`` dropped after sharing (seconds)."""
    import tracemalloc

    from device_runtime.dense_delta import dimension
    from device_runtime.secagg_client import SecAggClient, SecureSpec, secure_input
    from device_runtime.secagg_noise import secure_generator
    from device_runtime.secagg_quantize import plain_quantizer
    from fedcore.lowrank import factorize_state, rank_for_ratio
    from fedcore.models import build_model
    from server.engine.secure_aggregation import SecAggServer
    model = build_model("fedavgcnn", (1, 28, 28), 10)
    fe = {k: v.detach() for k, v in model.state_dict().items() if k.startswith("fe.")}
    shapes = {k: tuple(v.shape) for k, v in fe.items()}
    d, ids = dimension(shapes), tuple(f"d{i:02d}" for i in range(devices))
    rows = []
    for ratio in (1.0, 0.5, 0.25):
        ranks = {} if ratio == 1.0 else {k.rsplit(".", 1)[0]: rank_for_ratio(ratio, tuple(v.shape))
                                         for k, v in fe.items() if k.endswith(".weight")}
        sent = {k: v.numpy() for k, v in factorize_state(fe, ranks).items()}
        returned = {k: v + np.float32(0.01) for k, v in sent.items()}
        g = choose(devices)
        spec = SecureSpec(b"bench|1", ids, g.neighbors, g.threshold, g.threshold, b"graph",
                          plain_quantizer(8.0, devices), 8.0, False, 0.0, shapes, 1 / devices)
        clients = {i: SecAggClient(i, spec) for i in ids}
        server = SecAggServer(spec, d)
        for i, c in clients.items():
            server.receive_keys(i, c.advertise())
        keys = server.close_keys(0.0)
        for i, c in clients.items():
            server.receive_shares(i, c.share_keys(keys[i]))
        shares = server.close_shares(0.0)
        tracemalloc.start()
        start = time.perf_counter()
        first = clients[ids[0]].masked_input(secure_input(returned, sent, spec, secure_generator()), shares[ids[0]])
        device_s = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        server.receive_masked(ids[0], first)
        for i in ids[1:devices - dropped]:
            server.receive_masked(i, clients[i].masked_input(secure_input(returned, sent, spec, secure_generator()),
                                                             shares[i]))
        survivors = server.close_masked(0.0)
        for i in survivors:
            server.receive_unmasking(i, clients[i].unmask(survivors))
        start = time.perf_counter()
        assert server.finish(0.0) is not None
        rows.append({"tier": ratio, "factor_bytes": sum(v.nbytes for v in sent.values()), "masked_bytes": d * 4,
                     "device_step_s": device_s, "device_peak_mb": peak / 1e6,
                     "server_unmask_s": time.perf_counter() - start, "devices": devices, "dropped": dropped,
                     "dimension": d})
    return rows


def usage(process: psutil.Process) -> tuple[float, int, str] | None:
    """(CPU seconds, RSS bytes, its --device-id or "") of a process now; None once it is gone."""
    try:
        times, rss, cmdline = process.cpu_times(), process.memory_info().rss, process.cmdline()
    except psutil.Error:
        return None
    device = cmdline[cmdline.index("--device-id") + 1] if "--device-id" in cmdline[:-1] else ""
    return times.user + times.system, rss, device


def mqtt_run(a: argparse.Namespace, secure: bool) -> dict:
    """One broker_loop run with --mqtt device processes: its records, wall time, and the CPU seconds of the server
    and of its device processes (sampled until each exits)."""
    argv = ["--dataset", "digits", "--local-devices", str(a.mqtt), "--rounds", str(a.rounds), "--local-epochs", "1",
            "--max-samples", str(a.max_samples), "--aggregate", "updates", "--local-memory-mb", a.memory_mb,
            "--seed", "0",
            "--join-timeout", "900", "--round-deadline", "900", *(["--secure-aggregation"] if secure else [])]
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        server = subprocess.Popen([sys.executable, "-m", "server.broker_loop", *argv, "--out", tmp], cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        watched, cpu, rss, names = psutil.Process(server.pid), {}, {}, {}
        while server.poll() is None:
            try:
                processes = [watched, *watched.children(recursive=True)]
            except psutil.Error:
                processes = []
            for proc in processes:
                now = usage(proc)
                if now is not None:
                    cpu[proc.pid] = max(cpu.get(proc.pid, 0.0), now[0])
                    rss[proc.pid] = max(rss.get(proc.pid, 0), now[1])
                    names[proc.pid] = now[2] or names.get(proc.pid, "")
            time.sleep(0.2)
        if server.returncode != 0:
            raise RuntimeError(f"broker_loop {shlex.join(argv)} failed: {server.stderr.read()[-2000:]}")
        records = [json.loads(line) for line in Path(tmp, "metrics.jsonl").read_text().splitlines()]
    devices = [s for pid, s in cpu.items() if pid != server.pid]
    trained = [r for r in records if r.get("participants")]
    tiers = {d: row["tier"] for d, row in trained[0]["per_device"].items()} if trained else {}
    peak_by_tier: dict[str, list[float]] = {}
    for pid, device in names.items():
        if device in tiers:
            peak_by_tier.setdefault(tiers[device], []).append(rss[pid] / 2**20)
    return {"command": shlex.join(["python", "-m", "server.broker_loop", *argv]), "wall_s": time.perf_counter() - start,
            "round_s": [r["seconds"] for r in trained], "server_cpu_s": cpu.get(server.pid, 0.0),
            "device_cpu_s": sum(devices), "device_processes": len(devices),
            "server_peak_rss_mb": rss.get(server.pid, 0) / 2**20, "device_peak_rss_mb_by_tier": peak_by_tier,
            "bytes_in": [r.get("wire_bytes_in") for r in trained],
            "bytes_out": [r.get("wire_bytes_out") for r in trained],
            "secagg": [r.get("secagg") for r in trained]}


def mqtt_tables(doc: dict) -> str:
    lines = [f"{doc['config']['mqtt']} device processes, {doc['config']['rounds']} rounds (digits, budgets "
             f"{doc['config'].get('memory_mb', 'none: dense tier')} MB, embedded broker)", "",
             "| run | mean round s | server CPU s (run) | device CPU s (run, all devices) | "
             "device CPU s / device (run) | "
             "MB into server / round | MB out of server / round |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in ("plain", "secure"):
        run = doc.get(name)
        if run is None:
            continue
        lines.append(f"| {name} | {np.mean(run['round_s']):.2f} | {run['server_cpu_s']:.1f} | "
                     f"{run['device_cpu_s']:.1f} | {run['device_cpu_s'] / max(1, run['device_processes']):.2f} | "
                     f"{np.mean(run['bytes_in']) / 1e6:.2f} | {np.mean(run['bytes_out']) / 1e6:.2f} |")
    plain, secure = doc.get("plain"), doc.get("secure")
    if plain and secure and "device_peak_rss_mb_by_tier" in secure:
        lines += ["", "| tier | devices | device peak RSS MB, plain (mean / max) | secure (mean / max) |",
                  "| --- | --- | --- | --- |"]
        for tier in sorted(secure["device_peak_rss_mb_by_tier"], key=float):
            cells = [run["device_peak_rss_mb_by_tier"].get(tier, []) for run in (plain, secure)]
            lines.append(f"| {tier} | {len(cells[1])} | " + " | ".join(
                f"{np.mean(c):.1f} / {max(c):.1f}" if c else "-" for c in cells) + " |")
        lines.append(f"| server | 1 | {plain['server_peak_rss_mb']:.1f} | {secure['server_peak_rss_mb']:.1f} |")
    if secure and secure["secagg"]:
        lines += ["", "| SecAgg+ phase (secure run, mean over rounds) | bytes into server | bytes out of server | "
                  "seconds |", "| --- | --- | --- | --- |"]
        for phase in ("keys", "shares", "masked", "unmask"):
            cells = [row["phases"][phase] for row in secure["secagg"] if row and "phases" in row]
            lines.append(f"| {phase} | {np.mean([c['bytes_in'] for c in cells]):,.0f} | "
                         f"{np.mean([c['bytes_out'] for c in cells]):,.0f} | "
                         f"{np.mean([c['seconds'] for c in cells]):.3f} |")
    return "\n".join(lines)
def dropout_run(a: argparse.Namespace, seed: int) -> dict:
    """One secure run with --secagg-drop in this process, each round checked (module docstring)."""
    from device_runtime.dense_delta import reconstruct
    from server.run_setup import RunFolder
    from server.simulate import build_parser
    from server.simulation import Simulation

    class Checked(Simulation):
        """The simulation, keeping each round's updates in the clear (a benchmark's privilege) to check the step."""

        checks: list[dict] = []

        def _answers(self, tasks):
            self.clear = {}
            for device_id, update in super()._answers(tasks):
                self.clear[device_id] = (dict(update.weights), tasks[device_id].weights)
                yield device_id, update

        def _round(self, round_index: int, train: bool = True) -> None:
            before = self.engine.global_arrays()
            super()._round(round_index, train)
            secure = self.engine.secure
            if not train or secure.server is None or self.engine.pending is None:
                return
            row = self.engine.pending["secagg"]
            survivors = sorted(secure.server.masked)
            check = {"round": round_index, "survivors": len(survivors), "threshold": row["threshold"],
                     "aggregated": row["aggregated"], "error": None, "allowed": None}
            if row["aggregated"]:
                after, shapes = self.engine.global_arrays(), secure.dense_shapes
                samples = {d: self.engine.registry()[d].num_train for d in survivors}
                plain = {k: np.zeros(shape) for k, shape in shapes.items()}
                for d in survivors:
                    returned, sent = self.clear[d]
                    for key, shape in shapes.items():
                        layer = key.rsplit(".", 1)[0]
                        def mine(t: dict) -> dict:  # the tensor itself, or its layer's two factors
                            return {key: t[key]} if key in t else {n: t[n] for n in (layer + ".u", layer + ".v")}
                        change = (reconstruct(mine(returned), {key: shape})[key]
                                  - reconstruct(mine(sent), {key: shape})[key])
                        plain[key] += samples[d] * np.clip(change, -self.args.secagg_range, self.args.secagg_range)
                total = sum(samples.values())
                bound = row["quantization_bound"]
                excess, worst = 0.0, 0.0
                for key in shapes:  # within the bound plus the float32 rounding of the new model
                    err = np.abs(after[key].astype(np.float64) - before[key] - plain[key] / total)
                    slack = bound + np.spacing(np.abs(after[key]).astype(np.float32)).astype(np.float64)
                    excess = max(excess, float((err - slack).max()))
                    worst = max(worst, float(err.max()))
                check.update(error=worst, allowed=bound, within=excess <= 0)
            self.checks.append(check)

    argv = [*run_argv(a, seed), "--secure-aggregation", "--secagg-drop", str(a.drop), "--secagg-dropout-rate",
            str(a.drop)]
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        args = build_parser().parse_args([*argv, "--out", tmp])
        simulation = Checked(args, RunFolder(Path(tmp)))
        records = simulation.run()
    rows = [dict(r["secagg"], round=r["round"]) for r in records]
    checks = {c["round"]: c for c in simulation.checks}
    for r in rows:
        c = checks.get(r["round"], {})
        r.update(step_error=c.get("error"), within_bound=c.get("within"))
    accuracies = [r["accuracy"] for r in records if r.get("accuracy") is not None]
    return {"seed": seed, "command": shlex.join(["python", "-m", "server.simulate", *argv]),
            "wall_s": time.perf_counter() - start, "final_accuracy": accuracies[-1] if accuracies else None,
            "aggregated": sum(r["aggregated"] for r in rows), "rounds": rows,
            "every_round_with_t_survivors_aggregated": all(r["aggregated"] for r in rows
                                                           if r["threshold"] and r["survivors"] >= r["threshold"]),
            "every_aggregate_within_bound": all(r["within_bound"] for r in rows if r["aggregated"])}


def graph_costs(dropout_rate: float = 0.1, sizes: tuple[int, ...] = (10, 30, 100, 300, 1000)) -> list[dict]:
    """The k and t the rule chooses for rounds of ``sizes`` devices, what a device sends and receives for them per
    round (keys, sealed shares, unmasking shares), and a device's masking of fedavgcnn's d = 576,896 integers
    against its k neighbours (seconds, measured with the real client among k + 1 devices)."""
    from device_runtime.dense_delta import dimension
    from device_runtime.secagg_client import SecAggClient, SecureSpec
    from device_runtime.secagg_crypto import KEY_BYTES
    from device_runtime.secagg_quantize import plain_quantizer
    from device_runtime.secagg_shamir import SHARE_BYTES
    from fedcore.models import build_model
    model = build_model("fedavgcnn", (1, 28, 28), 10)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if k.startswith("fe.")}
    d, sealed = dimension(shapes), 12 + 2 * SHARE_BYTES + 16
    rows, timed = [], {}
    for n in sizes:
        g = choose(n, dropout_rate, DEFAULT_CORRUPT_RATE)
        k = g.neighbors
        if k not in timed:
            ids = tuple(f"d{i:04d}" for i in range(k + 1))
            spec = SecureSpec(b"bench|2", ids, k, g.threshold, g.threshold, b"graph", plain_quantizer(8.0, k + 1), 8.0,
                              False, 0.0, shapes)
            clients = {i: SecAggClient(i, spec) for i in ids}
            keys = {i: c.advertise() for i, c in clients.items()}
            shares = {i: c.share_keys({v: keys[v] for v in c.mine}) for i, c in clients.items()}
            to_first = {v: shares[v][ids[0]] for v in clients[ids[0]].mine}
            x = np.zeros(d, dtype=np.uint64)
            start = time.perf_counter()
            clients[ids[0]].masked_input(x, to_first)
            timed[k] = time.perf_counter() - start
        rows.append({"n": n, "dropout_rate": dropout_rate, "neighbors": k, "threshold": g.threshold,
                     "complete": g.complete, "min_survivors": g.min_survivors(n),
                     "bytes_up": 2 * KEY_BYTES + k * sealed + (k + 1) * SHARE_BYTES,
                     "bytes_down": 2 * KEY_BYTES * k + k * sealed, "masking_s": timed[k], "dimension": d})
    return rows


def tables(doc: dict) -> str:
    lines = ["| seed | plain final acc | secure final acc | secure − plain (pp) | max abs model diff |",
             "| --- | --- | --- | --- | --- |"]
    diffs = []
    for pair in doc["pairs"]:
        diffs.append(pair["secure"] - pair["plain"])
        lines.append(f"| {pair['seed']} | {pair['plain']:.4f} | {pair['secure']:.4f} | {100 * diffs[-1]:+.2f} | "
                     f"{pair['model_diff']:.3g} |")
    if diffs:
        se = np.std(diffs, ddof=1) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
        lines.append(f"| mean | | | {100 * np.mean(diffs):+.2f} ± {100 * se:.2f} | |")
    lines += ["", "| tier | plain bytes up / device / round | secure bytes up / device / round |", "| --- | --- | --- |"]
    plain, secure = doc.get("bytes_plain", {}), doc.get("bytes_secure", {})
    for tier in sorted(set(plain) | set(secure)):
        lines.append(f"| {tier} | {plain.get(tier, 0):,.0f} | {secure.get(tier, 0):,.0f} |")
    for run in doc.get("drop_runs", []):
        lines += ["", f"Dropout run (seed {run['seed']}, --secagg-drop {doc['config']['drop']}): "
                  f"{run['aggregated']} of {len(run['rounds'])} rounds aggregated; every round with >= t survivors "
                  f"aggregated: {'yes' if run.get('every_round_with_t_survivors_aggregated') else 'no'}; every "
                  f"aggregate within its bound of the survivors' plain aggregate: "
                  f"{'yes' if run.get('every_aggregate_within_bound') else 'no'}", "",
                  "| round | survivors | dropped | recovered | k | t | aggregated | max step error | bound |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['round']} | {r['survivors']} | {r['dropped']} | {r['recovered']} | {r.get('neighbors')} | "
                  f"{r['threshold']} | {'yes' if r['aggregated'] else 'no: ' + str(r['failure'])} | "
                  f"{'-' if r.get('step_error') is None else format(r['step_error'], '.2e')} | "
                  f"{'-' if not r['aggregated'] else format(r['quantization_bound'], '.2e')} |" for r in run["rounds"]]
    lines += ["", "| tier (fedavgcnn, fmnist) | factors up (bytes) | masked up (bytes) | device secure step s | "
              "device peak MB (tracemalloc) | server unmask s (10 devices, 3 dropped) |",
              "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['tier']:g} | {r['factor_bytes']:,} | {r['masked_bytes']:,} | {r['device_step_s']:.2f} | "
              f"{r['device_peak_mb']:.1f} | {r['server_unmask_s']:.2f} |" for r in doc.get("costs", [])]
    if doc.get("graphs"):
        lines += ["", f"k and t by round size (--secagg-dropout-rate {doc['graphs'][0]['dropout_rate']:g}, "
                  f"--secagg-corrupt-rate {DEFAULT_CORRUPT_RATE:g}; masking: one device, d = "
                  f"{doc['graphs'][0]['dimension']:,})", "",
                  "| n | k | t | graph | min survivors | bytes up / device (keys, shares) | bytes down / device | "
                  "device masking s |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r['n']:,} | {r['neighbors']} | {r['threshold']} | {'complete' if r['complete'] else 'Harary'} | "
                  f"{r['min_survivors']} | {r['bytes_up']:,} | {r['bytes_down']:,} | {r['masking_s']:.2f} |"
                  for r in doc["graphs"]]
    lines += ["", "| mechanism (ε = 8, bench_privacy's schedule) | z | d |", "| --- | --- | --- |"]
    lines += [f"| {row['mechanism']} | {row['z']:.4f} | {row['dimension']:,} |" for row in doc.get("noise", [])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    out = Path(a.out)
    if a.render_only:
        doc = json.loads(out.read_text())
        print(mqtt_tables(doc) if doc["config"].get("mqtt") else tables(doc))
        return 0
    if a.mqtt:
        doc = {"config": vars(a), "note": "measured on a shared, busy 2-core machine"}
        for name, secure in (("plain", False), ("secure", True)):
            doc[name] = mqtt_run(a, secure)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(doc, indent=1, default=float))
        print(mqtt_tables(doc))
        return 0
    if a.costs_only:
        print(tables({"config": vars(a), "pairs": [], "costs": step_costs(), "noise": noise_table(),
                      "graphs": graph_costs()}))
        return 0
    if a.drop_only:
        doc = json.loads(out.read_text()) if out.exists() else {"config": vars(a), "pairs": []}
        doc["config"].update(drop=a.drop, drop_seeds=a.drop_seeds)
        doc["drop_runs"] = []
        for seed in range(a.drop_seeds):
            doc["drop_runs"].append(dropout_run(a, seed))
            out.write_text(json.dumps(doc, indent=1, default=float))
        doc["costs"], doc["graphs"] = step_costs(), graph_costs()
        out.write_text(json.dumps(doc, indent=1, default=float))
        print(tables(doc))
        return 0
    doc = {"config": vars(a), "pairs": [], "drop_runs": [], "note": "measured on a shared, busy 2-core machine",
           "noise": noise_table(), "costs": step_costs(), "graphs": graph_costs()}
    for seed in range(max(a.seeds, a.drop_seeds)):  # each seed's pair, then its dropout run: partial results stand
        if seed < a.seeds:
            plain = execute(run_argv(a, seed))
            secure = execute([*run_argv(a, seed), "--secure-aggregation"])
            diff = max(float(np.abs(plain["model"][k].astype(np.float64) - secure["model"][k]).max())
                       for k in plain["model"])
            doc["pairs"].append({"seed": seed, "plain": plain["final_accuracy"], "secure": secure["final_accuracy"],
                                 "model_diff": diff, "plain_command": plain["command"],
                                 "secure_command": secure["command"], "plain_wall_s": plain["wall_s"],
                                 "secure_wall_s": secure["wall_s"]})
            if seed == 0:
                doc["bytes_plain"] = up_per_device(plain["records"])
                doc["bytes_secure"] = up_per_device(secure["records"])
                doc["secagg_rows"] = [r["secagg"] for r in secure["records"]]
            print(f"seed {seed}: plain {plain['final_accuracy']:.4f} secure {secure['final_accuracy']:.4f}", flush=True)
            out.write_text(json.dumps(doc, indent=1, default=float))
        if seed < a.drop_seeds:
            doc["drop_runs"].append(dropout_run(a, seed))
            out.write_text(json.dumps(doc, indent=1, default=float))
    print(tables(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
