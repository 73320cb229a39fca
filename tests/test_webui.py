"""What a newcomer meets at the served URL, in a real headless browser (Debian's chromium + chromedriver, driven
by selenium): llama.cpp's web UI built beside the managed build, a chat sent from it answered through the split
by the chat demo model; and, where the UI is not built, the page that says how to get it, whose completion form
also round-trips. ``GET /`` is never a 404."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _instance import isolated_env  # noqa: E402

from arcsplit.demo import ensure_chat_model  # noqa: E402
from arcsplit.llama import webui  # noqa: E402
from arcsplit.llama.patches import MARKER  # noqa: E402
from arcsplit.proc.ports import free_port  # noqa: E402
from _procs import wait_until  # noqa: E402

SHOTS = Path(os.environ.get("ARCSPLIT_SCREENSHOTS", "")) if os.environ.get("ARCSPLIT_SCREENSHOTS") else None


def test_serve_dir_is_the_ui_beside_arcsplits_build_else_the_page_else_nothing(tmp_path):
    bin_dir = tmp_path / "build-cpu-x" / "bin"
    bin_dir.mkdir(parents=True)
    assert webui.serve_dir(bin_dir) is None  # not built by arcsplit: it keeps its own UI
    (bin_dir / MARKER).write_text("stock\n")
    assert webui.serve_dir(bin_dir) == str(webui.FALLBACK_DIR)
    assert "arcsplit llama build" in (webui.FALLBACK_DIR / "index.html").read_text()
    assert "never built" in webui.missing_reason(tmp_path)
    (tmp_path / "ui").mkdir()
    (tmp_path / "ui" / "index.html").write_text("<html></html>")
    assert webui.serve_dir(bin_dir) == str(tmp_path / "ui") and webui.missing_reason(tmp_path) is None


def test_without_node_the_build_says_why_and_serve_can_repeat_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ARCSPLIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    steps = []
    reason = webui.build_ui(lambda step, pct: steps.append(step))
    assert reason and "Node.js and npm are not installed" in reason and "apt-get install nodejs npm" in reason
    assert webui.missing_reason() == reason and not steps  # nothing was started
    assert not webui.ui_dir().exists()


def test_llama_server_gets_the_ui_dir_before_the_users_args():
    from test_specs import config, specs_for

    server = next(s for s in specs_for(config("cpu", "rpc", [0, 1], ui_dir="/ui", extra_args=("--path", "/mine")))
                  if s.role == "server")
    assert server.argv[-4:] == ("--path", "/ui", "--path", "/mine")  # llama.cpp takes the last one: the user's


def serve(model: Path, llama_dir: Path) -> tuple[subprocess.Popen, str, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "arcsplit", "serve", str(model), "--backend", "cpu", "--gpus",
                             "0,1", "--ctx", "2048", "--threads", "1", "--port", str(port), "--llama-dir",
                             str(llama_dir), "--", "--temp", "0"],  # greedy, as `arcsplit demo` runs it
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "serving" not in line:
        proc.kill()
        pytest.fail(f"serve did not start: {line} {proc.stderr.read()[-2000:]}")
    return proc, f"http://127.0.0.1:{port}", line


def stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    return err


@pytest.fixture(scope="module")
def chat_model() -> Path:
    return ensure_chat_model()


@pytest.fixture
def browser(tmp_path) -> Iterator[object]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("no chromium/chromedriver (Debian: apt-get install chromium chromium-driver; scripts/_env.sh "
                    "installs them when run as root)")
    webdriver = pytest.importorskip("selenium.webdriver")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,900", f"--user-data-dir={tmp_path / 'profile'}"):
        opts.add_argument(arg)
    b = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=driver))
    b.set_page_load_timeout(60)
    try:
        yield b
    finally:
        b.quit()


def shoot(browser, tmp_path: Path, name: str) -> Path:
    path = (SHOTS or tmp_path) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(path))
    return path


@pytest.mark.slow
def test_managed_build_serves_llamas_ui_and_a_chat_round_trips(browser, tmp_path, llama_bins, chat_model):
    reason = webui.missing_reason(webui.root_of(llama_bins.bin_dir))
    if reason:
        pytest.skip(f"llama.cpp's web UI is not built here: {reason}")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    with isolated_env(tmp_path, llama_bins.bin_dir):
        proc, url, _ = serve(chat_model, llama_bins.bin_dir)
        try:
            r = httpx.get(url + "/", timeout=10)
            assert r.status_code == 200 and "_app/immutable" in r.text  # the SvelteKit UI, not the fallback
            browser.get(url + "/")
            box = wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "textarea"), 60, "the chat input")[0]
            box.send_keys("Name the capital of France.")
            box.send_keys(Keys.ENTER)
            wait_until(lambda: "Paris" in browser.find_element(By.TAG_NAME, "body").text, 120, "an answer with Paris")
            shot = shoot(browser, tmp_path, "webui-chat")
        finally:
            stop(proc)
    assert shot.stat().st_size > 10_000


@pytest.mark.slow
def test_without_the_ui_the_page_says_how_and_completes(browser, tmp_path, llama_bins, chat_model):
    """A build of arcsplit's with no UI beside it (the same binaries, seen from a fresh root)."""
    from selenium.webdriver.common.by import By

    bare = tmp_path / "root" / "build-cpu-bare" / "bin"
    bare.parent.mkdir(parents=True)
    bare.symlink_to(llama_bins.bin_dir, target_is_directory=True)
    with isolated_env(tmp_path, bare):
        proc, url, _ = serve(chat_model, bare)
        try:
            r = httpx.get(url + "/", timeout=10)
            assert r.status_code == 200 and "arcsplit llama build" in r.text
            browser.get(url + "/")
            browser.find_element(By.ID, "prompt").clear()
            browser.find_element(By.ID, "prompt").send_keys("The capital of France is")
            browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
            out = wait_until(lambda: (t := browser.find_element(By.ID, "out").text) not in ("", "…") and t, 60,
                           "the completion")
            shoot(browser, tmp_path, "webui-fallback")
        finally:
            err = stop(proc)
    assert "Paris" in out
    assert "web UI is not built" in err
