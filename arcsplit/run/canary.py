"""The output canary: does the running group still compute what it computed when it was known to be right?

After every (re)start once ready, and every ``every`` seconds after that, it asks llama-server tune's short greedy
check (llama/verify.py: 4 prompts x 16 tokens with the top 5 log-probabilities per token) and compares each answer
with the reference using tune's rule and tolerance. The reference is tune's kept answer for this rig's fingerprint
where one exists, else the group's own first answer of this run: a route that turns wrong while it serves (a device
lost, memory corrupted, peer copies gone bad) is caught; a route wrong from its first answer is tune's and
``doctor --verify``'s to catch.

It never delays a user: a prompt starts only when no slot is processing and no request waits
(``/metrics``: ``requests_processing`` and ``requests_deferred``), and while it streams its answer those two are
asked every ``poll`` seconds; a request seen there makes it drop the stream at once (llama-server cancels a
streamed task on the next token it cannot send) and try again ``retry`` seconds later, from the prompt it had
reached. A mismatch ends ``watch`` with its evidence (the prompt, the position, both sides' tokens and
log-probabilities); what follows (the run's state, the tune cache, the next route) is the supervisor's.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, AsyncIterator, Callable

import anyio

from ..llama import verify

_GAUGE = re.compile(r"^llamacpp:(requests_processing|requests_deferred)\s+([0-9.eE+-]+)", re.MULTILINE)


class Verdict(StrEnum):
    PASS = "pass"  # every prompt matches the reference
    REFERENCE = "reference"  # no reference yet: this answer is kept as the reference
    WRONG = "wrong"  # a prompt parted from the reference beyond tune's tolerance
    GAVE_WAY = "gave_way"  # a request came (or the slots were busy): tried again later
    FAILED = "failed"  # no answer (an HTTP error, a timeout): tried again later; hangs are the watchdog's


@dataclass(frozen=True)
class CanaryPolicy:
    every: float = 600.0  # seconds between checks once one passed (decide/prepare.py CANARY_EVERY_S says why)
    poll: float = 0.05  # while a prompt streams: how often the queue is asked (bounds a request's wait)
    retry: float = 5.0  # after giving way: the next try (each try first finds the slots idle)
    timeout: float = 120.0  # one prompt's answer; a group that stops answering is the progress watchdog's


@dataclass(frozen=True)
class CheckResult:
    verdict: Verdict
    seconds: float  # wall time of this try, its waits included
    reason: str = ""
    evidence: dict[str, Any] | None = None
    at: float = field(default_factory=time.time)
    prompts: int = 0  # prompts answered in this try

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "seconds": round(self.seconds, 3), "reason": self.reason, "at": self.at,
                "prompts": self.prompts, **({"evidence": self.evidence} if self.evidence else {})}


class _GaveWay(Exception):
    """A user's request came while a prompt streamed (``partial``: the steps streamed before it), or the slots were
    busy before it."""

    def __init__(self, partial: tuple[verify.Step, ...] = (), text: str = "") -> None:
        super().__init__("a request came")
        self.partial, self.text = partial, text


class Canary:
    """One run's canary: the reference (tune's, else the first answer) and the counts, kept across generations."""

    def __init__(self, policy: CanaryPolicy = CanaryPolicy(), reference: verify.Sample | None = None,
                 headers: dict[str, str] | None = None) -> None:
        self.policy = policy
        self.reference = reference
        self.reference_from = "tune" if reference is not None else ""  # "first ready" once taken from the group
        self.headers = headers or {}
        self.counts: dict[str, int] = {}
        self.last: CheckResult | None = None
        self.mismatch: CheckResult | None = None
        self._round: list[tuple[verify.Step, ...]] = []  # this check's answers so far (a check resumes after a wait)
        self._errors: tuple[type[Exception], ...] = ()  # the HTTP client's own errors (httpx.HTTPError)
        self.running = False  # a try is under way (status shows it)

    async def watch(self, url: str, report: Callable[[CheckResult], None]) -> CheckResult:
        """Check ``url`` now, then every ``every`` s, until a check finds a mismatch, which it returns. A try that
        gave way is retried after ``retry`` s, one that got no answer after at most a minute."""
        self._round = []  # a new generation: every prompt again
        client, self._errors = _client(self.headers, self.policy.timeout)
        async with client:
            delay = 0.0
            while True:
                await anyio.sleep(delay)
                self.running = True
                try:
                    result = await self.check(client, url)
                finally:
                    self.running = False
                self.counts[result.verdict] = self.counts.get(result.verdict, 0) + 1
                self.last = result
                report(result)
                if result.verdict is Verdict.WRONG:
                    self.mismatch = result
                    return result
                delay = {Verdict.PASS: self.policy.every, Verdict.REFERENCE: self.policy.every,
                         Verdict.GAVE_WAY: self.policy.retry}.get(result.verdict, min(self.policy.every, 60.0))

    async def check(self, client: Any, url: str) -> CheckResult:
        """One try: the prompts not answered yet, each only while the group is otherwise idle."""
        t0 = time.monotonic()
        done = 0
        errors: tuple[type[BaseException], ...] = (OSError, ValueError, KeyError, IndexError, *self._errors)
        try:
            for k in range(len(self._round), len(verify.PROMPTS)):
                if await _busy(client, url, 0):
                    raise _GaveWay
                got, text = await self._answer(client, url, verify.PROMPTS[k])
                done += 1
                answers = (*self._round, got)
                verdict, check = judge(self.reference, answers)
                if verdict is Verdict.WRONG and check is not None and self.reference is not None:
                    self._round = []
                    ev = await _evidence(client, url, self.reference[:k + 1], answers, text, check)
                    return CheckResult(Verdict.WRONG, time.monotonic() - t0, check.reason, ev, prompts=done)
                self._round.append(got)
        except _GaveWay as gave:
            # What streamed before the request came is judged too: on a server that is never idle for a whole
            # answer, a route that computes wrong parts from the reference within its first tokens.
            k = len(self._round)
            if gave.partial and self.reference is not None and k < len(self.reference):
                ref = (*self.reference[:k], self.reference[k][:len(gave.partial)])
                answers = (*self._round, gave.partial)
                check = verify.compare(ref, answers)
                if not check.ok:
                    self._round = []
                    ev = await _evidence(client, url, ref, answers, gave.text, check)
                    return CheckResult(Verdict.WRONG, time.monotonic() - t0, check.reason, ev, prompts=done)
            return CheckResult(Verdict.GAVE_WAY, time.monotonic() - t0, "a request came", prompts=done)
        except errors as exc:
            return CheckResult(Verdict.FAILED, time.monotonic() - t0, f"{type(exc).__name__}: {exc}"[:200], prompts=done)
        answers, self._round = tuple(self._round), []
        if self.reference is None:
            self.reference, self.reference_from = answers, "first ready"
            return CheckResult(Verdict.REFERENCE, time.monotonic() - t0, "kept as the reference", prompts=done)
        return CheckResult(Verdict.PASS, time.monotonic() - t0, "matches the reference", prompts=done)

    async def _answer(self, client: Any, url: str, prompt: str) -> tuple[tuple[verify.Step, ...], str]:
        """The streamed answer to one prompt, watched for users: a request seen meanwhile drops it (_GaveWay)."""
        probs: list[dict[str, Any]] = []
        text: list[str] = []
        failed: list[Exception] = []  # raised after the task group, as itself

        async def stream(scope: anyio.CancelScope) -> None:
            try:
                async with client.stream("POST", f"{url}/completion",
                                         json={**verify.request(prompt), "stream": True}) as r:
                    r.raise_for_status()
                    async for chunk in _events(r.aiter_lines()):
                        probs.extend(chunk.get("completion_probabilities") or [])
                        text.append(str(chunk.get("content") or ""))
            except Exception as exc:
                failed.append(exc)
            scope.cancel()

        async def watch(scope: anyio.CancelScope) -> None:
            try:
                while not await _busy(client, url, 1):
                    await anyio.sleep(self.policy.poll)
                failed.append(_GaveWay())
            except Exception as exc:
                failed.append(exc)
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream, tg.cancel_scope)
            await anyio.sleep(self.policy.poll)  # the stream holds its slot before the first look at the queue
            tg.start_soon(watch, tg.cancel_scope)
        if failed:
            if isinstance(failed[0], _GaveWay):
                raise _GaveWay(verify.steps_of({"completion_probabilities": probs}), "".join(text))
            raise failed[0]
        return verify.steps_of({"completion_probabilities": probs}), "".join(text)

    def to_dict(self) -> dict[str, Any]:
        """status()["canary"] and the run's state: counts, the last try, the mismatch with its evidence."""
        return {"on": True, "every": self.policy.every, "running": self.running, "reference": self.reference_from or None,
                "counts": dict(self.counts), "last": self.last.to_dict() if self.last else None,
                "mismatch": self.mismatch.to_dict() if self.mismatch else None}


def judge(reference: verify.Sample | None, answers: verify.Sample) -> tuple[Verdict | None, verify.Check | None]:
    """The verdict on the answers so far (the first prompts, in order): WRONG where one parts from the reference's
    beyond tune's tolerance (llama/verify.compare, its Check saying where), PASS once every prompt matched,
    REFERENCE once every prompt was answered with no reference to compare with, else None: ask the next prompt."""
    complete = len(answers) >= len(verify.PROMPTS)
    if reference is None:
        return (Verdict.REFERENCE if complete else None), None
    check = verify.compare(reference[:len(answers)], answers)
    if not check.ok:
        return Verdict.WRONG, check
    return (Verdict.PASS if complete else None), check


async def _busy(client: Any, url: str, own: int) -> bool:
    """Whether a user's request is processing or waiting (``own``: the slots this canary holds itself)."""
    r = await client.get(f"{url}/metrics")
    r.raise_for_status()
    gauges = {m.group(1): float(m.group(2)) for m in _GAUGE.finditer(r.text)}
    return gauges.get("requests_processing", 0.0) > own or gauges.get("requests_deferred", 0.0) > 0


async def _events(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a server-sent event stream (``data: {...}`` lines)."""
    async for line in lines:
        if line.startswith("data: ") and line[6:].strip() not in ("", "[DONE]"):
            yield json.loads(line[6:])


async def _evidence(client: Any, url: str, ref: verify.Sample, got: verify.Sample, text: str,
                    check: verify.Check) -> dict[str, Any]:
    """verify.evidence, with the text of the answer that parted (``text``) and of the reference's, where llama-server
    detokenizes it."""
    ev = {**verify.evidence(ref, got, check), "got_text": text}
    try:
        r = await client.post(f"{url}/detokenize", json={"tokens": ev["reference_tokens"]})
        ev["reference_text"] = str(r.json().get("content", "")) if r.status_code == 200 else None
    except Exception:  # the text is a courtesy: the token ids are the evidence
        ev["reference_text"] = None
    return ev


def _client(headers: dict[str, str], timeout: float) -> tuple[Any, tuple[type[Exception], ...]]:
    """An HTTP client for llama-server, and the errors it raises."""
    import httpx  # start-up: `arcsplit --help` and `plan` import this module (through the API)

    return httpx.AsyncClient(timeout=timeout, headers=headers, trust_env=False), (httpx.HTTPError,)
