"""Process mechanics shared by the supervisor (run/) and the node agent (node/): what to run (spec), starting it
(spawn, the exec shim, popen), supervising one child and its process group (child), ports, run directories, and
the node wire protocol (wire). Standard library only at import time (anyio and psutil where a function needs
them): the node agent imports these on the critical path of a start over SSH, before anyio.
"""
