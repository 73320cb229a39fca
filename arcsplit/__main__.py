"""``python -m arcsplit``: the ``arcsplit`` command (arcsplit/cli/).

Every import in arcsplit is at its module's top, except where start-up time needs it inside a function: what a
module imports at its top, every command that imports the module pays before it does anything. This is the one
list of those places (tests/test_shape.py holds the code to it). Each row: where, what it imports, what moving it
to the top would cost (min/median/max ms over 7 runs of bench/import_costs.py, bytecode compiled, on a shared
2-core machine; the figures move with its load, bench/results/import_costs.md has the last run), and below it why
it stays.

    cli/__init__.py:main               arcsplit._warm                 30/48/83
        serve with other hosts opens their ssh sessions before the serving stack is imported; every other command would pay it
    cli/dash.py:_dash                  arcsplit.tui.app               138/234/274
        textual: `arcsplit --help` imports every command's module
    cli/node.py:inventory              arcsplit.cli.llama             45/49/55
        the llama.cpp build and card code: the node agent answers its first ops before it reads the inventory
    cli/node.py:_node                  arcsplit.node.standing         11/11/18
        only --listen and --attach: not the per-run agent (--stdio)
    cli/node.py:_node                  arcsplit.node.quick            36/45/87
        only the agent (--stdio): not `arcsplit --help`, not --listen
    cli/report.py:_report              arcsplit.report                4/4/22
        tarfile, getpass and the redactor: `arcsplit --help` imports every command's module
    cli/serve.py:_serve                arcsplit.telemetry.prometheus  108/158/199
        prometheus_client: only with --metrics-port
    cli/serve.py:_serve_with_dashboard arcsplit.tui.app               143/180/322
        textual: only with --tui
    inproc.py:_bindings                llama_cpp                      optional
        an optional dependency, and it loads libllama from LLAMA_CPP_LIB_PATH, set just before
    llama/build.py:_running_exes       psutil                         12/13/32
        the node agent imports llama.build as it starts
    llama/source.py:extract_source     tarfile                        2/2/2
        the node agent imports llama.source (through llama.build) as it starts
"""

from .cli import run

run()
