"""The flight recorder's reading (llmctl.launch.flight): per group, the collective the ranks disagree on. The dumps
here have the shape torch 2.13's `_dump_fr_trace_json` writes on gloo (seen in tests/launch/test_stall.py's real run):
`pg_status` per group id with the last enqueued/completed sequence numbers, `entries` with each collective's name."""

from __future__ import annotations

import json
import time
from pathlib import Path

from llmctl.launch import flight


def _fr(groups: dict[str, tuple[str, list[str], int]]) -> dict:
    """One recorder: {pg_id: (description, names of its collectives in order, how many completed)}."""
    entries, status = [], {}
    for pg_id, (desc, names, done) in groups.items():
        for seq, name in enumerate(names, 1):
            entries.append(
                {
                    "pg_id": int(pg_id),
                    "process_group": [pg_id, desc],
                    "collective_seq_id": seq,
                    "is_p2p": False,
                    "profiling_name": f"gloo:{name}",
                    "retired": seq <= done,
                }
            )
        status[pg_id] = {"last_enqueued_collective": str(len(names)), "last_completed_collective": str(done)}
    return {"entries": entries, "pg_status": status}


def _dump(groups: dict[str, tuple[str, list[str], int]]) -> dict:
    return {"recorders": {"gloo": _fr(groups)}}


STEP = ["all_reduce", "all_gather", "reduce_scatter"]


def test_a_rank_that_did_not_enter_is_named_with_the_collective_and_the_waiting_ranks():
    dumps = {
        0: _dump({"0": ("default_pg", [*STEP, "all_gather"], 3)}),
        1: _dump({"0": ("default_pg", STEP, 3)}),
        2: _dump({"0": ("default_pg", [*STEP, "all_gather"], 3)}),
    }
    (line,) = flight.disagreement(dumps)
    assert line == (
        "default_pg: rank 1 did not enter collective #4 (all_gather) (last: #3 reduce_scatter); ranks 0, 2 wait in it"
    )


def test_agreeing_ranks_say_nothing_and_one_waiter_is_singular():
    same = {r: _dump({"0": ("default_pg", STEP, 3)}) for r in range(2)}
    assert flight.disagreement(same) == []
    # both entered #4 and wait in it (another group is the stuck one): nothing to say about this group
    both = {r: _dump({"0": ("default_pg", [*STEP, "all_gather"], 3)}) for r in range(2)}
    assert flight.disagreement(both) == []
    one = {0: _dump({"0": ("default_pg", [*STEP, "all_gather"], 3)}), 1: _dump({"0": ("default_pg", STEP, 3)})}
    assert flight.disagreement(one)[0].endswith("; rank 0 waits in it")
    # the waiting rank's collective completed (it went on alone: an async op): no "wait" clause
    done = {0: _dump({"0": ("default_pg", [*STEP, "all_gather"], 4)}), 1: _dump({"0": ("default_pg", STEP, 3)})}
    assert flight.disagreement(done) == [
        "default_pg: rank 1 did not enter collective #4 (all_gather) (last: #3 reduce_scatter)"
    ]


def test_a_collective_that_does_not_match_is_named():
    dumps = {
        0: _dump({"0": ("default_pg", [*STEP, "all_gather"], 3)}),
        1: _dump({"0": ("default_pg", [*STEP, "all_reduce"], 3)}),
    }
    assert flight.disagreement(dumps) == [
        "default_pg: collective #4 does not match (rank 0 in all_gather; rank 1 in all_reduce): a rank took another "
        "code path"
    ]


def test_groups_are_compared_by_description_and_backend_and_p2p_is_left_out():
    # rank 1 is behind on the tp group only; the pipeline's send/recv (p2p) are not collectives of a group's sequence
    r0 = _dump({"0": ("default_pg", STEP, 3), "1": ("mesh_tp", ["all_reduce", "all_reduce"], 1)})
    r1 = _dump({"0": ("default_pg", STEP, 3), "1": ("mesh_tp", ["all_reduce"], 1)})
    r1["recorders"]["gloo"]["entries"].append({"pg_id": 2, "process_group": ["2", "pp"], "is_p2p": True})
    assert flight.disagreement({0: r0, 1: r1}) == [
        "mesh_tp: rank 1 did not enter collective #2 (all_reduce) (last: #1 all_reduce); rank 0 waits in it"
    ]
    two = {
        r: {"recorders": {"gloo": _fr({"0": ("default_pg", STEP, 3)}), "nccl": _fr({"0": ("default_pg", n, 2)})}}
        for r, n in ((0, STEP), (1, STEP[:2]))
    }
    assert flight.disagreement(two) == [
        "default_pg (nccl): rank 1 did not enter collective #3 (reduce_scatter) (last: #2 all_gather); rank 0 waits in it"
    ]


def test_the_request_and_the_dumps_round_trip_through_the_run_folder(tmp_path: Path):
    assert flight.read_request(tmp_path) is None
    req = flight.write_request(tmp_path, "node7")
    assert flight.read_request(tmp_path) == req and req.host == "node7"
    path = flight.dump_path(tmp_path, 3)
    path.write_text(json.dumps(_dump({"0": ("default_pg", STEP, 3)})))
    (tmp_path / "flight" / "rank-00004.json").write_text("{torn")  # a half-written dump is skipped
    assert list(flight.read_dumps(tmp_path)) == [3]
    assert flight.read_dumps(tmp_path, since=time.time() + 60) == {}  # older than the request: not this request's
    t0 = time.monotonic()
    assert list(flight.wait_for_dumps(tmp_path, [3, 5], since=0, wait_s=0.3)) == [3]
    assert time.monotonic() - t0 >= 0.3  # rank 5's dump never came: waited the whole time, then gave what it had


SCRIPT = """
import json, os, sys, time
import torch, torch.distributed as dist
from llmctl.engine.watchdog import Watchdog, flight_recorder_env
from llmctl.launch import flight
run = sys.argv[1]
flight_recorder_env(run, "gloo")
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
t = torch.ones(3)
dist.all_reduce(t)
dist.all_gather_into_tensor(torch.zeros(3), t)
old = flight.write_request(run, "elsewhere")  # written before the rank started: not answered
time.sleep(0.05)
watch = Watchdog(run, 0)
time.sleep(1.2)
assert not flight.dump_path(run, 0).exists()
flight.write_request(run, "elsewhere")  # a reader on another host: the flight recorder and the stacks
deadline = time.time() + 10
while not flight.dump_path(run, 0).exists() and time.time() < deadline:
    time.sleep(0.1)
time.sleep(0.3)
watch.close()
print(json.dumps(flight.group_states(json.loads(flight.dump_path(run, 0).read_text()))["default_pg"].__dict__))
"""


def test_the_engine_answers_a_request_with_its_recorder_and_its_stacks_from_a_thread(tmp_path: Path):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_FR_")}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = json.loads(proc.stdout.strip().splitlines()[-1])
    assert state == {"group": "default_pg", "last": 2, "name": "all_gather", "completed": True}
    stacks = (tmp_path / "stacks" / "rank-00000.txt").read_text()
    assert "Thread" in stacks and "_answer_requests" in stacks  # the remote reader's request dumped every thread


def test_groups_of_one_dimension_are_told_apart_by_members_and_the_cause_comes_first():
    """The real 4-rank tp 2 x fsdp 2 hang (tests/launch/test_stall.py): rank 2 sleeps outside any collective; rank 3
    waits for it in their tp group, rank 0 in their shard group, and rank 1 waits in its tp group for rank 0, which
    is itself waiting: that last line is a consequence, named as such and listed last."""
    members = {"1": [0, 1], "2": [2, 3], "3": [0, 2], "4": [1, 3]}

    def rank(tp: tuple[str, int, int], shard: tuple[str, int, int]) -> dict:
        fr = _fr(
            {
                "1": ("mesh_tp", ["all_reduce"] * tp[1], tp[2]),
                "3": ("mesh_shard", ["all_gather"] * shard[1], shard[2]),
            }
        )
        for e in fr["entries"]:  # each rank's own groups under the names of its members
            e["process_group"][0] = tp[0] if e["process_group"][1] == "mesh_tp" else shard[0]
        return {"recorders": {"gloo": fr}, "groups": members}

    dumps = {
        0: rank(("1", 196, 196), ("3", 57, 56)),
        1: rank(("1", 197, 196), ("4", 58, 58)),
        2: rank(("2", 196, 196), ("3", 56, 56)),
        3: rank(("2", 197, 196), ("4", 58, 58)),
    }
    assert flight.disagreement(dumps) == [
        "mesh_shard [0, 2]: rank 2 did not enter collective #57 (all_gather) (last: #56 all_gather); rank 0 waits in it",
        "mesh_tp [2, 3]: rank 2 did not enter collective #197 (all_reduce) (last: #196 all_reduce); rank 3 waits in it",
        "mesh_tp [0, 1]: rank 0 did not enter collective #197 (all_reduce) (last: #196 all_reduce); rank 1 waits in it"
        " (itself waiting in mesh_shard [0, 2] #57 all_gather)",
    ]
