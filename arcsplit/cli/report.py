"""``arcsplit report``: write one redacted bundle to attach to a bug report (see arcsplit/report.py)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .. import backends
from ..errors import ArcsplitError
from ..llama.probe import DEFAULT_TIMEOUT_S
from ..proc.rundir import read_state
from .doctor import diagnose
from .llama import which_data
from .options import add_llama_dir


def _report(args: argparse.Namespace) -> int:
    from ..report import collect, find_run, write_bundle  # tarfile, getpass: not for `arcsplit --help`

    run = find_run(args.run)  # a wrong run id is a one-line error before anything runs
    out = Path(args.output or f"arcsplit-report-{time.strftime('%Y%m%d-%H%M%S')}.tar.gz")
    doctor_args = argparse.Namespace(backend=args.backend, gpus=args.gpus, mode=None, llama_dir=args.llama_dir,
                                     build=args.build, sycl_ls=None, kernel=None, kernel_config=None, reprobe=False,
                                     no_probe=not args.probe, timeout=DEFAULT_TIMEOUT_S, json=True)
    try:
        doctor = diagnose(doctor_args)
    except ArcsplitError as exc:  # a report is most wanted when things fail: say so inside it, go on
        doctor = ({"error": str(exc)}, f"arcsplit doctor failed: {exc}")
    try:
        which = which_data(args.llama_dir, args.backend, args.build)
    except ArcsplitError as exc:
        which = {"error": str(exc)}
    path = write_bundle(collect(args.run, doctor, which), out)
    print(f"arcsplit: wrote {path} (redacted: credentials, home, user and host names); attach it to your bug report",
          file=sys.stderr)
    for reset in ((read_state(run) if run is not None else None) or {}).get("resets") or []:  # run/faults.py
        print(f"arcsplit: note: {reset.get('line')}", file=sys.stderr)
    print(path)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="write a redacted bundle (doctor, build, last run's logs) for a bug report",
                       description="Write one .tar.gz with the doctor's findings, cached probe results, the llama.cpp "
                                   "build, the last run's state and log tails and the GPU-related environment, with "
                                   "credentials, your home directory, user and host names removed. Attach it to a "
                                   "bug report.")
    p.add_argument("run", nargs="?", help="run id (default: the last run; see `arcsplit ps`)")
    p.add_argument("-o", "--output", metavar="FILE", help="where to write it (default: ./arcsplit-report-<time>.tar.gz)")
    p.add_argument("--backend", choices=backends.choices(), default=backends.AUTO, help="backend the doctor checks (default: auto)")
    p.add_argument("--gpus", metavar="LIST", help="cards the doctor checks (default: all)")
    p.add_argument("--probe", action="store_true",
                   help="let the doctor run its probe when none is cached (default: include cached results only)")
    add_llama_dir(p)
    p.set_defaults(func=_report)
