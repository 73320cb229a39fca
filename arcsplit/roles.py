"""What a process of a group is for: the roles, one owner. Pure: standard library only.

``Role`` is a ``StrEnum``: a member compares and serialises as its value ("rpc"), so argv, the bus, state files
and JSON read back from disk (plain strings) see the same text as before.
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    RPC = "rpc"  # a ggml rpc-server holding cards for llama-server
    LINK = "link"  # this side of the SSH forward to another host's rpc-server (run/remote.py)
    SERVER = "server"  # llama-server, the one that serves the model
    NODE = "node"  # a host's node agent (run/early.py)
