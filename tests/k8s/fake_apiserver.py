"""A STAND-IN for the Kubernetes API server, for the orchestrator's tests: no real API server can run on these
machines (no kube-apiserver, envtest, kind or k3s from the registries).

It answers only what `forge rollout --backend k8s` calls, over plain HTTP on loopback, in the API's own JSON
shapes, so the official `kubernetes` client is used unchanged: create a Job, watch Jobs (a streamed list of
ADDED/MODIFIED events, with resourceVersions and label selectors), list a Job's pods, delete a Job. It also
plays the cluster: each created Job "runs" for `run_s` seconds, then ends as `outcome(job)` says, with a pod
whose verifier left its verdict as termination message (what `forge verify` writes in a real pod).
"""

import json
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

# (state, detail): ("Complete", verdict JSON for the termination message, or None for none), or ("Failed", reason)
JobOutcome = tuple[str, Any]


def matches(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that hung up (the dropped watch's test)
            super().handle_error(request, client_address)


class FakeApiServer:
    def __init__(self, outcome: Callable[[dict[str, Any]], JobOutcome], run_s: float = 0.15) -> None:
        self.outcome = outcome
        self.run_s = run_s
        self.lock = threading.Condition()
        self.version = 0
        self.jobs: dict[str, dict[str, Any]] = {}  # name -> Job
        self.pods: dict[str, dict[str, Any]] = {}  # job name -> Pod
        self.events: list[tuple[int, str, dict[str, Any]]] = []
        self.created: list[dict[str, Any]] = []  # every Job as the client sent it
        self.deleted: list[tuple[str, str | None]] = []  # (name, propagationPolicy)
        self.active = 0
        self.max_active = 0
        self.watches = 0
        self.stopping = False
        self.drop_watches = 0  # how many watch connections to break before serving one
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def send(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                parts = urlparse(self.path).path.strip("/").split("/")
                if parts[:3] != ["apis", "batch", "v1"] or parts[5:] != ["jobs"]:
                    self.send(404, {"kind": "Status", "code": 404, "message": f"not in the stand-in: {self.path}"})
                    return
                job = json.loads(self.rfile.read(int(self.headers["content-length"])))
                code, body = server.create_job(parts[4], job)
                self.send(code, body)

            def do_DELETE(self) -> None:
                parts = urlparse(self.path).path.strip("/").split("/")
                length = int(self.headers.get("content-length") or 0)
                options = json.loads(self.rfile.read(length) or b"{}")
                query = parse_qs(urlparse(self.path).query)
                policy = options.get("propagationPolicy") or next(iter(query.get("propagationPolicy") or []), None)
                self.send(*server.delete_job(parts[-1], policy))

            def do_GET(self) -> None:
                url = urlparse(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                parts = url.path.strip("/").split("/")
                selector = query.get("labelSelector", "")
                if parts[:3] == ["apis", "batch", "v1"] and parts[-1] == "jobs" and query.get("watch") in ("1", "true"):
                    self.watch(selector, query.get("resourceVersion"), float(query.get("timeoutSeconds", 30)))
                elif parts[:2] == ["api", "v1"] and parts[-1] == "pods":
                    with server.lock:
                        items = [p for p in server.pods.values() if matches(p["metadata"]["labels"], selector)]
                    self.send(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items})
                else:
                    self.send(404, {"kind": "Status", "code": 404, "message": f"not in the stand-in: {self.path}"})

            def watch(self, selector: str, since: str | None, timeout_s: float) -> None:
                with server.lock:
                    drop, server.drop_watches = server.drop_watches > 0, max(0, server.drop_watches - 1)
                    server.watches += drop
                if drop:  # a connection lost mid-stream: headers, then the socket closes with no end chunk
                    self.send_response(200)
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                with server.lock:
                    server.watches += 1
                    if since is None:  # a watch without a version starts with the current state, as ADDED
                        backlog = [(server.version, "ADDED", j) for j in server.jobs.values()]
                        seen = server.version
                    else:
                        seen = int(since)
                        backlog = []
                deadline = time.monotonic() + min(timeout_s, 30)
                try:
                    while time.monotonic() < deadline and not server.stopping:
                        with server.lock:
                            fresh = backlog + [e for e in server.events if e[0] > seen]
                            backlog = []
                            if not fresh:
                                server.lock.wait(0.2)
                                continue
                            seen = max(seen, *(e[0] for e in fresh))
                        for _, kind, job in fresh:
                            if matches(job["metadata"].get("labels") or {}, selector):
                                line = json.dumps({"type": kind, "object": job}).encode() + b"\n"
                                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                                self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = QuietServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def _event(self, kind: str, job: dict[str, Any]) -> None:
        self.version += 1
        job["metadata"]["resourceVersion"] = str(self.version)
        self.events.append((self.version, kind, json.loads(json.dumps(job))))
        self.lock.notify_all()

    def create_job(self, namespace: str, job: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self.lock:
            name = job["metadata"]["name"]
            if name in self.jobs:
                return 409, {"kind": "Status", "code": 409, "reason": "AlreadyExists", "message": f"{name} exists"}
            self.created.append(json.loads(json.dumps(job)))
            job["metadata"] |= {"uid": str(uuid.uuid4()), "namespace": namespace}
            job["status"] = {"active": 1}
            self.jobs[name] = job
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self._event("ADDED", job)
        threading.Timer(self.run_s, self._finish, (name,)).start()
        return 201, job

    def _finish(self, name: str) -> None:
        with self.lock:
            job = self.jobs.get(name)
            if job is None:
                return
            state, detail = self.outcome(job)
            self.active -= 1
            condition: dict[str, Any] = {"type": state, "status": "True"}
            if state == "Failed":
                condition |= {"reason": "BackoffLimitExceeded", "message": detail}
                job["status"] = {"failed": 1, "conditions": [condition]}
            else:
                job["status"] = {"succeeded": 1, "conditions": [condition]}
            terminated: dict[str, Any] = {"exitCode": 0 if state == "Complete" else 1, "reason": "Completed"}
            if state == "Complete" and detail is not None:
                terminated["message"] = json.dumps(detail)
            self.pods[name] = {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": f"{name}-x1", "namespace": job["metadata"]["namespace"],
                             "labels": {"job-name": name}},
                "status": {"phase": "Succeeded" if state == "Complete" else "Failed",
                           "containerStatuses": [{"name": "verifier", "ready": False, "restartCount": 0,
                                                  "image": "i", "imageID": "", "state": {"terminated": terminated}}]},
            }  # fmt: skip
            self._event("MODIFIED", job)

    def delete_job(self, name: str, policy: str | None) -> tuple[int, dict[str, Any]]:
        with self.lock:
            job = self.jobs.pop(name, None)
            if job is None:
                return 404, {"kind": "Status", "code": 404, "reason": "NotFound", "message": f"{name} not found"}
            if "conditions" not in job["status"]:
                self.active -= 1
            self.pods.pop(name, None)
            self.deleted.append((name, policy))
            self._event("DELETED", job)
        return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}

    def __enter__(self) -> "FakeApiServer":
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping = True
        with self.lock:
            self.lock.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()
