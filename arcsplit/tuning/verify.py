"""Does a route compute the model correctly? The rule, its tolerances and its records are llama/verify.py's (the
output canary of a running group judges with them too); this is tune's and ``doctor --verify``'s sampler."""

from __future__ import annotations

import httpx

from ..llama.verify import (LOGPROB_TOL, MARGIN, N_TOKENS, PROMPTS, TOP_K, Check, Sample, Step, agreement, compare,
                            evidence, from_json, request, steps_of, to_json)

__all__ = ["LOGPROB_TOL", "MARGIN", "N_TOKENS", "PROMPTS", "TOP_K", "Check", "Sample", "Step", "agreement", "compare",
           "evidence", "from_json", "request", "sample", "steps_of", "to_json"]


def sample(client: httpx.Client, url: str, n_tokens: int = N_TOKENS) -> Sample:
    """Greedy output with the top TOP_K per position, for every prompt, from a running llama-server."""
    out = []
    for prompt in PROMPTS:
        r = client.post(f"{url}/completion", json=request(prompt, n_tokens))
        r.raise_for_status()
        out.append(steps_of(r.json()))
    return tuple(out)
