"""Pipeline stages: scheduler, init, agent, reward, learner, sink."""

STAGES = ("scheduler", "init", "agent", "reward", "learner", "sink")
