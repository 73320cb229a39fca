"""The environment every llama.cpp child gets: inherited SYCL settings reported harmful are dropped, named, and
the user can keep one; credentials are dropped (llama-server keeps its own API key). Pure rules, the specs that
carry them, and real children (a real group's rpc-servers and llama-server) whose /proc/PID/environ shows it."""

from __future__ import annotations

import os
import sys

import anyio
import pytest

from pathlib import Path

from arcsplit.decide.specs import ProcessSpec, build_specs, n_rpc_servers
from arcsplit.llama.childenv import KEEP_VAR, SYCL_RULES, child_environ, clean_env, overlay
from arcsplit.redact import Redactor, is_secret_name, secret_env
from arcsplit.proc import spawn
from arcsplit.proc.child import Child

from test_specs import config

USER = {"PATH": "/usr/bin", "HOME": "/home/u", "GGML_SYCL_DISABLE_OPT": "1",
        "SYCL_PI_LEVEL_ZERO_USE_IMMEDIATE_COMMANDLISTS": "1", "SYCL_CACHE_PERSISTENT": "1",
        "GGML_SYCL_ENABLE_HOST_PINNED_MEM": "0"}


def test_sycl_children_lose_the_reported_harmful_settings_and_keep_the_rest():
    env, dropped = clean_env("sycl", USER)
    assert "GGML_SYCL_DISABLE_OPT" not in env and "SYCL_PI_LEVEL_ZERO_USE_IMMEDIATE_COMMANDLISTS" not in env
    assert env["SYCL_CACHE_PERSISTENT"] == "0"
    # the user's own settings and the #28765 workaround pass through untouched
    assert env["PATH"] == "/usr/bin" and env["GGML_SYCL_ENABLE_HOST_PINNED_MEM"] == "0"
    assert {d.var for d in dropped} == {r.var for r in SYCL_RULES}
    line = next(d for d in dropped if d.var == "GGML_SYCL_DISABLE_OPT").line()
    assert line.startswith("GGML_SYCL_DISABLE_OPT=1 removed: ") and "ggml-org/llama.cpp#22413" in line
    assert all(d.sources for d in dropped), "every change cites where the harm was reported"


def test_nothing_changes_when_nothing_harmful_is_inherited_or_on_other_backends():
    assert clean_env("sycl", {"PATH": "/usr/bin", "SYCL_CACHE_PERSISTENT": "0"}) == (
        {"PATH": "/usr/bin", "SYCL_CACHE_PERSISTENT": "0"}, ())
    for backend in ("cpu", "cuda", "vulkan"):
        assert clean_env(backend, USER) == (USER, ())


def test_the_user_can_keep_a_variable():
    env, dropped = clean_env("sycl", {**USER, KEEP_VAR: "GGML_SYCL_DISABLE_OPT, SYCL_CACHE_PERSISTENT"})
    assert env["GGML_SYCL_DISABLE_OPT"] == "1" and env["SYCL_CACHE_PERSISTENT"] == "1"
    assert [d.var for d in dropped] == ["SYCL_PI_LEVEL_ZERO_USE_IMMEDIATE_COMMANDLISTS"]


def test_every_process_of_a_group_gets_the_same_change():
    _, dropped = clean_env("sycl", USER)
    sets, unsets = overlay(dropped)
    for mode in ("multi", "hybrid", "rpc"):
        cfg = config("sycl", mode, [0, 1], env_dropped=dropped)
        for spec in build_specs(cfg, list(range(50100, 50100 + n_rpc_servers(cfg)))):
            assert spec.env_dict["SYCL_CACHE_PERSISTENT"] == "0", (mode, spec.name)
            assert set(spec.env_unset) == set(unsets) == {"GGML_SYCL_DISABLE_OPT",
                                                          "SYCL_PI_LEVEL_ZERO_USE_IMMEDIATE_COMMANDLISTS"}
    assert dict(sets) == {"SYCL_CACHE_PERSISTENT": "0"}


def test_a_real_child_does_not_inherit_a_dropped_variable(monkeypatch):
    """The supervisor's Child starts the process: an inherited variable in env_unset must not reach it."""
    monkeypatch.setenv("GGML_SYCL_DISABLE_OPT", "1")
    monkeypatch.setenv("ARCSPLIT_TEST_KEEP", "yes")
    code = "import os; print(sorted(k for k in os.environ if k in ('GGML_SYCL_DISABLE_OPT', 'ARCSPLIT_TEST_KEEP', 'SYCL_CACHE_PERSISTENT')))"
    spec = ProcessSpec(name="server", role="server", argv=(sys.executable, "-c", code), env=(("SYCL_CACHE_PERSISTENT", "0"),),
                       host="127.0.0.1", port=0, cards=(), env_unset=("GGML_SYCL_DISABLE_OPT",))
    child = Child(spec)

    async def run() -> None:
        with anyio.fail_after(20):
            await child.run()

    anyio.run(run)
    assert child.returncode == 0
    assert "['ARCSPLIT_TEST_KEEP', 'SYCL_CACHE_PERSISTENT']" in list(child.lines)
    assert os.environ["GGML_SYCL_DISABLE_OPT"] == "1"  # the supervisor's own environment is left alone


# What a shell that serves models often holds; none of it is any child's business but llama-server's own key.
PLANTED = {"HF_TOKEN": "hf_planted", "HUGGING_FACE_HUB_TOKEN": "hf_planted2", "AWS_ACCESS_KEY_ID": "AKIAPLANTED",
           "AWS_SECRET_ACCESS_KEY": "aws-planted", "AWS_SESSION_TOKEN": "aws-session", "GITHUB_TOKEN": "ghp_planted",
           "OPENAI_API_KEY": "sk-planted", "AZURE_CLIENT_SECRET": "az-planted", "MY_DB_PASSWORD": "pw-planted",
           "GOOGLE_APPLICATION_CREDENTIALS": "/home/u/gcp.json", "STRIPE_SECRET": "sk_live", "DEPLOY_KEY": "k",
           "LLAMA_API_KEY": "sk-llama-planted"}
PLAIN = {"PATH": "/usr/bin", "HOME": "/home/u", "SSH_AUTH_SOCK": "/run/user/1/ssh-agent", "TOKENIZERS_PARALLELISM": "0",
         "ONEAPI_DEVICE_SELECTOR": "level_zero:0", "MONKEY_BUSINESS": "1", "KEYBOARD": "us", "LANG": "C.UTF-8"}


def test_credentials_are_known_by_name_and_nothing_else_is():
    assert [k for k in PLANTED if not is_secret_name(k)] == []
    assert [k for k in PLAIN if is_secret_name(k)] == ["SSH_AUTH_SOCK"]  # a secret by name, kept for ssh all the same
    env = child_environ({**PLANTED, **PLAIN})
    assert env == PLAIN
    assert child_environ({**PLANTED, **PLAIN}, keep=("LLAMA_API_KEY",)) == {**PLAIN, "LLAMA_API_KEY": "sk-llama-planted"}
    assert "HF_TOKEN" in child_environ({**PLANTED, KEEP_VAR: "HF_TOKEN"})  # the user's way to pass one on
    assert clean_env("cpu", {**PLANTED, **PLAIN}) == (PLAIN, ())  # the probe's and fit-params' children too


# Caught before by only one of the two rules there were (children's: llama/childenv.py; the report's: redact.py),
# and by both: one rule now, so a name either caught is both withheld from children and redacted.
ONE_RULE = ["GPG_PASSPHRASE", "NETRC", "PGPASSFILE", "AZURE_CLIENT_ID", "AWS_ROLE_ARN", "GH_TOKENS", "DEPLOY_KEYS",
            "STRIPE_SECRETKEY", "OPENAI_APIKEY", "FTP_PASS", "PROXY_AUTH", "SESSION_COOKIE", "HF_TOKEN"]


@pytest.mark.parametrize("name", ONE_RULE)
def test_a_credential_name_is_withheld_from_children_and_redacted_from_reports(name):
    environ = {name: "planted-value-1234", "PATH": "/usr/bin"}
    assert child_environ(environ) == {"PATH": "/usr/bin"}
    assert secret_env(environ) == ["planted-value-1234"]
    assert Redactor().env(environ) == {name: "<redacted>", "PATH": "/usr/bin"}
    log = f"started with value planted-value-1234 from {name}"  # the value wherever a report's text repeats it
    assert "planted-value-1234" not in Redactor.of(secret_env(environ), None, None, ()).text(log)


def test_aws_plain_settings_are_not_credentials():
    # a region or profile name ("default") is no secret, and redacted it would blank that word all over a report
    environ = {"AWS_PROFILE": "default", "AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "AKIAPLANTED"}
    assert child_environ(environ) == {"AWS_PROFILE": "default", "AWS_REGION": "us-east-1"}
    assert secret_env(environ) == ["AKIAPLANTED"]


def test_ssh_keeps_its_agent_socket_though_a_report_hides_its_path():
    environ = {"SSH_AUTH_SOCK": "/run/user/1/ssh-agent"}
    assert child_environ(environ) == environ  # ssh logs in to other hosts with it
    assert Redactor().env(environ)["SSH_AUTH_SOCK"] == "<redacted>"


def _environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def test_an_ssh_session_gets_no_credentials(monkeypatch):
    """ssh (a layout's host session, spec role "node") starts through spawn like every child; a real process
    stands in for ssh here: what it inherits is decided before the exec."""
    for k, v in PLANTED.items():
        monkeypatch.setenv(k, v)
    spec = ProcessSpec(name="node-b", role="node", argv=("sleep", "30"), env=(), host="", port=0, cards=())
    proc = spawn.popen(spec)
    try:
        env = _wait_for_exec(proc.pid, "sleep")
        assert [k for k in PLANTED if k in env] == [] and env.get("PATH") == os.environ["PATH"]
    finally:
        proc.kill()
        proc.wait()


def _wait_for_exec(pid: int, name: str) -> dict[str, str]:
    """The environment of ``pid`` once the exec shim has become the program."""
    import time

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if Path(f"/proc/{pid}/comm").read_text().strip() == name:
            return _environ_of(pid)
        time.sleep(0.02)
    raise AssertionError(f"{pid} never became {name}")


@pytest.mark.slow  # a real group
def test_a_real_group_passes_no_credentials_but_llama_servers_own_key(monkeypatch, tmp_path, llama_bins, demo_model):
    from test_serve import config_for, running

    monkeypatch.setenv("ARCSPLIT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ARCSPLIT_LLAMA_DIR", str(llama_bins.bin_dir))
    monkeypatch.setenv("ARCSPLIT_TEST_PLAIN", "kept")
    for k, v in PLANTED.items():
        monkeypatch.setenv(k, v)
    with running(config_for(demo_model)) as sup:
        seen = {name: _environ_of(p["pid"]) for name, p in sup.status()["processes"].items()}
        roles = {name: p["role"] for name, p in sup.status()["processes"].items()}
    assert sorted(roles.values()) == ["rpc", "rpc", "server"]
    for name, env in seen.items():
        assert env.get("ARCSPLIT_TEST_PLAIN") == "kept", name  # the rest of the environment passes through
        kept = {k for k in PLANTED if k in env}
        assert kept == ({"LLAMA_API_KEY"} if roles[name] == "server" else set()), (name, kept)
