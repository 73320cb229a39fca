"""Redaction for ``arcsplit report``: what leaves the machine in a bug report carries no secret and no identity.

Pure: the secrets, home directory, user and host names are given; ``Redactor.text`` replaces them and anything that
looks like a credential (an ``--api-key`` value, a bearer token, ``KEY=value`` pairs whose name says secret, the
shapes of common API tokens). ``secret_env`` picks the variables whose values must go.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Iterable, Mapping

SECRET = "<redacted>"
# Variable names whose values are credentials: the one rule, for what ``arcsplit report`` redacts and what no child
# of arcsplit inherits (llama/childenv.py). A TOKEN/KEY/PASSWORD/PASS/AUTH/CREDENTIALS/COOKIE word (HF_TOKEN,
# OPENAI_API_KEY, LLAMA_API_KEY, ...), SECRET anywhere, every AWS_ variable but its plain settings (a profile or
# region name such as "default" would be redacted all over a report's text), Azure's client and Google's
# credentials file, netrc and PostgreSQL's password file.
_SECRET_NAME = re.compile(r"(?:^|_)(?:API_?KEY|KEYS?|TOKENS?|PASSWORD|PASSWD|PASSPHRASE|PASS|AUTH|CREDENTIALS?|COOKIE)"
                          r"(?:_|$)|SECRET|^AWS_(?!(?:PROFILE|REGION|DEFAULT_REGION|DEFAULT_OUTPUT|PAGER)$)|"
                          r"^AZURE_CLIENT_|^GOOGLE_APPLICATION_CREDENTIALS$|^NETRC$|^PGPASS",
                          re.IGNORECASE)
# Compiled on first use (``_patterns``): the node agent imports the name rule above (llama/childenv.py) on its way to
# its first answer and never redacts text; these cost ~1 ms to compile.
_PATTERN_TEXT = (
    # --api-key VALUE / --api-key=VALUE (llama-server), and the same for any *-key/*-token/*-secret flag
    r"(?i)(--[\w-]*(?:key|token|secret|password)(?:[= ]|\"?,\s*\"))([^\s\",']+)",
    r"(?i)(\bBearer\s+)([A-Za-z0-9._~+/=-]+)",
    # NAME=value / "name": "value" when the name says secret; short values ("BOS token = 2") are not credentials
    r"(?i)(\b[\w.-]*(?:api[_-]?key|token|secret|password|passwd)\b[\"']?\s*[=:]\s*[\"']?)([^\s\",']{6,})",
    # shapes of common tokens: OpenAI/Anthropic sk-, Hugging Face hf_, GitHub ghp_/gho_/github_pat_, Slack xox*-
    r"()\b(?:sk-[A-Za-z0-9_-]{16,}|hf_[A-Za-z0-9]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_\w{20,}|"
    r"xox[abprs]-[A-Za-z0-9-]{10,})",
)


@functools.cache
def _patterns() -> tuple[re.Pattern[str], ...]:
    return tuple(re.compile(p) for p in _PATTERN_TEXT)


def is_secret_name(name: str) -> bool:
    """Whether an environment variable's name says it holds a secret."""
    return bool(_SECRET_NAME.search(name))


def secret_env(environ: Mapping[str, str]) -> list[str]:
    """Values of the variables whose names say they are credentials (non-trivial values only)."""
    return [v for k, v in environ.items() if is_secret_name(k) and len(v.strip()) >= 4]


@dataclass(frozen=True)
class Redactor:
    secrets: tuple[str, ...] = ()
    home: str | None = None
    user: str | None = None
    hosts: tuple[str, ...] = ()
    users: tuple[str, ...] = ()  # other hosts' login names (their ssh destinations'), replaced like ``user``

    @classmethod
    def of(cls, secrets: Iterable[str], home: str | None, user: str | None, hosts: Iterable[str],
           users: Iterable[str] = ()) -> "Redactor":
        # longest first, so a secret that contains another is removed whole
        uniq = sorted({s.strip() for s in secrets if s and len(s.strip()) >= 4}, key=len, reverse=True)
        names = sorted({h for h in hosts if h and len(h) >= 3 and h != "localhost"}, key=len, reverse=True)
        others = sorted({u for u in users if u and len(u) >= 3 and u not in ("root", user)}, key=len, reverse=True)
        return cls(tuple(uniq), home.rstrip("/") if home and home != "/" else None,
                   user if user and len(user) >= 3 and user != "root" else None, tuple(names), tuple(others))

    def text(self, s: str) -> str:
        for secret in self.secrets:
            s = s.replace(secret, SECRET)
        for pat in _patterns():
            s = pat.sub(lambda m: m.group(1) + SECRET, s)
        if self.home:
            s = re.sub(re.escape(self.home) + r"(?=/|\b|$)", "~", s)
        for host in self.hosts:
            s = re.sub(rf"(?<![\w.-]){re.escape(host)}(?![\w-])", "<host>", s)
        for user in (*self.users, *([self.user] if self.user else [])):
            s = re.sub(rf"(?<![\w.-]){re.escape(user)}(?![\w-])", "<user>", s)
        return s

    def env(self, environ: Mapping[str, str]) -> dict[str, str]:
        """An environment to show: credential variables by name only, the rest redacted."""
        return {k: SECRET if is_secret_name(k) else self.text(v) for k, v in sorted(environ.items())}
