"""An exclusive lock on a conversion's destination, held for the whole run (resume and --check included).

`DST.lock` beside DST, locked with flock(LOCK_EX | LOCK_NB): a second conversion into the same DST fails
at once, naming the process that holds it, instead of "resuming" the first one's DST.partial while it
is being written. The kernel drops the lock when its holder dies (kill -9 included), so a stale lock
file never blocks anyone. The file is removed on release; a process that locked a file which was
unlinked meanwhile notices (the path no longer names its inode) and locks the new one instead.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from convert.destination import lock_path
from convert.errors import CheckpointError


class DestinationLock:
    def __init__(self, dst: str | Path):
        self.path = lock_path(Path(dst).absolute())
        self.fd: int | None = None

    def __enter__(self) -> "DestinationLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise CheckpointError(
                    f"{self.path}: another conversion into {_dst_of(self.path)} "
                    f"is running ({holder}); wait for it to finish"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # its holder released and removed the file between our open and our lock: retry
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode())
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)  # while still locked: a waiter that opened it retries on the new file
        except FileNotFoundError:
            pass
        os.close(self.fd)  # releases the lock
        self.fd = None


def _dst_of(lock: Path) -> Path:
    return lock.with_name(lock.name.removesuffix(".lock"))


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (ValueError, KeyError, TypeError, OSError):
        return "holder unknown"
