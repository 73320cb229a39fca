"""``arcsplit llama build|which``: the managed llama.cpp build and the binaries arcsplit will run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

from .. import __version__, backends
from ..errors import ArcsplitError, BadInput
from ..llama.build import BuildConfig, build, build_rpc_proto, llama_root, managed_builds, prune, stale_builds, sycl_flags
from ..llama.detect import resolve
from ..llama.devices import card_rows, discover_rig
from ..llama.locate import find_llama, server_build_info
from ..llama.patches import build_patches, patches
from ..llama.source import SDIST_VERSION, build_line
from ..llama.webui import build_ui, ui_dir
from . import print_json
from .options import add_llama_dir, say_choice


def _build(args: argparse.Namespace) -> int:
    args.backend, choice = resolve(args.backend, purpose="build")
    extra = (sycl_flags(args.sycl_arch) if args.backend == backends.SYCL else ()) + tuple(args.cmake_flag or ())
    bad = [f for f in extra if not f.startswith("-D")]
    if bad:
        raise BadInput(f"--cmake-flag {bad[0]!r} is not a -DNAME=VALUE definition", "write it like -DGGML_CUDA_F16=ON")
    config = BuildConfig(args.backend, extra, patched=not args.no_patches)
    say_choice(choice)
    source = Path(args.source) if args.source else None
    bin_dir, ui_missing = build_with_progress(config, args.jobs, args.force, source, ui=not args.no_ui)
    if args.json:
        print_json({"backend": args.backend, "bin_dir": str(bin_dir), "key": config.key,
                    "source": f"llama-cpp-python {SDIST_VERSION}",
                    "patches": [p.name for p in patches()] if config.patched else [],
                    "ui": None if args.no_ui or ui_missing else str(ui_dir()), "ui_missing": ui_missing})
    else:
        print(f"llama.cpp ({args.backend}) ready in {bin_dir}")
        stale = [s for s in stale_builds() if not s.kept]
        if stale:
            print(f"note: {len(stale)} build(s) an older arcsplit left take {sum(s.size for s in stale) / 2**30:.1f} "
                  "GiB: `arcsplit llama prune` removes them", file=sys.stderr)
        if ui_missing:
            print(f"web UI: not built: {ui_missing}; llama-server's / says how to get it", file=sys.stderr)
        elif not args.no_ui:
            print(f"web UI: {ui_dir()}")
    return 0


def build_with_progress(config: BuildConfig, jobs: int | None = None, force: bool = False,
                        source: Path | None = None, ui: bool = True) -> tuple[Path, str | None]:
    """Build llama.cpp, then its web UI, with progress on stderr (`llama build`; `demo` on a machine without a
    build). Returns the bin dir and why the UI is missing (None: built or not asked for)."""
    show = _progress_printer()
    bin_dir = build(config, jobs=jobs, force=force, source=source, progress=show)
    if sys.stderr.isatty():
        print(file=sys.stderr)  # end the last progress line
    return bin_dir, build_ui(show, force=force, source=source) if ui else None


def _progress_printer() -> Callable[[str, int | None], None]:
    """A build's steps on stderr; the compile percentage on one rewritten line on a terminal, else a line per
    10 % (a log, CI, `scripts/demo` piped) so a build of several minutes never looks stuck."""
    last: dict[str, int] = {}

    def show(step: str, pct: int | None) -> None:
        if pct is None:
            print(f"arcsplit: {step} …", file=sys.stderr, flush=True)
        elif sys.stderr.isatty():
            print(f"\r  {step}: {pct:3d}%", end="", file=sys.stderr, flush=True)
        elif pct >= last.get(step, -10) + 10 or (pct == 100 and last.get(step) != 100):
            last[step] = pct
            print(f"arcsplit: {step} {pct}%", file=sys.stderr, flush=True)

    return show


def which_data(llama_dir: str | None, backend: str, build: str | None = None) -> dict[str, Any]:
    """The binaries arcsplit will run and their build (``llama which --json``; ``arcsplit report`` bundles it)."""
    backend, _choice = resolve(backend, llama_dir)
    bins = find_llama(llama_dir, backend=backend, build=build)
    info = server_build_info(bins)
    return {
        **bins.to_dict(),
        "bin_dir": str(bins.bin_dir),
        "build_number": info.build_number,
        "commit": info.commit,
        "version": info.version,  # llama.cpp's own (CMake) version: 0.5.0-dev for a tree without a release number
        "rpc_proto": build_rpc_proto(bins.bin_dir),  # what another host's build must match (arcsplit/hosts.py)
        "compiler": info.compiler,
        "target": info.target,
        "rpc_server_name": bins.rpc_server.name,
        "same_build": bins.rpc_server.parent == bins.server.parent,
        "patches": build_patches(bins.bin_dir),
    }


def host_inventory(args: argparse.Namespace, backend: str | None = None) -> dict[str, Any]:
    """What hello reports: this host's arcsplit, llama.cpp build (commit, RPC protocol, rpc-server) and cards, for
    ``backend`` (the group's, from the hello; else --backend).

    A missing build or card list is reported, not raised: the supervisor names both sides in its error.
    """
    out: dict[str, Any] = {"arcsplit": __version__}
    try:
        backend, _ = resolve(backend or args.backend, args.llama_dir)
        w = which_data(args.llama_dir, backend, args.build)
        out["llama"] = {"backend": backend, "commit": w.get("commit"), "rpc_proto": w.get("rpc_proto"),
                        "rpc_bin": w.get("rpc_server"), "build_number": w.get("build_number")}
    except ArcsplitError as exc:
        out["llama"] = {"commit": None, "rpc_proto": None, "rpc_bin": None, "error": str(exc)}
        out["devices"] = []
        return out
    try:
        bins = None if backends.get(backend).on_cpu else find_llama(args.llama_dir, backend=backend, build=args.build)
        out["devices"] = card_rows(discover_rig(backend, None, bins))
    except ArcsplitError as exc:
        out["devices"], out["devices_error"] = [], str(exc)
    return out


def _which(args: argparse.Namespace) -> int:
    if args.all:
        return _list_builds(args)
    data = which_data(args.llama_dir, args.backend, args.build)
    if args.json:
        print_json(data)
    else:
        print(f"llama-server   {data['server']}")
        print(f"rpc-server     {data['rpc_server']}")
        for label, key in (("llama-cli", "cli"), ("llama-bench", "bench"), ("fit-params", "fit_params")):
            print(f"{label:<14} {data[key] or '(missing)'}")
        print(f"build          {build_line(data['build_number'], data['commit'], data['version'])}, "
              f"{data['compiler']} for {data['target']}")
        print(f"RPC protocol   {data['rpc_proto'] or 'unknown'}")
        applied = data["patches"]
        print(f"arcsplit patches {', '.join(applied) if applied else ('none' if applied == [] else 'unknown')}")
        print(f"found by       {data['found_by']}")
        if data["note"]:
            print(f"note           {data['note']}")
    return 0


def _list_builds(args: argparse.Namespace) -> int:
    """Every managed build, whichever backend: the keys ``--build`` takes."""
    builds = managed_builds()
    if args.json:
        print_json({"builds": [b.to_dict() for b in builds]})
        return 0
    if not builds:
        print("no managed llama.cpp build yet: run `arcsplit llama build`")
        return 0
    print(f"{'key':<18} {'backend':<7} {'patches':<8} flags")
    for b in builds:
        cfg = b.config
        patched = "unknown" if cfg is None else ("yes" if cfg.patched else "stock")
        flags = "(unknown)" if cfg is None else (" ".join(cfg.extra_flags) or "-")
        print(f"{b.key:<18} {b.backend:<7} {patched:<8} {flags}{'  (default)' if b.is_default else ''}")
    return 0


def _prune(args: argparse.Namespace) -> int:
    found = prune(dry_run=args.dry_run, progress=_progress_printer())
    if args.json:
        print_json({"dry_run": args.dry_run, "root": str(llama_root()), "stale": [s.to_dict() for s in found]})
        return 0
    gone = [s for s in found if not s.kept]
    for s in found:
        verb = "kept" if s.kept else ("would remove" if args.dry_run else "removed")
        why = ([f"in use by pid {', '.join(map(str, s.users))}"] if s.users else []) + (
            ["ARCSPLIT_LLAMA_DIR names it"] if s.named else [])
        print(f"{verb} {s.path} ({s.size / 2**20:.0f} MiB): {s.why}" + (f"; kept: {', '.join(why)}" if why else ""))
    freed = sum(s.size for s in gone) / 2**20
    print(f"{'would free' if args.dry_run else 'freed'} {freed:.0f} MiB" if gone else
          f"nothing to remove in {llama_root().parent}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("llama", help="build and locate llama.cpp", description="Build and locate llama.cpp.")
    lsub = p.add_subparsers(dest="llama_command", metavar="COMMAND", required=True)
    b = lsub.add_parser("build", help="build llama-server, ggml-rpc-server and tools from the pinned source",
                        description="Build llama-server, ggml-rpc-server, llama-cli, llama-bench and "
                                    "llama-fit-params (GGML_RPC=ON) from the llama.cpp tree vendored in "
                                    f"llama-cpp-python {SDIST_VERSION}, into the user cache. Cached per backend.")
    b.add_argument("--backend", choices=backends.choices(), default=backends.AUTO,
                   help="ggml backend (default auto: sycl for Intel Arc cards when icpx is on PATH, else vulkan when "
                        "glslc is; cuda for NVIDIA; cpu without a GPU)")
    b.add_argument("--jobs", "-j", type=int, default=None, help="parallel compile jobs (default: all cores)")
    b.add_argument("--sycl-arch", metavar="ARCH", help="SYCL AOT target, e.g. bmg_g31 for the Arc Pro B70")
    b.add_argument("--cmake-flag", action="append", metavar="-DNAME=VALUE",
                   help="an extra CMake definition, e.g. --cmake-flag=-DCMAKE_CUDA_ARCHITECTURES=90 (repeatable)")
    b.add_argument("--source", metavar="DIR", help="build this llama.cpp tree instead of the pinned PyPI source")
    b.add_argument("--no-patches", action="store_true",
                   help="build the stock llama.cpp tree, without arcsplit's patches (see docs/patches.md)")
    b.add_argument("--force", action="store_true", help="rebuild even if a finished build exists")
    b.add_argument("--no-ui", action="store_true",
                   help="skip llama.cpp's web UI (built once with npm when Node.js 20.19+ is installed)")
    b.add_argument("--json", action="store_true", help="machine-readable output")
    b.set_defaults(func=_build)
    w = lsub.add_parser("which", help="report the binaries arcsplit will run and their build",
                        description="Report the llama.cpp binaries arcsplit will run, their build and origin.")
    add_llama_dir(w)
    w.add_argument("--backend", choices=backends.choices(), default=backends.AUTO,
                   help="which managed build to fall back to (default auto: the one serve would use)")
    w.add_argument("--all", action="store_true", help="list every managed build and its key")
    w.add_argument("--json", action="store_true", help="machine-readable output")
    w.set_defaults(func=_which)
    r = lsub.add_parser("prune", help="remove llama.cpp builds an upgrade of arcsplit left behind",
                        description="Remove the managed llama.cpp builds this arcsplit would never run: made with "
                                    "another patch set or llama.cpp version (an older arcsplit), or never finished. "
                                    "Builds of today's keys stay, and so does one a running process uses.")
    r.add_argument("--dry-run", action="store_true", help="list what would go, remove nothing")
    r.add_argument("--json", action="store_true", help="machine-readable output")
    r.set_defaults(func=_prune)
