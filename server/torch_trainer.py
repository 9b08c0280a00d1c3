"""The PyTorch reference behind the device trainers' interface (``device_runtime.local_round.Trainer``), so the
simulator's ``--backend torch`` runs the very local round a device runs, with autograd as the oracle."""
from __future__ import annotations

import numpy as np

from device_runtime.tensor_check import check_tensors
from device_runtime.trainer import EvalResult, TrainResult
from fedcore.lowrank import FE_PREFIX
from fedcore.models import SplitModel
from fedcore.objective import compute_anchors
from fedcore.tensors import carried_tensors
from server.engine.sampling import to_numpy, to_torch
from server.training import evaluate, train_local

HEAD_PREFIX = "head."


class TorchTrainer:
    """A factorized client model trained with ``server.training.train_local``; its carried tensors
    (``fedcore.tensors``: parameters and BatchNorm running statistics, not the counter) by state_dict name."""

    def __init__(self, model: SplitModel):
        self.model = model
        state = carried_tensors(model)
        self.fe_names = tuple(k for k in state if k.startswith(FE_PREFIX))
        self.head_names = tuple(k for k in state if k.startswith(HEAD_PREFIX))

    def _read(self, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        state = carried_tensors(self.model)
        return to_numpy({k: state[k] for k in names})

    def _write(self, tensors: dict[str, np.ndarray], names: tuple[str, ...], kind: str) -> None:
        state = carried_tensors(self.model)
        check_tensors(kind, tensors, {k: tuple(state[k].shape) for k in names})
        self.model.load_state_dict(to_torch(tensors), strict=False)

    def get_fe(self) -> dict[str, np.ndarray]:
        return self._read(self.fe_names)

    def set_fe(self, tensors: dict[str, np.ndarray]) -> None:
        self._write(tensors, self.fe_names, "FE")

    def get_head(self) -> dict[str, np.ndarray]:
        return self._read(self.head_names)

    def set_head(self, tensors: dict[str, np.ndarray]) -> None:
        self._write(tensors, self.head_names, "head")

    def compute_anchors(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return compute_anchors(self.model.fe, x, y, self.model.num_classes)

    def train(self, x: np.ndarray, y: np.ndarray, *, anchors: np.ndarray | None, mask: np.ndarray | None,
              lam: float, mu: float, lr: float, epochs: int, batch_size: int, rng: np.random.Generator,
              params: str = "all") -> TrainResult:
        groups = {"all": self.model, "fe": self.model.fe, "head": self.model.head}
        if params not in groups:
            raise ValueError(f"params must be one of {tuple(groups)}, got {params!r}")
        return train_local(self.model, x, y, anchors=anchors, mask=mask, lam=lam, mu=mu, lr=lr, epochs=epochs,
                           batch_size=batch_size, rng=rng, params=list(groups[params].parameters()))

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> EvalResult:
        return evaluate(self.model, x, y)
