"""Writing the files llmctl owns (plans, reports, job records, scripts, token-file metadata) so that a crash or a
full disk never leaves a half-written file or destroys the previous one. Torch-free."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike[str], data: str | bytes, mode: int | None = None) -> None:
    """Write `data` to `path` all or nothing: a temporary file in the same folder, fsync, rename over the target,
    fsync the folder (so the rename itself survives a power cut). `mode` sets the permissions (e.g. 0o755); by default
    they are those of a new file (0666 less the umask)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp creates the file 0600; a plan or a report is as readable as any file the user writes.
        os.chmod(tmp, mode if mode is not None else 0o666 & ~_umask())
        os.replace(tmp, p)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            # a full disk names the file asked for, not the temporary one; the previous file is untouched
            raise_if_no_space(e, p, len(data.encode() if isinstance(data, str) else data))
        raise
    fsync_dir(p.parent)


def raise_if_no_space(e: OSError, path: str | os.PathLike[str], needed_bytes: int) -> None:
    """A full disk (or quota) while writing `path`: one line naming it and the bytes it needs (RuntimeFailure,
    exit 1), instead of an internal error. Any other OSError: returns (the caller re-raises it)."""
    import shutil

    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
        return
    from llmctl.errors import RuntimeFailure
    from llmctl.units import fmt_bytes

    try:
        free = f", {fmt_bytes(shutil.disk_usage(Path(path).parent).free)} free"
    except OSError:
        free = ""
    raise RuntimeFailure(
        f"no space left on the device writing {path}: it needs {needed_bytes:,} bytes ({fmt_bytes(needed_bytes)})"
        f"{free}; the previous file, if any, is intact",
        hint="free space, or write it elsewhere",
    ) from None


def _umask() -> int:
    current = os.umask(0)  # reading the umask means setting it: put it back at once
    os.umask(current)
    return current


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Persist a folder's entries (a rename or a new file in it); a no-op where folders cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------ reading user files

MAX_INPUT_BYTES = 64 * 2**20
"""The largest plan, cluster, catalog, config.json, bench report or metrics file llmctl reads (a real one is
kilobytes; a metrics file of a month-long run at one line a step, a few MB): a larger one is a wrong path."""


def read_input(path: str | os.PathLike[str], what: str, max_bytes: int = MAX_INPUT_BYTES) -> str:
    """The text of a file the user gave, or one SpecError line naming the file and the problem: missing, a
    folder, unreadable, larger than `max_bytes` (never read whole), not UTF-8, empty."""
    from llmctl.errors import SpecError

    p = Path(path)
    try:
        if p.is_dir():
            raise SpecError(f"{p}: is a folder, expected a {what}")
        with p.open("rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise SpecError(f"{p}: no such {what}") from None
    except PermissionError:
        raise SpecError(f"{p}: permission denied (reading the {what})") from None
    except OSError as e:
        raise SpecError(f"cannot read {what} {p}: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise SpecError(f"{p}: larger than {max_bytes // 2**20} MiB, too large for a {what}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{p}: not a UTF-8 text file (byte {e.start}); expected a {what}") from None
    if not text.strip():
        raise SpecError(f"{p}: empty {what}")
    return text


MAX_NESTING = 100
"""The deepest nesting of lists and mappings llmctl reads (a plan or a config.json has 3 or 4 levels): the parsers
recurse once per level, so a file of 5,000 `[` would otherwise end in a RecursionError, not a line."""


def load_yaml(path: str | os.PathLike[str], what: str) -> object:
    """A YAML file the user gave, strictly: no aliases (a plan never needs one, and nested aliases expand
    exponentially downstream: the 'billion laughs'), no duplicate keys (the later one would silently win), at most
    MAX_NESTING levels deep. Errors are one SpecError line with the line number."""
    return parse_yaml(read_input(path, what), str(path))


def parse_yaml(text: str, source: str) -> object:
    import yaml

    from llmctl.errors import SpecError

    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.reader.ReaderError as e:  # a control character: its message spans lines and has no mark
        line = text.count("\n", 0, e.position) + 1
        raise SpecError(f"{source}: not valid YAML line {line}: {e.reason} (#x{e.character:04x})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        problem = (str(getattr(e, "problem", None) or e).splitlines() or [""])[0]
        raise SpecError(f"{source}: not valid YAML{where}: {problem}") from None


def load_json(path: str | os.PathLike[str], what: str) -> object:
    """A JSON file the user gave; errors are one SpecError line with the line and column."""
    import json

    from llmctl.errors import SpecError

    p = Path(path)
    text = read_input(p, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"{p} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} ({what})") from None
    except RecursionError:  # json's decoder recurses once per level, like YAML's composer (MAX_NESTING)
        raise SpecError(f"{p}: nested too deeply to be a {what}") from None


def _strict_loader() -> type:
    import yaml

    class StrictLoader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise yaml.MarkedYAMLError(problem="aliases (*name) are not allowed", problem_mark=event.start_mark)
            self.depth += 1
            try:
                if self.depth > MAX_NESTING:
                    raise yaml.MarkedYAMLError(
                        problem=f"nested deeper than {MAX_NESTING} levels", problem_mark=self.peek_event().start_mark
                    )
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def fetch_flow_collection_start(self, TokenClass):  # type: ignore[no-untyped-def]
            # The same cap, in the scanner, for `[` and `{`: while one may still start a key it reads ahead up to
            # 1,024 characters checking every open one at each token, so 1,000 `[` on a line cost half a second
            # before the composer above would see the depth.
            if self.flow_level >= MAX_NESTING:
                raise yaml.MarkedYAMLError(
                    problem=f"nested deeper than {MAX_NESTING} levels", problem_mark=self.get_mark()
                )
            super().fetch_flow_collection_start(TokenClass)

        def construct_object(self, node, deep=False):  # type: ignore[no-untyped-def]
            try:
                return super().construct_object(node, deep=deep)
            except (ValueError, OverflowError) as e:  # int() of 5,000 digits (Python's limit), date 2024-02-30
                problem = str(e).split(";")[0]
                raise yaml.MarkedYAMLError(problem=problem, problem_mark=node.start_mark) from None

        def construct_mapping(self, node, deep=False):  # type: ignore[no-untyped-def]
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    continue  # SafeLoader's own error ("found unhashable key") follows
                if key in seen:
                    raise yaml.MarkedYAMLError(problem=f"duplicate key {key!r}", problem_mark=key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


class _LazyLoader:
    """The strict loader class, built on first use so that importing llmctl.fileio does not import yaml."""

    _cls: type | None = None

    def __call__(self, stream):  # type: ignore[no-untyped-def]
        if _LazyLoader._cls is None:
            _LazyLoader._cls = _strict_loader()
        return _LazyLoader._cls(stream)


_StrictLoader = _LazyLoader()


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (a folder named after a dead writer's pid is stale)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


# ------------------------------------------------------------------------------------------ append-only JSON lines


def whole_lines_end(path: str | os.PathLike[str]) -> int:
    """The byte offset just past the last newline of `path` (0 for a missing or empty file, or one without any):
    where a JSON-lines file's whole lines end. Read backwards, a block at a time (a torn tail is one line)."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return 0
    with f:
        end = f.seek(0, os.SEEK_END)
        while end > 0:
            start = max(0, end - 65536)
            f.seek(start)
            block = f.read(end - start)
            i = block.rfind(b"\n")
            if i >= 0:
                return start + i + 1
            end = start
        return 0


def repair_torn_tail(path: str | os.PathLike[str]) -> tuple[str, int] | None:
    """Before appending to a JSON-lines file: a last line without its newline (a writer killed mid-write) would be
    glued to the next line written, and both become unreadable. A tail that is a whole JSON object gets its newline;
    anything else (a cut line) is truncated away. Returns None when the file was whole, else ("newline" | "dropped",
    bytes of the tail)."""
    import json

    whole = whole_lines_end(path)
    try:
        with open(path, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            if size == whole:
                return None
            f.seek(whole)
            tail = f.read()
            try:
                complete = isinstance(json.loads(tail), dict)
            except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
                complete = False
            if complete:
                f.write(b"\n")
                return ("newline", len(tail))
            f.truncate(whole)
            return ("dropped", len(tail))
    except FileNotFoundError:
        return None
