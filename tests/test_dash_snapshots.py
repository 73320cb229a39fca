"""Snapshot of each dashboard panel at 80x24, from a stream recorded off a real instance's bus.

The stream (tests/snapshots/dash_stream.json) was recorded from the demo model on the CPU build by
``record()`` below, then masked: pids, ports, uptimes, paths, machine names, timings and speeds are replaced
by fixed values so the screens are the same on every machine. Screens are compared as text (reviewable
diffs); the same text must come out in the light theme, since nothing may depend on colour.

    ARCSPLIT_UPDATE_SNAPSHOTS=1 pytest tests/test_dash_snapshots.py        # rewrite the screens
    ARCSPLIT_UPDATE_SNAPSHOTS=record pytest tests/test_dash_snapshots.py   # re-record the stream too
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
from rich.console import Console

from arcsplit.tui.app import DashApp
from arcsplit.tui.state import DashState

HERE = Path(__file__).parent / "snapshots"
pytestmark = pytest.mark.slow  # a Textual app rendered per panel, seconds each
STREAM = HERE / "dash_stream.json"
UPDATE = os.environ.get("ARCSPLIT_UPDATE_SNAPSHOTS") in ("1", "record")
RECORD = os.environ.get("ARCSPLIT_UPDATE_SNAPSHOTS") == "record"
PANELS = {"overview": "1", "layers": "2", "logs": "3", "plan": "4"}


class Replay:
    """A recorded stream in place of the bus: same messages, no instance."""

    run_id = "demo-run"

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self.messages = messages
        self.requests: list[str] = []

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        for m in self.messages:
            yield m

    async def request(self, cmd: str, **args: Any) -> Any:
        self.requests.append(cmd)


def screen_text(app: DashApp) -> str:
    w, h = app.size
    console = Console(width=w, height=h, file=io.StringIO(), force_terminal=True, color_system="truecolor",
                      record=True)
    console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
    return "\n".join(line.rstrip() for line in console.export_text(styles=False).splitlines()) + "\n"


def render_panels(messages: list[dict[str, Any]], theme: str = "textual-dark") -> dict[str, str]:
    async def go() -> dict[str, str]:
        state = DashState(clock=lambda: 1000.0)
        for m in messages:
            state.apply(m)
        app = DashApp(Replay(messages), state=state, live=False)
        app.animation_level = "none"  # the tab underline and scrolling land at once
        out = {}
        async with app.run_test(size=(80, 24)) as pilot:
            app.theme = theme
            for name, key in PANELS.items():
                await pilot.press(key)
                await pilot.wait_for_scheduled_animations()
                await pilot.pause(0.2)
                out[name] = screen_text(app)
        return out

    return asyncio.run(go())


@pytest.fixture(scope="module")
def stream(request) -> list[dict[str, Any]]:
    if RECORD:
        llama_bins = request.getfixturevalue("llama_bins")
        demo_model = request.getfixturevalue("demo_model")
        tmp = request.getfixturevalue("tmp_path_factory").mktemp("rec")
        STREAM.write_text(json.dumps(record(tmp, llama_bins.bin_dir, demo_model), indent=1) + "\n")
    return json.loads(STREAM.read_text())


@pytest.mark.parametrize("panel", list(PANELS))
def test_panel_snapshot(stream, panel):
    screens = render_panels(stream)
    path = HERE / f"dash_{panel}.txt"
    if UPDATE:
        path.write_text(screens[panel])
    assert screens[panel] == path.read_text()


def test_light_theme_shows_the_same_text(stream):
    dark, light = render_panels(stream), render_panels(stream, "textual-light")
    assert dark == light


# -- recording --------------------------------------------------------------------------------------------


def record(tmp: Path, llama_dir: Path, model: Path) -> list[dict[str, Any]]:
    import httpx

    sys.path.insert(0, str(Path(__file__).parent))
    from _instance import isolated_env, running_instance

    from arcsplit.run.bus import attach

    msgs: list[dict[str, Any]] = []
    with isolated_env(tmp, llama_dir), running_instance(model, telemetry_interval=0.3) as inst:
        with attach() as client:
            t0 = time.monotonic()
            for msg in client.events(idle=5):
                msgs.append(msg)
                if sum(m["kind"] == "telemetry" for m in msgs) == 2:
                    httpx.post(f"{inst.url}/completion", json={"prompt": "Hello", "n_predict": 16}, timeout=60)
                if sum(m["kind"] == "telemetry" for m in msgs) >= 8 or time.monotonic() - t0 > 90:  # a loaded machine needs long for the completion
                    break
            status = client.status()
    return mask(msgs, status)


def mask(msgs: list[dict[str, Any]], status: dict[str, Any]) -> list[dict[str, Any]]:
    names = sorted(status["processes"])
    pids = {p["pid"]: 4100 + i for i, p in enumerate(status["processes"][n] for n in names)}
    ports = {p["port"]: 50100 + i for i, p in enumerate(status["processes"][n] for n in names)}
    url = status["url"]

    def text(s: str) -> str:
        s = s.replace(url, "http://127.0.0.1:8080")
        s = re.sub(r"\d+\.\d\d\.\d\d\d\.\d\d\d ", "0.00.000.000 ", s)  # llama.cpp log timestamps
        s = re.sub(r"(127\.0\.0\.1|localhost):(\d+)",
                   lambda m: f"127.0.0.1:{ports.get(int(m.group(2)), 8080)}", s)
        s = re.sub(r"/\S*/(gemma-3-270m-q4_k_m\.gguf)", r"\1", s)
        s = re.sub(r"/\S+/runs/\S+", "~/.local/state/arcsplit/runs/demo-run", s)
        return s

    def proc(name: str, p: dict[str, Any], i: int) -> dict[str, Any]:
        p = {k: v for k, v in p.items() if k not in ("argv", "returncode")}
        if p.get("pid") in pids:
            p["pid"] = pids[p["pid"]]
        if p.get("port") in ports:
            p["port"] = ports[p["port"]]
            p["endpoint"] = f"127.0.0.1:{p['port']}"
        if p.get("uptime") is not None:
            p["uptime"] = 3725.0
        return p

    def plan(pl: dict[str, Any]) -> dict[str, Any]:
        pl = json.loads(text(json.dumps(pl)))
        for c in pl.get("cards", []):
            c["name"], c["free"] = "CPU share", 8 * 1024**3
            c["free_after"] = c["free"] - c["bytes"]["total"]
        return pl

    out: list[dict[str, Any]] = []
    n_tel = 0
    for m in msgs:
        kind, data = m["kind"], m["data"]
        if kind == "snapshot":
            st = dict(data["status"])
            st["url"] = "http://127.0.0.1:8080"
            st["run_dir"] = "~/.local/state/arcsplit/runs/demo-run"
            st["uptime"] = 3725.0
            st["plan"] = plan(st["plan"])
            st["processes"] = {n: proc(n, p, i) for i, (n, p) in enumerate(st["processes"].items())}
            data = {"seq": 0, "status": st, "logs": [text(line) for line in data["logs"][-60:]]}
        elif kind == "log":
            data = {"line": text(data["line"])}
        elif kind == "state":
            data = proc(m["name"], data, 0)
        elif kind == "telemetry":
            n_tel += 1
            for c in data["cards"]:
                c["total"] = 8 * 1024**3
                c["used"] = int(c["used"] or 0) // (1024**2) * 1024**2
                c["util"] = round(0.1 * n_tel % 1, 2)
            data["processes"] = {n: {"pid": pids.get(p["pid"], 0), "cpu": 12.0 * (i + 1),
                                     "rss": (100 + 50 * i) * 1024**2, "threads": p["threads"]}
                                 for i, (n, p) in enumerate(sorted(data["processes"].items()))}
            s = data.get("server")
            if s:
                s["gen_tps"] = 40.0 + 2 * n_tel if s.get("gen_tps") else None
                s["prompt_tps"] = 150.0 if s.get("prompt_tps") else None
        elif kind in ("group", "buffers", "plan"):
            data = json.loads(text(json.dumps(data)))
        out.append({"v": m["v"], "seq": m["seq"], "time": 0.0, "kind": kind, "name": m["name"], "data": data})
    return out
