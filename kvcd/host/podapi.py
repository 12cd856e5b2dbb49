"""The HTTP plumbing of kvcd.host.podman: requests to the podman API service through
podman-py's low-level ``APIClient``, their timeouts, and their errors typed for the daemon.

A pull, build or image load may take ``image_timeout`` seconds in all (checked at each line of
its output; a reply silent that long ends it too), and a stop may cut into the wait for it
(kvcd.host.interrupt). Everything else waits at most ``timeout`` for each reply.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar, cast

import requests
from podman.api import APIClient

from kvcd.host import interrupt
from kvcd.host.podtypes import (
    CHUNK,
    DEFAULT_URL,
    PodmanError,
    PodmanTimedOut,
    PodmanUnavailable,
)

C = TypeVar("C", bound="Client")


class Client:
    """The HTTP plumbing to one podman API service: timeouts, the time limit of a pull, build
    or image load, a stop cutting into a long wait, and typed errors. Cheap to construct;
    connects on first use."""

    def __init__(
        self, url: str = DEFAULT_URL, timeout: float = 30.0, image_timeout: float | None = None
    ) -> None:
        """``url``: ``unix:///path.sock`` (or any scheme podman-py takes); ``timeout``: seconds
        for connecting and for each reply. A pull, build or image load may take
        ``image_timeout`` seconds in all (None: no limit; a compile step may be silent for
        long): checked at each line of its output, and a reply silent for that long ends it
        too (PodmanTimedOut). Everything else is bounded by ``timeout``."""
        self.url = url
        self.timeout = timeout
        self.image_timeout = image_timeout
        try:
            self._api: Any = APIClient(base_url=url, timeout=timeout)
        except ValueError as exc:
            raise PodmanError(f"bad podman API URL {url!r}: {exc}") from exc

    @classmethod
    def from_env(cls: type[C], env: Mapping[str, str], timeout: float = 30.0) -> C:
        """The service named by CONTAINER_HOST in ``env`` (as the podman CLI does), else the
        default rootful socket."""
        return cls(env.get("CONTAINER_HOST") or DEFAULT_URL, timeout)

    def close(self) -> None:
        self._api.close()

    def __enter__(self: C) -> C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(
        self,
        method: str,
        path: str,
        what: str,
        *,
        stream: bool = False,
        deadline: float | None = None,
        **kwargs: Any,
    ) -> requests.Response:
        """One API request; transport failures become PodmanUnavailable. HTTP error statuses
        are returned for the caller to judge (see :meth:`_failure`). With a ``deadline``
        (:meth:`_deadline`), the reply may be as slow as ``image_timeout``."""
        kwargs["timeout"] = self.timeout if deadline is None else (self.timeout, self.image_timeout)
        try:
            if deadline is None:
                resp = getattr(self._api, method)(path, stream=stream, **kwargs)
            else:  # a long wait: a stop may cut in (kvcd.host.interrupt)
                with interrupt.allowed():
                    resp = getattr(self._api, method)(path, stream=stream, **kwargs)
        except requests.RequestException as exc:
            # podman-py wraps every OSError of the transport in an APIError without a response.
            self._check(deadline, what, exc)
            raise self._unavailable(what, exc) from exc
        # podman-py's APIResponse forwards every attribute to the requests.Response it wraps.
        return cast("requests.Response", resp)

    def _unavailable(self, what: str, exc: BaseException) -> PodmanUnavailable:
        cause: BaseException | None = exc
        while cause is not None and cause.__cause__ is not None:
            cause = cause.__cause__
        return PodmanUnavailable(f"podman API at {self.url} did not answer ({what}): {cause}")

    @staticmethod
    def _failure(
        what: str, resp: requests.Response, cls: type[PodmanError] = PodmanError
    ) -> PodmanError:
        return cls(f"{what}: {error_text(resp)}")

    def _deadline(self) -> float:
        """When a pull, build or image load starting now must be over (time.monotonic();
        infinity without an image_timeout). A request with a deadline, even that one, waits
        for its reply without the short ``timeout``."""
        return math.inf if self.image_timeout is None else time.monotonic() + self.image_timeout

    def _check(self, deadline: float | None, what: str, cause: Exception | None = None) -> None:
        """Raise PodmanTimedOut once `deadline` has passed (told by the clock, not by the
        kind of error: a read timeout and a closed stream look alike)."""
        if deadline is not None and time.monotonic() >= deadline:
            raise PodmanTimedOut(
                f"{what} did not finish within image_timeout = {self.image_timeout:g} s "
                "(kvcd.toml): kvcd disconnected"
            ) from cause

    def _lines(
        self, resp: requests.Response, what: str, deadline: float | None
    ) -> Iterator[dict[str, Any]]:
        """The JSON objects of a streamed reply, one per line, as they arrive, until
        `deadline`."""
        lines = resp.iter_lines()
        try:
            while True:
                with interrupt.allowed():  # a stop may cut into the wait for the next line
                    raw = next(lines, None)
                if raw is None:
                    return
                self._check(deadline, what)
                if not raw:
                    continue
                try:
                    obj = json.loads(raw)
                except ValueError:
                    obj = {"stream": raw.decode("utf-8", "replace") + "\n"}
                if isinstance(obj, dict):
                    yield obj
        except requests.RequestException as exc:
            self._check(deadline, what, exc)
            raise self._unavailable(what, exc) from exc

    def _chunks(self, resp: requests.Response, what: str) -> Iterator[bytes]:
        try:
            yield from resp.iter_content(CHUNK)
        except requests.RequestException as exc:
            raise self._unavailable(what, exc) from exc


def error_text(resp: requests.Response) -> str:
    """The service's own words from an error reply (first JSON object), else its text."""
    try:
        text = resp.text
    except requests.RequestException:
        return f"HTTP {resp.status_code}"
    first = text.strip().splitlines()[0] if text.strip() else ""
    try:
        body = json.loads(first)
    except ValueError:
        return f"HTTP {resp.status_code}: {first or 'no detail'}"
    if isinstance(body, dict):
        return str(body.get("message") or body.get("cause") or body)
    return str(body)
