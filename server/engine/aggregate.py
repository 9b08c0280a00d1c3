"""Sample-weighted aggregation of client FEs, streaming and batched: memory stays flat whatever the client count.

The round's result is Σ_k n_k·W_k / Σ_k n_k, with the sums kept in float64. A client's factorized layer is not
multiplied back on its own: its factors wait in a buffer of bounded width, and a full buffer is folded as ONE
matrix product, Σ_k n_k U_k V_kᵀ = [n_1 U_1 … n_c U_c] [V_1 … V_c]ᵀ, which BLAS runs near its peak (clients of
any rank share the buffer: only the inner dimension grows). The fold happens in the layer's matrix view (conv:
the permuted (c_out·kh, c_in·kw) layout of ``fedcore.lowrank``) and is mapped back to the weight layout once,
when the sum is read. Sums are associative, so several aggregators can each fold a share of the updates and
``merge`` their ``partial`` sums.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fedcore.lowrank import FACTOR_SUFFIXES, from_matrix, matrix_shape

DEFAULT_FOLD_COLUMNS = 2048
"""Inner dimension Σ r_k of one fold: several clients per product (5 of FedAvgCNN's r = 384 tier, 32 of r = 64),
while the buffer stays ~17 MiB for its 512×1600 fc1 in float32 (try others: bench_server.py --fold-columns)."""
DEFAULT_DENSE_FOLD_CLIENTS = 8
"""Dense updates summed in ``product_dtype`` before each float64 add: 8 float32 terms keep ~1e-7 relative error."""


@dataclass
class PartialSum:
    """Σ n_k·W_k (float64, weight layout), Σ n_k and the number of updates behind them: one aggregator's share."""

    sums: dict[str, torch.Tensor]
    total_weight: float
    count: int


class _FactorFold:
    """One factorized layer's pending clients and its float64 Σ n_k U_k V_kᵀ (matrix view).

    A client's U and V are only referenced until the fold, where one concatenation per factor copies them, row by
    row, into preallocated storage viewed as contiguous (m, Σr) and (n, Σr) matrices, and one product adds them
    all: a handful of large operations per fold instead of several per client.
    """

    def __init__(self, rows: int, cols: int, width: int, dtype: torch.dtype):
        self.rows, self.cols, self.width = rows, cols, width
        self.u_store = torch.empty(rows * width, dtype=dtype)
        self.v_store = torch.empty(cols * width, dtype=dtype)
        self.pending: list[tuple[torch.Tensor, torch.Tensor, float]] = []
        self.used = 0
        self.sum = torch.zeros(rows, cols, dtype=torch.float64)

    def add(self, u: torch.Tensor, v: torch.Tensor, weight: float) -> None:
        rank = u.shape[1]
        if self.used + rank > self.width:
            self.fold()
        self.pending.append((u, v, weight))
        self.used += rank

    def fold(self) -> None:
        """Add the pending clients' [n_1 U_1 … n_c U_c][V_1 … V_c]ᵀ, one product, to the float64 sum."""
        if not self.pending:
            return
        u_cat = self.u_store[:self.rows * self.used].view(self.rows, self.used)
        v_cat = self.v_store[:self.cols * self.used].view(self.cols, self.used)
        torch.cat([u for u, _, _ in self.pending], dim=1, out=u_cat)
        torch.cat([v for _, v, _ in self.pending], dim=1, out=v_cat)
        u_cat.mul_(torch.cat([torch.full((u.shape[1],), w, dtype=u_cat.dtype) for u, _, w in self.pending]))
        self.sum += u_cat @ v_cat.T
        self.pending.clear()
        self.used = 0


class _DenseFold:
    """One dense tensor's float64 Σ n_k·W_k, fed through a float32 sum of at most ``clients`` updates.

    A weighted add of a float32 update into float64 converts the update first (one extra copy per add, seen as an
    aten::_to_copy per add in torch's profiler); a float32 sum of a few updates (relative error ~1e-7) is added
    to float64 once per fold instead.
    """

    def __init__(self, shape: tuple[int, ...], clients: int, dtype: torch.dtype):
        self.sum = torch.zeros(shape, dtype=torch.float64)
        self.pending = torch.zeros(shape, dtype=dtype)
        self.clients = clients
        self.count = 0

    def add(self, value: torch.Tensor, weight: float) -> None:
        self.pending.add_(value, alpha=weight)
        self.count += 1
        if self.count == self.clients:
            self.fold()

    def fold(self) -> None:
        if self.count:
            self.sum += self.pending
            self.pending.zero_()
            self.count = 0


class StreamingAverage:
    """Running Σ n_k·W_k and Σ n_k in float64; add one client at a time, read the weighted mean.

    ``fold_columns`` bounds the factor buffer of each layer (Σ r_k of the clients folded together; a layer's
    buffer is at least its full rank wide), ``dense_fold_clients`` the dense updates summed before a float64 add.
    ``product_dtype`` is the dtype the folds run in: devices send float32, so float32 loses nothing in the inputs
    and runs twice as fast as float64; the running sums are float64 either way.
    """

    def __init__(self, dense_shapes: dict[str, tuple[int, ...]], fold_columns: int = DEFAULT_FOLD_COLUMNS,
                 dense_fold_clients: int = DEFAULT_DENSE_FOLD_CLIENTS, product_dtype: torch.dtype = torch.float32):
        if fold_columns < 1 or dense_fold_clients < 1:
            raise ValueError(f"fold_columns and dense_fold_clients must be >= 1, got {fold_columns} and "
                             f"{dense_fold_clients}")
        self.dense_shapes = {k: tuple(int(d) for d in shape) for k, shape in dense_shapes.items()}
        self.fold_columns = fold_columns
        self.product_dtype = product_dtype
        self._dense = {k: _DenseFold(shape, dense_fold_clients, product_dtype) for k, shape in self.dense_shapes.items()}
        self._folds: dict[str, _FactorFold] = {}
        self.total_weight = 0.0
        self.count = 0

    def add(self, client_fe: dict[str, torch.Tensor], num_samples: int) -> None:
        """Accumulate a client's FE (``L.u``/``L.v`` factors of factorized layers, dense tensors otherwise).

        The whole update is checked before any of it counts, so a malformed update leaves the sums as they were.
        Factors are read when their fold runs (at most ``fold_columns`` later): do not modify them after ``add``.
        """
        if num_samples <= 0:
            raise ValueError(f"a client update needs a positive sample count, got {num_samples}")
        dense, factors = self._split(client_fe)
        weight = float(num_samples)
        for key, value in dense.items():
            self._dense[key].add(value, weight)
        for key, (u, v) in factors.items():
            self._fold_for(key).add(u, v, weight)
        self.total_weight += weight
        self.count += 1

    def partial(self) -> PartialSum:
        """This aggregator's Σ n_k·W_k (weight layout, float64), Σ n_k and count, to be merged elsewhere."""
        sums = {}
        for key, fold in self._dense.items():
            fold.fold()
            sums[key] = fold.sum.clone()
        for key, fold in self._folds.items():
            fold.fold()
            sums[key] += from_matrix(fold.sum, self.dense_shapes[key])
        return PartialSum(sums, self.total_weight, self.count)

    def merge(self, other: PartialSum) -> None:
        """Add another aggregator's partial sums (over other updates of the same round) to this one's."""
        if set(other.sums) != set(self.dense_shapes):
            raise ValueError(f"partial sums over tensors {sorted(other.sums)} cannot merge into an average over "
                             f"{sorted(self.dense_shapes)}")
        for key, value in other.sums.items():
            if tuple(value.shape) != self.dense_shapes[key]:
                raise ValueError(f"partial sum {key}: shape {tuple(value.shape)} != expected {self.dense_shapes[key]}")
        for key, value in other.sums.items():
            self._dense[key].sum += value.to(torch.float64)
        self.total_weight += float(other.total_weight)
        self.count += int(other.count)

    def result(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The weighted mean Σ n_k·W_k / Σ n_k in ``dtype``; adding more clients afterwards stays valid."""
        if self.count == 0:
            raise ValueError("no client update to aggregate")
        return {k: (s / self.total_weight).to(dtype) for k, s in self.partial().sums.items()}

    def _fold_for(self, key: str) -> _FactorFold:
        if key not in self._folds:
            rows, cols = matrix_shape(self.dense_shapes[key])
            self._folds[key] = _FactorFold(rows, cols, max(self.fold_columns, min(rows, cols)), self.product_dtype)
        return self._folds[key]

    def _split(self, client_fe: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor],
                                                                    dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """(dense tensors by key, (U, V) by weight key), every shape checked against ``dense_shapes``."""
        dense: dict[str, torch.Tensor] = {}
        factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, shape in self.dense_shapes.items():
            layer = key.rsplit(".", 1)[0]
            if key in client_fe:
                value = client_fe[key]
                if tuple(value.shape) != shape:
                    raise ValueError(f"{key}: shape {tuple(value.shape)} != expected {shape}")
                dense[key] = value
            elif key.endswith(".weight") and layer + ".u" in client_fe and layer + ".v" in client_fe:
                u, v = client_fe[layer + ".u"], client_fe[layer + ".v"]
                rows, cols = matrix_shape(shape)
                if (u.dim() != 2 or v.dim() != 2 or u.shape[0] != rows or v.shape[0] != cols
                        or u.shape[1] != v.shape[1] or not 1 <= u.shape[1] <= min(rows, cols)):
                    raise ValueError(f"factors U{tuple(u.shape)}, V{tuple(v.shape)} do not fit {key} of shape {shape}")
                factors[key] = (u, v)
            else:
                raise ValueError(f"client FE lacks {key} (neither dense nor as factors)")
        expected = set(dense) | {k.rsplit(".", 1)[0] + s for k in factors for s in FACTOR_SUFFIXES}
        extra = set(client_fe) - expected
        if extra:
            raise ValueError(f"client FE has unexpected tensors {sorted(extra)}")
        return dense, factors

