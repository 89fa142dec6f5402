"""A JupyterLab server of our own on 127.0.0.1 and the chromium that drives it (Playwright): for the
browser tests and the browser benchmark. Stopped by its PID, with every process it started. Also what
they read of the page (`SNAPSHOT_JS`, `LARGE_JS`) and where they leave their screenshots (`ARTIFACTS`)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from tests.support.processes import wait_gone

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SERVER_START_SECONDS = 60.0
VIEWPORT = {"width": 1200, "height": 1300}
# the screenshots of the browser tests (tests/test_browser.py, tests/test_jupyterhub.py), at the repository root
ARTIFACTS = Path(__file__).resolve().parent.parent.parent / "test-artifacts"


def missing_requirement() -> str | None:
    if not CHROMIUM.exists():
        return f"no chromium at {CHROMIUM} (apt-get install chromium; .ci/install does)"
    for module, package in (("jupyterlab", "jupyterlab"), ("playwright", "playwright")):
        if importlib.util.find_spec(module) is None:
            return f"{package} is not installed (pip install -e '.[test]')"
    return None


@dataclass
class Lab:
    url: str
    token: str
    root: Path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def jupyterlab(base: Path) -> Iterator[Lab]:
    """A JupyterLab server whose root is `base`/root, its settings and runtime files under `base`."""
    root = base / "root"
    settings = base / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    root.mkdir()
    # no news and no update checks: nothing leaves the machine, no toast over the screenshots
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false", "checkForUpdates": false}')
    port, token = free_port(), secrets.token_hex(16)
    # the kernels listen on unix sockets beside their connection files (TCP ports picked free may be
    # taken by another process before a kernel binds them, under a parallel run): a short folder,
    # since a socket's path must fit 108 bytes and pytest's tmp_path may not leave that
    runtime = tempfile.mkdtemp(prefix="lab-runtime-")
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(base / "config"),
        "JUPYTER_RUNTIME_DIR": runtime,
        "JUPYTERLAB_SETTINGS_DIR": str(base / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(base / "workspaces"),
    }
    log = (base / "server.log").open("w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            "--ServerApp.allow_root=True",
            "--KernelManager.transport=ipc",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    started: set[int] = {server.pid}
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + SERVER_START_SECONDS
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"JupyterLab did not start: {(base / 'server.log').read_text()[-2000:]}"
                    ) from None
                time.sleep(0.2)
        yield Lab(url, token, root)
    finally:
        # the kernel and the world's ranks are the server's descendants: ours to clean up
        try:
            started.update(child.pid for child in psutil.Process(server.pid).children(recursive=True))
        except psutil.Error:
            pass
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
        for pid in wait_gone(sorted(started), 15):
            os.kill(pid, signal.SIGKILL)
        log.close()
        shutil.rmtree(runtime, ignore_errors=True)
        assert wait_gone(sorted(started), 5) == [], "processes of the JupyterLab session outlived it"


def launch_chromium(playwright: Any, profile: Path, cpus: Sequence[int] | None = None) -> Any:
    """Debian's chromium, headless, with a fresh user-data-dir `profile` (no cookie, no history);
    with `cpus`, its processes run on those CPUs only (a browser on a machine of its own)."""
    executable = CHROMIUM
    if cpus is not None:
        executable = profile.parent / "chromium-on-its-cpus"
        executable.write_text(f'#!/bin/sh\nexec taskset -c {",".join(map(str, cpus))} {CHROMIUM} "$@"\n')
        executable.chmod(0o700)
    return playwright.chromium.launch_persistent_context(
        str(profile), executable_path=str(executable), headless=True, args=CHROMIUM_ARGS, viewport=VIEWPORT
    )


def run_all_cells(page: Any) -> None:
    """Once the notebook's kernel is idle, JupyterLab's Run > Run All Cells."""
    page.get_by_text("Python 3 (ipykernel) | Idle").wait_for(timeout=60_000)
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()


def watch_page(
    page: Any,
    script: str,
    until: str,
    seconds: float,
    pause_ms: int,
    picture: Path | None = None,
    on_sample: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every sample of `script` (a function returning the page's "text" and "errors", among others),
    taken every `pause_ms` until the text holds `until` or an error shows. Past `seconds`: a picture
    of the page to `picture`, and TimeoutError with the last sample."""
    samples: list[dict[str, Any]] = []
    deadline = time.monotonic() + seconds
    while True:
        sample = page.evaluate(script)
        samples.append(sample)
        if on_sample is not None:
            on_sample(sample)
        if until in sample["text"] or sample["errors"]:
            return samples
        if time.monotonic() > deadline:
            if picture is not None:
                page.screenshot(path=picture, full_page=True)
            raise TimeoutError(f"the notebook did not finish in {seconds:g} s; last page state: {sample}")
        page.wait_for_timeout(pause_ms)


def wait_until_drawn(page: Any, condition: str, seconds: float) -> bool:
    """Poll `condition` (a function returning true once the page drew what it should) for up to
    `seconds`; whether it came true. Past the time the caller's checks read the page as it is, and
    say what is missing."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(condition, timeout=seconds * 1000, polling=100)
    except PlaywrightTimeout:
        return False
    return True


def notebook_text(cells: Sequence[str]) -> str:
    """A notebook of these code cells for the default Python kernel, as a file holds it (without a
    kernelspec, JupyterLab asks which kernel to start and the notebook never runs)."""
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    kernelspec = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    return str(
        nbformat.writes(new_notebook(cells=[new_code_cell(c) for c in cells], metadata={"kernelspec": kernelspec}))
    )


# what the page shows: the live view's bars and curves, the other plots, any error
SNAPSHOT_JS = """() => {
  const live = document.querySelector('.ddp-live');
  const plot = live && live.querySelector('.js-plotly-plot');
  const plots = Array.from(document.querySelectorAll('.js-plotly-plot'));
  return {
    views: document.querySelectorAll('.ddp-live').length,
    traces: plot && plot.data ? plot.data.map(t => [t.meta, t.name, t.x ? t.x.length : 0]) : [],
    bars: live ? Array.from(live.querySelectorAll('.ddp-bar')).map(b => ({
      label: b.innerText,
      width: b.querySelector('.progress-bar').style.width,
      done: b.classList.contains('ddp-bar-done'),
    })) : [],
    otherPlots: plots.filter(p => !p.closest('.ddp-live')).map(p => (p.data || []).map(t => t.type)),
    // the drawn bars of each lane of a profile's timeline (plotly draws a path per bar)
    profileLanes: plots.filter(p => !p.closest('.ddp-live') && (p.data || []).some(t => t.name === 'compute'))
      .map(p => [...new Set(p.data.flatMap(t => Array.from(t.y || [])))].sort()
        .concat([p.querySelectorAll('.barlayer .point path').length])),
    otherBars: Array.from(document.querySelectorAll('.widget-hprogress'))
      .filter(p => !p.closest('.ddp-live'))
      .map(p => [p.parentElement.innerText, p.querySelector('.progress-bar').style.width]),
    status: live ? (live.querySelector('.ddp-status') || {}).innerText || '' : '',
    steps: live ? (live.querySelector('.ddp-steps') || {}).innerText || '' : '',
    errors: Array.from(document.querySelectorAll('.jp-OutputArea-output'))
      .map(o => o.innerText)
      .filter(t => /Traceback|Error displaying widget|Failed to load model|Error:/.test(t)),
    text: document.querySelector('.jp-Notebook') ? document.querySelector('.jp-Notebook').innerText : '',
    prompts: Array.from(document.querySelectorAll('.jp-InputPrompt')).map(p => p.innerText.trim()),
    // plotly.js being imported (or imported) by the page, once per plotly version
    plotlyLoading: Boolean(globalThis.__ddpNotebookPlotly && globalThis.__ddpNotebookPlotly.size),
  };
}"""
# what the page shows of a large world's aggregate view, and the frame gaps recorded since FRAMES_JS ran
LARGE_JS = """() => {
  const live = document.querySelector('.ddp-large');
  const plots = live ? Array.from(live.querySelectorAll('.js-plotly-plot')) : [];
  const main = plots.find(p => !p.closest('.ddp-heat'));
  const heat = plots.find(p => p.closest('.ddp-heat'));
  return {
    shown: !!live,
    bars: live ? Array.from(live.querySelectorAll('.ddp-bar')).map(b => b.innerText) : [],
    traces: main && main.data ? main.data.map(t => [t.name, t.visible, t.x ? t.x.length : 0]) : [],
    heat: heat && heat.data ? heat.data.map(t => [t.type, t.y ? t.y.length : 0,
      t.z ? Array.from(t.z).flatMap(row => Array.from(row)).filter(v => v !== null && !isNaN(v)).length : 0]) : [],
    heatCells: heat ? heat.querySelectorAll('.hm image, .heatmaplayer image').length : 0,
    status: live ? (live.querySelector('.ddp-status') || {}).innerText || '' : '',
    gaps: window.__frameGaps || [],
    text: document.querySelector('.jp-Notebook') ? document.querySelector('.jp-Notebook').innerText : '',
    errors: Array.from(document.querySelectorAll('.jp-OutputArea-output')).map(o => o.innerText)
      .filter(t => /Traceback|Error displaying widget|Failed to load model|Error:/.test(t)),
  };
}"""
