"""A device process for the edge-envelope tests, run inside a memory cgroup: it reports its resource profile,
takes the plan the test assigns, and does a device's local rounds on it.

    python -m tests.support.confined_device SHARD [--memory-budget-mb MB] [--runtime KIND]

Lines of JSON on stdout and stdin: out ``{"profile": ...}`` (device_runtime.profile, with no budget flag the
budget is the limit it read; its runtime is the one ``--runtime`` detects, as the device CLI's flag does); in ``{"artifacts": DIR, "rounds": N, "batch_size": B}``; out the rounds' result.
The rounds are the ones the memory floors were measured with (scripts/bench_device.py, the device floor worker,
which runs the artifacts' kind: the task received as MQTT frames, ``run_task``, the head and answer saved, the answer framed), so a
tier chosen by its floor is checked on the same work, here on the device's own shard.
"""
from __future__ import annotations

import argparse
import json
import sys

from device_runtime.profile import collect_profile
from device_runtime.runtimes import AUTO, detect
from tests.support.scripts import load_script


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shard")
    parser.add_argument("--memory-budget-mb", type=float, default=None)
    parser.add_argument("--runtime", default=AUTO)
    args = parser.parse_args()
    profile = collect_profile(args.memory_budget_mb, 1, runtime=detect(args.runtime))
    print(json.dumps(dict(profile=profile.to_meta())), flush=True)
    plan = json.loads(sys.stdin.readline())
    result = load_script("bench_device").device_floor_worker(dict(plan, shard=args.shard), "artifacts")
    print(json.dumps(dict(result, rounds=plan["rounds"])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
