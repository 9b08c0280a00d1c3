"""A user's model named by --model MODULE:FUNCTION or PATH.py:FUNCTION: built from a file anywhere, probed once
against the contract (docs/your_model.md), each misfit refused in one line that names it."""
from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

from fedcore.model_probe import ModelMisfit, probe_model
from fedcore.model_spec import absolute_spec, parse_model_spec
from fedcore.models import ARCHITECTURES, SplitModel, build_model, rank_plan, split_sequential
from tests.support.processes import child_env

ZOO = tuple(ARCHITECTURES)
MLP = """
from torch import nn
from fedcore.models import split_sequential

class Flat(nn.Module):
    def forward(self, x):
        return x.flatten(1)

def build(input_shape, num_classes):
    size = 1
    for d in input_shape:
        size *= d
    return split_sequential(nn.Sequential(Flat(), nn.Linear(size, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(),
                                          nn.Linear(8, num_classes)))
"""


def write_model(folder, text: str, name: str = "mine.py") -> str:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return f"{path}:build"


def model(fe: nn.Module, width: int, classes: int = 3) -> SplitModel:
    return SplitModel("test", fe, width, classes)


def test_a_model_file_anywhere_builds_with_its_fe_and_head(tmp_path):
    built = build_model(write_model(tmp_path, MLP), (2, 5), 3, seed=0)
    assert isinstance(built.head, nn.Linear) and built.head.out_features == 3 and built.feature_dim == 8
    assert probe_model(built, (2, 5), 3) == 8
    assert list(built.state_dict()) == ["fe.1.weight", "fe.1.bias", "fe.3.weight", "fe.3.bias", "head.weight",
                                        "head.bias"]


def test_the_same_seed_builds_the_same_weights(tmp_path):
    spec = write_model(tmp_path, MLP)
    first, again = build_model(spec, (4,), 3, seed=7), build_model(spec, (4,), 3, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), again.state_dict().values()))


def test_a_model_built_from_a_file_pickles_in_a_process_that_imports_the_file(tmp_path):
    spec = write_model(tmp_path, MLP)
    blob = pickle.dumps(build_model(spec, (4,), 3, seed=0))
    code = ("import pickle, sys; from fedcore.models import import_model_code, ARCHITECTURES; "
            "from fedcore.model_spec import parse_model_spec; "
            f"import_model_code(parse_model_spec({spec!r}, tuple(ARCHITECTURES))); "
            "m = pickle.loads(sys.stdin.buffer.read()); print(m.feature_dim)")
    done = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, env=child_env(),
                          timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == "8"


def test_a_relative_model_file_is_made_absolute_and_a_zoo_name_is_kept(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute_spec("models/mine.py:build") == f"{tmp_path}/models/mine.py:build"
    assert absolute_spec("fedavgcnn") == "fedavgcnn" and absolute_spec("pkg.mod:build") == "pkg.mod:build"


@pytest.mark.parametrize("text, message", [
    ("resnet18", "is not a zoo model"),
    ("/nowhere/model.py:build", "no file /nowhere/model.py"),
    ("no_such_module_here:build", "no module 'no_such_module_here'"),
    ("examples/dscnn.py:2build", "is not a function name"),
])
def test_a_model_that_cannot_be_found_is_named_with_the_fix(text, message):
    with pytest.raises(ValueError, match=message):
        parse_model_spec(text, ZOO)


def test_a_module_function_spec_is_parsed():
    spec = parse_model_spec("fedcore.models:split_sequential", ZOO)
    assert (spec.kind, spec.source, spec.function) == ("module", "fedcore.models", "split_sequential")


def test_split_sequential_cuts_before_the_last_linear():
    fe, head = split_sequential(nn.Sequential(nn.Flatten(), nn.Linear(4, 2)))
    assert isinstance(head, nn.Linear) and len(fe) == 1
    with pytest.raises(ValueError, match="last layer must be the nn.Linear head"):
        split_sequential(nn.Sequential(nn.Linear(4, 2), nn.ReLU()))


def test_a_function_returning_neither_fe_and_head_nor_the_pair_is_refused(tmp_path):
    spec = write_model(tmp_path, "from torch import nn\ndef build(shape, k):\n    return nn.Linear(3, k)\n")
    with pytest.raises(ValueError, match=r"must return a module with \.fe .* or the pair \(fe, head\)"):
        build_model(spec, (3,), 2)


class Custom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class UsesCustom(nn.Module):
    def forward(self, x):
        return Custom.apply(x)


@pytest.mark.parametrize("fe, width, shape, message", [
    (nn.Conv1d(2, 4, 3), 4, (2, 8), r"maps a batch of 3 to \(3, 4, 6\), not \(batch, D\)"),
    (nn.Sequential(nn.Linear(5, 4).double()), 4, (5,), "parameter fe.0.weight is float64; the device trains float32"),
    (nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4, momentum=None)), 4, (5,), "fe.1: BatchNorm1d with momentum=None"),
    (nn.Sequential(nn.Linear(7, 4)), 4, (5,), r"fails on samples of the data's shape \(5,\)"),
    (nn.Sequential(nn.Linear(5, 4), UsesCustom()), 4, (5,), "calls the custom autograd Function Custom"),
    (nn.Sequential(nn.Linear(5, 6)), 4, (5,), r"make it nn.Linear\(6, 3\)"),
])
def test_each_misfit_is_refused_naming_it(fe, width, shape, message):
    with pytest.raises(ModelMisfit, match=message):
        probe_model(model(fe, width), shape, 3)


def test_the_probe_leaves_weights_and_batchnorm_statistics_as_they_were():
    checked = model(nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4)), 4)
    before = {k: v.clone() for k, v in checked.state_dict().items()}
    probe_model(checked, (5,), 3)
    assert all(torch.equal(before[k], v) for k, v in checked.state_dict().items())


def test_a_model_that_embeds_token_ids_is_probed_with_ids_below_its_vocabulary():
    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(7, 4)

        def forward(self, x):
            return self.embed(x.long()).mean(1)

    assert probe_model(model(Bag(), 4), (5,), 3) == 4  # normal samples would be negative ids: IndexError


def test_factorize_and_personal_must_name_layers_of_the_fe():
    checked = model(nn.Sequential(nn.Linear(5, 4)), 4)
    checked.factorize = ("7",)
    with pytest.raises(ModelMisfit, match="factorize names '7'"):
        probe_model(checked, (5,), 3)
    checked.factorize, checked.personal = None, ("9",)
    with pytest.raises(ModelMisfit, match="personal names '9'"):
        probe_model(checked, (5,), 3)


def test_the_rank_plan_takes_the_models_factorize_list_and_leaves_personal_layers_dense():
    fe = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    chosen = model(fe, 32)
    chosen.factorize = ("0",)
    assert rank_plan(chosen, 0.5).layers == ("0",)
    chosen.factorize, chosen.personal = None, ("2",)
    assert rank_plan(chosen, 0.5).layers == ("fe.0", "fe.4")


def run_simulate(capsys, *flags: str) -> tuple[int, str, str]:
    """server.simulate's main in this process (torch is loaded already): its exit status, stdout and stderr."""
    from server import simulate

    status = simulate.main(list(flags))
    out, err = capsys.readouterr()
    return status, out, err


def write_npz(path, sample: tuple[int, ...], classes: int = 3, n: int = 240) -> str:
    rng = np.random.default_rng(0)
    y = np.arange(n) % classes
    x = rng.normal(size=(n, *sample)) + y.reshape(-1, *([1] * len(sample)))
    np.savez(path, x_train=x[: n * 3 // 4], y_train=y[: n * 3 // 4], x_test=x[n * 3 // 4:], y_test=y[n * 3 // 4:])
    return f"npz:{path}"


def test_a_model_file_from_a_temporary_folder_federates_through_the_simulator(tmp_path, capsys):
    status, out, err = run_simulate(capsys, "--model", write_model(tmp_path, MLP),
                                    "--dataset", write_npz(tmp_path / "d.npz", (2, 5)), "--clients", "2", "--rounds", "1",
                                    "--local-epochs", "1", "--min-samples", "20", "--out", str(tmp_path / "run"))
    assert status == 0, err
    assert "final accuracy" in out


def test_a_misfit_is_one_line_and_exit_2_before_anything_compiles(tmp_path, capsys):
    spec = write_model(tmp_path, """
        from torch import nn
        def build(input_shape, num_classes):
            return nn.Conv1d(input_shape[0], 4, 3), nn.Linear(4, num_classes)
        """)
    status, out, err = run_simulate(capsys, "--model", spec, "--dataset", write_npz(tmp_path / "d.npz", (2, 5)),
                                    "--clients", "2", "--rounds", "1", "--backend", "ort", "--min-samples", "20",
                                    "--out", str(tmp_path / "run"))
    errors = [line for line in err.splitlines() if line.strip()]
    assert status == 2
    assert len(errors) == 1 and errors[0].startswith(f"error: --model {spec}: in train mode the FE maps a batch")
    assert "compiling" not in out


@pytest.mark.slow
def test_an_operation_without_an_onnx_translation_is_one_line_naming_it(tmp_path, capsys):
    spec = write_model(tmp_path, """
        import torch
        from torch import nn

        class Bessel(nn.Module):
            def forward(self, x):
                return torch.special.i0(x)

        def build(input_shape, num_classes):
            return nn.Sequential(nn.Flatten(), nn.Linear(10, 8), Bessel()), nn.Linear(8, num_classes)
        """)
    status, out, err = run_simulate(capsys, "--model", spec, "--dataset", write_npz(tmp_path / "d.npz", (2, 5)),
                                    "--clients", "2", "--rounds", "1", "--backend", "portable", "--rank-ratio", "1",
                                    "--min-samples", "20", "--cache-dir", str(tmp_path / "cache"),
                                    "--out", str(tmp_path / "run"))
    errors = [line for line in err.splitlines() if line.strip()]
    assert status == 2
    assert len(errors) == 1
    assert errors[0].startswith("error: fe.2: the op prims.bessel_i0 has no ONNX translation")
