"""`rollway broker`: run the embedded Kafka-protocol broker in the foreground."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

NAME = "broker"
HELP = "Run the embedded Kafka-protocol broker (Tansu, in memory) on 127.0.0.1."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=9092, help="port to listen on (default 9092; 0 picks a free one)")


def run(args: argparse.Namespace) -> int:
    from rollway.runtime.broker import BrokerError, EmbeddedBroker

    broker = EmbeddedBroker(args.port)
    try:
        broker.start()
    except BrokerError as err:
        print(f"rollway broker: {err}", file=sys.stderr)
        return 1
    print(f"broker listening on {broker.bootstrap} (in memory: data is lost when it stops)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        if broker.proc.poll() is not None:
            print(f"rollway broker: the broker exited (code {broker.proc.returncode})", file=sys.stderr)
            return 1
    broker.stop()
    return 0
