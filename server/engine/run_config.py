"""What a run is asked to do, checked, without torch: the names and defaults the command line offers and the
federation's settings with their checks.

The drivers parse and check their flags with this alone, so a mistake is reported (exit 2) before torch and the
data load. The algorithms take their names from here and the datasets' names live in ``server.data`` (torch-free, below the engine);
``fedcore.models`` sits below ``server`` and keeps its own registry. A test holds each registry to its names.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from enum import Enum

from server.engine.secagg_parameters import DEFAULT_CORRUPT_RATE, DEFAULT_DROPOUT_RATE
from server.engine.secagg_parameters import parameters as graph_parameters

ALGORITHMS = ("fedara", "fedavg", "fedrep", "local")
"""The algorithms, one file each in server/algorithms/."""
MODELS = ("fedavgcnn", "cnn1", "cnn2", "cnn3", "cnn4", "cnn5")
"""The model zoo (fedcore/models.py); --model also takes MODULE:FUNCTION or PATH.py:FUNCTION (fedcore/model_spec.py)."""
BN_STATS = ("personal", "shared")
"""BatchNorm running statistics: kept on each device (FedBN) or averaged with the FE by samples (FedAvg-BN)."""
DEFAULT_BN_STATS = "personal"
"""Chosen by the paired study of docs/your_model.md (DS-CNN and ResNet-8, Fashion-MNIST, 20 devices, Dirichlet 0.5,
30 rounds, 5 seeds, reduced data): personal ahead of shared in 9 of 10 paired seeds, +2.3 and +1.9 pp; every
accuracy here is a device's own test split under label skew, which its own statistics describe, and they cost
nothing on the wire."""
DEFAULT_MU = 1e-3
"""The Frobenius decay μ on factorized layers (the paper's)."""
DEFAULT_LAM_WARMUP = 10
"""Rounds over which λ ramps from 0 to its target (the paper's)."""
DEFAULT_TIERS = (1.0, 0.75, 0.5, 0.25, 0.125)
"""The rank ratios a heterogeneous run offers by default."""

AGGREGATION_RULES = ("weights", "updates")
"""weights: ω ← Σ p_k U_k V_kᵀ (the paper's); updates: ω ← ω + Σ p_k (U_k V_kᵀ − U_k⁰ V_k⁰ᵀ), what was sent subtracted."""



class RunError(RuntimeError):
    """The run cannot go on: not enough devices, every local device died, a bad resume."""


@dataclass(frozen=True)
class FederationConfig:
    """Hyper-parameters of a run; defaults are the paper's (homogeneous λ = 10, lr 5e-3, batch 16, E = 5)."""

    algo: str = "fedara"
    rounds: int = 100
    lam: float = 10.0
    lam_warmup: int = DEFAULT_LAM_WARMUP
    mu: float = DEFAULT_MU
    lr: float = 5e-3
    local_epochs: int = 5
    batch_size: int = 16
    join_ratio: float = 1.0
    seed: int = 0
    aggregate: str = "weights"
    min_completion: float = 0.5

    def __post_init__(self) -> None:
        if self.algo not in ALGORITHMS:
            raise ValueError(f"--algo {self.algo!r} is unknown; choose one of {', '.join(ALGORITHMS)}")
        if self.aggregate not in AGGREGATION_RULES:
            raise ValueError(f"--aggregate {self.aggregate!r} is unknown; choose one of {', '.join(AGGREGATION_RULES)}")
        if not 0.0 < self.join_ratio <= 1.0:
            raise ValueError(f"--join-ratio must be in (0, 1], got {self.join_ratio}")
        if not 0.0 <= self.min_completion <= 1.0:
            raise ValueError(f"--min-completion must be in [0, 1], got {self.min_completion:g}")
        for name in ("rounds", "local_epochs", "batch_size", "lam_warmup"):
            if getattr(self, name) < (0 if name == "lam_warmup" else 1):
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be at least {0 if name == 'lam_warmup' else 1}, got {getattr(self, name)}")
        for flag, value, positive in (("--lr", self.lr, True), ("--lam", self.lam, False), ("--frob", self.mu, False)):
            if not math.isfinite(value) or value < 0 or (positive and value == 0):
                raise ValueError(f"{flag} must be {'positive' if positive else 'non-negative'}, got {value:g}")

    def to_dict(self) -> dict:
        return asdict(self)


class NormAction(str, Enum):
    """What happens to an update beyond the bound."""

    CLIP = "clip"
    REJECT = "reject"


@dataclass(frozen=True)
class NormBound:
    """At most ``bound`` (L2, over the whole FE) between a counted client FE and the global FE."""

    bound: float
    action: NormAction = NormAction.CLIP

    def __post_init__(self) -> None:
        if isinstance(self.bound, bool) or not isinstance(self.bound, (int, float)) or not math.isfinite(self.bound) \
                or self.bound <= 0:
            raise ValueError(f"update norm bound must be a positive finite number, got {self.bound!r}")
        if self.action not in {a.value for a in NormAction}:
            raise ValueError(f"update norm action must be one of {[a.value for a in NormAction]}, got {self.action!r}")
        object.__setattr__(self, "action", NormAction(self.action))


def add_norm_bound_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The --update-norm-bound / --update-norm-action flags shared by the simulator and the broker loop."""
    parser.add_argument("--update-norm-bound", type=float, default=None, metavar="FLOAT",
                        help="robust aggregation: the largest L2 distance a client FE may have from the global FE "
                             "(whole FE, reconstructed to full rank); default: no bound")
    parser.add_argument("--update-norm-action", choices=[a.value for a in NormAction], default=NormAction.CLIP.value,
                        help="beyond the bound: scale the update back onto it (clip) or leave it out (reject)")


def norm_bound_from_args(args: argparse.Namespace) -> NormBound | None:
    """The rule the flags ask for, or None (the default: every update counts as sent)."""
    if args.update_norm_bound is None:
        return None
    return NormBound(args.update_norm_bound, NormAction(args.update_norm_action))


ACCOUNTANTS = ("pld", "rdp")
"""ε from privacy loss distributions (tighter) or Rényi DP (the classic bound); both Google's dp-accounting."""
DP_DEFAULT_CLIP = 0.1
"""The clip C (L2, over every shared tensor), or the adaptive clip's start (Flower's default, Andrew et al.)."""
DP_DEFAULT_CLIP_LR = 0.2
"""The adaptive clip's learning rate η (Flower's default)."""


@dataclass(frozen=True)
class DpSettings:
    """User-level DP-FedAvg (``server.engine.privacy``) and its budget (``server.engine.accountant``).

    ``noise_multiplier`` is z, what the accountant charges per round; ``population`` N the devices a round samples
    from (rate ``join_ratio``), so E = q·N participants are expected; ``delta`` defaults to 1/N^1.1. In the async
    mode a version is a round: rate 1 (no sampling) and population K (the buffer), so E = K, and δ is given."""

    noise_multiplier: float
    join_ratio: float
    population: int
    clip: float = DP_DEFAULT_CLIP
    clip_quantile: float | None = None
    clip_lr: float = DP_DEFAULT_CLIP_LR
    delta: float | None = None
    target_epsilon: float | None = None
    accountant: str = ACCOUNTANTS[0]
    test_seed: int | None = None

    def __post_init__(self) -> None:
        for flag, value in (("--dp-noise-multiplier", self.noise_multiplier), ("--dp-clip", self.clip),
                            ("--dp-clip-lr", self.clip_lr), ("--dp-target-epsilon", self.target_epsilon)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{flag} must be a positive number, got {value:g}")
        if self.population < 1:
            raise ValueError(f"differential privacy needs the devices a round samples from, got {self.population}")
        if self.clip_quantile is not None and not 0 < self.clip_quantile < 1:
            raise ValueError(f"--dp-clip-quantile must be in (0, 1), got {self.clip_quantile:g}")
        if self.delta is not None and not 0 < self.delta < 1:
            raise ValueError(f"--dp-delta must be in (0, 1), got {self.delta:g}")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"--dp-accountant {self.accountant!r} is unknown; choose one of {', '.join(ACCOUNTANTS)}")
        if self.clip_quantile is not None and self.noise_multiplier >= 2 * self.count_stddev:
            raise ValueError(f"--dp-noise-multiplier {self.noise_multiplier:g} with --dp-clip-quantile: the adaptive "
                             f"clip's count takes noise of std E/20 = {self.count_stddev:.3g} (E = {self.expected:.3g} "
                             f"expected participants), which alone costs multiplier {2 * self.count_stddev:.3g}; "
                             "use a smaller multiplier, more devices per round, or a fixed --dp-clip")

    def check_budget_fits(self) -> None:
        """Raise ValueError when --dp-target-epsilon is below what one round spends (no round would train)."""
        if self.target_epsilon is None:
            return
        from server.engine.accountant import epsilon  # dp-accounting loads only for a private run
        self.check_first_round(epsilon(self.join_ratio, self.noise_multiplier, 1, self.run_delta, self.accountant))

    def check_first_round(self, first: float, accountant: str | None = None) -> None:
        """Raise ValueError when ``first``, what one round spends (on ``accountant``, when it is not the run's
        --dp-accountant: distributed DP's Skellam one), is above --dp-target-epsilon."""
        if self.target_epsilon is not None and first > self.target_epsilon:
            raise ValueError(f"--dp-target-epsilon {self.target_epsilon:g} fits no round: one round already spends "
                             f"ε = {first:.4g} (--dp-noise-multiplier {self.noise_multiplier:g}, rate "
                             f"{self.join_ratio:g}, δ = {self.run_delta:.3g}"
                             f"{'' if accountant is None else f', {accountant} accountant'}); raise the target or the "
                             "noise multiplier")

    def budget_plan(self, rounds: int, unit: str = "round") -> str:
        """The line a private run prints before it trains (``accountant.budget_plan``)."""
        from server.engine.accountant import budget_plan
        return budget_plan(self.join_ratio, self.noise_multiplier, self.run_delta, self.accountant,
                           self.target_epsilon, rounds, unit)

    @property
    def expected(self) -> float:
        """E = q·N, the fixed denominator of the mean update."""
        return self.join_ratio * self.population

    @property
    def run_delta(self) -> float:
        """δ: --dp-delta, or 1/N^1.1 (below 1/N, as a user-level δ must be)."""
        return self.delta if self.delta is not None else self.population ** -1.1

    @property
    def count_stddev(self) -> float:
        """σ_b, the noise on the adaptive clip's count of participants within the clip (Flower's E/20)."""
        return self.expected / 20

    @property
    def update_noise_multiplier(self) -> float:
        """z_Δ, the update's own multiplier: z with a fixed clip; (z⁻² − (2σ_b)⁻²)^(−½) with the adaptive one, so the
        update and the count together cost z."""
        if self.clip_quantile is None:
            return self.noise_multiplier
        return (self.noise_multiplier ** -2 - (2 * self.count_stddev) ** -2) ** -0.5


def add_dp_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The differential-privacy flags shared by the simulator and the broker loop."""
    parser.add_argument("--dp-noise-multiplier", type=float, default=None, metavar="Z",
                        help="user-level DP-FedAvg: clip each device's reconstructed update, average with a fixed "
                             "denominator (join ratio x devices), add Gaussian noise of std Z x clip / that "
                             "(needs --aggregate updates; personal heads stay on the device, outside the guarantee); "
                             "default: off")
    parser.add_argument("--dp-clip", type=float, default=DP_DEFAULT_CLIP, metavar="C",
                        help="L2 bound of each device's update over every shared tensor (the adaptive clip's start "
                             "with --dp-clip-quantile)")
    parser.add_argument("--dp-clip-quantile", type=float, default=None, metavar="Q",
                        help="adapt the clip to this quantile of the update norms (Andrew et al. 2021; its count's "
                             "noise is accounted); default: a fixed --dp-clip")
    parser.add_argument("--dp-clip-lr", type=float, default=DP_DEFAULT_CLIP_LR, metavar="ETA",
                        help="the adaptive clip's learning rate")
    parser.add_argument("--dp-target-epsilon", type=float, default=None, metavar="E",
                        help="stop before a round that would spend more than this ε (the checkpoint is kept); "
                             "default: no limit (ε is still reported)")
    parser.add_argument("--dp-delta", type=float, default=None, metavar="D",
                        help="the δ of every reported ε (default: 1/N^1.1 for N devices)")
    parser.add_argument("--dp-accountant", choices=ACCOUNTANTS, default=ACCOUNTANTS[0],
                        help="pld: privacy loss distributions (tighter); rdp: Renyi DP (Google's dp-accounting)")
    parser.add_argument("--dp-test-seed", type=int, default=None, metavar="N",
                        help="TESTS ONLY: fix DP's sampling and noise (the guarantee no longer holds); default: "
                             "seeded from the OS's secure generator, never by --seed")


def dp_from_args(args: argparse.Namespace, population: int) -> DpSettings | None:
    """The DP settings the flags ask for (``population``: the devices a round samples from), or None (off)."""
    if args.dp_noise_multiplier is None:
        asked = [f for f, v in (("--dp-clip-quantile", args.dp_clip_quantile), ("--dp-target-epsilon",
                 args.dp_target_epsilon), ("--dp-delta", args.dp_delta), ("--dp-test-seed", args.dp_test_seed))
                 if v is not None]
        if asked:
            raise ValueError(f"{asked[0]} needs --dp-noise-multiplier Z (differential privacy is off without it)")
        return None
    if args.aggregate != "updates":
        raise ValueError(f"--dp-noise-multiplier clips each device's update (what it changed): use --aggregate updates "
                         f"(got --aggregate {args.aggregate}, which averages whole weights)")
    if args.algo == "local":
        raise ValueError("--dp-noise-multiplier with --algo local: nothing is shared, so nothing needs noise; "
                         "choose fedara, fedavg or fedrep")
    if args.update_norm_bound is not None:
        raise ValueError("--dp-noise-multiplier clips every update already: leave --update-norm-bound out")
    if args.dp_delta is not None and args.dp_delta * population >= 1:
        raise ValueError(f"--dp-delta {args.dp_delta:g} is not below 1/N = {1 / population:.3g} for N = {population} "
                         "devices: a δ that large allows publishing one device's data outright; leave --dp-delta out "
                         f"(1/N^1.1 = {population ** -1.1:.3g}) or give a smaller one")
    if getattr(args, "mode", "sync") == "async":  # a flush: ≤ K clipped changes over K, unsampled (privacy.BufferDp)
        if args.dp_clip_quantile is not None:
            raise ValueError(f"--dp-clip-quantile {args.dp_clip_quantile:g} with --mode async: the adaptive clip learns "
                             "from a sampled round's count; use a fixed --dp-clip")
        delta = args.dp_delta if args.dp_delta is not None else population ** -1.1
        settings = DpSettings(args.dp_noise_multiplier, 1.0, async_rule_from_args(args).buffer_size, args.dp_clip,
                              args.dp_clip_quantile, args.dp_clip_lr, delta, args.dp_target_epsilon,
                              args.dp_accountant, args.dp_test_seed)
    else:
        settings = DpSettings(args.dp_noise_multiplier, args.join_ratio, population, args.dp_clip,
                              args.dp_clip_quantile, args.dp_clip_lr, args.dp_delta, args.dp_target_epsilon,
                              args.dp_accountant, args.dp_test_seed)
    settings.check_budget_fits()
    return settings
MODES = ("sync", "async")
"""sync: rounds that wait for their devices; async: buffered asynchronous aggregation (server/engine/fedbuff.py)."""
NORMALIZATIONS = ("samples", "staleness")
"""The async step's denominator: Σ n_i (FedBuff's rule) or Σ s(τ_i)·n_i (the staleness-weighted mean)."""


@dataclass(frozen=True)
class BufferRule:
    """The async mode's settings: C devices training at once, a version every K accepted updates, updates staler
    than S refused, staleness weight (1 + τ)^−a, server learning rate η_g and the step's denominator."""

    buffer_size: int = 10
    max_staleness: int = 20
    staleness_exponent: float = 0.5
    server_lr: float = 1.0
    normalize: str = "staleness"  # measured better than FedBuff's "samples" (docs/async.md): +3.6 pp, 5 of 5 seeds
    concurrency: int = 20
    task_timeout: float | None = None  # seconds a task may be in flight; None: its slot is held until it is answered

    def __post_init__(self) -> None:
        if self.task_timeout is not None and not (math.isfinite(self.task_timeout) and self.task_timeout > 0):
            raise ValueError(f"--task-timeout must be positive seconds, got {self.task_timeout:g}")
        for flag, value in (("--buffer-size", self.buffer_size), ("--concurrency", self.concurrency)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.max_staleness < 0:
            raise ValueError(f"--max-staleness must be >= 0, got {self.max_staleness}")
        if not (math.isfinite(self.staleness_exponent) and self.staleness_exponent >= 0):
            raise ValueError(f"--staleness-exponent must be a finite number >= 0, got {self.staleness_exponent:g}")
        if not (math.isfinite(self.server_lr) and self.server_lr > 0):
            raise ValueError(f"--server-lr must be a positive number, got {self.server_lr:g}")
        if self.normalize not in NORMALIZATIONS:
            raise ValueError(f"--buffer-normalize {self.normalize!r} is unknown; choose one of "
                             f"{', '.join(NORMALIZATIONS)}")

    def to_dict(self) -> dict:
        """The settings a resumed run must match (no task_timeout where none is set: as runs before it had)."""
        settings = asdict(self)
        if self.task_timeout is None:
            del settings["task_timeout"]
        return settings


ASYNC_ONLY = (("--concurrency", "concurrency"), ("--buffer-size", "buffer_size"), ("--max-staleness", "max_staleness"),
              ("--staleness-exponent", "staleness_exponent"), ("--server-lr", "server_lr"),
              ("--buffer-normalize", "normalize"))
"""The async mode's flags and their BufferRule fields: unset (None) unless given, so sync mode can refuse them."""


def add_async_arguments(parser: argparse.ArgumentParser) -> None:
    """The --mode flag and the async mode's settings, shared by both drivers (each defaults to BufferRule's, shown
    in its help: the parser's default is None, so a flag given in sync mode is seen and refused)."""
    d = BufferRule()
    group = parser.add_argument_group("asynchronous mode (--mode async: buffered aggregation, FedBuff; see docs/async.md)")
    group.add_argument("--mode", choices=MODES, default="sync",
                       help="sync: rounds that wait for their devices; async: devices train as they come free, a "
                            "new model version every --buffer-size updates (--rounds counts versions)")
    group.add_argument("--concurrency", type=int, default=None,
                       help=f"async: devices training at once (default: {d.concurrency})")
    group.add_argument("--buffer-size", type=int, default=None,
                       help=f"async: accepted updates per new version (K) (default: {d.buffer_size})")
    group.add_argument("--max-staleness", type=int, default=None,
                       help=f"async: updates more versions behind than this are refused ([too_stale]) "
                            f"(default: {d.max_staleness})")
    group.add_argument("--staleness-exponent", type=float, default=None,
                       help=f"async: an update of staleness τ weighs (1 + τ)^-a (0: no discount) "
                            f"(default: {d.staleness_exponent:g})")
    group.add_argument("--server-lr", type=float, default=None,
                       help=f"async: the server's step size η_g (default: {d.server_lr:g})")
    group.add_argument("--buffer-normalize", choices=NORMALIZATIONS, default=None,
                       help="async: divide the buffer's staleness-weighted sum by its staleness-weighted samples (a "
                            "weighted mean; measured better) or by its samples (FedBuff's rule) "
                            f"(default: {d.normalize})")


def async_flags_given(args: argparse.Namespace) -> list[str]:
    """The async mode's flags set on the command line (or in --config), in their --help order."""
    return [flag for flag, _ in ASYNC_ONLY if getattr(args, flag[2:].replace("-", "_"), None) is not None]


def async_rule_from_args(args: argparse.Namespace) -> BufferRule | None:
    """The async mode's rule the flags ask for (checked; BufferRule's defaults for the flags not given), None in
    sync mode."""
    if args.mode != "async":
        return None
    d = BufferRule()
    given = {field_name: getattr(args, flag[2:].replace("-", "_"), None) for flag, field_name in ASYNC_ONLY}
    task_timeout = getattr(args, "task_timeout", None)  # a broker-loop flag: the simulator's devices all return
    return BufferRule(**{k: getattr(d, k) if v is None else v for k, v in given.items()}, task_timeout=task_timeout)


SECAGG_DEFAULT_RANGE = 8.0
"""Without DP, each coordinate of a device's change is clipped to ±R before quantization (Flower's SecAgg+ range)."""


@dataclass(frozen=True)
class SecureSettings:
    """Secure aggregation (SecAgg+, ``server.engine.secure_rounds``): the neighbours k and threshold t of each round
    (None: the rule of ``server.engine.secagg_parameters`` for the round's n participants, the dropout rate δ and the
    corrupt fraction γ), and the coordinate range R of a change without DP."""

    neighbors: int | None = None
    threshold: int | None = None
    coordinate_range: float = SECAGG_DEFAULT_RANGE
    dropout_rate: float = DEFAULT_DROPOUT_RATE
    corrupt_rate: float = DEFAULT_CORRUPT_RATE

    def __post_init__(self) -> None:
        if not 0 <= self.dropout_rate < 1:
            raise ValueError(f"--secagg-dropout-rate must be a probability in [0, 1), got {self.dropout_rate:g}")
        if not 0 <= self.corrupt_rate < 0.5:
            raise ValueError(f"--secagg-corrupt-rate must be in [0, 0.5) (t is a majority of each device's holders), "
                             f"got {self.corrupt_rate:g}")
        if self.neighbors is not None and self.neighbors < 2:
            raise ValueError(f"--secagg-neighbors must be >= 2, got {self.neighbors}")
        if self.threshold is not None and self.threshold < 2:
            raise ValueError(f"--secagg-threshold must be >= 2, got {self.threshold}")
        if not (math.isfinite(self.coordinate_range) and self.coordinate_range > 0):
            raise ValueError(f"--secagg-range must be a positive number, got {self.coordinate_range:g}")


def secure_from_args(args: argparse.Namespace, devices: int | None = None) -> SecureSettings | None:
    """The secure-aggregation settings the flags ask for, or None (off); ValueError for a combination it cannot
    serve: the async mode, aggregator processes, --update-norm-bound (the server never sees one update), an
    aggregation other than updates, the adaptive clip; and, given the fleet's ``devices``, an explicit
    --secagg-neighbors / --secagg-threshold that misses SecAgg+'s bounds for the round size --join-ratio expects."""
    if not args.secure_aggregation:
        asked = [f for f, v in (("--secagg-neighbors", args.secagg_neighbors), ("--secagg-threshold",
                 args.secagg_threshold)) if v is not None]
        if asked:
            raise ValueError(f"{asked[0]} needs --secure-aggregation")
        return None
    if getattr(args, "mode", "sync") == "async":
        raise ValueError("--secure-aggregation with --mode async: SecAgg+ sums a sync round's devices; use --mode sync")
    if getattr(args, "aggregators", 0):
        raise ValueError(f"--secure-aggregation with --aggregators {args.aggregators}: the server unmasks one sum "
                         "itself; leave --aggregators out")
    if args.update_norm_bound is not None:
        raise ValueError("--secure-aggregation with --update-norm-bound: the server never sees one device's update "
                         "to bound it; leave --update-norm-bound out (clip on the device with --dp-clip)")
    if args.aggregate != "updates":
        raise ValueError(f"--secure-aggregation sums each device's change: use --aggregate updates (got --aggregate "
                         f"{args.aggregate})")
    if args.algo == "local":
        raise ValueError("--secure-aggregation with --algo local: nothing is shared; choose fedara, fedavg or fedrep")
    if args.dp_noise_multiplier is not None and args.dp_clip_quantile is not None:
        raise ValueError("--secure-aggregation with --dp-clip-quantile: the adaptive clip needs each device's norm at "
                         "the server; use a fixed --dp-clip")
    settings = SecureSettings(args.secagg_neighbors, args.secagg_threshold, args.secagg_range,
                              args.secagg_dropout_rate, args.secagg_corrupt_rate)
    if devices and (settings.neighbors is not None or settings.threshold is not None):
        expected = max(1, round(args.join_ratio * devices))
        graph_parameters(expected, settings.neighbors, settings.threshold, settings.dropout_rate,
                         settings.corrupt_rate)
    return settings
