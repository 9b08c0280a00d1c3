"""The servers' command lines: one definition, defaults in --help, a config file, and bad input that is named
once, before any data is loaded, with exit status 2."""
from __future__ import annotations

import io
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from server import broker_loop, simulate
from server.broker_flags import check_broker_args
from server.cli import check_args, check_async_fleet, console_logging, parse
from tests.support.broker import free_loopback_port
from tests.support.processes import child_env

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120


def run(module: str, *flags: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *flags], cwd=cwd, capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=child_env(repo_on_path=True))


def test_both_drivers_share_every_algorithm_and_data_flag_with_the_same_defaults():
    sim, mqtt = simulate.build_parser(), broker_loop.build_parser()
    shared = {a.dest: a.default for a in sim._actions if a.dest not in ("help", "clients", "backend", "workers", "device",
                                                                  "device_speed", "availability", "virtual_deadline",
                                                                  "ray", "ray_gpus", "secagg_drop",
                                                                  "secagg_test_seed")}
    theirs = {a.dest: a.default for a in mqtt._actions}
    assert {k: theirs.get(k, "missing") for k in shared} == shared


@pytest.mark.parametrize("module", ["server.simulate", "server.broker_loop"])
def test_help_shows_the_defaults(module):
    done = run(module, "--help")
    assert done.returncode == 0
    assert "(default: 300.0)" in done.stdout if module == "server.broker_loop" else "(default: 20)" in done.stdout
    assert "(default: 0.005)" in done.stdout  # --lr


@pytest.mark.parametrize("module", ["server.simulate", "server.broker_loop"])
def test_a_negative_lambda_is_named_once_with_its_value_and_exits_2(module, tmp_path):
    extra = ["--local-devices", "2"] if module == "server.broker_loop" else []
    done = run(module, "--lam", "-1", "--out", str(tmp_path / "run"), *extra)
    assert done.returncode == 2
    assert done.stderr.count("--lam must be non-negative, got -1") == 1, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "run" / "checkpoint.npz").exists()


def test_no_local_devices_and_no_broker_is_refused_at_once(tmp_path):
    done = run("server.broker_loop", "--local-devices", "0", "--out", str(tmp_path / "run"))
    assert done.returncode == 2 and "--local-devices 0 with the embedded broker" in done.stderr


def test_an_unknown_config_setting_is_named(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('rounds = 3\nlocal_epoks = 1\n')
    done = run("server.simulate", "--config", str(config), "--out", str(tmp_path / "run"))
    assert done.returncode == 2 and "unknown setting 'local_epoks'" in done.stderr


def test_a_config_file_sets_flags_and_the_command_line_wins(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('rounds = 3\nlocal-epochs = 2\nalgo = "fedrep"\n')
    args = parse(simulate.build_parser(), ["--config", str(config), "--rounds", "7"])
    assert (args.rounds, args.local_epochs, args.algo) == (7, 2, "fedrep")


@pytest.mark.slow
def test_without_out_each_run_gets_a_fresh_folder(tmp_path):
    flags = ["--dataset", "digits", "--clients", "2", "--rounds", "1", "--local-epochs", "1", "--max-samples", "300",
             "--rank-ratio", "1.0"]
    first, second = run("server.simulate", *flags, cwd=tmp_path), run("server.simulate", *flags, cwd=tmp_path)
    assert first.returncode == 0 and second.returncode == 0, second.stderr
    folders = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert len(folders) == 2 and all((tmp_path / "runs" / f / "report.md").exists() for f in folders)


def test_console_logging_writes_to_the_current_stderr_after_the_old_one_is_closed(monkeypatch) -> None:
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    console_logging()
    first.close()
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    logging.getLogger("fedara.test").warning("a warning after the swap")
    assert "fedara.test WARNING a warning after the swap" in second.getvalue()
    assert "Logging error" not in second.getvalue()


@pytest.mark.parametrize("flags, named", [
    (["--local-cpu-limit", "1,x"], "--local-cpu-limit: CPU limits must be comma-separated cores"),
    (["--local-cpu-limit", "1,0"], "--local-cpu-limit: CPU limits must be at least 0.01 core each"),
    (["--mode", "async", "--task-timeout", "0"], "--task-timeout must be positive seconds, got 0"),
    (["--task-timeout", "5"], "--task-timeout 5 ends async tasks"),
    (["--mode", "async", "--aggregators", "2", "--broker", "mqtt://127.0.0.1:1"], "--mode async with --aggregators 2"),
    (["--mode", "async", "--aggregate", "updates", "--dp-noise-multiplier", "1", "--dp-clip-quantile", "0.5"],
     "--dp-clip-quantile 0.5 with --mode async"),
])
def test_a_bad_cpu_limit_or_async_combination_is_named_in_one_line_and_exits_2(flags, named, tmp_path):
    done = run("server.broker_loop", "--local-devices", "2", "--out", str(tmp_path / "run"), *flags)
    assert done.returncode == 2 and done.stderr.count(named) == 1, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_the_broker_loop_takes_dp_in_the_async_mode():
    args = broker_loop.build_parser().parse_args(["--local-devices", "3", "--mode", "async", "--aggregate", "updates",
                                                  "--buffer-size", "2", "--dp-noise-multiplier", "1",
                                                  "--dp-target-epsilon", "8"])
    check_broker_args(args)  # no refusal: the MQTT loop stops at the budget as the simulator does


@pytest.mark.parametrize("module", ["server.simulate", "server.broker_loop"])
def test_async_flags_in_sync_mode_are_refused_in_one_line_naming_them(module, tmp_path):
    extra = ["--local-devices", "2"] if module == "server.broker_loop" else []
    done = run(module, "--buffer-size", "5", "--staleness-exponent", "0", "--out", str(tmp_path / "run"), *extra)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "--buffer-size --staleness-exponent are for --mode async and would be ignored in --mode sync" in done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag, value", [("--concurrency", "4"), ("--max-staleness", "3"), ("--server-lr", "2"),
                                         ("--buffer-normalize", "samples")])
def test_each_async_flag_is_refused_in_sync_mode(flag, value):
    with pytest.raises(ValueError, match=f"^{flag} is for --mode async"):
        check_args(parse(simulate.build_parser(), [flag, value]))


def test_an_async_flag_at_its_default_value_is_still_seen_in_sync_mode():
    with pytest.raises(ValueError, match="--buffer-size is for --mode async"):
        check_args(parse(simulate.build_parser(), ["--buffer-size", "10"]))


def async_args(*flags: str):
    return parse(simulate.build_parser(), ["--mode", "async", *flags])


def test_a_dp_buffer_larger_than_the_fleet_is_refused_since_it_would_never_fill():
    args = async_args("--buffer-size", "5", "--aggregate", "updates", "--dp-noise-multiplier", "1")
    with pytest.raises(ValueError, match="--buffer-size 5 with 3 devices and DP: a device counts once per buffer"):
        check_async_fleet(args, 3)


def test_a_buffer_larger_than_the_fleet_or_the_concurrency_is_warned_with_the_reason():
    assert check_async_fleet(async_args("--buffer-size", "4", "--concurrency", "8"), 8) == []
    fleet, slots = check_async_fleet(async_args("--buffer-size", "6", "--concurrency", "4"), 5)
    assert fleet.startswith("--buffer-size 6 is more than the 5 devices")
    assert slots.startswith("--buffer-size 6 is more than --concurrency 4") and "K ≤ C/2" in slots
    assert check_async_fleet(async_args("--buffer-size", "6", "--concurrency", "8"), None) == []  # devices unknown


@pytest.mark.slow
def test_a_buffer_larger_than_the_fleet_is_warned_on_the_console_before_the_run(tmp_path):
    done = run("server.simulate", "--mode", "async", "--clients", "2", "--buffer-size", "3", "--concurrency", "2",
               "--dataset", "digits", "--max-samples", "300", "--rounds", "1", "--local-epochs", "1",
               "--out", str(tmp_path / "run"))
    assert done.returncode == 0 and "warning: --buffer-size 3 is more than the 2 devices" in done.stderr, done.stderr


@pytest.mark.parametrize("module", ["server.simulate", "server.broker_loop"])
@pytest.mark.parametrize("flags, named", [
    (["--dp-target-epsilon", "0.001"], "--dp-target-epsilon 0.001 fits no round: one round already spends ε = "),
    (["--dp-delta", "0.34"], "--dp-delta 0.34 is not below 1/N = 0.333 for N = 3 devices"),
])
def test_a_privacy_budget_that_cannot_work_is_refused_in_one_line_before_the_data_loads(module, flags, named,
                                                                                         tmp_path):
    devices = ["--local-devices", "3"] if module == "server.broker_loop" else ["--clients", "3"]
    done = run(module, *devices, "--aggregate", "updates", "--dp-noise-multiplier", "1", *flags,
               "--out", str(tmp_path / "run"))
    assert done.returncode == 2 and done.stderr.count(named) == 1, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("broker", ["mqtt://127.0.0.1:{port}", "mqtt://no-such-host.invalid:1883"])
def test_a_broker_that_cannot_be_there_is_named_within_two_seconds(broker, tmp_path):
    """A refusal on loopback or a name that does not resolve needs no wait: said before the data loads."""
    started = time.monotonic()
    done = run("server.broker_loop", "--broker", broker.format(port=free_loopback_port()), "--local-devices", "1",
               "--out", str(tmp_path / "run"))
    elapsed = time.monotonic() - started
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "connection refused: nothing listens" in done.stderr or "cannot resolve the broker host" in done.stderr
    assert elapsed < 2.0, f"{elapsed:.2f} s"


@pytest.mark.parametrize("module", ["server.simulate", "server.broker_loop"])
def test_an_out_that_is_a_file_is_named_in_one_line(module):
    extra = ["--local-devices", "1"] if module == "server.broker_loop" else []
    done = run(module, "--out", "README.md", *extra)
    assert done.returncode == 2 and done.stderr.strip() == (
        "error: --out README.md is a file, not a folder: name a folder for the run (or leave --out out for a new one)")


def test_a_memory_limit_below_any_devices_floor_is_refused_at_once(tmp_path):
    done = run("server.broker_loop", "--local-devices", "2", "--local-memory-limit-mb", "128,20",
               "--out", str(tmp_path / "run"))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "--local-memory-limit-mb 20 MiB is below the smallest memory any measured device ran in" in done.stderr
