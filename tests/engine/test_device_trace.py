"""The seeded speed and availability model of a fleet on a virtual clock (server/engine/device_trace.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from server.engine.device_trace import Availability, DeviceTrace, SpeedModel

IDS = [f"dev_{i:03d}" for i in range(50)]


def test_speed_factors_are_a_function_of_seed_and_device_not_of_query_order():
    first = DeviceTrace(3, SpeedModel(1.0))
    second = DeviceTrace(3, SpeedModel(1.0))
    forward = [first.factor(d) for d in IDS]
    backward = [second.factor(d) for d in reversed(IDS)][::-1]
    assert forward == backward
    assert forward != [DeviceTrace(4, SpeedModel(1.0)).factor(d) for d in IDS]


def test_log_speed_factors_have_the_asked_spread():
    trace = DeviceTrace(0, SpeedModel(1.0))
    logs = np.log([trace.factor(f"d{i}") for i in range(2000)])
    # the sample std of 2000 normal draws has a standard error of sigma/sqrt(2n) = 0.016: 5 of them as tolerance
    assert abs(logs.std() - 1.0) < 0.08 and abs(logs.mean()) < 5 / math.sqrt(2000)


def test_without_a_model_every_device_is_reference_speed_and_always_online():
    trace = DeviceTrace(0)
    assert trace.factor("a") == 1.0 and trace.online("a", 123.0) and trace.finish("a", 5.0, 2.0) == 7.0


def test_a_device_is_online_the_asked_fraction_of_the_time():
    trace = DeviceTrace(1, availability=Availability(0.7, 10.0))
    times = np.arange(0.0, 200_000.0, 1.0)  # ~14,000 periods per device
    share = np.mean([trace.online(d, t) for d in IDS[:3] for t in times])
    assert abs(share - 0.7) < 0.02


def test_work_pauses_while_the_device_is_away():
    trace = DeviceTrace(2, availability=Availability(0.5, 3.0))
    start, work = 1.0, 20.0
    end = trace.finish("dev_000", start, work)
    grid = np.linspace(start, end, 200_001)[:-1]
    online_time = np.mean([trace.online("dev_000", t) for t in grid]) * (end - start)
    assert end - start > work and abs(online_time - work) < 0.01 * work
    assert trace.online("dev_000", end - 1e-9)


def test_answers_do_not_depend_on_the_order_of_questions():
    a = DeviceTrace(5, availability=Availability(0.6, 2.0))
    b = DeviceTrace(5, availability=Availability(0.6, 2.0))
    late = b.finish("x", 500.0, 3.0)
    assert a.finish("x", 1.0, 3.0) == b.finish("x", 1.0, 3.0)
    assert a.finish("x", 500.0, 3.0) == late


@pytest.mark.parametrize("text", ["lognormal", "normal:1", "lognormal:-1", "lognormal:x"])
def test_a_bad_speed_names_the_flag(text):
    with pytest.raises(ValueError, match="--device-speed"):
        SpeedModel.parse(text)


@pytest.mark.parametrize("text", ["0.7", "0,10", "1.5,10", "0.7,0", "a,b"])
def test_a_bad_availability_names_the_flag(text):
    with pytest.raises(ValueError, match="--availability"):
        Availability.parse(text)
