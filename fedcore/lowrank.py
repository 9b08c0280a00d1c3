"""Low-rank factorization of the feature extractor: decompose, reconstruct, factorized layers, rank plans.

A weight W is viewed as a matrix M (m×n) and factorized as M ≈ U Vᵀ with U (m×r), V (n×r):
- Linear W (out, in): M = W.
- Conv2d W (c_out, c_in, kh, kw): M = W.permute(0, 2, 1, 3).reshape(c_out·kh, c_in·kw), so the factors
  run as a 1×kw conv c_in→r (width axis) followed by a kh×1 conv r→c_out (height axis, with the bias).
  Reshaping without the permute does not give a separable pair of convs and is wrong even at full rank.
- Conv1d W (c_out, c_in, k): the Conv2d rule with kh = 1, M = W.reshape(c_out, c_in·k): a k-wide conv c_in→r
  then a 1-wide conv r→c_out (with the bias); exact at full rank.
Spectral initialisation U = U_r·√S_r, V = V_r·√S_r is the Eckart–Young optimum at rank r.

What can be factorized (:func:`factorization_candidates`): the FE's Linear and ungrouped, undilated Conv1d/Conv2d
layers with numeric padding and zero padding mode (1×1 included) whose forward their parent calls. Excluded, with
the reason: grouped and depthwise convolutions (a grouped weight is G small matrices, not one), dilated or
"same"-padded ones, and layers whose parent reads ``.weight`` itself (``nn.MultiheadAttention`` passes
``out_proj.weight`` to its functional form: a factorized twin has no ``.weight``). By default a plan factorizes
the candidates whose matrix view has full rank ≥ ``min_full_rank`` (16): an input layer's rank is capped by
c_in·k (5 for a 1-channel 5×5 conv), so factorizing it saves nothing; a plan may name any candidate instead.
"""
from __future__ import annotations

import copy
import inspect
import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from fedcore.tensors import UnsupportedModel, carried_tensors

FE_PREFIX = "fe."
FACTOR_SUFFIXES = (".u", ".v")
DEFAULT_MIN_FULL_RANK = 16


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """(m, n) of the matrix view of a Linear (2-D), Conv1d (3-D) or Conv2d (4-D) weight shape."""
    if len(shape) == 2:
        return int(shape[0]), int(shape[1])
    if len(shape) == 3:
        c_out, c_in, k = shape
        return int(c_out), int(c_in * k)
    if len(shape) == 4:
        c_out, c_in, kh, kw = shape
        return int(c_out * kh), int(c_in * kw)
    raise ValueError(f"only 2-D (Linear), 3-D (Conv1d) and 4-D (Conv2d) weights can be factorized, got shape "
                     f"{tuple(shape)}")


def full_rank(shape: tuple[int, ...]) -> int:
    return min(matrix_shape(shape))


def rank_for_ratio(ratio: float, shape: tuple[int, ...]) -> int:
    """r = max(1, round(ratio · min(m, n))), as in the paper."""
    _check_ratio(ratio)
    return max(1, round(ratio * full_rank(shape)))


def factorization_is_lighter(rank: int, shape: tuple[int, ...]) -> bool:
    """True while r·(m+n) < m·n: only then do the factors hold fewer numbers (and cost fewer MACs)."""
    m, n = matrix_shape(shape)
    return rank * (m + n) < m * n


def to_matrix(weight: torch.Tensor) -> torch.Tensor:
    m, n = matrix_shape(tuple(weight.shape))
    if weight.dim() < 4:
        return weight.reshape(m, n)
    c_out, c_in, kh, kw = weight.shape
    return weight.permute(0, 2, 1, 3).reshape(c_out * kh, c_in * kw)


def from_matrix(matrix: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if len(shape) < 4:
        return matrix.reshape(shape)
    c_out, c_in, kh, kw = shape
    return matrix.reshape(c_out, kh, c_in, kw).permute(0, 2, 1, 3).contiguous()


def spectrum(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD (U, S, Vᴴ) of the matrix view, in float64: one per layer serves every rank."""
    return torch.linalg.svd(to_matrix(weight.detach()).double(), full_matrices=False)


def truncate(svd: tuple[torch.Tensor, torch.Tensor, torch.Tensor], rank: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Balanced rank-``rank`` factors U_r√S_r, V_r√S_r from a thin SVD."""
    u, s, vh = svd
    if not 1 <= rank <= s.numel():
        raise ValueError(f"rank {rank} is outside [1, {s.numel()}]")
    root = s[:rank].sqrt()
    return (u[:, :rank] * root).to(dtype), (vh[:rank].T * root).to(dtype)


def decompose(weight: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated-SVD factors (U, V) of ``weight`` at ``rank``, balanced as U_r√S_r, V_r√S_r."""
    full = full_rank(tuple(weight.shape))
    if not 1 <= rank <= full:
        raise ValueError(f"rank {rank} is outside [1, {full}] for a weight of shape {tuple(weight.shape)}")
    return truncate(spectrum(weight), rank, weight.dtype)


def reconstruct(u: torch.Tensor, v: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The full-rank weight of ``shape`` from its factors: the exact inverse of the layout in decompose."""
    m, n = matrix_shape(shape)
    if u.dim() != 2 or v.dim() != 2 or u.shape[0] != m or v.shape[0] != n or u.shape[1] != v.shape[1]:
        raise ValueError(f"factors U{tuple(u.shape)}, V{tuple(v.shape)} do not fit a weight of shape {tuple(shape)}")
    return from_matrix(u @ v.T, shape)


class FactorizedLinear(nn.Module):
    """Linear in→r (weight Vᵀ, no bias) then r→out (weight U, bias)."""

    def __init__(self, u: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.u = nn.Parameter(u.detach().clone())
        self.v = nn.Parameter(v.detach().clone())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())

    @property
    def weight_shape(self) -> tuple[int, int]:
        return self.u.shape[0], self.v.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.v.T), self.u, self.bias)


class _FactorizedConv(nn.Module):
    """A convolution's factors U, V (and bias) with the dense weight's shape, stride and padding."""

    def __init__(self, u: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, weight_shape: tuple[int, ...],
                 stride: tuple[int, ...], padding: tuple[int, ...]):
        super().__init__()
        self.u = nn.Parameter(u.detach().clone())
        self.v = nn.Parameter(v.detach().clone())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        self.weight_shape = tuple(int(d) for d in weight_shape)
        self.stride = stride
        self.padding = padding


class FactorizedConv2d(_FactorizedConv):
    """A 1×kw conv c_in→r (width stride/padding) then a kh×1 conv r→c_out (height stride/padding, bias)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c_out, c_in, kh, kw = self.weight_shape
        r = self.u.shape[1]
        width_kernel = self.v.T.reshape(r, c_in, 1, kw)
        height_kernel = self.u.reshape(c_out, kh, r).permute(0, 2, 1).unsqueeze(3)
        z = F.conv2d(x, width_kernel, stride=(1, self.stride[1]), padding=(0, self.padding[1]))
        return F.conv2d(z, height_kernel, self.bias, stride=(self.stride[0], 1), padding=(self.padding[0], 0))


class FactorizedConv1d(_FactorizedConv):
    """A k-wide conv c_in→r (stride, padding) then a 1-wide conv r→c_out (bias)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c_out, c_in, k = self.weight_shape
        r = self.u.shape[1]
        z = F.conv1d(x, self.v.T.reshape(r, c_in, k), stride=self.stride, padding=self.padding)
        return F.conv1d(z, self.u.unsqueeze(2), self.bias)


FactorizedLayer = (FactorizedLinear, FactorizedConv1d, FactorizedConv2d)


def unfactorizable_reason(layer: nn.Module) -> str | None:
    """Why ``layer`` itself cannot be factorized (None: it can): not a Linear/Conv1d/Conv2d, grouped, dilated,
    non-numeric padding or a padding mode other than zeros."""
    kind = type(layer).__name__
    if isinstance(layer, nn.Linear):
        return None
    if not isinstance(layer, (nn.Conv1d, nn.Conv2d)):
        return f"a {kind} cannot be factorized (only Linear, Conv1d and Conv2d)"
    if layer.groups != 1:
        depthwise = "depthwise " if layer.groups == layer.in_channels else "grouped "
        return f"{depthwise}{kind} (groups={layer.groups}) cannot be factorized"
    if any(d != 1 for d in layer.dilation):
        return f"dilated {kind} (dilation={layer.dilation}) cannot be factorized"
    if not isinstance(layer.padding, tuple) or layer.padding_mode != "zeros":
        return f"{kind} with padding={layer.padding!r}, padding_mode={layer.padding_mode!r} cannot be factorized"
    return None


def factorize_layer(layer: nn.Module, rank: int) -> nn.Module:
    """The factorized twin of a dense Linear/Conv1d/Conv2d, initialised by truncated SVD."""
    reason = unfactorizable_reason(layer)
    if reason is not None:
        raise UnsupportedModel(reason)
    u, v = decompose(layer.weight, rank)
    if isinstance(layer, nn.Linear):
        return FactorizedLinear(u, v, layer.bias)
    shape = tuple(layer.weight.shape)
    kind = FactorizedConv1d if isinstance(layer, nn.Conv1d) else FactorizedConv2d
    return kind(u, v, layer.bias, shape, layer.stride, layer.padding)


@dataclass(frozen=True)
class RankPlan:
    """A client's rank ratio r_k and the FE layers Q_k it factorizes (None: the default layers, the candidates
    whose full rank is at least ``min_full_rank``; see the module docstring)."""

    ratio: float = 1.0
    layers: tuple[str, ...] | None = None
    min_full_rank: int = DEFAULT_MIN_FULL_RANK

    def __post_init__(self) -> None:
        _check_ratio(self.ratio)
        if not (isinstance(self.min_full_rank, int) and self.min_full_rank >= 1):
            raise ValueError(f"min_full_rank must be an integer >= 1, got {self.min_full_rank!r}")


@dataclass(frozen=True)
class ResolvedPlan:
    """A plan applied to a concrete FE: the rank of each factorized layer, and the layers kept dense
    because their factors would hold as many numbers as the dense weight or more."""

    ranks: dict[str, int]
    kept_dense: tuple[str, ...] = field(default=())

    def describe(self) -> str:
        parts = [f"{name}@r{rank}" for name, rank in self.ranks.items()]
        parts += [f"{name}=dense(costlier)" for name in self.kept_dense]
        return ", ".join(parts) if parts else "dense"


@dataclass(frozen=True)
class Candidates:
    """The FE's factorizable layers (name → module, in model order) and the FE's other Linear/Conv layers with
    the reason each cannot be factorized (name → one line)."""

    layers: dict[str, nn.Module]
    excluded: dict[str, str]

    def describe(self) -> str:
        lines = [f"{name}: {type(m).__name__} {tuple(m.weight.shape)}, full rank {full_rank(tuple(m.weight.shape))}"
                 for name, m in self.layers.items()]
        return "\n".join(lines + [f"{name}: excluded: {why}" for name, why in self.excluded.items()])


def _check_ratio(ratio: float) -> None:
    if not (isinstance(ratio, (int, float)) and 0.0 < ratio <= 1.0):
        raise ValueError(f"rank ratio must be in (0, 1], got {ratio!r}")


def _reads_weight(parent: nn.Module, child: str) -> bool:
    """Whether ``parent``'s own forward reads ``self.<child>.weight`` (nn.MultiheadAttention does, for out_proj)."""
    if isinstance(parent, nn.MultiheadAttention):
        return True
    try:
        source = inspect.getsource(type(parent).forward)
    except (OSError, TypeError):
        return False
    return re.search(rf"\b{re.escape(child)}\.weight\b", source) is not None


def factorization_candidates(model: nn.Module) -> Candidates:
    """Which FE layers can be factorized, and why each other FE Linear/Conv cannot (module docstring)."""
    layers: dict[str, nn.Module] = {}
    excluded: dict[str, str] = {}
    for name, module in model.named_modules():
        if not name.startswith(FE_PREFIX) or not isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d,
                                                                       nn.modules.conv._ConvTransposeNd)):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        reason = unfactorizable_reason(module)
        if reason is None and _reads_weight(parent, child):
            reason = (f"{type(module).__name__} whose parent ({type(parent).__name__}) reads {child}.weight itself "
                      "cannot be factorized")
        if reason is None:
            layers[name] = module
        else:
            excluded[name] = reason
    return Candidates(layers, excluded)


def factorizable_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The FE's factorizable layers by their name in the model (``fe.conv1`` ...), in order."""
    return factorization_candidates(model).layers


def default_layers(model: nn.Module, min_full_rank: int = DEFAULT_MIN_FULL_RANK) -> tuple[str, ...]:
    """The candidates a plan factorizes by default: those whose matrix view has full rank ≥ ``min_full_rank``
    (the zoo's first conv, rank 5 or 15, stays dense; every other zoo layer has rank ≥ 80)."""
    return tuple(name for name, m in factorizable_layers(model).items()
                 if full_rank(tuple(m.weight.shape)) >= min_full_rank)


def _qualify(name: str) -> str:
    return name if name.startswith(FE_PREFIX) else FE_PREFIX + name


def _check_named(candidates: Candidates, names) -> None:
    """UnsupportedModel (one line) for a name that is an excluded layer, ValueError for one that is no FE layer."""
    for name in names:
        if name in candidates.excluded:
            raise UnsupportedModel(f"{name}: {candidates.excluded[name]}")
    unknown = [n for n in names if n not in candidates.layers]
    if unknown:
        raise ValueError(f"unknown FE layer(s) {unknown} in rank plan; factorizable: {list(candidates.layers)}")


def resolve_plan(model: nn.Module, plan: RankPlan) -> ResolvedPlan:
    """Per-layer ranks for ``plan`` on ``model``'s FE; a named layer that cannot be factorized is refused in one
    line (UnsupportedModel), an unknown one raises ValueError, costlier layers stay dense."""
    candidates = factorization_candidates(model)
    if plan.layers is None:
        chosen = list(default_layers(model, plan.min_full_rank))
    else:
        chosen = [_qualify(n) for n in plan.layers]
        _check_named(candidates, chosen)
    ranks: dict[str, int] = {}
    kept_dense: list[str] = []
    for name in chosen:
        shape = tuple(candidates.layers[name].weight.shape)
        rank = rank_for_ratio(plan.ratio, shape)
        if factorization_is_lighter(rank, shape):
            ranks[name] = rank
        else:
            kept_dense.append(name)
    return ResolvedPlan(ranks, tuple(kept_dense))


def check_ranks(model: nn.Module, ranks: dict[str, int]) -> None:
    """Raise on a rank outside [1, full rank] or a layer that is not a factorizable FE layer (UnsupportedModel,
    one line, for one that is an excluded layer)."""
    candidates = factorization_candidates(model)
    _check_named(candidates, list(ranks))
    for name, rank in ranks.items():
        full = full_rank(tuple(candidates.layers[name].weight.shape))
        if not 1 <= rank <= full:
            raise ValueError(f"rank {rank} for {name} is outside [1, {full}]")


def factorize_model(model: nn.Module, ranks: dict[str, int]) -> nn.Module:
    """A deep copy of ``model`` whose named FE layers are replaced by SVD-initialised factorized layers."""
    check_ranks(model, ranks)
    client = copy.deepcopy(model)
    for name, rank in ranks.items():
        parent_name, _, child = name.rpartition(".")
        parent = client.get_submodule(parent_name)
        setattr(parent, child, factorize_layer(getattr(parent, child), rank))
    return client


def frobenius_decay_step(u: torch.Tensor, v: torch.Tensor, mu: float, step: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(U − s·2μ·U(VᵀV), V − s·2μ·V(UᵀU)), s = ``step``: one SGD step on μ‖U Vᵀ‖²_F from the given values.

    The PyTorch twin of ``device_runtime.frobenius.frobenius_decay_step`` (the trainers apply it once per local
    epoch with s = lr × that epoch's step count, instead of the term in every step's loss).
    """
    if u.dim() != 2 or v.dim() != 2 or u.shape[1] != v.shape[1]:
        raise ValueError(f"factors must be U (m×r) and V (n×r) of one rank r, got U{tuple(u.shape)} and V{tuple(v.shape)}")
    if not mu >= 0:
        raise ValueError(f"mu must be >= 0, got {mu!r}")
    if not step >= 0:
        raise ValueError(f"step must be >= 0, got {step!r}")
    scale = 2.0 * mu * step
    return u - scale * (u @ (v.T @ v)), v - scale * (v @ (u.T @ u))


@torch.no_grad()
def decay_factors(model: nn.Module, mu: float, step: float, params: list[nn.Parameter] | None = None) -> None:
    """Apply :func:`frobenius_decay_step` in place to every factorized layer of ``model``.

    Only factors among ``params`` (default: all) change, so a phase that trains the head alone leaves the FE's
    factors as they are. A dense model, or μ = 0, is left untouched.
    """
    if not mu:
        return
    trained = None if params is None else {id(p) for p in params}
    for layer in model.modules():
        if isinstance(layer, FactorizedLayer):
            new_u, new_v = frobenius_decay_step(layer.u, layer.v, mu, step)
            for factor, value in ((layer.u, new_u), (layer.v, new_v)):
                if trained is None or id(factor) in trained:
                    factor.copy_(value)


def fe_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The FE's carried tensors (``fedcore.tensors``) by full name (``fe.conv1.weight``, ``fe.fc1.u``/``.v``,
    ``fe.bn1.running_mean``), detached copies."""
    return {k: v.detach().clone() for k, v in carried_tensors(model).items() if k.startswith(FE_PREFIX)}


def factorize_state(global_fe: dict[str, torch.Tensor], ranks: dict[str, int],
                    spectra: dict[str, tuple] | None = None) -> dict[str, torch.Tensor]:
    """The client's FE tensors: each ``L.weight`` of a layer in ``ranks`` becomes ``L.u`` and ``L.v``.

    ``spectra`` (layer → thin SVD) is filled and reused, so several plans pay one SVD per layer.
    """
    spectra = {} if spectra is None else spectra
    out: dict[str, torch.Tensor] = {}
    for key, value in global_fe.items():
        layer = key.rsplit(".", 1)[0]
        if key.endswith(".weight") and layer in ranks:
            if layer not in spectra:
                spectra[layer] = spectrum(value)
            out[layer + ".u"], out[layer + ".v"] = truncate(spectra[layer], ranks[layer], value.dtype)
        else:
            out[key] = value.clone()
    return out


def reconstruct_state(client_fe: dict[str, torch.Tensor], dense_shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Full-rank FE tensors from a client's FE (factors multiplied back, dense tensors passed through).

    ``dense_shapes`` maps every global FE tensor name to its shape; the result has exactly those keys.
    """
    out: dict[str, torch.Tensor] = {}
    for key, shape in dense_shapes.items():
        layer = key.rsplit(".", 1)[0]
        if key in client_fe:
            value = client_fe[key]
            if tuple(value.shape) != tuple(shape):
                raise ValueError(f"{key}: shape {tuple(value.shape)} != expected {tuple(shape)}")
            out[key] = value
        elif key.endswith(".weight") and layer + ".u" in client_fe and layer + ".v" in client_fe:
            out[key] = reconstruct(client_fe[layer + ".u"], client_fe[layer + ".v"], shape)
        else:
            raise ValueError(f"client FE lacks {key} (neither dense nor as factors)")
    extra = set(client_fe) - set(out) - {k.rsplit(".", 1)[0] + s for k in out for s in FACTOR_SUFFIXES}
    if extra:
        raise ValueError(f"client FE has unexpected tensors {sorted(extra)}")
    return out
