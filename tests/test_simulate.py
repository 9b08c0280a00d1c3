import json

import numpy as np
import pytest

from server.simulate import build_parser, main, prepare
from server.strategy import FederationConfig, batch_seed, sample_clients, weighted_accuracy

QUICK = ["--dataset", "digits", "--clients", "4", "--rounds", "2", "--local-epochs", "1", "--batch-size", "32",
         "--max-samples", "600", "--lr", "0.05", "--lam", "1", "--lam-warmup", "1"]


@pytest.mark.parametrize("algo", ["fedara", "fedavg", "fedrep", "local"])
def test_two_round_federation_runs_and_writes_the_documented_json(algo, tmp_path):
    out = tmp_path / "run.json"
    assert main(QUICK + ["--algo", algo, "--rank-ratio", "0.5", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc) >= {"config", "rounds", "final_accuracy", "best_accuracy"}
    assert [r["round"] for r in doc["rounds"]] == [1, 2]
    assert set(doc["rounds"][0]) >= {"round", "accuracy", "accuracy_std", "train_loss", "bytes_down", "bytes_up", "seconds"}
    assert 0.0 <= doc["final_accuracy"] <= 1.0 and doc["best_accuracy"] >= doc["final_accuracy"]


def test_local_training_exchanges_no_bytes(tmp_path):
    out = tmp_path / "run.json"
    main(QUICK + ["--algo", "local", "--out", str(out)])
    assert all(r["bytes_down"] == 0 and r["bytes_up"] == 0 for r in json.loads(out.read_text())["rounds"])


def test_factorized_clients_exchange_fewer_bytes_than_dense(tmp_path):
    sizes = {}
    for ratio in ("1.0", "0.25"):
        out = tmp_path / f"{ratio}.json"
        main(QUICK + ["--rounds", "1", "--rank-ratio", ratio, "--out", str(out)])
        sizes[ratio] = json.loads(out.read_text())["rounds"][0]["bytes_up"]
    assert sizes["0.25"] < 0.5 * sizes["1.0"]


def test_rank_tiers_are_assigned_round_robin():
    args = build_parser().parse_args(QUICK + ["--rank-tiers", "1.0,0.25"])
    clients, _ = prepare(args)
    assert [bool(c.plan.ranks) for c in clients] == [False, True, False, True]


def test_heterogeneous_models_only_with_local(capsys):
    assert main(QUICK + ["--model", "cnn1,cnn2", "--algo", "fedara"]) == 2
    assert "only make sense with --algo local" in capsys.readouterr().err


def test_heterogeneous_local_models_train(tmp_path):
    assert main(QUICK + ["--rounds", "1", "--model", "cnn4,cnn5", "--algo", "local", "--out", str(tmp_path / "o.json")]) == 0


def test_same_seed_gives_identical_runs(tmp_path):
    docs = []
    for name in ("a", "b"):
        main(QUICK + ["--out", str(tmp_path / name)])
        docs.append(json.loads((tmp_path / name).read_text()))
    assert [r["accuracy"] for r in docs[0]["rounds"]] == [r["accuracy"] for r in docs[1]["rounds"]]
    assert [r["train_loss"] for r in docs[0]["rounds"]] == [r["train_loss"] for r in docs[1]["rounds"]]


def test_join_ratio_samples_a_seeded_subset():
    ids = [f"c{i}" for i in range(10)]
    chosen = sample_clients(ids, 0.3, 5, seed=1)
    assert len(chosen) == 3 and chosen == sample_clients(ids, 0.3, 5, seed=1)
    assert chosen != sample_clients(ids, 0.3, 6, seed=1) or chosen != sample_clients(ids, 0.3, 7, seed=1)


def test_batch_seed_differs_per_round_and_client():
    assert len({batch_seed(0, r, c) for r in range(3) for c in range(3)}) == 9


def test_accuracy_is_sample_weighted_over_clients():
    accuracy, std = weighted_accuracy([9, 1], [10, 10])
    assert accuracy == pytest.approx(0.5) and std == pytest.approx(np.std([0.9, 0.1]))


def test_invalid_config_is_refused():
    with pytest.raises(ValueError, match="join ratio"):
        FederationConfig(join_ratio=0.0)
    with pytest.raises(ValueError, match="unknown algorithm"):
        FederationConfig(algo="fedprox")
