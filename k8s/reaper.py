"""Run a command and, once it ends, everything it left running: `python -m k8s.reaper -- COMMAND...`.

The local backend's harness runs agent-written shell commands as the user's own uid. A process group is not a
bound: `setsid` or a double fork leaves the group and outlives a `killpg`, free to change the workspace under the
verifier or wait for a later rollout's folder. This process makes itself a child subreaper (Linux
`PR_SET_CHILD_SUBREAPER`, as tini's `-s` and systemd do): every orphan among the command's descendants, whatever
session it moved to, is re-parented to it rather than to init. When the command exits (or this process gets
SIGTERM/SIGINT), it kills its children with SIGKILL and reaps them until it has none left, then exits with the
command's status (128 + N when a signal N ended the command). A Kubernetes pod needs none of this: its containers
end with their PID namespace.
"""

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36


def make_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (from /proc/*/stat: the field after the command's closing
    parenthesis is the state, then the parent's pid)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def reap_all(timeout_s: float = 10.0) -> int:
    """SIGKILL every child (orphans re-parented here included) and reap them until none is left; how many."""
    me, reaped = os.getpid(), 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pid in children(me):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped  # none left, not even one re-parented since the last listing
        if pid:
            reaped += 1
        else:
            time.sleep(0.02)
    return reaped


def run(command: list[str]) -> int:
    make_subreaper()
    child = subprocess.Popen(command)

    def stop(_signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.kill()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = child.wait()
    reap_all()
    return 128 - code if code < 0 else code


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        sys.exit("usage: python -m k8s.reaper -- COMMAND [ARG...]")
    try:
        sys.exit(run(args))
    except OSError as error:
        print(f"forge reaper: {args[0]}: {error.strerror or error}", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    main()
