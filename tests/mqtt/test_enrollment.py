"""Specification of enrollment: the file of admitted device ids and keys, and the commands that edit it."""
from __future__ import annotations

import logging
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from device_runtime.auth import read_key_file
from server.mqtt.enrollment import (EnrollmentError, enroll, key_ring, load_enrollment, main, revoke, rotate,
                               run_key_ring, save_enrollment)

ROOT = Path(__file__).resolve().parents[2]


def test_enroll_gives_new_ids_keys_and_keeps_existing_ones():
    first = enroll({}, ["dev_a"])
    second = enroll(first, ["dev_a", "dev_b"])
    assert second["dev_a"] == first["dev_a"] and len(second["dev_b"]) == 32


def test_rotate_changes_only_that_key_and_revoke_removes_the_id():
    keys = enroll({}, ["dev_a", "dev_b"])
    rotated = rotate(keys, "dev_a")
    assert rotated["dev_a"] != keys["dev_a"] and rotated["dev_b"] == keys["dev_b"]
    assert set(revoke(keys, "dev_a")) == {"dev_b"}


def test_rotating_an_id_that_is_not_enrolled_says_so():
    with pytest.raises(EnrollmentError, match="not enrolled"):
        rotate({}, "dev_a")


def test_enrollment_file_round_trips_and_is_private(tmp_path):
    keys = enroll({}, ["dev_a", "dev_b"])
    path = save_enrollment(tmp_path / "enroll.json", keys)
    assert load_enrollment(path) == keys
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_missing_enrollment_file_names_the_fix(tmp_path):
    with pytest.raises(EnrollmentError, match="--enroll open"):
        load_enrollment(tmp_path / "none.json")


def test_a_key_of_the_wrong_length_names_the_file_and_the_format(tmp_path):
    (tmp_path / "k").write_text("abcd\n")
    with pytest.raises(ValueError, match="64 hex digits"):
        read_key_file(tmp_path / "k")


def test_enrolled_key_ring_admits_only_the_enrolled_ids(tmp_path):
    path = save_enrollment(tmp_path / "enroll.json", enroll({}, ["dev_a"]))
    ring = key_ring(str(path), None)
    assert ring.enrolled("dev_a") and not ring.enrolled("dev_b")


def test_open_enrollment_needs_a_run_key(tmp_path):
    with pytest.raises(EnrollmentError, match="--run-key"):
        key_ring("open", None)


def test_open_enrollment_is_logged_loudly(tmp_path, caplog):
    assert main(["new-key", str(tmp_path / "run.key")]) == 0
    with caplog.at_level(logging.WARNING):
        ring = key_ring("open", tmp_path / "run.key")
    assert ring.enrolled("anyone") and "OPEN ENROLLMENT" in caplog.text


def test_cli_add_rotate_revoke_list(tmp_path, capsys):
    file, keys_dir = tmp_path / "enroll.json", tmp_path / "keys"
    assert main(["add", str(file), "dev_a", "dev_b", "--keys-dir", str(keys_dir)]) == 0
    old = read_key_file(keys_dir / "dev_a.key")
    assert load_enrollment(file)["dev_a"] == old
    assert main(["rotate", str(file), "dev_a", "--keys-dir", str(keys_dir)]) == 0
    assert read_key_file(keys_dir / "dev_a.key") == load_enrollment(file)["dev_a"] != old
    assert main(["revoke", str(file), "dev_b"]) == 0
    capsys.readouterr()
    assert main(["list", str(file)]) == 0
    assert capsys.readouterr().out.split() == ["dev_a"]


def test_cli_refuses_a_bad_id_with_exit_2_and_no_traceback(tmp_path, capsys):
    assert main(["add", str(tmp_path / "e.json"), "a/b", "--keys-dir", str(tmp_path)]) == 2
    assert "device_id" in capsys.readouterr().err


def test_credentials_command_also_enrolls_its_devices(tmp_path):
    out = tmp_path / "auth"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "mosquitto_credentials.py"), "--out", str(out),
                           "--device-id", "dev_a", "--device-id", "dev_b", "--bind", "127.0.0.1", "--user", "root"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    keys = load_enrollment(out / "enrollment.json")
    assert set(keys) == {"dev_a", "dev_b"}
    assert read_key_file(out / "keys" / "dev_b.key") == keys["dev_b"]
    assert f"--enroll {out / 'enrollment.json'}" in done.stdout and f"--key-file {out / 'keys' / 'dev_a.key'}" in done.stdout


def test_runs_of_one_enrollment_share_their_authentication_state(tmp_path):
    path = save_enrollment(tmp_path / "enroll.json", enroll({}, ["dev_a"]))
    _, first = run_key_ring(str(path), None, ["dev_a"], tmp_path / "run1")
    _, second = run_key_ring(str(path), None, [], tmp_path / "run2")
    assert first == second == tmp_path / "enroll.json.state"
    assert read_key_file(tmp_path / "run1" / "keys" / "dev_a.key") == load_enrollment(path)["dev_a"]


def test_a_run_without_enrollment_enrolls_its_local_devices_only(tmp_path):
    ring, state = run_key_ring(None, None, ["dev_000"], tmp_path / "run")
    assert ring.device_ids == ("dev_000",) and state == tmp_path / "run" / "enrollment.json.state"


def test_a_run_without_enrollment_or_local_devices_names_the_flags(tmp_path):
    with pytest.raises(EnrollmentError, match="--enroll FILE"):
        run_key_ring(None, None, [], tmp_path / "run")
