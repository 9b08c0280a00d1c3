"""The per-round progress line: its ETA counts rounds only, not the compiling and joining before round 1."""
from server.outputs.progress import Progress


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
