"""Is a path on a file system that the compute nodes share with this machine? Read from the kernel's mount table
(/proc/self/mountinfo): the file system type of the mount that holds the path. Torch-free.

A job runs on other machines than the login node it is submitted from: an interpreter or a venv there must be on a
shared file system (NFS, Lustre, GPFS, ...), or the nodes must have their own at the same path (a container, a
module, an environment that `--setup` activates).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from llmctl.launch import shell

MOUNTINFO = Path("/proc/self/mountinfo")

# Network and parallel file systems, as mountinfo names them (proc(5) "mountinfo": the field after " - ").
SHARED_FSTYPES = frozenset(
    {
        "nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "panfs", "wekafs", "glusterfs", "cifs", "smb3",
        "afs", "openafs", "orangefs", "pvfs2", "dvs", "quobyte", "ocfs2", "gfs2", "juicefs",
    }
)  # fmt: skip
# Local disks and memory: a path there exists on this machine only.
LOCAL_FSTYPES = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "vfat", "exfat", "ntfs", "overlay", "tmpfs", "ramfs"}
)


@dataclass(frozen=True)
class Mount:
    point: str
    fstype: str

    @property
    def shared(self) -> bool | None:
        """True on a network or parallel file system (and FUSE ones: gcsfuse, s3fs, sshfs, ...), False on a local
        one, None when the type says neither."""
        if self.fstype in SHARED_FSTYPES or self.fstype.startswith("fuse."):
            return True
        return False if self.fstype in LOCAL_FSTYPES else None


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes (\\040 ...)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[Mount]:
    """Mount points and their file system types, in the table's order (a later mount hides an earlier one)."""
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        mounts.append(Mount(_unescape(fields[4]), right.split()[0]))
    return mounts


def mount_of(path: str, mountinfo: str | None = None) -> Mount | None:
    """The mount that holds `path` (its folder's symlinks resolved: a venv's bin/python is a link to the base
    interpreter, but what matters is where the venv is). None when the table cannot be read."""
    if mountinfo is None:
        try:
            mountinfo = MOUNTINFO.read_text()
        except OSError:
            return None
    p = os.path.join(os.path.realpath(os.path.dirname(path) or "."), os.path.basename(path))
    best: Mount | None = None
    for m in parse_mountinfo(mountinfo):
        inside = p == m.point or p.startswith(m.point.rstrip("/") + "/")
        if inside and (best is None or len(m.point) >= len(best.point)):
            best = m
    return best


def local_paths(paths: list[str], mountinfo: str | None = None) -> list[tuple[str, Mount]]:
    """The absolute paths among `paths` that are on a local file system of this machine, with their mount."""
    out = []
    for path in dict.fromkeys(paths):  # once each, in order
        if not os.path.isabs(path):
            continue  # a name the nodes look up on their own PATH
        m = mount_of(path, mountinfo)
        if m is not None and m.shared is False:
            out.append((path, m))
    return out


def interpreter_note(paths: Iterable[str], fix: str, mountinfo: str | None = None) -> str | None:
    """One line when an interpreter the job runs by absolute path is on a local file system of this machine: the
    compute nodes (the batch host is one) may not have it. None when it is on a shared one, or not known. Written
    without parentheses or unquoted paths, so that the line stays harmless where a --dry-run's output is fed to a
    shell."""
    found = local_paths(list(paths), mountinfo)
    if not found:
        return None
    path, mount = found[0]
    return (
        f"the job runs {shell.quote(path)}, which is on a local file system of this machine - {mount.fstype} at "
        f"{shell.quote(mount.point)} - and the compute nodes may not have it; {fix}"
    )
