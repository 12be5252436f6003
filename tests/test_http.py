"""The blocking HTTP helper on aiohttp (base/http.py), against a real HTTP server in a child process:
bodies and statuses, an error that names the URL with its credentials masked, a closed port reported
as an OSError, and a call made from inside a running event loop."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollway.base.http import HttpError, http_get, http_ok, http_post
from rollway.base.process import Child, free_port


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    """`python -m http.server` over a folder with one file: GET works, POST answers 501."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "hello.txt").write_text("hello")
    port = free_port()
    child = Child([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                   "--directory", str(tmp_path / "site")], tmp_path / "http.out", name="the test server").start()
    try:
        child.wait_for_http(f"http://127.0.0.1:{port}/hello.txt", timeout_s=60)
        yield f"http://127.0.0.1:{port}"
    finally:
        child.stop()


def test_get_reads_the_body(server: str) -> None:
    response = http_get(f"{server}/hello.txt")
    assert (response.status, response.text) == (200, "hello")
    assert http_ok(f"{server}/hello.txt") and not http_ok(f"{server}/missing")


def test_a_refused_status_names_the_url_with_credentials_masked(server: str) -> None:
    url = server.replace("http://", "http://user:hunter2secret@") + "/hello.txt"
    with pytest.raises(HttpError, match=r"POST http://\*\*\*@127.0.0.1:\d+/hello.txt answered 501") as err:
        http_post(url, {"x": 1})
    assert err.value.status == 501 and "hunter2secret" not in str(err.value)


def test_a_closed_port_is_an_oserror() -> None:
    with pytest.raises(OSError, match="failed"):
        http_get(f"http://127.0.0.1:{free_port()}/health", timeout_s=5)
    assert not http_ok(f"http://127.0.0.1:{free_port()}/health")


def test_callable_from_inside_a_running_event_loop(server: str) -> None:
    async def inside() -> str:
        return http_get(f"{server}/hello.txt").text

    assert asyncio.run(inside()) == "hello"
