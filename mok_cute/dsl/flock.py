"""An exclusive ``flock`` with a bounded wait, shared by the on-disk caches (the kernel cache,
:mod:`mok_cute.dsl.disk_cache`, and the tuning file, :mod:`mok_cute.tuning`)."""
from __future__ import annotations

import fcntl
import time


def acquire(fd: int, wait_s: float) -> bool:
    """Lock the open file ``fd`` exclusively, polling for at most ``wait_s`` seconds: True once held
    (released when ``fd`` is closed); False when the wait ran out or the file system has no flock."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        except OSError:
            return False
