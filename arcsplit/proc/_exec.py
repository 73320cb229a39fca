"""Exec shim: make a child die with the supervisor, then become the real program.

    python -I -S _exec.py --parent PID [--ignore-sigpipe] -- argv...

anyio.open_process has no preexec_fn, so the parent-death signal is set here, between fork and the real exec:
prctl(PR_SET_PDEATHSIG, SIGKILL) survives execve (the binaries are not set-uid). If the supervisor died before
prctl took effect, getppid() no longer returns it: exit instead of running an orphan. The signal fires when the
*thread* that forked exits, so the supervisor spawns from its event-loop thread, which lives as long as it does.

Stdlib only and run by path (not ``-m``) so starting it imports nothing of arcsplit: it costs ~20 ms per child.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    parent = None
    ignore_sigpipe = False
    i = 0
    while i < len(argv) and argv[i] != "--":
        if argv[i] == "--parent":
            parent = int(argv[i + 1])
            i += 2
        elif argv[i] == "--ignore-sigpipe":
            ignore_sigpipe = True
            i += 1
        else:
            print(f"_exec: unknown option {argv[i]}", file=sys.stderr)
            return 127
    target = argv[i + 1:]
    if not target:
        print("_exec: no command after --", file=sys.stderr)
        return 127
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            print(f"_exec: prctl failed: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
            return 127
    if parent is not None and os.getppid() != parent:
        return 127  # the supervisor is already gone
    # Python itself ignores SIGPIPE; an ignored disposition is inherited through exec, so set it explicitly.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN if ignore_sigpipe else signal.SIG_DFL)
    try:
        os.execvp(target[0], target)
    except OSError as exc:
        print(f"_exec: cannot run {target[0]}: {exc.strerror}", file=sys.stderr)
        return 127
    return 127  # unreachable


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
