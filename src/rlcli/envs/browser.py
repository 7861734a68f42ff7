"""Headless Chromium for envs that drive web pages (the `miniwob:` adapter): one browser per process.

- The binary: the file RLCLI_CHROMIUM names, else the first of BROWSERS on the PATH. Without one,
  `find_chromium` says in one sentence how to install it (INSTALL_HINT).
- One browser per process that plays episodes (the main process with env.workers 0, else each env
  worker), started by the first page asked for and reused by every episode after it, each episode
  in a browser context of its own (no cookies, storage or history shared). A browser that died is
  started again by the next call; envs whose pages it held fail their next call, saying so.
- It runs on a thread of its own that owns it: playwright's sync API must be used from the thread
  that started it, and env calls come from several (with env.workers 0 each runs in a thread of its
  own, under env.step_timeout_s). `Chromium.run(fn, timeout_s)` runs fn(browser) there.
- A call that outlasts its time limit (a page stuck in a script) kills the browser, which ends the
  call with an error on that thread; the call fails with `PageTimeout` and the next one starts a
  fresh browser. The limit counts from when the call's turn comes with a browser running: starting
  Chromium has START_TIMEOUT_S of its own, since on a loaded machine a start can outlast a page
  limit of a second, and each call would then kill the browser it was waiting for.
- rlcli starts Chromium itself, under its process supervisor (envs/subprocesses.py), in this process's
  process group, and playwright connects to it over the DevTools protocol. (playwright's own launch
  puts the browser in a session of its own, out of reach of an env worker's process group.) So the
  browser and its child processes die with the thread that started it: with its process killed -9,
  and with its env worker (killed as a process group past env.step_timeout_s, or by its watcher when
  the worker dies).
- Its profile is a temporary folder, removed when the process exits normally, and by the supervisor
  when the process is killed; folders left otherwise (a supervisor killed -9 itself) are removed by
  the next browser started on the machine.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import os
import queue
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from rlcli.envs.subprocesses import Supervision, die_with_parent, scratch_folder
from rlcli.errors import UsageError

_T = TypeVar("_T")
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_HINT = (
    "make browser (Debian and Ubuntu: sudo apt-get install chromium), or set RLCLI_CHROMIUM to a Chromium binary"
)
# --no-sandbox: the sandbox cannot start as root (containers, CI); a container's /dev/shm is often 64 MB.
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-breakpad",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--mute-audio",
    "--hide-scrollbars",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",  # the port Chromium picks is written to DevToolsActivePort
]
START_TIMEOUT_S = 60.0
# Chromium puts a unix socket in $TMPDIR/org.chromium.Chromium.XXXXXX/ and aborts at start when the path
# outgrows a socket address (108 bytes): a longer profile path gives it /tmp instead.
MAX_TMPDIR_CHARS = 60
PROFILE_PREFIX = "rlcli-chromium-"
PROFILE_REMOVAL_S = 10.0
_STDERR_TAIL_CHARS = 600


class PageTimeout(Exception):
    """A browser call outlasted its time limit; the browser was killed and starts afresh next time."""


class BrowserGone(Exception):
    """The browser a page lived in has died or was replaced since the page was opened."""


def find_chromium() -> str:
    """The Chromium binary to drive, or one sentence (UsageError) naming the install command."""
    chosen = os.environ.get("RLCLI_CHROMIUM")
    if chosen:
        if not (os.path.isfile(chosen) and os.access(chosen, os.X_OK)):
            raise UsageError(f"RLCLI_CHROMIUM={chosen} is not an executable file; unset it or name a Chromium binary.")
        return chosen
    found = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    if found is None:
        raise UsageError(
            f"No Chromium browser found ({', '.join(BROWSERS)} on the PATH) for the web envs: install it with "
            f"{INSTALL_HINT}."
        )
    return found


@dataclass
class _Job:
    """fn(browser) for the browser's thread; launch: start a browser for it when none is running (else
    it is dropped: closing a page of a browser that is gone). started is set once fn begins (or the job
    ended without it)."""

    fn: Callable[[Any], Any]
    launch: bool
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    started: threading.Event = field(default_factory=threading.Event)


class Chromium:
    """This process's headless Chromium, owned by one thread; see the module docstring."""

    def __init__(self, executable: str):
        self.executable = executable
        self.pid = os.getpid()  # a forked child must never kill its parent's browser
        self.generation = 0  # how many browsers this process has started: a page remembers its own
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()  # None stops the thread
        self.process: subprocess.Popen | None = None
        self.profile: str | None = None
        self.browser: Any = None
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._serve, name="rlcli-chromium", daemon=True)
        self.thread.start()

    def run(self, fn: Callable[[Any], _T], timeout_s: float) -> _T:
        """fn(the playwright Browser), on the browser's thread, waited for up to timeout_s from when it
        starts (a browser started for it first, within START_TIMEOUT_S)."""
        job = _Job(fn, launch=True)
        self.jobs.put(job)
        try:
            # Its turn (after the jobs queued before it) and a browser's start are bounded apart: a start
            # waits for Chromium's port up to START_TIMEOUT_S, and playwright's connection as long.
            job.started.wait(2 * START_TIMEOUT_S + timeout_s)
            return job.future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            self.kill()  # the stuck call ends with an error on the browser's thread
            with contextlib.suppress(Exception):
                job.future.result(30)
            raise PageTimeout(
                f"the browser did not answer within {timeout_s:g}s (a page stuck in a script?); it was killed, "
                "and the next episode starts a fresh one"
            ) from None

    def submit(self, fn: Callable[[Any], Any]) -> None:
        """fn(browser) on the browser's thread if a browser is running, not waited for (closing an
        episode's page)."""
        self.jobs.put(_Job(fn, launch=False))

    def kill(self) -> None:
        """SIGKILL the browser (its child processes follow it); the next call starts a new one."""
        with self.lock:
            process = self.process
        if process is not None and os.getpid() == self.pid and process.poll() is None:
            with contextlib.suppress(OSError):
                process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)  # reaped: the browser's thread sees it gone

    def close(self) -> None:
        """Kill the browser and remove its profile (at exit)."""
        if os.getpid() != self.pid:
            return
        self.kill()
        with self.lock:
            process, profile = self.process, self.profile
        if process is not None:
            with contextlib.suppress(Exception):
                process.wait(10)
        if profile:
            _remove_profile(profile)

    # --- the browser's thread ---------------------------------------------------------

    def _serve(self) -> None:
        from playwright.sync_api import sync_playwright

        playwright = None
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                if playwright is None:
                    playwright = sync_playwright().start()
                if job.launch or self._running():
                    browser = self._browser(playwright)
                    job.started.set()
                    job.future.set_result(job.fn(browser))
            except BaseException as exc:  # the caller's to report
                job.future.set_exception(exc)
            finally:
                job.started.set()

    def _browser(self, playwright: Any) -> Any:
        """The running browser, started (again) when there is none or it died."""
        if self._running():
            return self.browser
        self._stop()
        port = self._launch()
        try:
            self.browser = playwright.chromium.connect_over_cdp(
                f"http://127.0.0.1:{port}", timeout=START_TIMEOUT_S * 1000
            )
        except Exception:
            self._stop()
            raise
        self.generation += 1
        return self.browser

    def _running(self) -> bool:
        alive = self.process is not None and self.process.poll() is None
        return self.browser is not None and alive and self.browser.is_connected()

    def _launch(self) -> int:
        """Start Chromium (a parent-death signal ties it to this thread) and return its DevTools port."""
        profile = str(scratch_folder(PROFILE_PREFIX))
        log = Path(profile) / "stderr.log"
        # Its supervisor removes the profile if this process is killed (-9 too) while the browser runs.
        argv = die_with_parent(
            [self.executable, *ARGS, f"--user-data-dir={profile}", "about:blank"], Supervision(remove=profile)
        )
        env = dict(os.environ)
        # Chromium's singleton socket goes in $TMPDIR, and a long path aborts it. In the profile, it is
        # removed with it, also when Chromium is killed.
        if len(profile) <= MAX_TMPDIR_CHARS:
            env["TMPDIR"] = profile
        elif os.access("/tmp", os.W_OK):
            env["TMPDIR"] = "/tmp"
        with open(log, "wb") as err:  # a file, never a pipe nobody reads (a full pipe would block it)
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env=env)
        with self.lock:
            self.process, self.profile = process, profile
        port_file = Path(profile) / "DevToolsActivePort"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(
                    f"Chromium ({self.executable}) exited with status {process.returncode} as it started: {_tail(log)}"
                )
            with contextlib.suppress(OSError, ValueError, IndexError):
                return int(port_file.read_text().split()[0])
            time.sleep(0.02)
        self._stop()
        raise RuntimeError(f"Chromium ({self.executable}) did not start within {START_TIMEOUT_S:g}s: {_tail(log)}")

    def _stop(self) -> None:
        """Forget the browser; kill its process and remove its profile."""
        if self.browser is not None:
            with contextlib.suppress(Exception):
                self.browser.close()
            self.browser = None
        self.kill()
        with self.lock:
            process, profile = self.process, self.profile
            self.process = self.profile = None
        if process is not None:
            with contextlib.suppress(Exception):
                process.wait(10)
        if profile:
            _remove_profile(profile)


def _remove_profile(profile: str) -> None:
    """Remove a profile folder. Chromium's helper processes outlive its main one by a moment and may still
    write into it while it is removed (the removal then fails on a folder that is not empty): try again
    for a few seconds."""
    deadline = time.monotonic() + PROFILE_REMOVAL_S
    shutil.rmtree(profile, ignore_errors=True)
    while os.path.exists(profile) and time.monotonic() < deadline:
        time.sleep(0.1)
        shutil.rmtree(profile, ignore_errors=True)


def _tail(log: Path) -> str:
    try:
        text = log.read_text(errors="replace").strip()
    except OSError:
        return "no output"
    return text[-_STDERR_TAIL_CHARS:] or "no output"


_shared: Chromium | None = None
_shared_lock = threading.Lock()


def shared_chromium() -> Chromium:
    """This process's one browser host (started at its first call, after a fork too)."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared.thread.ident is None or not _shared.thread.is_alive():
            _shared = Chromium(find_chromium())
            atexit.register(_shared.close)
        return _shared


def _forget_after_fork() -> None:
    global _shared, _shared_lock
    _shared, _shared_lock = None, threading.Lock()  # a forked child has neither the thread nor the browser


os.register_at_fork(after_in_child=_forget_after_fork)
