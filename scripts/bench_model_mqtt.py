"""A model of yours federated over MQTT by three local device processes in memory cgroups: per device the tier it
trained at, the floor the server predicted for it against what the kernel really charged, the rounds completed and
the accuracy; per tier the parity of its compiled step against PyTorch eager.

    .venv/bin/python scripts/bench_model_mqtt.py --model examples/resnet8.py:build --rank-overrides 1,0.5,0.25 \
        --out-dir docs/results/your_model/mqtt

One ``python -m server.broker_loop`` run (a real broker, real device processes, each in a memory cgroup of its
``--local-memory-limit-mb``): either every device is given its tier (``--rank-overrides``, device i the i-th ratio),
or each takes the largest tier whose measured floor fits its limit (``--limits`` only). The run's first use of a
model measures its tiers (``server.tier_measurement``) into the user's cost model; this script reads them there:
the predicted floor of a tier is the charged peak of a measuring device process at batch 16 in an open group, the
tier choice's need that plus the margin and the device's shard. What was really charged is each device group's
peak over the run (server.log). Parity: each tier's cached portable artifacts run one step and one forward in
onnxruntime against PyTorch eager (``export.step_compiler.check_parity``, the gate's own check): the largest |Δ|.
Writes ``mqtt_<name>.json`` and ``.md`` under ``--out-dir``. Needs root and a writable memory cgroup controller.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from fedcore.model_spec import absolute_spec  # noqa: E402

DEVICES = 3
TIER_LINE = re.compile(r"(dev_\d+): tier ([\d.]+), predicted to need ([\d.]+) MiB")
PEAK_LINE = re.compile(r"local device (dev_\d+): cgroup peak ([\d.]+) MiB under its ([\d.]+) MiB limit")
FLOOR_BATCH = "16"


def device_lines(log: str) -> dict[str, dict[str, float]]:
    """Per device, from a broker_loop server.log: its tier and predicted need (the tier choice's line) and its
    group's charged peak and limit (the line written as the device processes are stopped)."""
    devices: dict[str, dict[str, float]] = {}
    for device, tier, need in TIER_LINE.findall(log):
        devices.setdefault(device, {}).update(tier=float(tier), need_mb=float(need))
    for device, peak, limit in PEAK_LINE.findall(log):
        devices.setdefault(device, {}).update(peak_mb=float(peak), limit_mb=float(limit))
    return devices


def measured_floors(cost_file: Path, key: str, input_shape: tuple[int, ...]) -> dict[float, dict[str, Any]]:
    """Ratio -> the tier's measured entry (charged peaks by batch size, peak RSS, step ms) from a cost-model file."""
    from device_runtime.artifact_contract import PORTABLE_KIND

    entries = json.loads(cost_file.read_text())["entries"] if cost_file.exists() else []
    return {e["ratio"]: dict(floor_mb=e.get("floors", {}).get(PORTABLE_KIND, {}).get("floor_mb"),
                             peak_rss_mb=e["peak_mb"], step_ms=e["step_ms"]["1"])
            for e in entries if e["model"] == key and tuple(e["input_shape"]) == tuple(input_shape)}


def rows(devices: dict[str, dict[str, float]], floors: dict[float, dict[str, Any]],
         parity: dict[float, float]) -> list[dict[str, Any]]:
    """One row per device: its tier, the tier's predicted floor at batch 16, the need, the real peak, the error."""
    out = []
    for device, seen in sorted(devices.items()):
        floor = (floors.get(seen.get("tier"), {}).get("floor_mb") or {}).get(FLOOR_BATCH)
        peak = seen.get("peak_mb")
        out.append(dict(device=device, tier=seen.get("tier"), limit_mb=seen.get("limit_mb"),
                        predicted_floor_mb=floor, need_mb=seen.get("need_mb"), cgroup_peak_mb=peak,
                        floor_vs_peak=None if floor is None or not peak else floor / peak - 1,
                        parity=parity.get(seen.get("tier"))))
    return out


def tier_parity(spec: str, shape: tuple[int, ...], classes: int, tiers: list[float], cache_dir: Path,
                seed: int) -> dict[float, float]:
    """Ratio -> the largest |onnxruntime - PyTorch| of the tier's cached step and eval graphs (the parity gate's
    check, at its two batch sizes)."""
    import onnx

    from device_runtime.artifact_contract import ARTIFACT_FILES_BY_KIND, PORTABLE_KIND
    from export.artifacts import build_artifacts_of_kind, inference_session
    from export.step_compiler import check_parity
    from fedcore.lowrank import factorize_model, resolve_plan
    from fedcore.models import build_model, rank_plan

    files = ARTIFACT_FILES_BY_KIND[PORTABLE_KIND]
    worst = {}
    for ratio in tiers:
        model = build_model(spec, shape, classes, seed=seed)
        ranks = resolve_plan(model, rank_plan(model, ratio)).ranks
        directory = build_artifacts_of_kind(PORTABLE_KIND, model, ranks, shape, classes, cache_dir).directory
        client = factorize_model(model, ranks)
        worst[ratio] = check_parity(client, onnx.load(directory / files["step_model"]),
                                    onnx.load(directory / files["eval_model"]), shape, classes, client.feature_dim,
                                    inference_session)
    return worst


def cost_key(spec: str, shape: tuple[int, ...], classes: int, seed: int) -> str:
    """The cost model's name for ``spec`` on samples of ``shape`` (``server.tier_measurement.measured_key``)."""
    from fedcore.models import build_model
    from server.tier_measurement import measured_key

    return measured_key(build_model(spec, shape, classes, seed=seed), shape)


def _mib(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def markdown(result: dict[str, Any]) -> str:
    """The run as a table: one row per device."""
    accuracy = "none" if result["final_accuracy"] is None else f"{result['final_accuracy']:.4f}"
    lines = [f"`{result['command']}`", "",
             f"{result['rounds_completed']} of {result['rounds']} rounds, final accuracy {accuracy}, "
             f"{result['wall_s']:.0f} s wall (busy shared machine)", "",
             "| device | tier | limit MiB | predicted floor b16 MiB | need MiB | cgroup peak MiB | floor / peak "
             "| parity |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["devices"]:
        err = "" if r["floor_vs_peak"] is None else f"{100 * r['floor_vs_peak']:+.1f} %"
        parity = "" if r["parity"] is None else f"{r['parity']:.1e}"
        tier = "" if r["tier"] is None else f"{r['tier']:g}"
        limit = "" if r["limit_mb"] is None else f"{r['limit_mb']:g}"
        lines.append(f"| {r['device']} | {tier} | {limit} | {_mib(r['predicted_floor_mb'])} | "
                     f"{_mib(r['need_mb'])} | {_mib(r['cgroup_peak_mb'])} | {err} | {parity} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="FILE.py:FUNCTION or a zoo name")
    p.add_argument("--dataset", default="fmnist")
    p.add_argument("--max-samples", type=int, default=1500)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tiers", default="1,0.5,0.25", help="--rank-tiers of the run")
    p.add_argument("--rank-overrides", default=None,
                   help="comma-separated ratios, device i the i-th (else the tier comes from --limits)")
    p.add_argument("--limits", default="400,400,400", help="--local-memory-limit-mb of the three devices")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=None, help="broker_loop's --lr (default: its own)")
    p.add_argument("--cache-dir", default=None, help="the artifact cache (default: the server's)")
    p.add_argument("--run-dir", default=None, help="the run's folder (default: a temporary one)")
    p.add_argument("--out-dir", default="docs/results/your_model/mqtt")
    args = p.parse_args(argv)
    args.model = absolute_spec(args.model)  # as the flag reads it: the artifacts' hash holds the spec

    from server.cli import DEFAULT_CACHE_DIR
    from server.data.datasets import load_dataset
    from server.engine.cost_model import measured_path
    from server.outputs.report import METRICS_FILE, read_metrics

    cache_dir = Path(args.cache_dir or DEFAULT_CACHE_DIR)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="fedara-model-mqtt-"))
    command = [sys.executable, "-m", "server.broker_loop", "--model", args.model, "--dataset", args.dataset,
               "--max-samples", str(args.max_samples), "--local-devices", str(DEVICES), "--rounds", str(args.rounds),
               "--local-epochs", str(args.local_epochs), "--rank-tiers", args.tiers,
               "--local-memory-limit-mb", args.limits,
               "--seed", str(args.seed), "--cache-dir", str(cache_dir), "--out", str(run_dir)]
    command += ["--lr", str(args.lr)] if args.lr is not None else []
    if args.rank_overrides:
        ratios = [float(r) for r in args.rank_overrides.split(",")]
        overrides = run_dir.with_name(run_dir.name + "-tiers.json")
        overrides.write_text(json.dumps({f"dev_{i:03d}": r for i, r in enumerate(ratios)}))
        command += ["--rank-overrides", str(overrides)]
    started = time.monotonic()
    status = subprocess.run(command, cwd=REPO, env=os.environ | {"PYTHONPATH": str(REPO)}).returncode
    wall = time.monotonic() - started
    records = [r for r in read_metrics(run_dir / METRICS_FILE) if r.get("accuracy") is not None] \
        if (run_dir / METRICS_FILE).exists() else []
    devices = device_lines((run_dir / "server.log").read_text())
    tiers = sorted({d["tier"] for d in devices.values() if "tier" in d}, reverse=True)
    data = load_dataset(args.dataset)
    shape, classes = tuple(data.input_shape), data.num_classes
    key = cost_key(args.model, shape, classes, args.seed)
    parity = tier_parity(args.model, shape, classes, tiers, cache_dir, args.seed) if status == 0 else {}
    measured = measured_floors(measured_path(), key, shape)
    result = dict(command=shlex.join(["python", *command[1:]]), status=status, wall_s=wall, rounds=args.rounds,
                  rounds_completed=len(records), accuracy=[r["accuracy"] for r in records],
                  final_accuracy=records[-1]["accuracy"] if records else None, cost_key=key, input_shape=shape,
                  measured=measured, devices=rows(devices, measured, parity), load_average=os.getloadavg())
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = "mqtt_" + Path(args.model.split(":")[0]).stem + ("_overrides" if args.rank_overrides else "_limits")
    (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (out / f"{name}.md").write_text(markdown(result))
    print(markdown(result))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
