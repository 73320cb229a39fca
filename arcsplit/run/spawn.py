"""Starting one process the supervisor's way: through the exec shim (it dies with the supervisor), line-buffered,
in a session of its own, stdout and stderr on one pipe.

Its own light module (anyio and the standard library) so ``serve --layout`` can start its ssh sessions before it
imports the serving stack (run/early.py), and every Child starts the same way.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
from anyio.abc import Process

from .procspec import ProcessSpec

_SHIM = str(Path(__file__).with_name("_exec.py"))
_STDBUF = shutil.which("stdbuf")  # stdout of llama.cpp tools is block-buffered on a pipe: force line buffering


def command(spec: ProcessSpec) -> list[str]:
    """The argv that runs ``spec``: the shim (parent-death signal), stdbuf where present, then the program."""
    shim = [sys.executable, "-I", "-S", _SHIM, "--parent", str(os.getpid())]
    if spec.ignore_sigpipe:
        shim.append("--ignore-sigpipe")
    buf = [_STDBUF, "-oL", "-eL"] if _STDBUF else []
    return [*shim, "--", *buf, *spec.argv]


async def start(spec: ProcessSpec) -> Process:
    """Spawn ``spec`` from this thread (the parent-death signal follows the thread that forks: the event loop's).
    OSError when the shim cannot run; a missing program is the shim's exit 127 with its reason."""
    env = dict(os.environ)
    for var in spec.env_unset:
        env.pop(var, None)
    env.update(spec.env_dict)
    return await anyio.open_process(
        command(spec), stdin=subprocess.PIPE if spec.keep_stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
