"""The demo's per-rank state file: written by two threads of a rank, read by the launcher's hang watch,
and the attribution of a hang from the ranks' states (tensorplay.analysis.hang).

The race is forced as it was found: the writer thread rewrites the file with no pause while the
training thread writes its final state, a hundred times over, and a strict reader (json.loads on
whatever is there) polls all along.
"""

import json
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tensorplay.analysis.hang import attribute_hang
from tensorplay.demo import hang
from tensorplay.demo.hang import HangWatch, RankStateWriter
from tensorplay.demo.rundir import RunDir
from tensorplay.telemetry import TensorplayMetrics

ROUNDS = 100


def test_two_writers_never_tear_or_lose_the_state_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hang, "_WRITE_EVERY_S", 0.0)
    run_dir = RunDir(tmp_path)
    path = run_dir.state(0)
    metrics = TensorplayMetrics(CollectorRegistry())
    stop = threading.Event()
    torn: list[str] = []

    def strict_reader() -> None:
        while not stop.is_set():
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except FileNotFoundError:
                pass  # before the first write of a round
            except ValueError as error:
                torn.append(str(error))

    reader = threading.Thread(target=strict_reader, daemon=True)
    reader.start()
    raised: list[str] = []
    lost_final_state = 0
    for _ in range(ROUNDS):
        path.unlink(missing_ok=True)
        writer = RankStateWriter(run_dir, 0, metrics)
        time.sleep(0.002)  # the writer thread is rewriting the file now
        try:
            writer.finished()  # the training thread's write, as at the end of training
        except OSError as error:
            raised.append(repr(error))
        writer._thread.join(5)
        try:
            lost_final_state += json.loads(path.read_text(encoding="utf-8"))["finished"] is not True
        except (OSError, ValueError):
            lost_final_state += 1
    stop.set()
    reader.join(5)
    assert raised == [], f"{len(raised)} of {ROUNDS} rounds raised into the training thread: {raised[:2]}"
    assert torn == [], f"{len(torn)} torn reads"
    assert lost_final_state == 0, f"{lost_final_state} of {ROUNDS} rounds ended without the final state"
    assert not list(tmp_path.glob("*.partial")), "a temporary file was left behind"


def test_the_hang_watch_rides_over_a_torn_state_file(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    state = {"rank": 1, "steps_done": 3, "finished": False, "activity_unix": time.time(),
             "last_hook_call_unix": None, "waiting": None}
    run_dir.state(0).write_text('{"rank": 0, "steps_do', encoding="utf-8")  # half a file
    run_dir.state(1).write_text(json.dumps(state), encoding="utf-8")
    with HangWatch(run_dir, world_size=2, timeout_s=3600, poll_s=0.01) as watch:
        time.sleep(0.2)  # many polls of the torn file
        alive_over_torn_file = watch._thread.is_alive()
        for rank in (0, 1):
            run_dir.state(rank).write_text(json.dumps({**state, "rank": rank, "finished": True}), encoding="utf-8")
        watch._thread.join(5)
        ended_once_all_finished = not watch._thread.is_alive()
    assert alive_over_torn_file
    assert ended_once_all_finished and watch.report is None


def _state(rank: int, finished: bool = False, waiting_step: int | None = None) -> dict:
    waiting = None if waiting_step is None else {"since_unix": 1.0, "step": waiting_step, "bucket": 0}
    return {"rank": rank, "finished": finished, "waiting": waiting, "steps_done": 3, "activity_unix": 1.0}


def test_the_hang_is_attributed_as_the_alerts_do() -> None:
    # TensorplayRankStalled: ranks in no collective while others wait never arrived; finished ranks wait for no one.
    never_arrived, waiting = attribute_hang([_state(2, waiting_step=5), _state(0, finished=True), _state(1),
                                             _state(3, waiting_step=5)])
    assert [s["rank"] for s in never_arrived] == [1] and [s["rank"] for s in waiting] == [2, 3]
    # TensorplayJobHung: every unfinished rank waits inside a collective: nobody to blame.
    never_arrived, waiting = attribute_hang([_state(1, waiting_step=4), _state(0, waiting_step=4)])
    assert never_arrived == [] and [s["rank"] for s in waiting] == [0, 1]
