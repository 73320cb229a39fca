"""``python -m arcsplit``: the ``arcsplit`` command (arcsplit/cli/).

Every import in arcsplit is at its module's top, except where start-up time needs it inside a function: what a
module imports at its top, every command that imports the module pays before it does anything. This is the one
list of those places (tests/test_shape.py holds the code to it). Each row: where, what it imports, what moving it
to the top would cost (min/median/max ms over 7 runs of bench/import_costs.py, bytecode compiled, on a shared
2-core machine; the figures move with its load, bench/results/import_costs.md has the last run), and below it why
it stays. anyio 4.16 defers its own imports to first use, hence the 1 ms of its rows here; the releases before it
that pyproject allows (from 4.7) import asyncio with it.

    _api.py:instance                   arcsplit.telemetry             79/99/121
        the route, HTTP and card samplers, for a run that asks for them: `arcsplit --help` and `plan` import the API
    _warm.py:warm_hosts                anyio                          1/1/1
        serve's early sessions: this module is imported before anyio, which comes once every ssh is spawned
    _warm.py:warm_hosts                arcsplit.run.remote            58/61/75
        the serving stack, imported while the early sessions log in
    _warm.py:check_builds              arcsplit.run.remote            53/63/69
        as in warm_hosts
    _warm.py:run_early                 anyio                          1/1/1
        after start_sessions, so the ssh logins begin meanwhile
    _warm.py:run_early                 anyio.to_thread                3/3/5
        as above
    cli/__init__.py:main               arcsplit._warm                 30/38/50
        serve with other hosts opens their ssh sessions before it imports the serving stack; other commands would pay it
    cli/dash.py:_dash                  arcsplit.tui.app               123/127/134
        textual: `arcsplit --help` imports every command's module
    cli/doctor.py:_verify              arcsplit.tuning.picks            249/377/394
        the planner and the request's preparation (decide/), for tune's kept results: only with --verify
    cli/doctor.py:_verify              arcsplit.tuning.runner           281/338/372
        the serving stack and httpx: only with --verify (doctor alone starts nothing)
    cli/node.py:inventory              arcsplit.cli.llama             45/50/71
        the llama.cpp build and card code: the node agent answers its first ops before it reads the inventory
    cli/node.py:_node                  arcsplit.node.standing         11/12/23
        only --listen and --attach: not the per-run agent (--stdio)
    cli/node.py:_node                  arcsplit.node.quick            29/32/37
        only the agent (--stdio): not `arcsplit --help`, not --listen
    cli/report.py:_report              arcsplit.report                4/4/4
        tarfile, getpass and the redactor: `arcsplit --help` imports every command's module
    cli/serve.py:_serve                arcsplit.cli.serve_run         246/265/292
        the serving stack: cli.main checks a layout's serve with this module before its ssh sessions start, and
        imports the stack while they log in
    cli/serve_run.py:serve             arcsplit.telemetry.prometheus  85/99/110
        prometheus_client: only with --metrics-port
    cli/serve_run.py:_tuned_request    arcsplit.tuning.runner           77/92/147
        httpx and the tune runner: only with --tune (a kept pick is read from tuning/picks.py, which the API imports)
    cli/serve_run.py:_serve_with_dashboard arcsplit.tui.app           116/136/205
        textual: only with --tui
    cli/tune.py:_tune                  arcsplit.tuning.runner           73/86/92
        `arcsplit --help` imports every command's module
    decide/prepare.py:_runtime         arcsplit.llama.runtime         9/11/24
        the probe and the facts, for a multi-card Intel run only: `plan` imports this module
    inproc.py:_bindings                llama_cpp                      optional
        an optional dependency, and it loads libllama from LLAMA_CPP_LIB_PATH, set just before
    llama/build.py:_running_exes       psutil                         11/12/19
        the node agent imports llama.build as it starts
    llama/probe.py:probe_model         arcsplit.synth                 135/195/236
        numpy and gguf's writer, for a probe only: `arcsplit --help` imports llama.probe (doctor, report)
    llama/source.py:extract_source     tarfile                        2/2/8
        the node agent imports llama.source (through llama.build) as it starts
    node/quick.py:_start               psutil                         9/10/29
        after the first rpc-server's spawn, so it starts meanwhile
    node/quick.py:run_stdio            arcsplit.node.agent            27/34/37
        anyio, psutil and the agent's supervision: after the first ops (first_ops's thread imports it)
    proc/ports.py:probe_once           anyio                          8/8/13
        the node agent picks ports before it imports anyio (node/quick.py)
    proc/rundir.py:supervisor_identity psutil                         14/16/16
        the node agent imports this module as it starts and answers its first ops before psutil is imported
    proc/rundir.py:same_process        psutil                         14/15/18
        as in supervisor_identity
    proc/ports.py:_owns_port_psutil    psutil                         14/15/18
        as in proc/rundir.py's rows (the same psutil import): only where netlink's sock_diag cannot be asked
    proc/rundir.py:sweep               psutil                         14/15/25
        as in supervisor_identity: only once a dead run left processes
    proc/spawn.py:start                anyio                          1/1/1
        popen() serves the node agent and serve's early sessions before anyio is imported
    run/bus.py:_curve                  zmq.auth.asyncio               1/1/2
        only for a bus on TCP (--bus-tcp): `arcsplit --help` and `plan` import the bus
    run/early.py:start_sessions        arcsplit.proc.popen            7/8/11
        anyio, once every early ssh session is spawned
    run/early.py:end                   anyio                          2/2/3
        serve's early sessions: this module is imported before anyio
    run/launch.py:http_client          httpx                          80/83/148
        only once a server's health is checked, or the progress watchdog reads: `arcsplit --help` and `plan`
        import this module (through the API)
    run/canary.py:_client              httpx                          90/134/166
        only once a group is ready with its output canary on: `arcsplit --help` and `plan` import this module
    telemetry/nvidia.py:__init__       pynvml                         optional
        an optional dependency (nvidia-ml-py), on a CUDA host only
"""

from .cli import run

run()
