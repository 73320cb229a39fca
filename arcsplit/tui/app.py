"""The arcsplit dashboard: a Textual app that watches one instance through the bus.

    run_dashboard(lambda: attach(run))          # arcsplit dash [RUN]; serve --tui passes its own factory

Messages are folded into a DashState as they come and the panels they touch are redrawn at most every
50 ms, so a flood of log lines costs one redraw per tick, not one per line. Log lines reach the log widget
only while the logs tab is shown (the ring keeps them); a batch larger than the widget keeps only its tail.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, AsyncIterator, Callable, Protocol

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.css.query import NoMatches
from textual.markup import escape
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Input, Label, Log, Static, TabbedContent, TabPane

from ..proc.states import GroupState
from ..run.bus import is_final
from .feed import Feed
from .state import DashState
from .widgets import (HELP, process_rows, render_cards, render_header, render_layers, render_plan,
                      render_server)

TICK = 0.05  # redraw period, s
LOG_BATCH_MAX = 1000  # lines written to the log widget per tick at most
PROC_COLUMNS = ("process", "role", "card", "pid", "state", "uptime", "restarts", "cpu", "rss", "port")


class Source(Protocol):
    """Where the dashboard gets its messages and sends its requests (the bus Feed, or a recording)."""

    @property
    def run_id(self) -> str: ...

    def events(self) -> AsyncIterator[dict[str, Any]]: ...

    async def request(self, cmd: str, **args: Any) -> Any: ...


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [Binding("y", "answer(True)", "yes"), Binding("n", "answer(False)", "no"),
                Binding("escape", "answer(False)", "no")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(self.question)
            yield Label("[b]y[/b] yes    [b]n[/b] / escape no", classes="muted")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "close")]

    def compose(self) -> ComposeResult:
        with Vertical(id="help"):
            yield Static(HELP)


class DashApp(App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "arcsplit"
    ENABLE_COMMAND_PALETTE = False  # its footer entry is wide-glyph trouble in tmux; keys are in ? help
    BINDINGS = [
        Binding("1", "tab('overview')", "overview"),
        Binding("2", "tab('layers')", "layers"),
        Binding("3", "tab('logs')", "logs"),
        Binding("4", "tab('plan')", "plan"),
        Binding("l", "logs_of_selected", "logs of process", show=False),
        Binding("r", "restart", "restart"),
        Binding("s", "stop", "stop"),
        Binding("question_mark", "help", "help"),
        Binding("q", "quit", "quit"),
        Binding("p", "next_process", "process", show=False),
        Binding("f", "toggle_follow", "follow", show=False),
        Binding("ampersand", "ask('filter')", "filter", show=False),
        Binding("slash", "ask('search')", "search", show=False),
        Binding("n", "search_step(1)", "next", show=False),
        Binding("N", "search_step(-1)", "previous", show=False),
    ]

    def __init__(self, source: Source, *, state: DashState | None = None, live: bool = True) -> None:
        super().__init__()
        self.source = source
        self.state = state or DashState()
        self.live = live  # False: draw what state holds, take no messages (snapshot tests)
        self._inbox: list[dict[str, Any]] = []
        self._dirty: set[str] = set()
        self.log_proc: str | None = None
        self.log_filter = ""
        self.search_text = ""
        self.search_at = -1
        self.follow = True
        self._asking: str | None = None
        self._log_stale = True
        self._main: Any = None  # the dashboard screen (dialogs go on top of it)
        self.tick_times: list[float] = []  # seconds spent per redraw tick (the bench reads it)

    # -- layout ---------------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static(id="header")
        with TabbedContent(id="tabs", initial="overview"):
            with TabPane("1 Overview", id="overview"):
                with VerticalScroll():
                    yield Static(id="cards", classes="panel")
                    yield Static(id="server", classes="panel")
                    yield DataTable(id="procs", classes="panel", cursor_type="row", zebra_stripes=False)
            with TabPane("2 Layers", id="layers"):
                yield VerticalScroll(Static(id="layermap"))
            with TabPane("3 Logs", id="logs"):
                yield Static(id="logbar")
                yield Input(id="logask")
                yield Log(id="log", max_lines=self.state.log_lines, auto_scroll=True)
            with TabPane("4 Plan", id="plan"):
                yield VerticalScroll(Static(id="planview"))
        yield Footer()

    def on_mount(self) -> None:
        self._main = self.screen
        self.query_one("#cards").border_title = "Cards"
        self.query_one("#server").border_title = "Server"
        self.query_one("#procs").border_title = "Processes"
        table = self._w("#procs", DataTable)
        for col in PROC_COLUMNS:
            table.add_column(col, key=col)
        self._w("#logask", Input).display = False
        self._dirty = {"header", "cards", "layers", "procs", "server", "logs", "plan"}
        self._redraw()
        if self.live:
            self._consume()
            self.set_interval(TICK, self._tick)
            self.set_interval(1.0, self._mark_clock)

    # -- messages -------------------------------------------------------------------------------------

    @work(exclusive=True, group="feed")
    async def _consume(self) -> None:
        n = 0
        msg: dict[str, Any] = {}
        try:
            async for msg in self.source.events():
                self._inbox.append(msg)
                n += 1
                if n % 100 == 0:
                    await asyncio.sleep(0)  # a ready socket never yields by itself: let the UI run
        except Exception as exc:
            self.state.error = f"disconnected: {exc}"
        else:
            if not is_final(msg):  # a stopped group ends its stream: the header says "stopped", not an error
                self.state.error = "disconnected"
        self._dirty.add("header")

    def _mark_clock(self) -> None:
        self._dirty.add("procs")

    def _tick(self) -> None:
        started = time.perf_counter()
        inbox, self._inbox = self._inbox, []
        for msg in inbox:
            self._dirty |= self.state.apply(msg)
            if msg.get("kind") == "group" and (msg.get("data") or {}).get("state") in (GroupState.READY, GroupState.BACKOFF):
                self._refresh_status()  # restart counts and buffers are in status(), not in the events
        if self._dirty:
            self._redraw()
        self.tick_times.append(time.perf_counter() - started)
        if len(self.tick_times) > 10_000:
            del self.tick_times[:5_000]

    def _w(self, selector: str, kind: type[Any] = Static) -> Any:
        return self._main.query_one(selector, kind)

    def _redraw(self) -> None:
        if self._main is None or not self._main.is_attached:
            return
        try:
            self._redraw_now()
        except NoMatches:  # starting or shutting down: nothing to draw on
            pass

    def _redraw_now(self) -> None:
        dirty, self._dirty = self._dirty, set()
        st = self.state
        if "header" in dirty:
            self._w("#header").update(render_header(st, self.source.run_id))
        if "cards" in dirty:
            self._w("#cards").update(render_cards(st))
        if "server" in dirty:
            self._w("#server").update(render_server(st))
        if "procs" in dirty:
            self._draw_procs()
        if "layers" in dirty:
            self._w("#layermap").update(render_layers(st))
        if "plan" in dirty:
            self._w("#planview").update(render_plan(st))
        if "logs" in dirty:
            self._draw_logs()

    def _draw_procs(self) -> None:
        table = self._w("#procs", DataTable)
        rows = process_rows(self.state)
        keys = [r[0] for r in rows]
        if [k.value for k in table.rows] != keys:
            table.clear()
            for r in rows:
                table.add_row(*r, key=r[0])
            return
        for r in rows:
            for col, value in zip(PROC_COLUMNS, r):
                if table.get_cell(r[0], col) != value:
                    table.update_cell(r[0], col, value, update_width=True)

    # -- logs -----------------------------------------------------------------------------------------

    def _wanted(self, name: str, line: str) -> bool:
        if self.log_proc is not None and name != self.log_proc:
            return False
        return not self.log_filter or self.log_filter.lower() in line.lower()

    def _fmt(self, name: str, line: str) -> str:
        return line if self.log_proc is not None else f"{name:>6} │ {line}"

    def _draw_logs(self) -> None:
        log = self._w("#log", Log)
        pending = self.state.take_pending_logs()
        if self._w("#tabs", TabbedContent).active != "logs":
            self._log_stale = True
        elif self._log_stale:
            self._log_stale = False
            log.clear()
            lines = [self._fmt(n, t) for n, t in self.state.logs if self._wanted(n, t)]
            log.write_lines(lines[-self.state.log_lines:])
        else:
            lines = [self._fmt(n, t) for n, t in pending if self._wanted(n, t)]
            if lines:
                log.write_lines(lines[-LOG_BATCH_MAX:])
        self._draw_logbar()

    def _draw_logbar(self, note: str = "") -> None:
        who = self.log_proc or "all processes"
        parts = [f"[b]{who}[/b]", "follow [b]on[/b]" if self.follow else "follow [b]off[/b]"]
        if self.log_filter:
            parts.append(f"filter “{self.log_filter}”")
        if self.search_text:
            parts.append(f"search “{self.search_text}”")
        if note:
            parts.append(note)
        hidden = self.state.log_hidden  # what `arcsplit logs` hides too; `arcsplit dash -v` keeps them
        parts.append(f"{self.state.log_total} lines" + (f", {hidden} hidden (dash -v)" if hidden else ""))
        self._w("#logbar").update("  ·  ".join(escape(p) if "[b]" not in p else p for p in parts))

    def _relog(self) -> None:
        self._log_stale = True
        self._dirty.add("logs")
        self._redraw()

    @on(TabbedContent.TabActivated)
    def _tab_changed(self, event: TabbedContent.TabActivated) -> None:
        if event.pane.id == "logs" and self._log_stale:
            self._dirty.add("logs")
            self._redraw()

    # -- actions --------------------------------------------------------------------------------------

    def action_tab(self, tab: str) -> None:
        self._w("#tabs", TabbedContent).active = tab

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_logs_of_selected(self) -> None:
        table = self._w("#procs", DataTable)
        names = self.state.process_names
        if table.row_count and 0 <= table.cursor_row < len(names):
            self.log_proc = names[table.cursor_row]
        self.action_tab("logs")
        self._relog()

    def action_next_process(self) -> None:
        choices: list[str | None] = [None, *self.state.process_names]
        i = choices.index(self.log_proc) if self.log_proc in choices else 0
        self.log_proc = choices[(i + 1) % len(choices)]
        self._relog()

    def action_toggle_follow(self) -> None:
        self.follow = not self.follow
        log = self._w("#log", Log)
        log.auto_scroll = self.follow
        if self.follow:
            log.scroll_end(animate=False)
        self._draw_logbar()

    def action_ask(self, what: str) -> None:
        self.action_tab("logs")
        ask = self._w("#logask", Input)
        self._asking = what
        ask.placeholder = ("filter: show lines containing… (empty: show all)" if what == "filter"
                           else "search for…")
        ask.value = ""  # as in less: & then enter clears the filter
        ask.display = True
        ask.focus()

    @on(Input.Submitted, "#logask")
    def _asked(self, event: Input.Submitted) -> None:
        ask = self._w("#logask", Input)
        ask.display = False
        if self._asking == "filter":
            self.log_filter = event.value
            self._relog()
        else:
            self.search_text = event.value
            self.search_at = -1
            self.action_search_step(1)
        self._asking = None
        self._w("#log", Log).focus()

    def action_search_step(self, step: int) -> None:
        if not self.search_text:
            return
        log = self._w("#log", Log)
        lines = log.lines
        needle = self.search_text.lower()
        n = len(lines)
        for k in range(1, n + 1):
            i = (self.search_at + step * k) % n if n else 0
            if needle in lines[i].lower():
                self.search_at = i
                if self.follow:
                    self.action_toggle_follow()  # looking back: stop following
                log.scroll_to(y=max(0, i - log.size.height // 2), animate=False)
                self._draw_logbar(f"match at line {i + 1}: {lines[i][:60]}")
                return
        self._draw_logbar("no match")

    def action_restart(self) -> None:
        def answered(yes: bool | None) -> None:
            if yes:
                self._control("restart")

        self.push_screen(ConfirmScreen("Restart the whole group (llama-server, then the rpc-servers)?"), answered)

    def action_stop(self) -> None:
        def answered(yes: bool | None) -> None:
            if yes:
                self._control("stop")

        self.push_screen(ConfirmScreen("Stop this arcsplit instance? Serving ends for every client."), answered)

    @work(exclusive=True, group="status")
    async def _refresh_status(self) -> None:
        try:
            status = await self.source.request("status")
        except Exception:
            return
        if isinstance(status, dict):
            self._inbox.append({"kind": "status", "name": "group", "data": status})

    @work(group="control")
    async def _control(self, cmd: str) -> None:
        try:
            await self.source.request(cmd, by="the dashboard", pid=os.getpid())
            self.notify(f"{cmd} requested")
        except Exception as exc:
            self.notify(f"{cmd} failed: {exc}", severity="error")


def run_dashboard(client_factory: Callable[[], Any], verbose: bool = False) -> int:
    """Run the dashboard in the foreground on the instance ``client_factory()`` connects to (a bus Client);
    ``verbose``: its Logs tab keeps the lines `arcsplit logs` hides without --verbose."""
    feed = Feed(client_factory())
    try:
        DashApp(feed, state=DashState(verbose=verbose)).run()
    finally:
        feed.close()
    return 0
