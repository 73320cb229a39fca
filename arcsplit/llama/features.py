"""Which flags a llama.cpp build arcsplit did not make accepts, read once from each binary's own ``--help``.

A llama-server from PATH, ``--llama-dir`` or Intel's IPEX-LLM may predate flags arcsplit passes (``--fit`` and
``--kv-unified`` are 2025 additions; ``-fa`` took no value before ``-fa on|off|auto``). llama-server exits on an
unknown flag, so arcsplit asks the binary once (cached by path, size and mtime), drops what it lacks and says which
features are off; a flag the route cannot do without (``--rpc``, ``--device``, ...) is a one-line error instead.
``parse_help`` and ``fit_args`` are pure; ``binary_features`` runs the binary (llama-server or ggml-rpc-server).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..errors import BadInput, LlamaError
from .answers import answer, cache_path, run_flag

CACHE_VERSION = 2  # 2: flags taking two values (with_two)
# One option line of `--help` (common/arg.cpp common_arg::to_string: aliases joined by ", ", then the value hint,
# then the help text after padding; ggml-rpc-server indents its options by two) or the first cell of the README
# table llama-gen-docs makes from it. Help text continues 40 columns in, so it never looks like an option.
_HELP_LINE = re.compile(r"^ {0,4}(?P<names>-{1,2}[A-Za-z0-9][\w.-]*(?:,\s*-{1,2}[A-Za-z0-9][\w.-]*)*)(?P<hint>[^\n]*?)(?:\s{2,}|$)")
_TABLE_CELL = re.compile(r"^\|\s*`(?P<cell>[^`]+)`\s*\|")

# arcsplit's optional flags: (takes a value, what is lost when the build lacks it; None: nothing).
OPTIONAL: dict[str, tuple[bool, str | None]] = {
    "--metrics": (False, "llama-server's /metrics (request and token counters in the dashboard)"),
    "--fit": (True, None),  # builds without --fit never fit on their own: "--fit off" is their behaviour
    # Before the switch (llama.cpp PR #14363, mid-2025) every build shared one KV cache among all sequences.
    "--kv-unified": (False, None),
    "--no-kv-unified": (False, "a KV stream per slot (this build shares one KV cache among the slots)"),
    "--swa-full": (False, "full-size SWA cache"),
    "-ot": (True, "--output-layer local (this build cannot place tensors)"),
    "-lv": (True, "per-card buffer lines in the log (verbosity 4)"),
}
# Flags a route cannot run without.
REQUIRED = ("-m", "--host", "--port", "--device", "-ngl", "-c", "-np", "-b", "-ub", "-ctk", "-ctv", "-ts", "-sm",
            "--rpc", "-t")
# The same for ggml-rpc-server (tools/rpc/rpc-server.cpp): -t and -c came after -H/-p.
RPC_OPTIONAL: dict[str, tuple[bool, str | None]] = {
    "-t": (True, "rpc-server thread count (its own default applies)"),
    "-c": (False, "--rpc-cache (this rpc-server has no local weight cache)"),
    "--seed-cache": (True, "weights read from the local GGUF (they cross the socket instead; patch 0006)"),
}
RPC_REQUIRED = ("-H", "-p", "-d")  # -d only in a per-host rpc-server's argv (required only where it is passed)


@dataclass(frozen=True)
class Features:
    """The flags (every alias) a llama-server accepts, and which of them take a value."""

    flags: frozenset[str]
    with_value: frozenset[str]
    source: str = ""
    with_two: frozenset[str] = frozenset()  # flags that take two values (--lora-scaled FNAME SCALE)

    def has(self, flag: str) -> bool:
        return flag in self.flags

    def to_dict(self) -> dict[str, object]:
        return {"flags": sorted(self.flags), "with_value": sorted(self.with_value), "source": self.source,
                "with_two": sorted(self.with_two)}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Features:
        return cls(frozenset(d["flags"]), frozenset(d["with_value"]), str(d.get("source", "")),  # type: ignore[call-overload]
                   frozenset(d.get("with_two", ())))  # type: ignore[call-overload]


def parse_help(text: str, source: str = "") -> Features:
    """The flags in ``--help`` output (or the README table made from it); an alias group shares its value hint."""
    flags: set[str] = set()
    with_value: set[str] = set()
    with_two: set[str] = set()
    for raw in text.splitlines():
        cell = _TABLE_CELL.match(raw)
        line = cell.group("cell") if cell else raw
        m = _HELP_LINE.match(line)
        if m is None:
            continue
        names = [n.strip() for n in m.group("names").split(",")]
        flags.update(names)
        hint = m.group("hint").split()
        if hint:
            with_value.update(names)
        if len(hint) == 2:  # common_arg::to_string prints value_hint then value_hint_2
            with_two.update(names)
    return Features(frozenset(flags), frozenset(with_value), source, frozenset(with_two))


def check_user_args(argv: Sequence[str], features: Features, binary: str = "llama-server") -> None:
    """Refuse the user's llama-server arguments (after ``--``) that this build would refuse, before anything starts:
    llama.cpp's parser (common/arg.cpp common_params_parse_ex) exits on an unknown flag, a flag without its value and
    a bare word, and a group that restarts on it only repeats the error. Same rules: ``--a_b`` reads as ``--a-b``;
    a flag with a value takes the next argument whatever it looks like."""
    fix = f"fix the arguments after --: `{binary} --help` lists what this build accepts"
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.replace("_", "-") if arg.startswith("--") else arg
        if name not in features.flags:
            hint = "" if arg.startswith("-") else " (a value without its flag?)"
            raise BadInput(f"llama-server argument {arg!r} is not an option of this build{hint}", fix)
        need = 2 if name in features.with_two else 1 if name in features.with_value else 0
        if i + need >= len(argv):
            if need:
                raise BadInput(f"llama-server argument {arg} needs {'two values' if need == 2 else 'a value'}", fix)
        i += 1 + need


def fit_args(argv: Sequence[str], features: Features | None, binary: str = "llama-server",
             optional: dict[str, tuple[bool, str | None]] = OPTIONAL, required: Sequence[str] = REQUIRED
             ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(argv this build accepts, features that are off). ``features`` None: a managed build, nothing to change.
    Only arcsplit's own flags are touched (``optional``/``required``: llama-server's by default, RPC_* for the
    rpc-server); a required one the build lacks is a BadInput naming it."""
    if features is None:
        return tuple(argv), ()
    out: list[str] = []
    off: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        value = argv[i + 1] if i + 1 < len(argv) else None
        if arg in ("-fa", "--flash-attn"):
            if not features.has(arg):
                off.append(f"flash attention switch ({arg} {value}; the build's own default applies)")
            elif arg in features.with_value:
                out += [arg, value or "on"]
            elif value == "on":  # the old form is a bare switch, off by default
                out.append(arg)
            i += 2
            continue
        if arg in optional and not features.has(arg):
            takes_value, lost = optional[arg]
            if lost:
                off.append(f"{lost} [{arg}]")
            i += 2 if takes_value else 1
            continue
        if arg in required and not features.has(arg):
            raise BadInput(f"{binary} does not accept {arg}, which this route needs (an older or differently built "
                           f"llama.cpp)", "use a newer llama.cpp built with -DGGML_RPC=ON, or `arcsplit llama build`")
        out.append(arg)
        i += 1
    return tuple(out), tuple(off)


def binary_features(binary: Path, timeout: float = 30.0) -> Features:
    """Ask ``binary --help`` once; the answer is cached until the file changes (llama/answers.py)."""
    try:
        path = cache_path(binary, "features", CACHE_VERSION)
    except OSError as exc:
        raise LlamaError(f"cannot read {binary}: {exc.strerror}", "point --llama-dir at a llama.cpp build") from None

    def ask() -> dict[str, object]:
        text, rc = run_flag(binary, "--help", "check that the binary runs, or use `arcsplit llama build`", timeout)
        features = parse_help(text, str(binary))
        if not features.flags:
            raise LlamaError(f"`{binary} --help` printed no options (exit {rc})",
                             "check that its shared libraries load, or use `arcsplit llama build`")
        return features.to_dict()

    return answer(path, ask, Features.from_dict)
