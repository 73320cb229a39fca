"""Per-process CPU and memory through psutil; a CPU "card" is the rpc-server (or llama-server) that holds it."""

from __future__ import annotations

from typing import Any

import psutil

from ..samples import CardSample


class ProcessSampler:
    """Keeps one psutil.Process per pid so cpu_percent() is the use since the previous sample."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}

    def sample(self, pids: dict[str, int]) -> dict[str, dict[str, Any]]:
        """name -> {pid, cpu (percent of one core), rss (bytes), threads}; a gone pid is left out."""
        out: dict[str, dict[str, Any]] = {}
        live: dict[int, psutil.Process] = {}
        for name, pid in pids.items():
            proc = self._procs.get(pid)
            try:
                if proc is None:
                    proc = psutil.Process(pid)
                    proc.cpu_percent(None)  # the first call only starts the clock
                    cpu = None
                else:
                    cpu = proc.cpu_percent(None)
                with proc.oneshot():
                    mem = proc.memory_info()
                    threads = proc.num_threads()
            except psutil.Error:
                continue
            live[pid] = proc
            out[name] = {"pid": pid, "cpu": cpu, "rss": mem.rss, "threads": threads}
        self._procs = live
        return out


class RemoteSampler:
    """Processes on other hosts, from their node agents' reports in the status (``usage``): CPU use is the change in
    CPU seconds between two reports, so it is None until a second one arrived."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, Any], dict[str, Any]] = {}

    def sample(self, procs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """name -> {pid, cpu, rss, threads, host} for each process whose status carries a usage report."""
        out: dict[str, dict[str, Any]] = {}
        last: dict[tuple[str, Any], dict[str, Any]] = {}
        for name, p in procs.items():
            u = p.get("usage")
            if not u:
                continue
            key = (name, p.get("pid"))
            prev = self._last.get(key)
            cpu = None
            if prev is not None and u["at"] > prev["at"]:
                cpu = max(0.0, (u["cpu_s"] - prev["cpu_s"]) / (u["at"] - prev["at"]) * 100)
            elif prev is not None:  # no new report since: keep the last rate
                cpu = prev.get("cpu")
            last[key] = {**u, "cpu": cpu}
            out[name] = {"pid": p.get("pid"), "cpu": cpu, "rss": u.get("rss"), "threads": u.get("threads"),
                         "host": p.get("host")}
        self._last = last
        return out


def threads_of(argv: list[str] | None) -> int | None:
    """The ``-t N`` a process was started with (its share of cores), if any."""
    argv = argv or []
    for flag in ("-t", "--threads"):
        if flag in argv[:-1]:
            try:
                return int(argv[argv.index(flag) + 1])
            except ValueError:
                return None
    return None


def cpu_card(proc: dict[str, Any] | None, budget: int | None, threads: int | None) -> CardSample:
    """A CPU card's reading: memory is the holder's RSS against its planned budget, use is CPU over its threads."""
    if proc is None:
        return CardSample(source="psutil", total=budget)
    cpu = proc.get("cpu")
    n = threads or psutil.cpu_count() or 1
    return CardSample(source="psutil", used=proc.get("rss"), total=budget,
                      util=None if cpu is None else min(1.0, cpu / 100.0 / n))
