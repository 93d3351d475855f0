"""What torch's flight recorder says about a hung collective (issue 50): which one, and which ranks did not enter it.

torch records every collective a process group enqueues (its sequence number in the group, its name, whether it
completed) in a ring buffer per process, the "flight recorder" (`TORCH_FR_BUFFER_SIZE`; on NCCL also
`TORCH_NCCL_TRACE_BUFFER_SIZE`). The engine switches it on for gloo and NCCL and, when asked (the request file this
module writes, which a thread of each rank watches, so it works while the main thread is blocked in a collective and
for ranks on other hosts of a shared run folder) or when a collective times out, writes the buffer as JSON to
`<logging.dir>/flight/rank-NNNNN.json` (`llmctl.engine.watchdog`).

The reading (`disagreement`): per process group (its description, e.g. `default_pg`, `mesh_dp_shard`), each rank's
last enqueued collective. The ranks at the highest sequence number that have not completed it are waiting in it; a rank
whose last one is lower did not enter it (it is behind: stuck in its own work, or on another code path). Ranks at the
same number with different collectives called a collective that did not match. Groups of one description on
different ranks are compared as one: a training step enters each mesh dimension's collectives the same number of
times on every rank, so their counts agree on healthy ranks.

JSON only, never a pickle (NCCL's own dump on timeout is a pickle that `python -m
torch.distributed.flight_recorder.fr_trace` reads; reading a run folder must not run code). Torch-free.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

DIR = "flight"
REQUEST = "request.json"
BUFFER_ENTRIES = 2000
"""Collectives kept per rank (torchtitan's setting of TORCH_NCCL_TRACE_BUFFER_SIZE); a few hundred bytes each."""


def dump_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(run_dir) / DIR / f"rank-{rank:05d}.json"


def request_path(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / DIR / REQUEST


@dataclass(frozen=True)
class Request:
    """What a reader asks of the ranks: every rank dumps its flight recorder; ranks on a host other than `host` also
    dump their stacks (the reader signals the ranks of its own host, it cannot signal the others)."""

    stamp: float
    host: str


def write_request(run_dir: str | os.PathLike[str], host: str) -> Request:
    """Ask every rank for its flight recorder (and the remote ones for their stacks): the request file, whole."""
    req = Request(time.time(), host)
    path = request_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps({"stamp": req.stamp, "host": req.host}))
    os.replace(tmp, path)
    return req


def read_request(run_dir: str | os.PathLike[str]) -> Request | None:
    try:
        data = json.loads(request_path(run_dir).read_text())
        return Request(float(data["stamp"]), str(data["host"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None


@dataclass(frozen=True)
class GroupState:
    """One rank's view of one process group: its last enqueued collective and whether that one completed."""

    group: str
    """The group's description (`default_pg`, `mesh_tp`, ...), its members when the engine recorded them, and its
    backend when the rank has two recorders: `mesh_tp [2, 3]`."""
    last: int
    """The sequence number of the last collective this rank enqueued on the group (0: none)."""
    name: str
    """That collective's name, e.g. `all_reduce` (the backend's prefix dropped)."""
    completed: bool


def group_states(dump: dict) -> dict[str, GroupState]:
    """{group: state} from one rank's dump: {"recorders": {backend: torch's `_dump_fr_trace_json` format}, "groups":
    {process group name: global ranks}}. Groups of one description are told apart by their members (the tp group of
    ranks 0, 1 is not the one of ranks 2, 3, and their sequence numbers are not comparable)."""
    recorders = dump.get("recorders") or {}
    members = dump.get("groups") or {}
    out: dict[str, GroupState] = {}
    for backend, fr in sorted(recorders.items()):
        for state in _recorder_states(fr, members):
            key = f"{state.group} ({backend})" if len(recorders) > 1 else state.group
            out[key] = GroupState(key, state.last, state.name, state.completed)
    return out


def _recorder_states(fr: dict, members: dict[str, list[int]]) -> list[GroupState]:
    entries = [e for e in fr.get("entries", []) if not e.get("is_p2p")]
    ids = {str(e.get("pg_id")): _group_label(e, members) for e in entries}
    out = []
    for pg_id, status in (fr.get("pg_status") or {}).items():
        group = ids.get(str(pg_id))
        last = int(status.get("last_enqueued_collective", -1))
        if group is None or last <= 0:
            continue
        at = [e for e in entries if str(e.get("pg_id")) == str(pg_id) and e.get("collective_seq_id") == last]
        name = str(at[-1].get("profiling_name", "?")).split(":", 1)[-1] if at else "?"
        done = int(status.get("last_completed_collective", -1)) >= last
        out.append(GroupState(group, last, name, done))
    return out


def _group_label(entry: dict, members: dict[str, list[int]]) -> str:
    pg = entry.get("process_group") or []
    name = str(pg[0]) if pg else str(entry.get("pg_id"))
    desc = (pg[1] if len(pg) > 1 else "") or f"group {name}"
    ranks = members.get(name)
    return f"{desc} [{', '.join(map(str, ranks))}]" if ranks and desc != "default_pg" else desc


def read_dumps(run_dir: str | os.PathLike[str], since: float = 0.0) -> dict[int, dict]:
    """{rank: flight-recorder JSON} of the dumps in the run folder written at or after `since` (unreadable skipped)."""
    out = {}
    for p in sorted((Path(run_dir) / DIR).glob("rank-*.json")):
        try:
            if p.stat().st_mtime + 1 < since:
                continue
            out[int(p.stem.split("-")[1])] = json.loads(p.read_text())
        except (OSError, ValueError, IndexError):
            continue
    return out


def wait_for_dumps(run_dir: str | os.PathLike[str], ranks: list[int], since: float, wait_s: float) -> dict[int, dict]:
    """The dumps of `ranks` written after a request at `since`, waiting up to `wait_s` for all of them."""
    deadline = time.monotonic() + wait_s
    while True:
        got = read_dumps(run_dir, since)
        if set(ranks) <= set(got) or time.monotonic() >= deadline:
            return got
        time.sleep(0.1)


def disagreement(dumps: dict[int, dict]) -> list[str]:
    """One line per process group whose ranks disagree (module docstring). The lines whose ranks behind wait in no
    collective come first: those ranks are the cause; a rank behind in one group because it waits in another is a
    consequence, and its line says so."""
    views: dict[str, dict[int, GroupState]] = {}
    for rank, dump in sorted(dumps.items()):
        for group, state in group_states(dump).items():
            views.setdefault(group, {})[rank] = state
    waits_in = {
        r: f"{g} #{s.last} {s.name}"
        for g, by_rank in sorted(views.items())
        for r, s in by_rank.items()
        if not s.completed
    }
    found = []
    for group, by_rank in sorted(views.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        if (got := _group_line(group, by_rank)) is not None:
            line, behind = got
            busy = [r for r in behind if r in waits_in]
            if busy and len(busy) == len(behind):
                line += f" (itself waiting in {waits_in[busy[0]]})"
            found.append((len(busy) == len(behind) and bool(busy), line))
    return [line for _, line in sorted(found, key=lambda f: f[0])]


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (f" (+{len(ranks) - 8} more)" if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


def _group_line(group: str, by_rank: dict[int, GroupState]) -> tuple[str, list[int]] | None:
    """(the line, the ranks behind) for one group whose ranks disagree, else None."""
    if len(by_rank) < 2:
        return None
    top = max(s.last for s in by_rank.values())
    at_top = {r: s for r, s in by_rank.items() if s.last == top}
    names = sorted({s.name for s in at_top.values()})
    if len(names) > 1:
        parts = "; ".join(f"{_ranks([r for r, s in at_top.items() if s.name == n])} in {n}" for n in names)
        return f"{group}: collective #{top} does not match ({parts}): a rank took another code path", []
    behind = sorted(r for r, s in by_rank.items() if s.last < top)
    if not behind:
        return None
    waiting = sorted(r for r, s in at_top.items() if not s.completed)
    lasts = ", ".join(f"#{by_rank[r].last} {by_rank[r].name}" for r in behind[:4])
    wait = f"; {_ranks(waiting)} wait{'s' if len(waiting) == 1 else ''} in it" if waiting else ""
    return f"{group}: {_ranks(behind)} did not enter collective #{top} ({names[0]}) (last: {lasts}){wait}", behind
