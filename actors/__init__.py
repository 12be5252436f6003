"""Pipeline stages: scheduler, init, agent, reward, learner, sink."""

from rollway.topics.topology import STAGE_NAMES as STAGES  # noqa: F401  (declared in topics/topology.py)
