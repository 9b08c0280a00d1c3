"""The per-round progress line: its ETA counts rounds only, not the compiling and joining before round 1."""
from pathlib import Path

from server.outputs.progress import Progress, final_line


def record(round_index: int, seconds: float) -> dict:
    return {"round": round_index, "train_loss": 1.0, "participants": 2, "selected": 2, "dropped": {},
            "bytes_down": 0, "bytes_up": 0, "bytes_artifacts": 0, "seconds": seconds}


def test_the_eta_is_the_mean_round_time_times_the_rounds_left():
    lines: list[str] = []
    progress = Progress(5, emit=lines.append)
    progress.trained(record(1, 2.0))
    progress.trained(record(2, 4.0))
    assert lines[0].endswith("ETA 8 s") and lines[1].endswith("ETA 9 s")


def test_a_long_eta_is_given_in_minutes():
    lines: list[str] = []
    Progress(100, emit=lines.append).trained(record(1, 6.0))
    assert lines[0].endswith("ETA 9.9 min")


def version(index: int, *, sim_time: float = 5.0) -> dict:
    return dict(record(index, 99.0), round=index, sim_time=sim_time)


def row(index: int, evaluated: int) -> dict:
    return dict(record(index, 99.0), accuracy=0.5, accuracy_std=0.1, evaluated=evaluated,
                per_tier={"0.25": {"accuracy": 0.4, "devices": 1}, "1": {"accuracy": 0.6, "devices": evaluated - 1}})


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_async_rows_completed_late_each_get_their_accuracy_line_once_in_order():
    lines: list[str] = []
    clock = Clock()
    progress = Progress(3, emit=lines.append, unit="version", clock=clock, virtual=True)
    records: list[dict] = []
    progress.begin(0, records)
    clock.now += 2
    progress.follow(1, version(1, sim_time=40.0), records)  # version 1 made, its row pending
    progress.follow(1, version(1), records)  # an evaluation came in: nothing new to say
    clock.now += 3
    progress.follow(2, version(2, sim_time=90.0), records)  # version 2 made; version 1's row still waits
    records += [row(1, 4), row(2, 3)]  # both rows complete at once (an evaluation, then the final one)
    progress.follow(2, None, records)
    assert [line.split("  ")[0] for line in lines] == ["version 1/3", "version 2/3", "", ""]
    assert lines[0].endswith("2.0s  virtual 40.0s  ETA 4 s") and lines[1].endswith("3.0s  virtual 90.0s  ETA 2 s")
    assert lines[2] == "  accuracy after version 1: 0.5000 ±0.1000 (4 devices)  by tier 0.25: 0.4000  1: 0.6000"
    assert lines[3].startswith("  accuracy after version 2: 0.5000 ±0.1000 (3 devices)")


def test_a_resumed_async_run_says_nothing_again_of_what_came_before_it():
    lines: list[str] = []
    progress = Progress(3, emit=lines.append, unit="version", clock=Clock())
    records = [row(1, 4)]
    progress.begin(1, records)
    progress.follow(1, version(1), records)
    assert lines == []
    progress.follow(2, version(2), records)
    assert lines[0].startswith("version 2/3") and "virtual" not in lines[0]


def test_bytes_down_published_once_per_tier_are_labelled_as_such():
    lines: list[str] = []
    Progress(2, emit=lines.append, shared_down=True).trained(record(1, 1.0))
    Progress(2, emit=lines.append).trained(record(1, 1.0))
    assert "  down (one payload per tier) 0.00 MB  " in lines[0] and "  down 0.00 MB  " in lines[1]


def test_the_final_line_names_the_version_in_async_mode():
    line = final_line([dict(row(3, 4), mode="async")], Path("run"), Path("run/report.md"))
    assert line.startswith("final accuracy 0.5000 (after version 3);")
