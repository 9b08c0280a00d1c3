"""The in-process driver (``python -m server.simulate``) and the round engine's per-algorithm decisions.

Runs are tiny (digits, 4 clients, 1-2 rounds, 1 epoch, torch backend); the engine is driven directly where a
decision is checked (what each algorithm asks of a device, what the server averages).
"""
import time

import numpy as np
import pytest
import torch

from device_runtime.messages import update_message
from device_runtime.task import Phase, Update
from fedcore.lowrank import FE_PREFIX
from server.algorithms import FedAra, FedAvg, FedRep, Local, Settings, get_algorithm
from server.outputs.checkpoint import CHECKPOINT_NAME, load_checkpoint
from server.outputs.report import METRICS_FILE, REPORT_FILE, read_metrics
from server.run_setup import RunFolder
from server.simulate import Simulation, build_parser, main
from server.simulator_flags import DEVICE_PREFIX
from server.engine.run_config import FederationConfig
from server.engine.sampling import batch_seed, sample_clients, weighted_accuracy

QUICK = ["--dataset", "digits", "--clients", "4", "--rounds", "2", "--local-epochs", "1", "--batch-size", "32",
         "--max-samples", "600", "--lr", "0.05", "--lam", "1", "--lam-warmup", "1"]
EVAL = {"eval_correct": 1, "eval_loss": 1.0}


def run_main(out, *flags: str) -> tuple[list[dict], dict[str, np.ndarray], dict[str, dict[str, np.ndarray]]]:
    """main(); returns the records, the final global model and each device's personal tensors."""
    assert main([*QUICK, "--out", str(out), *flags]) == 0
    tensors = load_checkpoint(out / CHECKPOINT_NAME).tensors
    personal: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        if key.startswith(DEVICE_PREFIX):
            device_id, name = key[len(DEVICE_PREFIX):].split("/", 1)
            personal.setdefault(device_id, {})[name] = value
    shared = {k: v for k, v in tensors.items() if not k.startswith(DEVICE_PREFIX)}
    return read_metrics(out / METRICS_FILE), shared, personal


def simulation(tmp_path, *flags: str) -> Simulation:
    args = build_parser().parse_args([*QUICK, "--out", str(tmp_path / "sim"), *flags])
    return Simulation(args, RunFolder(tmp_path / "sim"))


# -- runs and their outputs -----------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["fedara", "fedavg", "fedrep", "local"])
def test_two_round_federation_writes_its_records_and_the_algorithms_global_model(algo, tmp_path):
    records, shared, personal = run_main(tmp_path / "run", "--algo", algo, "--rank-ratio", "0.5")
    assert [r["round"] for r in records] == [1, 2]
    for r in records:
        assert set(r) >= {"round", "accuracy", "accuracy_std", "train_loss", "bytes_down", "bytes_up", "seconds",
                          "per_device", "per_tier"}
        assert (r["participants"], r["selected"], r["evaluated"], r["dropped"]) == (4, 4, 4, {})
        assert 0.0 <= r["accuracy"] <= 1.0 and np.isfinite(r["train_loss"])
    assert (tmp_path / "run" / REPORT_FILE).stat().st_size > 0
    assert set(personal) == {f"dev_{i:03d}" for i in range(4)}
    # What the server keeps: FedARA and FedRep average only the FE, FedAvg the head too, local nothing.
    fe_keys = {k for k in shared if k.startswith(FE_PREFIX)}
    head_keys = set(shared) - fe_keys
    assert bool(fe_keys) == (algo != "local")
    assert bool(head_keys) == (algo == "fedavg")
    # What stays on the device: the head (and the FE too for local training); never what FedAvg averages only.
    for tensors in personal.values():
        assert all(k.startswith("head.") for k in tensors) != (algo == "local")
        assert any(k.startswith(FE_PREFIX) for k in tensors) == (algo == "local")


def test_fedavg_averages_the_devices_heads_by_sample_count(tmp_path):
    """After the last round each device holds the head it trained and sent; the global head is their mean
    weighted by training samples (a FedAvg that shared only the FE would keep the initial head)."""
    _, shared, personal = run_main(tmp_path / "run", "--algo", "fedavg", "--rounds", "1")
    sim = simulation(tmp_path, "--algo", "fedavg")
    samples = {d: len(device.shard.y_train) for d, device in sim.devices.items()}
    total = sum(samples.values())
    for name in (k for k in shared if not k.startswith(FE_PREFIX)):
        expected = sum(samples[d] * personal[d][name].astype(np.float64) for d in personal) / total
        np.testing.assert_allclose(shared[name], expected, rtol=0, atol=1e-6, err_msg=name)
        initial = sim.engine.initial_personal["fedavgcnn"][name]
        assert not np.allclose(shared[name], initial)


def test_personal_heads_stay_personal(tmp_path):
    """FedARA and FedRep never average heads: after training, no two devices hold the same head."""
    for algo in ("fedara", "fedrep"):
        _, _, personal = run_main(tmp_path / algo, "--algo", algo, "--rounds", "1")
        heads = [np.concatenate([v.ravel() for _, v in sorted(p.items())]) for p in personal.values()]
        assert all(not np.array_equal(a, b) for i, a in enumerate(heads) for b in heads[i + 1:]), algo


def test_local_training_exchanges_no_bytes(tmp_path):
    records, shared, _ = run_main(tmp_path / "run", "--algo", "local")
    assert shared == {}
    assert all(r["bytes_down"] == 0 and r["bytes_up"] == 0 for r in records)
    assert all(r["aggregated"] is False for r in records)


def test_factorized_clients_exchange_fewer_bytes_than_dense(tmp_path):
    sizes = {}
    for ratio in ("1.0", "0.25"):
        records, _, _ = run_main(tmp_path / ratio, "--rounds", "1", "--rank-ratio", ratio)
        sizes[ratio] = records[0]["bytes_up"]
    assert 0 < sizes["0.25"] < 0.5 * sizes["1.0"]


def test_other_models_train_locally(tmp_path):
    """(Heterogeneous per-client models, ``--model cnn4,cnn5``, are gone with the engine: every device runs the
    one --model.)"""
    records, _, personal = run_main(tmp_path / "run", "--rounds", "1", "--model", "cnn5", "--algo", "local")
    assert records[0]["evaluated"] == 4 and 0.0 <= records[0]["accuracy"] <= 1.0
    assert all(any(k.startswith(FE_PREFIX) for k in p) for p in personal.values())


def test_local_training_gives_each_device_its_model_of_a_list_round_robin(tmp_path):
    _, shared, personal = run_main(tmp_path / "run", "--algo", "local", "--model", "cnn1,cnn5", "--rounds", "1")
    hidden = {d: p["fe.fc1.weight"].shape[0] for d, p in personal.items()}  # CNN1's fc1 is 2000 wide, CNN5's 500
    assert shared == {} and hidden == {"dev_000": 2000, "dev_001": 500, "dev_002": 2000, "dev_003": 500}


def test_a_model_list_is_refused_for_an_algorithm_that_shares_one_model(capsys):
    assert main(QUICK + ["--model", "cnn1,cnn2", "--algo", "fedara"]) == 2
    assert "--model 'cnn1,cnn2' names several models" in capsys.readouterr().err


@pytest.mark.slow
def test_same_seed_gives_identical_runs_and_another_seed_does_not(tmp_path):
    runs = [run_main(tmp_path / name, *flags) for name, flags in (("a", ()), ("b", ()), ("c", ("--seed", "1")))]
    (a, fe_a, _), (b, fe_b, _), (c, fe_c, _) = runs
    for key in ("accuracy", "train_loss"):
        assert [r[key] for r in a] == [r[key] for r in b]
    assert all(np.array_equal(fe_a[k], fe_b[k]) for k in fe_a)
    assert not all(np.array_equal(fe_a[k], fe_c[k]) for k in fe_a)


def test_bad_flags_exit_2_with_one_line(tmp_path, capsys):
    assert main(QUICK + ["--clients", "0", "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip() == "error: --clients must be >= 1, got 0"


# -- the engine's decisions per algorithm ------------------------------------------------------------


def test_rank_tiers_are_assigned_round_robin_by_device_id(tmp_path):
    sim = simulation(tmp_path, "--rank-tiers", "1.0,0.25")
    ratios = [sim.engine.coordinator.devices[d].ratio for d in sorted(sim.devices)]
    assert ratios == [1.0, 0.25, 1.0, 0.25]
    assert [bool(sim.engine.plan_info(d).resolved.ranks) for d in sorted(sim.devices)] == [False, True, False, True]


SETTINGS = Settings(local_epochs=5, lam=10.0, lam_warmup=10, mu=1e-3)


def fit(algorithm, round_index: int = 11, factorized: bool = True):
    """What ``algorithm`` tells a training client in ``round_index`` (5 epochs, λ 10 over 10 rounds, μ 1e-3)."""
    return algorithm.configure_fit(round_index, factorized)


def test_the_algorithms_phases_returns_and_anchor_weight():
    assert fit(FedAra.from_settings(SETTINGS)).phases == fit(FedAvg.from_settings(SETTINGS)).phases == fit(Local.from_settings(SETTINGS)).phases == (Phase("all", 5),)
    assert fit(FedRep.from_settings(SETTINGS)).phases == (Phase("head", 1), Phase("fe", 5))  # head first, on the received FE
    assert [fit(a).returns for a in (FedAra.from_settings(SETTINGS), FedAvg.from_settings(SETTINGS), FedRep.from_settings(SETTINGS), Local.from_settings(SETTINGS))] == ["fe", "all", "fe", "none"]
    assert fit(FedAra.from_settings(SETTINGS), 1).lam == 0.0 and fit(FedAra.from_settings(SETTINGS), 11).lam == 10.0
    assert all(fit(a).lam == 0.0 for a in (FedAvg.from_settings(SETTINGS), FedRep.from_settings(SETTINGS), Local.from_settings(SETTINGS)))
    assert fit(FedAra.from_settings(SETTINGS)).mu == 1e-3 and fit(FedAra.from_settings(SETTINGS), factorized=False).mu == 0.0  # μ acts on factors only


def test_what_each_algorithm_shares_keeps_and_expects_back():
    state = {"fe.w": torch.ones(2, 3), "head.w": torch.ones(4, 2)}
    fe, head = {"fe.w": (2, 3)}, {"head.w": (4, 2)}
    for algorithm in (FedAra.from_settings(SETTINGS), FedRep.from_settings(SETTINGS)):
        assert (set(algorithm.global_tensors(state)), set(algorithm.personal_tensors(state))) == ({"fe.w"}, {"head.w"})
        assert algorithm.update_shapes(fe, head) == fe
    assert set(FedAvg.from_settings(SETTINGS).global_tensors(state)) == {"fe.w", "head.w"} and FedAvg.from_settings(SETTINGS).update_shapes(fe, head) == {**fe, **head}
    assert Local.from_settings(SETTINGS).global_tensors(state) == {} and set(Local.from_settings(SETTINGS).personal_tensors(state)) == {"fe.w", "head.w"}
    assert Local.from_settings(SETTINGS).update_shapes(fe, head) == {}
    assert FedAra.from_settings(SETTINGS).offered_tiers((1.0, 0.5), {"d": 0.5}) == ((1.0, 0.5), {"d": 0.5})
    assert all(a.offered_tiers((1.0, 0.5), {"d": 0.5}) == ((1.0,), {}) for a in (FedAvg.from_settings(SETTINGS), FedRep.from_settings(SETTINGS), Local.from_settings(SETTINGS)))
    with pytest.raises(ValueError, match="unknown algorithm"):
        get_algorithm("fedprox", SETTINGS)


@pytest.mark.parametrize("algo, weights, phases, returns", [
    ("fedara", "fe-factorized", (Phase("all", 1),), "fe"),
    ("fedavg", "fe+head", (Phase("all", 1),), "all"),
    ("fedrep", "fe", (Phase("head", 1), Phase("fe", 1)), "fe"),
    ("local", "none", (Phase("all", 1),), "none"),
])
def test_each_algorithms_tasks(algo, weights, phases, returns, tmp_path):
    sim = simulation(tmp_path, "--algo", algo, "--rank-ratio", "0.5")
    tasks = sim.engine.open_round(2, time.monotonic())
    assert sorted(tasks) == sorted(sim.devices)
    for device_id, task in tasks.items():
        assert (task.phases, task.returns, task.round) == (phases, returns, 2)
        assert task.seed == batch_seed(0, 2, device_id)
        assert task.lam == (1.0 if algo == "fedara" else 0.0)  # λ 1 after a 1-round warm-up
        assert task.mu == (1e-3 if algo == "fedara" else 0.0)  # the Frobenius decay acts on factors only
        names = set(task.weights)
        if weights == "none":
            assert names == set()
        else:
            assert names and all(k.startswith(FE_PREFIX) for k in names - {k for k in names if k.startswith("head.")})
            assert any(k.startswith("head.") for k in names) == (weights == "fe+head")
            assert any(k.endswith((".u", ".v")) for k in names) == (weights == "fe-factorized")


def test_an_evaluation_round_asks_only_for_evaluations(tmp_path):
    sim = simulation(tmp_path, "--algo", "fedavg")
    tasks = sim.engine.open_round(3, time.monotonic(), train=False)
    assert all(t.evaluate_only and t.returns == "none" and t.lam == 0.0 for t in tasks.values())
    assert all(set(t.weights) == set(sim.engine.global_state) for t in tasks.values())


def test_engine_averages_accepted_updates_by_sample_count(tmp_path):
    """FedAvg, driven by hand: device k sends every tensor filled with k + 1 and n_k samples; the new global
    model is Σ n_k (k + 1) / Σ n_k everywhere. An update on the wrong topic's device is not counted."""
    sim = simulation(tmp_path, "--algo", "fedavg")
    engine = sim.engine
    now = time.monotonic()
    tasks = engine.open_round(1, now)
    samples = {d: sim.devices[d].shard.y_train.size for d in tasks}
    for k, (device_id, task) in enumerate(sorted(tasks.items())):
        weights = {n: np.full_like(v, k + 1.0) for n, v in task.weights.items()}
        evaluation = dict(EVAL, eval_total=sim.devices[device_id].shard.y_test.size)
        msg = update_message(Update(1, weights, samples[device_id], 0.5, 0.5, evaluation),
                             plan_hash=sim.devices[device_id].plan_hash, device_id=device_id, run_id=sim.run_id)
        if k == 0:
            assert not engine.receive("dev_003", msg, now).accepted  # dev_000's update on dev_003's topic
        assert engine.receive(device_id, msg, now).accepted
    result, completed = engine.close_round(now)
    assert completed is None and result.enough and engine.pending["participants"] == 4
    expected = sum(samples[d] * (k + 1.0) for k, d in enumerate(sorted(tasks))) / sum(samples.values())
    for name, value in engine.global_state.items():
        torch.testing.assert_close(value, torch.full_like(value, expected), rtol=0, atol=1e-6)


# -- helpers ----------------------------------------------------------------------------------------


def test_join_ratio_samples_a_seeded_subset_that_changes_from_round_to_round():
    ids = [f"c{i}" for i in range(10)]
    rounds = [sample_clients(ids, 0.3, r, seed=1) for r in range(1, 11)]
    assert all(len(s) == 3 and s == sorted(s, key=ids.index) and set(s) <= set(ids) for s in rounds)
    assert rounds == [sample_clients(ids, 0.3, r, seed=1) for r in range(1, 11)]
    assert len({tuple(s) for s in rounds}) >= 5  # 120 possible subsets: a fixed sample would give 1
    assert rounds != [sample_clients(ids, 0.3, r, seed=2) for r in range(1, 11)]
    assert sample_clients(ids, 1.0, 4, seed=1) == ids


def test_batch_seed_differs_per_round_and_device_and_depends_on_nothing_else():
    seeds = {(r, d): batch_seed(0, r, d) for r in range(3) for d in ("dev_000", "dev_001", "dev_002")}
    assert len(set(seeds.values())) == 9
    assert seeds == {(r, d): batch_seed(0, r, d) for r in range(3) for d in ("dev_002", "dev_000", "dev_001")}
    assert batch_seed(1, 0, "dev_000") != seeds[(0, "dev_000")]


def test_accuracy_is_sample_weighted_over_clients():
    accuracy, std = weighted_accuracy([9, 1], [10, 10])
    assert accuracy == pytest.approx(0.5) and std == pytest.approx(np.std([0.9, 0.1]))


def test_invalid_config_is_refused():
    with pytest.raises(ValueError, match="join-ratio"):
        FederationConfig(join_ratio=0.0)
    with pytest.raises(ValueError, match="unknown"):
        FederationConfig(algo="fedprox")
