"""Does a route compute the model correctly? Its greedy output for fixed prompts against a reference's.

Backends round differently (a CPU llama-server repacks Q4_K for its own kernels, an rpc-server does not; GPUs sum
in other orders), so greedy text may part where two tokens are nearly tied. Corruption (peer copies that corrupt
data, intel/compute-runtime#942; garbled output, ggml-org/llama.cpp#26058) parts where the reference was sure, or
shifts the probabilities of the tokens it still agrees on. The rule, per prompt, using llama-server's ``n_probs``:
  - where both chose the same token, its log-probability may differ by at most LOGPROB_TOL nats;
  - at the first position they differ, the candidate's token must be among the reference's top TOP_K and within
    MARGIN nats of the reference's choice there (a near tie, where rounding may flip it); after that the texts differ
    and the prompt is done.
Measured on the demo model (gemma-3 270M Q4_K_M), CPU llama-server (which repacks Q4_K) against CPU rpc-servers
(which do not), 4 prompts x 16 tokens: agreeing tokens moved by at most 0.29 nats (most under 0.1), and the texts
parted three times, at leads of 0.10, 0.11 and 0.29 nats, once to the reference's third choice. Weights corrupted on
the way to an rpc-server part at once, far outside both (tests/test_tune_real.py).

Pure, and below run/: ``arcsplit tune`` and ``doctor --verify`` (tuning/verify.py's ``sample``) and the output
canary of a running group (run/canary.py) ask llama-server the same ``request`` and judge with the same ``compare``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are")
N_TOKENS = 16
MARGIN = 0.5  # nats between the reference's choice and the candidate's, where they part: a near tie
LOGPROB_TOL = 1.0  # nats: how far the same token's log-probability may move between backends
TOP_K = 5  # n_probs asked for: the reference's alternatives at each position


@dataclass(frozen=True)
class Step:
    """One generated token: its id, its log-probability, and the top TOP_K (id, logprob) at that position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]

    def to_list(self) -> list[Any]:
        return [self.token, self.logprob, [list(t) for t in self.top]]

    @classmethod
    def from_list(cls, x: Sequence[Any]) -> "Step":
        return cls(int(x[0]), float(x[1]), tuple((int(t[0]), float(t[1])) for t in x[2]))


Sample = tuple[tuple[Step, ...], ...]  # one tuple of steps per prompt


@dataclass(frozen=True)
class Check:
    ok: bool
    reason: str
    noise: float = 0.0  # the largest log-probability difference on agreeing tokens
    near_ties: int = 0  # prompts that parted at a near tie (accepted)
    prompt: int | None = None  # where a failed check parted: the prompt's index (0-based) ...
    position: int | None = None  # ... and the token's within its answer


def compare(reference: Sample, candidate: Sample, margin: float = MARGIN, tol: float = LOGPROB_TOL) -> Check:
    """Whether ``candidate`` computes what ``reference`` does, up to rounding (the rule in the module text)."""
    if len(reference) != len(candidate):
        return Check(False, f"{len(candidate)} answers for {len(reference)} prompts")
    noise, ties = 0.0, 0
    for k, (ref, got) in enumerate(zip(reference, candidate)):
        if len(got) < min(len(ref), N_TOKENS // 2):
            return Check(False, f"prompt {k + 1}: {len(got)} tokens where the reference gave {len(ref)}",
                         prompt=k, position=len(got))
        for i, (r, g) in enumerate(zip(ref, got)):
            if r.token == g.token:
                noise = max(noise, abs(r.logprob - g.logprob))
                if abs(r.logprob - g.logprob) > tol:
                    return Check(False, f"prompt {k + 1}, token {i + 1}: same token, log-probability "
                                 f"{g.logprob:.3f} vs the reference's {r.logprob:.3f} (more than {tol} apart)", noise,
                                 prompt=k, position=i)
                continue
            alt = dict(r.top).get(g.token)
            gap = max(r.logprob, *(lp for _, lp in r.top)) - alt if alt is not None else float("inf")
            if gap <= margin:
                ties += 1
                break
            lead = f"a lead of {gap:.2f} nats" if alt is not None else f"its choice not in the reference's top {TOP_K}"
            return Check(False, f"prompt {k + 1}, token {i + 1}: token {g.token} where the reference chose "
                         f"{r.token} with {lead} (a near tie is {margin} or less)", noise, prompt=k, position=i)
    return Check(True, "matches the reference" + (f" ({ties} prompt(s) part at a near tie)" if ties else ""),
                 noise, ties)


def agreement(samples: dict[str, Sample]) -> str | None:
    """The reference where no route computes another way: the sample most others agree with (ties: the first);
    None with fewer than 3 samples (two that disagree cannot say which is wrong)."""
    if len(samples) < 3:
        return None
    votes = {k: sum(compare(s, o).ok and compare(o, s).ok for j, o in samples.items() if j != k)
             for k, s in samples.items()}
    best = max(votes, key=lambda k: votes[k])
    return best if votes[best] * 2 >= len(samples) - 1 else None


def steps_of(body: dict[str, Any]) -> tuple[Step, ...]:
    """A /completion answer with n_probs as steps."""
    out = []
    for p in body.get("completion_probabilities") or []:
        top = tuple((int(t["id"]), float(t["logprob"])) for t in (p.get("top_logprobs") or [])[:TOP_K])
        out.append(Step(int(p["id"]), float(p["logprob"]), top))
    return tuple(out)


def request(prompt: str, n_tokens: int = N_TOKENS) -> dict[str, Any]:
    """The /completion body every check sends: greedy, the top TOP_K per position, no cached prompt."""
    return {"prompt": prompt, "n_predict": n_tokens, "temperature": 0, "n_probs": TOP_K, "cache_prompt": False,
            "ignore_eos": True}


def evidence(reference: Sample, candidate: Sample, check: Check) -> dict[str, Any]:
    """What a failed ``check`` saw, for a report: the prompt, the position, and both sides' token, log-probability
    and top TOP_K there (token ids of the model's vocabulary)."""
    k, i = check.prompt, check.position
    out: dict[str, Any] = {"reason": check.reason, "prompt": PROMPTS[k] if k is not None and k < len(PROMPTS) else None,
                           "prompt_index": k, "position": i}
    for side, sample in (("reference", reference), ("got", candidate)):
        steps = sample[k] if k is not None and k < len(sample) else ()
        step = steps[i] if i is not None and i < len(steps) else None
        out[side] = None if step is None else {"token": step.token, "logprob": step.logprob,
                                               "top": [list(t) for t in step.top]}
        out[f"{side}_tokens"] = [s.token for s in steps]
    return out


def to_json(s: Sample) -> list[list[Any]]:
    return [[st.to_list() for st in steps] for steps in s]


def from_json(x: Sequence[Sequence[Any]]) -> Sample:
    return tuple(tuple(Step.from_list(st) for st in steps) for steps in x)
