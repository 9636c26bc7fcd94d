"""The server in a thread of the calling process on a loopback port the OS picks: for tests, benchmarks and
notebooks that talk to it over HTTP. `stop()` is what uvicorn does on SIGTERM (a graceful shutdown)."""

from __future__ import annotations

import socket
import threading

import uvicorn

from jaxspec.serving.app import Service, create_app

START_TIMEOUT_S = 30.0


class BackgroundServer:
    def __init__(self, service: Service, host: str = "127.0.0.1"):
        self.service = service
        self._sock = socket.socket()
        self._sock.bind((host, 0))
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://{host}:{self.port}/v1"
        config = uvicorn.Config(create_app(service), log_level="warning",
                                timeout_graceful_shutdown=service.shutdown_timeout_s)
        self.http = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.http.run, kwargs={"sockets": [self._sock]}, daemon=True,
                                       name="jaxspec-http")

    def start(self) -> "BackgroundServer":
        self.thread.start()
        started = threading.Event()
        for _ in range(int(START_TIMEOUT_S / 0.05)):  # bounded wait for uvicorn's startup
            if self.http.started or not self.thread.is_alive():
                break
            started.wait(0.05)
        if not self.http.started:
            raise RuntimeError("the HTTP server did not start")
        return self

    def request_stop(self) -> None:
        self.http.should_exit = True

    def stop(self, timeout_s: float = 60.0) -> None:
        self.request_stop()
        self.thread.join(timeout_s)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
