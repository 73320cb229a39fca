"""Process mechanics shared by the supervisor (run/) and the node agent (node/): what to run (spec), starting it
(spawn, the exec shim _exec, popen), one supervised child and its process group (child), the member and group
state tables (states), ports, run directories (rundir), and the node wire protocol (wire). Standard library only
at import time (anyio and psutil where a function needs them): the node agent imports these on the critical path
of a start over SSH, before anyio.
"""
