"""The stream runtime: the actor contract (actor.py), the worker that consumes, calls `handle`,
produces and commits (worker.py; faust.py is the faust-streaming engine of the same contract), the
Kafka clients (kafka.py), telemetry and log scans. It depends only on schemas, topics and base."""
