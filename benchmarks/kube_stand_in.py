"""A stand-in Kubernetes API server on 127.0.0.1 speaking the EndpointSlice list and watch
protocol, for the gateway's discovery (`gateway/discovery.py`) in tests and in
`routing.py --fleets discovery` (here, in benchmarks/, which is on the tests' path too).

What it serves, as the real API server does: `GET /apis/discovery.k8s.io/v1/namespaces/NS/
endpointslices` with a `labelSelector` on `kubernetes.io/service-name` (`=` or `in (...)`):
a list whose `metadata.resourceVersion` is the store's version; with `watch=true`, one JSON
event a line (ADDED, MODIFIED, DELETED) after the `resourceVersion` asked for, BOOKMARK
events when `allowWatchBookmarks` is set, a 410 ERROR event when that version is older than
the history kept (`compact`), and the stream's end after `timeoutSeconds`.

Tests change the slices (`put_pod`, `remove_pod`) and break watches (`drop_watches`: the
connection ends; `expire_watches`: a 410 ERROR event, as after etcd compaction).
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

PATH = re.compile(r"^/apis/discovery\.k8s\.io/v1/namespaces/([^/]+)/endpointslices$")
SERVICE_LABEL = "kubernetes.io/service-name"


@dataclass
class Event:
    version: int
    kind: str  # ADDED, MODIFIED, DELETED
    slice_: dict


class KubeStandIn:
    """The store (slices by name, a version counter, the event history) and the server."""

    def __init__(self, namespace: str = "default") -> None:
        self.namespace = namespace
        self.version = 100
        self.slices: dict[str, dict] = {}
        self.history: list[Event] = []
        self.oldest_version = self.version  # watches from before this get 410
        self.num_lists = 0
        self.num_watches = 0
        self.watch_params: list[dict[str, list[str]]] = []
        self._generation = 0  # bumped by drop_watches / expire_watches
        self._expire = False
        self._changed = threading.Condition()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> KubeStandIn:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.drop_watches()
        self._server.shutdown()
        self._server.server_close()

    # The store ---------------------------------------------------------------------------
    def put_pod(
        self, service: str, pod: str, port: int, *, ready: bool = True, labels: dict | None = None
    ) -> None:
        """The pod's slice (one per pod: each test replica has its own port), added or
        changed; `labels` as the Service's, which the slice controller copies."""
        name = f"{service}-{pod}"
        with self._changed:
            kind = "MODIFIED" if name in self.slices else "ADDED"
            self.version += 1
            self.slices[name] = {
                "kind": "EndpointSlice",
                "apiVersion": "discovery.k8s.io/v1",
                "metadata": {
                    "name": name,
                    "namespace": self.namespace,
                    "resourceVersion": str(self.version),
                    "labels": {SERVICE_LABEL: service, **(labels or {})},
                },
                "addressType": "IPv4",
                "endpoints": [
                    {
                        "addresses": ["127.0.0.1"],
                        "conditions": {"ready": ready, "serving": ready, "terminating": False},
                        "targetRef": {"kind": "Pod", "name": pod, "namespace": self.namespace},
                    }
                ],
                "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
            }
            self.history.append(Event(self.version, kind, self.slices[name]))
            self._changed.notify_all()

    def remove_pod(self, service: str, pod: str) -> None:
        """The pod's slice deleted."""
        with self._changed:
            slice_ = self.slices.pop(f"{service}-{pod}")
            self.version += 1
            deleted = {**slice_, "metadata": {**slice_["metadata"],
                                              "resourceVersion": str(self.version)}}  # fmt: skip
            self.history.append(Event(self.version, "DELETED", deleted))
            self._changed.notify_all()

    def compact(self) -> None:
        """Forget the history (etcd compaction): watches from an older version get 410."""
        with self._changed:
            self.history.clear()
            self.oldest_version = self.version

    def drop_watches(self) -> None:
        """End every open watch's connection."""
        with self._changed:
            self._generation += 1
            self._changed.notify_all()

    def expire_watches(self) -> None:
        """Compact, and send every open watch a 410 ERROR event."""
        with self._changed:
            self.compact()
            self._expire = True
            self._generation += 1
            self._changed.notify_all()

    # The protocol ------------------------------------------------------------------------
    def _selected(self, params: dict[str, list[str]]) -> set[str] | None:
        selector = params.get("labelSelector", [""])[0]
        if not selector:
            return None
        match = re.fullmatch(rf"{re.escape(SERVICE_LABEL)}\s*(=|in)\s*\(?([^)]*)\)?", selector)
        assert match, f"unexpected labelSelector {selector!r}"
        return {name.strip() for name in match.group(2).split(",")}

    def _matches(self, slice_: dict, services: set[str] | None) -> bool:
        return services is None or slice_["metadata"]["labels"][SERVICE_LABEL] in services

    def _list(self, params: dict[str, list[str]]) -> dict:
        services = self._selected(params)
        with self._changed:
            self.num_lists += 1
            items = [s for s in self.slices.values() if self._matches(s, services)]
            return {
                "kind": "EndpointSliceList",
                "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"resourceVersion": str(self.version)},
                "items": items,
            }

    def _watch(self, params: dict[str, list[str]], write) -> None:
        services = self._selected(params)
        since = int(params.get("resourceVersion", ["0"])[0] or 0)
        deadline = time.monotonic() + float(params.get("timeoutSeconds", ["300"])[0])
        bookmarks = params.get("allowWatchBookmarks", ["false"])[0] == "true"
        with self._changed:
            self.num_watches += 1
            self.watch_params.append(params)
            generation = self._generation
            if since < self.oldest_version:
                write(_gone())
                return
            if since == 0:  # no version: the current state as ADDED, then changes
                events = [Event(self.version, "ADDED", s) for s in self.slices.values()]
                since = self.version
            else:
                events = []
        sent_bookmark = time.monotonic()
        while time.monotonic() < deadline:
            for event in events:
                if self._matches(event.slice_, services):
                    write({"type": event.kind, "object": event.slice_})
                since = event.version
            if bookmarks and time.monotonic() - sent_bookmark > 0.5:
                write(_bookmark(since))
                sent_bookmark = time.monotonic()
            with self._changed:
                self._changed.wait_for(
                    lambda seen=since: self._generation != generation or self.version > seen,
                    timeout=0.5,
                )
                if self._generation != generation:
                    if self._expire:
                        self._expire = False
                        write(_gone())
                    return
                events = [e for e in self.history if e.version > since]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # the body ends with the connection

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                params = parse_qs(parts.query)
                match = PATH.match(parts.path)
                if match is None or match.group(1) != stand_in.namespace:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.end_headers()
                if params.get("watch", ["false"])[0] != "true":
                    self.wfile.write(json.dumps(stand_in._list(params)).encode())
                    return

                def write(event: dict) -> None:
                    self.wfile.write(json.dumps(event).encode() + b"\n")
                    self.wfile.flush()

                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    stand_in._watch(params, write)

        return Handler


def _gone() -> dict:
    status = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": "too old resource version",
        "reason": "Expired",
        "code": 410,
    }
    return {"type": "ERROR", "object": status}


def _bookmark(version: int) -> dict:
    metadata = {"resourceVersion": str(version)}
    return {"type": "BOOKMARK", "object": {"kind": "EndpointSlice",
                                           "apiVersion": "discovery.k8s.io/v1",
                                           "metadata": metadata}}  # fmt: skip
