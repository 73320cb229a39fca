"""Panel renderers: DashState -> Textual markup. Colours are theme variables ($success, $error, ...), so one
rendering reads in light and dark themes; every state also has a word or symbol, so nothing relies on colour.
"""

from __future__ import annotations

import shlex
from typing import Any

from textual.markup import escape

from ..decide.choice import LEGEND, ChosenBy, RouteChoice
from ..route import holders as route_holders
from ..run.fallback import route_lines
from ..samples import NO_READING, CardRow
from ..proc.rundir import fault_lines
from ..proc.states import GroupState, MemberState
from ..run.events import failure_line
from .state import DashState

SPARK = "▁▂▃▄▅▆▇█"
CARD_COLOURS = ("$primary", "$secondary", "$accent", "$success", "$warning")
# Every member and group state (proc/states.py) has a colour and a mark; an unknown one shows as "?".
_M, _G = MemberState, GroupState
STATE_STYLE: dict[str, str] = {_G.READY: "$success", _G.STARTING: "$warning", _G.STOPPING: "$warning", _G.BACKOFF: "$warning",
               _M.EXITED: "$error", _G.STOPPED: "$text-muted", _G.NEW: "$text-muted"}
STATE_MARK: dict[str, str] = {_G.READY: "●", _G.STARTING: "◐", _G.STOPPING: "◑", _G.BACKOFF: "◌", _M.EXITED: "✖", _G.STOPPED: "○",
              _G.NEW: "○"}
NONE = "—"


def fmt_bytes(n: Any) -> str:
    if n is None:
        return NONE
    n = float(n)
    if n >= 1024**3:
        return f"{n / 1024**3:.1f}G"
    if n >= 1024**2:
        return f"{n / 1024**2:.0f}M" if n >= 100 * 1024**2 else f"{n / 1024**2:.1f}M"
    return f"{n / 1024:.0f}K"


def fmt_duration(s: float | None) -> str:
    if s is None:
        return NONE
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def fmt_pct(x: float | None) -> str:
    return NONE if x is None else f"{100 * x:.0f}%"


def state_markup(state: str | None) -> str:
    state = state or _M.NEW
    return f"[{STATE_STYLE.get(state, '$foreground')}]{STATE_MARK.get(state, '?')} {escape(state)}[/]"


def sparkline(values: list[float], width: int) -> str:
    vals = list(values)[-width:]
    if not vals:
        return ""
    top = max(vals) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))] if v > 0 else " " for v in vals)


def memory_bar(used: int | None, planned: int | None, total: int | None, width: int) -> str:
    """█ used, ▒ planned but not (yet) used, ░ free; used beyond the plan turns $warning."""
    if not total:
        return f"[$text-muted]{'·' * width}[/]"
    def cells(n: int | None) -> int:
        return 0 if not n else max(1, min(width, round(n / total * width)))
    u, p = cells(used), cells(planned)
    over = used is not None and planned is not None and used > planned * 1.05
    used_style = "$warning" if over else "$accent"
    planned_extra = max(0, p - u)
    free = width - u - planned_extra
    return (f"[{used_style}]{'█' * u}[/][$primary]{'▒' * planned_extra}[/]"
            f"[$text-muted]{'░' * max(0, free)}[/]")


def _cards(state: DashState) -> list[dict[str, Any]]:
    return list((state.status.get("plan") or {}).get("cards") or [])


def render_header(state: DashState, run_id: str = "") -> str:
    st = state.status
    if not state.connected:
        return f"[b]arcsplit[/b] {escape(run_id)}  [$warning]connecting…[/]" + (
            f"  [$error]{escape(state.error)}[/]" if state.error else "")
    tuned = (st.get("choice") or {}).get("by") == ChosenBy.TUNE
    parts = ["[b]arcsplit[/b]", state_markup(st.get("state")),
             f"[b]{escape(str(st.get('mode') or NONE))}[/b]/{escape(str(st.get('backend') or NONE))}"
             + (" [$success]tuned[/]" if tuned else ""), escape(str(st.get("url") or ""))]
    prog = st.get("progress") or {}
    if st.get("state") == GroupState.STARTING and prog.get("value") is not None:
        cards = [f"{'host' if c['card'] is None else c['card']}: {100 * c['done'] // max(1, c['total'])}%"
                 for c in prog.get("cards") or []]
        parts.append(f"loading {100 * float(prog['value']):.0f}%" + (f" ({', '.join(cards)})" if cards else ""))
    if state.error:
        parts.append(f"[$error]{escape(state.error)}[/]")
    parts.append(f"[$text-muted]run {escape(run_id)}[/]")
    return "  ".join(p for p in parts if p)


def render_cards(state: DashState) -> str:
    cards = _cards(state)
    if not cards:
        return "[$text-muted]no plan yet[/]"
    tel = {r.pos: r.sample for r in map(CardRow.from_dict, state.telemetry.get("cards") or [])}
    bufs = (state.status.get("buffers") or {}).get("cards") or []
    lines = []
    for i, c in enumerate(cards):
        t = tel.get(i, NO_READING)
        planned = (c.get("bytes") or {}).get("total")
        alloc = sum((bufs[i].get("actual") or {}).values()) if i < len(bufs) and bufs[i].get("actual") else None
        total = t.total or c.get("free")
        used = t.used
        colour = CARD_COLOURS[i % len(CARD_COLOURS)]
        extras = [f"use {fmt_pct(t.util)}"]
        if t.temp is not None:
            extras.append(f"{t.temp:.0f}°C")
        if t.power is not None:
            extras.append(f"{t.power:.0f} W")
        if t.drm is not None and t.drm.freq is not None:
            extras.append(f"{t.drm.freq} MHz")
        name = escape(str(c.get("name") or "")[:20])
        lines.append(f"[b {colour}]{i}[/] [b]{escape(str(c.get('device')))}[/b] {escape(str(c.get('backend')))} "
                     f"{name}  " + "  ".join(extras))
        lines.append(f"  {memory_bar(used, planned, total, 22)} used {fmt_bytes(used)}  plan {fmt_bytes(planned)}"
                     f"  alloc {fmt_bytes(alloc)}  of {fmt_bytes(total)}")
    return "\n".join(lines)


def render_layers(state: DashState, width: int = 60) -> str:
    plan = state.status.get("plan") or {}
    cards = _cards(state)
    if not cards:
        return "[$text-muted]no plan yet[/]"
    n_layer = int(plan.get("n_layer") or max(c["layers"][1] for c in cards))
    owner = ["·"] * n_layer
    lines = [f"[b]{escape(str(plan.get('arch') or 'model'))}[/b]: {n_layer} layers, context {plan.get('n_ctx', NONE)}"
             f", tensor split {escape(str(plan.get('tensor_split') or []))}", "",
             "card  device    layers      count  output"]
    out_card = None
    for i, c in enumerate(cards):
        first, end = c["layers"]
        colour = CARD_COLOURS[i % len(CARD_COLOURS)]
        for k in range(first, min(end, n_layer)):
            owner[k] = f"[{colour}]{i % 10}[/]"
        last = min(end, n_layer)  # llama.cpp counts the output as layer n_layer: shown as "output", not a layer
        span = f"{first}-{last - 1}" if last > first else NONE
        mark = "[b]◆ output[/b]" if c.get("has_output") else ""
        if c.get("has_output"):
            out_card = i
        device = escape(str(c.get("device")))
        lines.append(f"[b {colour}]{i:<4}[/] {device:<9} {span:<11} {max(0, last - first):<6} {mark}")
    lines += ["", "layer map (digit = card):"]
    for start in range(0, n_layer, width):
        lines.append(f"{start:>4} " + "".join(owner[start:start + width]))
    if out_card is not None:
        lines.append(f" out [b]{out_card}[/b] ◆")
    return "\n".join(lines)


def process_rows(state: DashState) -> list[tuple[str, ...]]:
    """name, role, cards, pid, state, uptime, restarts, cpu, rss, port."""
    procs = state.status.get("processes") or {}
    tel = state.telemetry.get("processes") or {}
    holders: dict[str, list[str]] = {}
    for i, holder in enumerate(route_holders(state.status)):
        holders.setdefault(holder, []).append(str(i))
    rows: list[tuple[str, ...]] = []
    for name, p in procs.items():
        t = tel.get(name) or {}
        cpu = t.get("cpu")
        role = str(p.get("role") or "") + (f"@{p['host']}" if p.get("host") else "")  # rpc@b: on host b
        rows.append((name, role, ",".join(holders.get(name, [])) or NONE,
                     str(p.get("pid") or NONE), "paused" if p.get("paused") else str(p.get("state") or _M.NEW),
                     fmt_duration(state.process_uptime(name)), str(p.get("restarts", 0)),
                     NONE if cpu is None else f"{cpu:.0f}%", fmt_bytes(t.get("rss")), str(p.get("port") or NONE)))
    return rows


def render_server(state: DashState, spark_width: int = 40) -> str:
    s = state.telemetry.get("server")
    if not s:
        return "[$text-muted]no server metrics yet (llama-server is not ready, or telemetry is off)[/]"
    slots = s.get("slots") or {}

    def tps(v: Any) -> str:
        return f"{v:7.1f} t/s" if v else f"{'idle':>7}    "

    busy = f"{slots.get('busy', 0)}/{slots.get('total', 0)}" if slots else NONE
    return "\n".join([
        f"requests  processing [b]{s.get('requests_processing', 0)}[/b]  deferred "
        f"[b]{s.get('requests_deferred', 0)}[/b]   slots busy [b]{busy}[/b]",
        f"prompt    {tps(s.get('prompt_tps'))}  [$secondary]{sparkline(list(state.prompt_tps), spark_width)}[/]",
        f"generate  {tps(s.get('gen_tps'))}  [$accent]{sparkline(list(state.gen_tps), spark_width)}[/]",
        f"tokens    prompt {s.get('prompt_tokens_total', 0)}  generated {s.get('tokens_predicted_total', 0)}",
    ])


def render_plan(state: DashState) -> str:
    st = state.status
    plan = st.get("plan") or {}
    lines = [f"mode [b]{escape(str(st.get('mode') or NONE))}[/b] on {escape(str(st.get('backend') or NONE))}"
             f", group {state_markup(st.get('state'))}, generation {st.get('generation', NONE)}"
             f", failures {round(float(st.get('failures') or 0))}"]
    decision = st.get("decision") or {}
    for reason in decision.get("reasons") or []:
        lines.append(f"  because {escape(str(reason))}")
    lines += render_choice(st.get("choice"))
    lines += [escape(line) for line in route_lines(st.get("routes"), st.get("canary"))]
    for v in state.verdicts:
        lines.append(f"[$warning]verdict:[/] {escape(str(v.get('failed_mode')))} failed ({escape(str(v.get('kind')))})"
                     f" -> now {escape(str(v.get('fallback')))}: {escape(str(v.get('message', ''))[:200])}")
    lines.append(f"context {plan.get('n_ctx', NONE)}, {plan.get('n_gpu_layers', NONE)} layers offloaded, "
                 f"tensor split {escape(str(plan.get('tensor_split') or []))}")
    args = plan.get("llama_server_args") or []
    if args:
        lines.append("llama-server " + escape(shlex.join(str(a) for a in args)))
    for w in plan.get("warnings") or []:
        lines.append(f"[$warning]warning:[/] {escape(str(w))}")
    for line in fault_lines(st):  # the last error, its log lines below, failures by card, cards to reset
        head, sep, rest = line.partition(": ")
        lines.append(f"[$error]{escape(head)}:[/] {escape(rest)}" if sep and head == "last error" else escape(line))
    if st.get("last_failure"):
        lines.append(f"[$error]last failure:[/] {escape(failure_line(st['last_failure'], st.get('causes')))}")
    if st.get("run_dir"):
        lines.append(f"logs in {escape(str(st['run_dir']))}")
    return "\n".join(lines)


def render_choice(data: dict[str, Any] | None) -> list[str]:
    """How the route was chosen (status's ``choice``): tuned, with the alternatives tune measured; asked; or the
    default order. Nothing from an instance too old to say."""
    if not data:
        return []
    choice = RouteChoice.from_dict(data)
    out = [f"[$success]{escape(choice.line())}[/]" if choice.tuned else escape(choice.line())]
    if choice.alternatives:
        out.append(f"  measured ({escape(LEGEND)}):")
        out += [f"  {escape(row)}" for row in choice.table()]
    return out


HELP = """\
[b]arcsplit dashboard[/b]: watching changes nothing; r and s ask first.

  1 2 3 4   overview, layers, logs, plan
  l         logs of the process selected in the table
  r         restart the group        s   stop the instance
  ?         this help                q   quit (the instance keeps running)
  tab       next panel               escape  close a dialog

[b]logs[/b]
  p         next process (all, rpc0, ..., server)
  f         follow on/off
  &         filter: show only lines containing a text
  /         search; n / N next / previous match
"""
