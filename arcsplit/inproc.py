"""``arcsplit.load``: an in-process ``llama_cpp.Llama`` whose layers live on arcsplit-run rpc-servers.

llama-cpp-python 0.3.36 accepts ``Llama(rpc_servers=...)`` and silently ignores it (every layer lands on the
CPU), so the servers are registered the way llama.cpp's own ``--rpc`` does it: ``ggml_backend_rpc_add_server``
looked up through the ggml backend registry of the same ``libllama`` the bindings loaded, then
``ggml_backend_register``. The bindings must load the managed build's ``libllama`` (``LLAMA_CPP_LIB_PATH``),
built from the same sdist version, so llama.cpp is compiled once and the C ABI matches.

The rpc-servers live as long as the returned model: closing it (or interpreter exit) closes the model first,
then stops the servers (in that order: freeing remote buffers needs a live server).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import subprocess
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Sequence

from .decide.specs import ServeConfig, build_specs
from .errors import ArcsplitError, LlamaError, RunError
from .llama.devices import discover_rig
from .llama.locate import LlamaBinaries, find_llama
from .model import load_profile
from .modes import Mode
from .planner import Plan, PlanOptions, make_plan
from .proc import spawn
from .proc.ports import free_port, wait_listening
from .roles import Role
from .route import Route

_registered: set[str] = set()
_live: list[tuple[weakref.ref, list[subprocess.Popen]]] = []
_lock = threading.Lock()


def _bindings(bin_dir: Path) -> Any:
    """Import llama_cpp against ``bin_dir``'s libllama; refuse a process that already loaded another one."""
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(bin_dir))
    os.environ.setdefault("MTMD_CPP_LIB", str(bin_dir))
    try:
        import llama_cpp  # an optional dependency, and it loads libllama from the path set just above
    except (ImportError, OSError):
        raise ArcsplitError("arcsplit.load needs llama-cpp-python 0.3.36 built against arcsplit's libllama",
                            'install it against the managed build: CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" '
                            "pip install llama-cpp-python==0.3.36 (or `pip install arcsplit[inproc]`)") from None
    low = llama_cpp.llama_cpp  # its package imports it
    loaded = Path(getattr(low._lib, "_name", "")).resolve().parent
    if loaded != bin_dir.resolve():
        raise LlamaError(f"llama_cpp already loaded libllama from {loaded}, not from {bin_dir}",
                         f"set LLAMA_CPP_LIB_PATH={bin_dir} before importing llama_cpp")
    return llama_cpp, low._lib


def _register(lib: ctypes.CDLL, endpoint: str) -> None:
    """Add one rpc-server to llama.cpp's device registry, as ``--rpc`` does."""
    if endpoint in _registered:
        return
    lib.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    lib.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    lib.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.ggml_backend_register.restype = None
    lib.ggml_backend_register.argtypes = [ctypes.c_void_p]
    rpc = lib.ggml_backend_reg_by_name(b"RPC")
    if not rpc:
        raise LlamaError("this libllama has no RPC backend", "rebuild with `arcsplit llama build` (GGML_RPC=ON)")
    addr = lib.ggml_backend_reg_get_proc_address(rpc, b"ggml_backend_rpc_add_server")
    if not addr:
        raise LlamaError("the RPC backend lacks ggml_backend_rpc_add_server", "use the llama.cpp arcsplit builds")
    add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(addr)
    reg = add_server(endpoint.encode())
    if not reg:
        raise RunError(f"llama.cpp could not reach the rpc-server at {endpoint}")
    lib.ggml_backend_register(reg)
    _registered.add(endpoint)


def _stop(procs: list[subprocess.Popen], grace: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _close_all() -> None:
    """At exit: close each model still open, then stop its servers."""
    with _lock:
        items = list(_live)
        _live.clear()
    for ref, procs in items:
        llm = ref()
        if llm is not None:
            llm.close()
        _stop(procs)


atexit.register(_close_all)


def load(model: str | os.PathLike[str], gpus: Sequence[int] = (0, 1), *, backend: str = "cpu",
         ctx: int | None = None, cpu_memory_mib: int | None = None, llama_dir: str | None = None,
         flash_attn: bool = True, threads: int | None = None, ready_timeout: float = 60.0,
         **llama_kwargs: Any) -> Any:
    """Start one rpc-server per card, plan the split, and return an in-process ``llama_cpp.Llama``.

    The returned model carries ``arcsplit_plan`` (the Plan) and ``arcsplit_endpoints``; ``close()`` on it
    also stops its rpc-servers.
    """
    if _registered:
        # llama.cpp's device registry only grows: a second set of rpc-servers would sit beside the first.
        raise ArcsplitError("arcsplit.load runs once per process", "load the next model in a new process")
    binaries: LlamaBinaries = find_llama(llama_dir, backend=backend)
    llama_cpp, lib = _bindings(binaries.bin_dir)
    gpus = list(gpus)
    profile = load_profile(os.fspath(model))
    rig = discover_rig(backend, gpus, binaries, cpu_memory_mib)
    route = Route.build(Mode.RPC, backend, [c.index for c in rig.cards])
    plan: Plan = make_plan(profile, rig, PlanOptions(n_ctx=ctx, flash_attn=flash_attn), devices=route.devices)
    config = ServeConfig(plan=plan, mode=Mode.RPC, backend=backend, server_bin=str(binaries.server),
                         rpc_bin=str(binaries.rpc_server), threads=threads, cores=os.cpu_count() or 1)
    specs = [s for s in build_specs(config, [free_port() for _ in plan.cards]) if s.role == Role.RPC]
    procs: list[subprocess.Popen] = []
    try:
        for spec in specs:  # the supervisor's way (exec shim, environment, own session); output not read here
            procs.append(subprocess.Popen(spawn.command(spec), env=spawn.environment(spec), stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True))
        for spec, proc in zip(specs, procs):
            wait_listening(proc, spec.host, spec.port, ready_timeout)
        for spec in specs:
            _register(lib, spec.endpoint)
        o = plan.options
        kwargs: dict[str, Any] = dict(
            n_gpu_layers=plan.n_gpu_layers,
            split_mode=llama_cpp.LLAMA_SPLIT_MODE_LAYER,
            tensor_split=[float(n) for n in plan.tensor_split],
            n_ctx=plan.n_ctx, n_batch=o.n_batch, n_ubatch=o.n_ubatch, flash_attn=o.flash_attn,
            swa_full=o.swa_full,  # the bindings default to a full-size SWA cache; the plan sized the window
            verbose=False,
        )
        for key, name in (("type_k", o.cache_type_k), ("type_v", o.cache_type_v)):
            if name != "f16":
                kwargs[key] = getattr(llama_cpp, f"GGML_TYPE_{name.upper()}")
        kwargs.update(llama_kwargs)
        llm = llama_cpp.Llama(model_path=str(model), **kwargs)
    except BaseException:
        _stop(procs)
        raise
    llm.arcsplit_plan = plan
    llm.arcsplit_endpoints = [s.endpoint for s in specs]
    inner_close = llm.close

    def close() -> None:
        inner_close()
        _stop(procs)

    llm.close = close
    with _lock:
        _live.append((weakref.ref(llm), procs))
    return llm
