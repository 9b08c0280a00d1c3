"""What a device does with a message, as pure functions of its saved state (no I/O, no clock).

The agent (``device_runtime.agent``) parses a message, asks here, and carries the answer out with MQTT and
its workdir. The rules:
- a TASK of another run, or for a plan it has not loaded, is answered with UNKNOWN_PLAN and a new JOIN;
- a TASK for a round before the last one answered is stale: ignored;
- a TASK for the round (and kind: training or evaluation) it last answered gets the saved answer again, as
  sent (a restarted server or broker asks twice; the same answer is counted once);
- any other TASK is computed;
- a verified PLAN of another run starts a new run from the plan's initial tensors: this run's personal tensors
  and saved answer are set aside until the new run commits a trained round (a PLAN of this run brings them
  back; the artifact cache stays);
- a PLAN of its run starts from the plan's initial tensors only while it holds nothing committed of the run.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class TaskAction(str, Enum):
    UNKNOWN_PLAN = "unknown plan"
    STALE = "stale"
    RESEND = "resend"
    COMPUTE = "compute"


@dataclass
class DeviceState:
    """What survives a restart besides the files: the run, the plan and the last round answered."""

    run_id: str
    plan_hash: str | None = None
    answered_round: int = 0
    answered_evaluation: bool = False  # that answer was an evaluation only (a run extended later trains that round)
    personal: tuple[str, ...] = ()  # names of the tensors this device keeps to itself in this run


def on_task(state: DeviceState, loaded_hash: str | None, run_id: str, plan_hash: str, round_index: int,
            evaluate_only: bool, has_saved_answer: bool) -> TaskAction:
    """What to do with a TASK (see the module docstring)."""
    if run_id != state.run_id or plan_hash != loaded_hash:
        return TaskAction.UNKNOWN_PLAN
    if round_index < state.answered_round:
        return TaskAction.STALE
    if (round_index, evaluate_only) == (state.answered_round, state.answered_evaluation) and has_saved_answer:
        return TaskAction.RESEND
    return TaskAction.COMPUTE


def starts_new_run(state: DeviceState, run_id: str) -> bool:
    """A verified PLAN of another run than the device's: it sets this run's heads and answer aside."""
    return run_id != state.run_id


def takes_initial_tensors(state: DeviceState, has_committed_personal: bool) -> bool:
    """Whether a PLAN's initial personal tensors replace what the device holds."""
    return not state.personal or not has_committed_personal


def answered(state: DeviceState, round_index: int, evaluate_only: bool) -> DeviceState:
    """The state to commit once a task's answer is saved (the commit point of a round)."""
    return DeviceState(state.run_id, state.plan_hash, round_index, evaluate_only, state.personal)
