"""Which of a model's tensors the runtime carries, and which of those are step state rather than parameters.

Carried: every ``state_dict`` entry except BatchNorm's ``num_batches_tracked`` counter, by its ``state_dict`` name
(``fe.bn1.weight``, ``fe.bn1.running_mean``). Of those, the parameters (``named_parameters``) are trained; the
rest are buffers (BatchNorm's ``running_mean``/``running_var``): STATE, inputs of a step graph whose ``.next``
outputs the training-mode forward updates and nothing differentiates. The counter only matters to BatchNorm with
``momentum=None`` (a cumulative average, whose weight would be the counter): such a layer is refused, so the
counter is never read and never travels. A model the runtime cannot take raises :class:`UnsupportedModel`, one line
naming the layer, what is wrong and the fix.
"""
from __future__ import annotations

import torch
from torch import nn

COUNTER = "num_batches_tracked"


class UnsupportedModel(ValueError):
    """A model (or a layer of it) the runtime cannot train: the message is one line naming the layer and the fix."""


def _batch_norms(model: nn.Module) -> dict[str, nn.modules.batchnorm._BatchNorm]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def check_tensors(model: nn.Module) -> None:
    """UnsupportedModel for a BatchNorm with ``momentum=None`` or without running statistics, or a carried
    tensor that is not floating point."""
    for name, bn in _batch_norms(model).items():
        kind = type(bn).__name__
        if bn.momentum is None:
            raise UnsupportedModel(f"{name}: {kind} with momentum=None (a cumulative average over "
                                   f"{COUNTER}) is refused: give it a momentum, e.g. momentum=0.1")
        if not bn.track_running_stats:
            raise UnsupportedModel(f"{name}: {kind} with track_running_stats=False is refused (its eval forward "
                                   "would use batch statistics): keep track_running_stats=True")
    for name, value in carried_tensors(model).items():
        if not value.is_floating_point():
            raise UnsupportedModel(f"{name}: a {value.dtype} tensor is refused: every parameter and buffer the "
                                   "runtime carries must be floating point (a constant buffer: register it with "
                                   "persistent=False)")


def _is_counter(name: str) -> bool:
    return name.rpartition(".")[2] == COUNTER


def carried_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors that travel and that the step graphs take, by ``state_dict`` name, in ``state_dict`` order."""
    return {k: v for k, v in model.state_dict().items() if not _is_counter(k)}


def state_names(model: nn.Module) -> tuple[str, ...]:
    """The carried tensors that are buffers, not parameters: updated by the forward, never differentiated."""
    parameters = {name for name, _ in model.named_parameters()}
    return tuple(k for k in carried_tensors(model) if k not in parameters)


def without_counters(model: nn.Module) -> nn.Module:
    """``model`` itself with every BatchNorm's counter buffer removed (so nothing increments or holds it)."""
    for bn in _batch_norms(model).values():
        if bn.momentum is not None and getattr(bn, COUNTER, None) is not None:
            bn._buffers[COUNTER] = None
    return model
