"""The Kubernetes node backend, through the official `kubernetes` client (imported lazily).

Credentials: a kubeconfig path (settings `kubeconfig`) or the in-cluster service account. The
node name comes from settings, $KVCD_NODE_NAME or the hostname (backend.node_name).

- Read: GET /api/v1/nodes/<name>.
- Write: JSON merge patch of kvcd's own annotation keys only, carrying the resourceVersion of the
  read it was computed from: a concurrent writer (another `kvcd@` process on the node) makes it
  409 Conflict, and the update is recomputed from a fresh read. 429, 5xx and connection errors
  are retried with capped exponential backoff; when the attempts run out the call raises
  `Unavailable` and the daemon keeps its modules and retries later. A 401 or 403 is not retried
  here: `Refused` (an Unavailable) says which credentials or which RBAC permission it lacks.
- Watch: list+watch of the one node (fieldSelector metadata.name) from the last resourceVersion;
  410 Gone -> re-list; dropped connections -> back off and resume.
- Events: core/v1 Events about the Node in namespace "default", correlated as the kubelet does
  (kvcd/core/nodeevents.py): the same reason, type and message again PATCHes the existing
  Event's count and lastTimestamp; a token bucket caps the rate.

Responses are read as raw JSON (`_preload_content=False`), so kvcd depends on the API's wire
format, not on the generated model classes of one client version.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

from kvcd.core import nodeevents
from kvcd.host import pylibs
from kvcd.node.backend import (
    Backend,
    Failing,
    NodeView,
    Patch,
    Refused,
    Unavailable,
    changes,
    string_map,
)

log = logging.getLogger(__name__)
# A dropped connection or two is routine (debug); this many failures in a row are said once in
# the journal at WARNING, and the recovery after them at INFO.
WATCH_WARN_AFTER = 3
RETRYING = "; retrying with back-off"

RETRY_STATUS = frozenset({409, 429, 500, 502, 503, 504})
EVENTS_NAMESPACE = "default"
COMPONENT = "kvcd"
_VERBS = {"GET": "get", "PATCH": "patch", "POST": "create"}  # a request's RBAC verb


def refusal(status: int, verb: str, resource: str) -> str:
    """What a 401 or 403 means, said with it: neither fixes itself ("" for other statuses)."""
    if status == 401:
        return " (the API server does not accept kvcd's credentials: its kubeconfig)"
    if status == 403:
        return (
            f" (no permission: kvcd's RBAC does not let it {verb} {resource}; "
            "packaging/kubernetes/rbac.yaml)"
        )
    return ""


class KubeBackend(Backend):
    kind = "kubernetes"

    def __init__(
        self,
        name: str,
        *,
        kubeconfig: str | None = None,
        attempts: int = 5,
        first_delay: float = 0.5,
        max_delay: float = 8.0,
        watch_timeout: int = 300,
        request_timeout: float = 30.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.name = name
        self.kubeconfig = kubeconfig
        self.attempts = attempts
        self.first_delay = first_delay
        self.max_delay = max_delay
        self.watch_timeout = watch_timeout
        self.request_timeout = request_timeout
        self.sleep = sleep
        self._api: Any = None
        self._uid = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: Any = None
        self._events = nodeevents.Correlator(name)
        self._dropping = False

    def hurry(self, timeout: float) -> None:
        self.attempts = 1
        self.request_timeout = min(self.request_timeout, timeout)

    # --- client ----------------------------------------------------------------------------
    def api(self) -> Any:
        if self._api is not None:
            return self._api
        try:
            from kubernetes import client, config
        except ImportError as exc:  # `kvcd run` refuses this at start; `kvcd label` gets here
            raise Unavailable(
                f'node_backend = "kubernetes" needs {pylibs.KUBERNETES.named()}: {exc}'
            ) from None
        cfg = client.Configuration()
        try:
            if self.kubeconfig:
                config.load_kube_config(  # type: ignore[no-untyped-call]
                    config_file=self.kubeconfig, client_configuration=cfg
                )
            else:
                config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        except Exception as exc:  # ConfigException, missing files, bad YAML
            raise Unavailable(f"no Kubernetes credentials: {exc}") from None
        cfg.retries = 0  # retries are ours (backoff, re-read on conflict)
        self._api = client.CoreV1Api(client.ApiClient(cfg))
        return self._api

    def _delay(self, attempt: int) -> float:
        return min(self.max_delay, self.first_delay * 2.0**attempt)

    def _call(
        self,
        what: str,
        fn: Callable[[], Any],
        *,
        conflict_ok: bool = False,
        absent_ok: bool = False,
    ) -> Any:
        """fn() with retries on 409/429/5xx and connection errors; the parsed JSON body.
        With `conflict_ok`, a 409 is returned to the caller as None (it re-reads); with
        `absent_ok`, a 404 is."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        last = ""
        for attempt in range(self.attempts):
            try:
                resp = fn()
                data = resp.data if hasattr(resp, "data") else resp
                obj = json.loads(data) if isinstance(data, (bytes, str)) else data
            except ValueError as exc:  # a 200 that is not JSON: a proxy's page, another server
                raise Unavailable(f"{what}: the answer is not JSON ({exc})") from None
            except ApiException as exc:
                if (exc.status == 409 and conflict_ok) or (exc.status == 404 and absent_ok):
                    return None
                method, _, rest = what.partition(" ")  # "POST event", "PATCH node <name>"
                last = f"{what}: HTTP {exc.status} {exc.reason}" + refusal(
                    exc.status, _VERBS.get(method, method.lower()), rest.partition(" ")[0] + "s"
                )
                if exc.status in (401, 403):
                    raise Refused(last) from None
                if exc.status not in RETRY_STATUS:
                    raise Unavailable(last) from None
            except (HTTPError, OSError) as exc:
                last = f"{what}: {type(exc).__name__}: {exc}"
            else:
                if not isinstance(obj, dict):  # every answer kvcd asks for is one object
                    raise Unavailable(f"{what}: the answer is not a JSON object: {data!r:.60}")
                return obj
            if attempt + 1 < self.attempts:
                log.debug("%s; retrying", last)
                self.sleep(self._delay(attempt))
        raise Unavailable(last)

    # --- read / write ---------------------------------------------------------------------
    def _view(self, obj: Mapping[str, Any]) -> NodeView:
        """This Node as the API answered it; Unavailable when the answer is not this Node (a
        Status, another node's object, labels that are not strings): never read as "no labels",
        which makes an ordered upgrade unload the driver."""

        def wrong(why: str) -> Unavailable:
            return Unavailable(f"node {self.name}: the API's answer {why}")

        kind, version = obj.get("kind"), obj.get("apiVersion")
        if (kind, version) != ("Node", "v1"):
            raise wrong(f"is kind {kind!r:.40}, apiVersion {version!r:.40}, not a v1 Node")
        meta = obj.get("metadata")
        name = meta.get("name") if isinstance(meta, dict) else None
        if not isinstance(meta, dict) or name != self.name:
            raise wrong(f"is node {name!r:.80}, not {self.name!r}")
        try:
            labels, annotations = (
                string_map(part, {} if meta.get(part) is None else meta.get(part))
                for part in ("labels", "annotations")
            )
        except ValueError as exc:
            raise wrong(str(exc)) from None
        rv, uid = meta.get("resourceVersion", ""), meta.get("uid", "")
        if not isinstance(rv, str) or not isinstance(uid, str):
            raise wrong("has a resourceVersion or uid that is not a string")
        self._uid = uid or self._uid
        return NodeView(self.name, dict(labels), dict(annotations), rv)

    def read(self) -> NodeView:
        api = self.api()
        obj = self._call(
            f"GET node {self.name}",
            lambda: api.read_node(
                self.name, _preload_content=False, _request_timeout=self.request_timeout
            ),
        )
        return self._view(obj)

    def update(
        self,
        change: Callable[[NodeView], Patch],
        labels: Callable[[NodeView], Patch] | None = None,
    ) -> NodeView:
        api = self.api()
        for _ in range(self.attempts):
            view = self.read()
            patch = changes(view.annotations, change(view))
            label_patch = changes(view.labels, labels(view)) if labels is not None else {}
            if not patch and not label_patch:
                return view
            meta: dict[str, object] = {"resourceVersion": view.version}
            if patch:
                meta["annotations"] = patch
            if label_patch:
                meta["labels"] = label_patch
            body = {"metadata": meta}
            obj = self._call(
                f"PATCH node {self.name}",
                lambda body=body: api.patch_node(  # type: ignore[misc]
                    self.name,
                    body,
                    _content_type="application/merge-patch+json",
                    _preload_content=False,
                    _request_timeout=self.request_timeout,
                ),
                conflict_ok=True,
            )
            if obj is not None:
                return self._view(obj)
            log.debug("node %s changed under us (409); re-reading", self.name)
        raise Unavailable(f"PATCH node {self.name}: conflicts on every attempt")

    # --- watch -----------------------------------------------------------------------------
    def watch(
        self, on_change: Callable[[NodeView], None], on_lost: Callable[[], None] = lambda: None
    ) -> None:
        # No API call here: without credentials or a server yet, the loop backs off and retries.
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._watch_loop, args=(on_change, on_lost), name="kvcd-node-watch", daemon=True
        )
        self._thread.start()

    def _watch_loop(
        self, on_change: Callable[[NodeView], None], on_lost: Callable[[], None]
    ) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        rv: str | None = None
        # An event came, or a watch ran its time out: the watch works (said when it was said to
        # fail). Not the (re-)list's read: a watch that fails after it would never back off.
        failing = Failing(log, "node watch", warn_after=WATCH_WARN_AFTER, then=RETRYING)
        while not self._stop.is_set():
            try:
                if rv is None:  # (re-)list: the current state and where to watch from
                    view = self.read()
                    rv = view.version
                    on_change(view)
                started, events = time.monotonic(), 0
                self._watch = watch.Watch()  # type: ignore[no-untyped-call]
                for ev in self._watch.stream(
                    self.api().list_node,
                    field_selector=f"metadata.name={self.name}",
                    resource_version=rv,
                    timeout_seconds=self.watch_timeout,
                    allow_watch_bookmarks=True,
                    _request_timeout=self.watch_timeout + 30,
                ):
                    if self._stop.is_set():
                        return
                    obj = ev.get("raw_object") or {}
                    if not isinstance(obj, dict):
                        raise Unavailable(f"node watch: an event that is not an object: {obj!r}")
                    if ev.get("type") == "ERROR":
                        said_as = obj.get("reason") or obj.get("message")  # 410: re-list
                        raise ApiException(status=obj.get("code", 500), reason=said_as)
                    # Checked before it moves rv: an object that is not this Node is not news
                    # (Unavailable: back off, then re-list rather than resume past it).
                    node = self._view(obj) if ev.get("type") in ("ADDED", "MODIFIED") else None
                    rv = str((obj.get("metadata") or {}).get("resourceVersion", rv))
                    failing.worked()
                    events += 1
                    if node is not None:
                        on_change(node)
                if events or time.monotonic() - started >= 1.0:
                    failing.worked()
                    continue
                # Ended at once with nothing (a proxy's empty answer): back off, not a busy loop.
                raise Unavailable("the watch ended at once without an event")
            except ApiException as exc:
                if exc.status == 410:
                    log.debug("node watch: 410 Gone, re-listing")
                    rv = None
                    continue
                why = f"HTTP {exc.status} {exc.reason or ''}".rstrip()
                # Refused credentials do not fix themselves: say so at once.
                refused = exc.status in (401, 403)
                failing.failed(why + refusal(exc.status, "watch", "nodes"), at_once=refused)
                on_lost()
            except Unavailable as exc:
                failing.failed(str(exc), at_once=isinstance(exc, Refused))
                rv = None  # an answer that is not this Node: re-list, never resume past it
                on_lost()
            except Exception as exc:  # dropped connections, protocol errors, bad chunks
                failing.failed(f"{type(exc).__name__}: {exc}")
                on_lost()
            self._stop.wait(self._delay(min(failing.failures - 1, 6)))

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None

    # --- events ----------------------------------------------------------------------------
    def event(self, reason: str, message: str, *, warning: bool = False) -> None:
        """A core/v1 Event about the Node, correlated as the kubelet does
        (kvcd/core/nodeevents.py): the same one again counts on the existing Event."""
        ev = nodeevents.NodeEvent(reason, message[:1024], warning)
        d = self._events.decide(ev, time.time())
        if d.what == nodeevents.DROP:
            if not self._dropping:
                log.warning(
                    "node events limited to %d, then one every %.0f s: %s not posted",
                    nodeevents.BURST,
                    nodeevents.REFILL_SECONDS,
                    reason,
                )
            self._dropping = True
            return
        self._dropping = False
        api = self.api()
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        if d.what == nodeevents.COUNT and self._count_event(api, d, d.count, now):
            return
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": d.name, "namespace": EVENTS_NAMESPACE},
            "involvedObject": {"kind": "Node", "name": self.name, "uid": self._uid or self.name},
            "reason": reason,
            "message": d.message[:1024],
            "type": "Warning" if warning else "Normal",
            "source": {"component": COMPONENT, "host": self.name},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        created = self._call(
            "POST event",
            lambda: api.create_namespaced_event(
                EVENTS_NAMESPACE,
                body,
                _preload_content=False,
                _request_timeout=self.request_timeout,
            ),
            conflict_ok=True,
        )
        if created is not None:
            self._events.correct(d.name, 1)
            return
        # 409: an Event of this name exists (an earlier daemon of this instance posted it).
        found = self._call(
            f"GET event {d.name}",
            lambda: api.read_namespaced_event(
                d.name,
                EVENTS_NAMESPACE,
                _preload_content=False,
                _request_timeout=self.request_timeout,
            ),
        )
        count = found.get("count")
        count = (count if isinstance(count, int) and count > 0 else 1) + 1
        if self._count_event(api, d, count, now):
            self._events.correct(d.name, count)

    def _count_event(self, api: Any, d: nodeevents.Decision, count: int, now: str) -> bool:
        """Set the Event's count, lastTimestamp and message; False when it is gone (expired,
        or never created by this process's memory): the caller creates it."""
        body = {"count": count, "lastTimestamp": now, "message": d.message[:1024]}
        done = self._call(
            f"PATCH event {d.name}",
            lambda: api.patch_namespaced_event(
                d.name,
                EVENTS_NAMESPACE,
                body,
                _content_type="application/merge-patch+json",
                _preload_content=False,
                _request_timeout=self.request_timeout,
            ),
            absent_ok=True,
        )
        return done is not None
