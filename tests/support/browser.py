"""The real browser the page tests drive (the usage dashboard, the operator console): Debian's
Chromium through Playwright, and what a page asked for and what went wrong in it.

Needs `/usr/bin/chromium` (`apt-get install -y chromium`); without it a test fails, never skips.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from aiohttp.test_utils import TestServer
from playwright.async_api import Browser, ConsoleMessage, Page, Request, async_playwright

CHROMIUM = Path("/usr/bin/chromium")


def chromium() -> str:
    """Debian's Chromium, or the test fails saying how to install it (never a skip)."""
    if not CHROMIUM.exists():
        pytest.fail(f"the page tests drive Debian's Chromium, and {CHROMIUM} is missing: "
                    "install it with `apt-get install -y chromium` (as root)", pytrace=False)
    return str(CHROMIUM)


@asynccontextmanager
async def launched() -> AsyncIterator[Browser]:
    executable = chromium()
    async with async_playwright() as playwright:
        # Chromium refuses to run as root inside its sandbox.
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        browser = await playwright.chromium.launch(executable_path=executable, args=args)
        try:
            yield browser
        finally:
            await browser.close()


class Watched:
    """What a page asked for, and what went wrong in it."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.urls: list[str] = []
        self.errors: list[str] = []
        page.on("request", self._request)
        page.on("console", self._console)
        page.on("pageerror", lambda error: self.errors.append(f"page error: {error}"))

    def _request(self, request: Request) -> None:
        self.urls.append(request.url)

    def _console(self, message: ConsoleMessage) -> None:
        # An answer with an error status is logged as one; a CSP refusal or a script error
        # would be too, and those must not happen.
        if message.type == "error" and not message.text.startswith("Failed to load resource"):
            self.errors.append(message.text)

    def assert_stayed_home(self, gateway: TestServer, secret: str) -> None:
        """Every request went to the gateway, none with `secret` in its URL; nothing failed."""
        home = urlsplit(str(gateway.make_url("/")))
        for url in self.urls:
            parts = urlsplit(url)
            assert (parts.scheme, parts.netloc) == (home.scheme, home.netloc), url
            assert secret not in url, "the key went into a URL"
        assert self.errors == []


class Markup(HTMLParser):
    """A page's scripts, the links it names, and anything inline (which its policy forbids)."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[tuple[str | None, bool]] = []  # (src, has inline text)
        self.links: list[str] = []
        self.inline: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        self.inline += [f"{tag} {name}" for name in found if name.startswith("on")
                        or name == "style"]
        if tag == "style":
            self.inline.append("<style>")
        if tag == "script":
            self.scripts.append((found.get("src"), False))
            self._in_script = True
        for name in ("src", "href", "action"):
            if found.get(name):
                self.links.append(str(found[name]))

    def handle_endtag(self, tag: str) -> None:
        self._in_script = self._in_script and tag != "script"

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.scripts[-1] = (self.scripts[-1][0], True)
