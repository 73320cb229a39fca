"""A member's process group ends with it. Found leaking in a CI run: an rpc-server was stopped under a loading
llama-server, whose RPC client aborted; ggml's abort forks to print a backtrace, the group's SIGTERM landed in that
fork before it was ready and deadlocked its exit (fork holds malloc's lock), and the fork, holding llama-server's
output pipe with SIGTERM blocked, outlived the stopped group. Here a real process leaves such a straggler: it
ignores SIGTERM and holds the pipe."""

from __future__ import annotations

import anyio

from arcsplit.proc.child import Child
from arcsplit.proc.spec import ProcessSpec

from _procs import dead, stop_after_first_line, wait_until

# the straggler: SIGTERM ignored (inherited through exec), the output pipe inherited; its pid on the first line
STRAGGLER = '(trap "" TERM; exec sleep 600) & echo $!; '


def _spec(script: str) -> ProcessSpec:
    return ProcessSpec(name="p", role="rpc", argv=("sh", "-c", STRAGGLER + script), env=(), host="127.0.0.1",
                       port=1, cards=())


def test_a_leader_that_exits_takes_what_it_left_in_its_group_with_it():
    """The leader exits on its own (a crash): its exit is reported, and nothing of its group is left running, though
    the straggler holds the pipe the member reads to its end."""
    child = Child(_spec("exit 3"))

    async def main() -> None:
        with anyio.fail_after(10):
            await child.run()

    anyio.run(main)
    assert child.returncode == 3
    straggler = int(child.lines[0])
    wait_until(lambda: dead(straggler), 5, "the straggler to die", interval=0.01)


def test_a_stopped_member_leaves_nothing_of_its_group():
    """stop(): the leader goes at SIGTERM; what ignores it in its group is killed once the leader has gone."""
    child = Child(_spec("exec sleep 600"))
    stop_after_first_line(child, timeout=15)
    straggler = int(child.lines[0])
    wait_until(lambda: dead(straggler), 5, "the straggler to die", interval=0.01)
