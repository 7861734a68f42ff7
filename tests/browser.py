"""Headless Chromium for tests: playwright driving the machine's own Chromium or Chrome.

`playwright install` downloads its browser builds from a CDN, which these machines cannot reach, so
the tests launch the system binary instead: Debian's `chromium`, which `make install` installs when
it can (the Makefile's `browser` target), or any of BROWSERS on the PATH, or the file that
RLCLI_CHROMIUM names. Without one, a test that asks for a browser skips and says why.

    from browser import chromium  # noqa: F401 (a fixture)

    def test_page(chromium, tmp_path):
        with open_page(chromium, tmp_path / "page.html") as (page, problems):
            ...
            assert problems.all() == []

`chromium` is a fixture (one browser per test module); `launch_chromium()` is the same as a context
manager, for code that is not a test.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# As root (CI containers) Chromium's sandbox cannot start; a container's /dev/shm is often 64 MB.
ARGS = ["--no-sandbox", "--disable-dev-shm-usage"]


def chromium_executable() -> str | None:
    """The browser binary to drive: RLCLI_CHROMIUM, else the first of BROWSERS on the PATH."""
    chosen = os.environ.get("RLCLI_CHROMIUM")
    if chosen:
        return chosen
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def require_chromium() -> str:
    path = chromium_executable()
    if path is None:
        pytest.skip(
            f"no Chromium binary ({', '.join(BROWSERS)} on the PATH, or RLCLI_CHROMIUM): `make install` installs "
            "Debian's chromium as root, or run `apt-get install chromium`"
        )
    return path


@contextmanager
def launch_chromium(**options: Any) -> Iterator[Any]:
    """A headless playwright Browser on the system Chromium (skips the test without one)."""
    from playwright.sync_api import sync_playwright

    path = require_chromium()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=path, headless=True, args=ARGS, **options)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    """One headless Chromium (a playwright Browser) for the test module."""
    with launch_chromium() as browser:
        yield browser


@dataclass
class Problems:
    """What went wrong while a page loaded and ran: console errors, uncaught exceptions, requests that
    failed or answered 4xx/5xx, and requests off the machine (blocked unless the page was opened with
    network=True)."""

    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    network_requests: list[str] = field(default_factory=list)

    def all(self) -> list[str]:
        return [
            *(f"console error: {m}" for m in self.console_errors),
            *(f"page error: {m}" for m in self.page_errors),
            *(f"failed request: {m}" for m in self.failed_requests),
            *(f"network request: {m}" for m in self.network_requests),
        ]


def watch(page: Any, network: bool = False) -> Problems:
    """Record a page's problems from now on; unless `network`, every http(s) or ws(s) request is
    answered with a failure (and recorded), so a test proves a page self-contained and never waits
    on the network."""
    problems = Problems()
    page.on("console", lambda msg: problems.console_errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: problems.page_errors.append(str(exc)))
    page.on("requestfailed", lambda req: problems.failed_requests.append(f"{req.url[:200]} ({req.failure})"))
    page.on(
        "response",
        lambda resp: (
            problems.failed_requests.append(f"{resp.url[:200]} (HTTP {resp.status})") if resp.status >= 400 else None
        ),
    )
    if not network:

        def refuse(route: Any) -> None:
            problems.network_requests.append(route.request.url[:200])
            route.abort("internetdisconnected")

        page.route("http*://**", refuse)
        page.route("ws*://**", refuse)
    return problems


@contextmanager
def open_page(
    browser: Any, target: Path | str, network: bool = False, **context: Any
) -> Iterator[tuple[Any, Problems]]:
    """A new page, in a browser context of its own (`context`: options such as viewport) that closes
    after the block, watched from before it loads `target` (a file path or a URL), with its problems.
    The page's load event has fired: its images are decoded, or have failed."""
    ctx = browser.new_context(**context)
    try:
        page = ctx.new_page()
        problems = watch(page, network)
        page.goto(Path(target).resolve().as_uri() if isinstance(target, Path) else target, wait_until="load")
        yield page, problems
    finally:
        ctx.close()
