"""``arcsplit report``: the redactor on planted secrets, the bundle writer, and a real CPU run whose env, argv, logs
and state carry planted secrets that must not reach the bundle."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from arcsplit.errors import BadInput
from arcsplit.redact import SECRET, Redactor, is_secret_name, secret_env
from arcsplit.report import write_bundle

R = Redactor.of(["PlantedSecret-1234"], "/home/alice", "alice", ["build-box-7", "build-box-7.lab.example"])


def test_credentials_are_replaced_wherever_they_stand():
    text = "\n".join([
        "llama-server --api-key sk-abcdefghijklmnopqrstuv -m x.gguf",
        '"argv": ["llama-server", "--api-key", "hunter2-value", "--port", "8080"]',
        "--api-key=inline-value-9",
        "Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.payload.sig",
        "HF_TOKEN=hf_ABCDEFGHIJKLMNOPQRSTUVWXYZ012345 api_key: 'quoted-key-77'",
        "password = s3cretpw and the exact PlantedSecret-1234 too",
        "ghp_0123456789abcdefghijABCDEFGHIJ and xoxb-1234567890-abcdef",
    ])
    out = R.text(text)
    for leaked in ("sk-abcdef", "hunter2", "inline-value", "eyJhbGci", "hf_ABCDEF", "quoted-key", "s3cretpw",
                   "PlantedSecret", "ghp_0123", "xoxb-1234"):
        assert leaked not in out, (leaked, out)
    assert out.count(SECRET) >= 9 and "--port\", \"8080\"" in out  # neighbours stay


def test_identity_is_replaced_but_lookalikes_stay():
    text = ("model /home/alice/models/q.gguf on build-box-7.lab.example (build-box-7) by alice; "
            "/home/alicesmith stays; malice stays; commit 571d0d540 and /usr/lib/x86_64-linux-gnu stay")
    out = R.text(text)
    assert "~/models/q.gguf" in out and "<host>" in out and "by <user>" in out
    assert "alice" not in out.replace("alicesmith", "").replace("malice", "")
    assert "/home/alicesmith" in out and "malice" in out and "571d0d540" in out and "/usr/lib/x86_64-linux-gnu" in out


def test_too_short_or_generic_names_are_not_redacted_everywhere():
    r = Redactor.of([], "/", "root", ["vm", "localhost"])
    text = "llvm vmlinux root localhost /usr"
    assert r.text(text) == text


def test_secret_variables_by_name():
    env = {"LLAMA_API_KEY": "k-123456", "HF_TOKEN": "hf_x1234", "AWS_SECRET_ACCESS_KEY": "abcd1234",
           "DB_PASSWORD": "pw-12345", "ONEAPI_DEVICE_SELECTOR": "level_zero:0", "KEYBOARD": "us", "PATH": "/bin"}
    assert sorted(secret_env(env)) == ["abcd1234", "hf_x1234", "k-123456", "pw-12345"]
    assert not is_secret_name("KEYBOARD") and not is_secret_name("ONEAPI_DEVICE_SELECTOR")
    shown = R.env(env)
    assert shown["LLAMA_API_KEY"] == SECRET and shown["ONEAPI_DEVICE_SELECTOR"] == "level_zero:0"


def test_bundle_is_complete_or_absent(tmp_path):
    out = write_bundle({"a.txt": "x\n", "run/r/state.json": "{}"}, tmp_path / "r.tar.gz")
    with tarfile.open(out) as tar:
        assert sorted(tar.getnames()) == ["r/a.txt", "r/run/r/state.json"]
    assert oct(out.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(BadInput):
        write_bundle({"a": "b"}, tmp_path / "missing" / "r.tar.gz")
    with pytest.raises(BadInput):
        write_bundle({"a": "b"}, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.tar.gz"]  # no .partial left


@pytest.mark.slow
def test_a_real_run_with_planted_secrets_leaves_none_in_the_bundle(llama_bins, demo_model, tmp_path):
    user = "fielduserq"
    home = tmp_path / "home" / user
    (home / "models").mkdir(parents=True)
    model = home / "models" / "demo.gguf"
    try:
        os.link(demo_model, model)
    except OSError:
        model.symlink_to(demo_model)
    planted = {"HF_TOKEN": "hf_PLANTEDenvtoken0123456789", "SERVICE_PASSWORD": "PlantedPassw0rd-4411",
               "OPENAI_API_KEY": "sk-PLANTEDopenai0123456789abc"}
    api_key = "sk-PLANTEDargvkey0123456789xyz"
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    free = port.getsockname()[1]
    port.close()
    env = {**os.environ, **planted, "HOME": str(home), "USER": user, "LOGNAME": user,
           "ARCSPLIT_STATE_DIR": str(tmp_path / "state"), "ARCSPLIT_RUNTIME_DIR": str(tmp_path / "rt"),
           "ARCSPLIT_LLAMA_DIR": str(llama_bins.bin_dir)}
    serve = subprocess.Popen([sys.executable, "-m", "arcsplit", "serve", str(model), "--backend", "cpu", "--gpus",
                              "0,1", "--port", str(free), "--cpu-memory", "1024", "--", "--api-key", api_key],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 180
        lines = []
        for line in serve.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "arcsplit: serving" in line or time.time() > deadline:
                break
        assert any("arcsplit: serving" in line for line in lines), "".join(lines)
        run_dir = next((tmp_path / "state" / "runs").iterdir())
        with (run_dir / "server.log").open("a") as log:  # what a program that prints credentials would leave
            log.write(f"Authorization: Bearer PLANTEDbearer0123456789\nkey {api_key} from {home}\n"
                      f"{planted['SERVICE_PASSWORD']} on {socket.gethostname()}\n")
        out = tmp_path / "bundle.tar.gz"
        r = subprocess.run([sys.executable, "-m", "arcsplit", "report", "-o", str(out), "--backend", "cpu"],
                           env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    finally:
        serve.send_signal(signal.SIGINT)
        serve.wait(timeout=60)
    with tarfile.open(out) as tar:
        names = tar.getnames()
        blob = "\n".join(tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile())
    base = f"bundle/run/{run_dir.name}/"
    assert {base + "state.json", base + "server.log", base + "rpc0.log", "bundle/doctor.json",
            "bundle/build.json", "bundle/env.json"} <= set(names), names
    state = json.loads(tarfile.open(out).extractfile(base + "state.json").read())
    assert state["plan"]["n_layer"] > 0 and state["mode"] == "rpc"
    assert "~/models/demo.gguf" in blob and "Bearer " + SECRET in blob
    for secret in [*planted.values(), api_key, "PLANTEDbearer", str(home), str(tmp_path / "home")]:
        assert secret not in blob, secret
    assert user not in blob
    host = socket.gethostname()
    if len(host) >= 3:
        assert host not in blob


def test_model_log_lines_keep_their_token_ids():
    line = "print_info: BOS token        = 2 '<bos>'\nprint_info: EOS token = 1 '<eos>'\nload: token_embd.weight"
    assert R.text(line) == line


def test_collect_redacts_what_a_run_dir_holds(tmp_path, monkeypatch):
    """The run's argv names an --api-key-file: its content is a secret wherever it shows up."""
    from arcsplit.report import collect, find_run

    monkeypatch.setenv("ARCSPLIT_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path / "cache"))
    assert find_run(None) is None
    key = tmp_path / "key.txt"
    key.write_text("file-key-PLANTED-31337\n")
    run = tmp_path / "state" / "runs" / "20261202-000000-1"
    run.mkdir(parents=True)
    (run / "state.json").write_text(json.dumps({"processes": [{"argv": ["llama-server", "--api-key-file", str(key)]}],
                                                "mode": "rpc"}))
    (run / "server.log").write_text("srv: loaded key file-key-PLANTED-31337\n")
    env = {"HOME": str(tmp_path), "GGML_SYCL_DISABLE_OPT": "1", "SERVICE_TOKEN": "tok-PLANTED-777"}
    files = collect(None, ({"facts": {}}, "doctor text"), {"bin_dir": "/x"}, environ=env)
    assert set(files) >= {"run/20261202-000000-1/state.json", "run/20261202-000000-1/server.log", "doctor.json",
                          "doctor.txt", "build.json", "env.json", "system.json", "README.txt"}
    blob = "\n".join(files.values())
    assert "file-key-PLANTED" not in blob and "tok-PLANTED" not in blob and str(tmp_path) not in blob
    assert json.loads(files["env.json"]) == {"GGML_SYCL_DISABLE_OPT": "1"}
    with pytest.raises(BadInput):
        find_run("no-such-run")


def test_report_cli_bad_run_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    from arcsplit.cli import main

    monkeypatch.setenv("ARCSPLIT_STATE_DIR", str(tmp_path / "state"))
    assert main(["report", "no-such-run", "-o", str(tmp_path / "r.tar.gz")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no-such-run" in err and "arcsplit ps" in err
    assert not any(tmp_path.glob("r.tar.gz*"))
