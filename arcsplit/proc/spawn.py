"""Starting one process the supervisor's way: through the exec shim (it dies with the supervisor), line-buffered,
in a session of its own, stdout and stderr on one pipe.

Its own light module (the standard library; anyio only when :func:`start` runs) so ``serve --layout`` can start its
ssh sessions before it imports the serving stack (run/early.py), the node agent can start an rpc-server before it
imports anyio (node/quick.py: :func:`popen`), and every Child starts the same way.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..llama.childenv import SERVER_KEY_VAR, child_environ
from ..roles import Role
from .spec import ProcessSpec

if TYPE_CHECKING:
    from anyio.abc import Process

_SHIM = str(Path(__file__).with_name("_exec.py"))
_STDBUF = shutil.which("stdbuf")  # stdout of llama.cpp tools is block-buffered on a pipe: force line buffering


def command(spec: ProcessSpec) -> list[str]:
    """The argv that runs ``spec``: the shim (parent-death signal), stdbuf where present, then the program."""
    shim = [sys.executable, "-I", "-S", _SHIM, "--parent", str(os.getpid())]
    if spec.ignore_sigpipe:
        shim.append("--ignore-sigpipe")
    buf = [_STDBUF, "-oL", "-eL"] if _STDBUF else []
    return [*shim, "--", *buf, *spec.argv]


def environment(spec: ProcessSpec) -> dict[str, str]:
    """This process's environment without its credentials (llama-server keeps its own API key; rpc-servers and ssh
    get none: llama/childenv.py) and ``spec.env_unset``, with ``spec.env`` on top."""
    env = child_environ(os.environ, keep=(SERVER_KEY_VAR,) if spec.role == Role.SERVER else ())
    for var in spec.env_unset:
        env.pop(var, None)
    env.update(spec.env_dict)
    return env


async def start(spec: ProcessSpec) -> Process:
    """Spawn ``spec`` from this thread (the parent-death signal follows the thread that forks: the event loop's).
    OSError when the shim cannot run; a missing program is the shim's exit 127 with its reason."""
    import anyio  # start-up: popen() serves callers that have not imported anyio yet (node/quick.py, run/early.py)

    return await anyio.open_process(
        command(spec), stdin=subprocess.PIPE if spec.keep_stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=environment(spec), start_new_session=True)


def popen(spec: ProcessSpec) -> subprocess.Popen[bytes]:
    """:func:`start` without an event loop (the node agent before anyio is imported); proc/popen.py's
    PopenProcess lets a Child adopt it. Spawned from the calling thread, which must outlive the child's
    supervision (the parent-death signal follows it)."""
    return subprocess.Popen(
        command(spec), stdin=subprocess.PIPE if spec.keep_stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=environment(spec), start_new_session=True)
