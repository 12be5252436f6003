"""The config root: `RunConfig`, the whole run's settings, composed from every package's own section
(config/run.py), loaded from YAML with dotted overrides. It sits above the domain packages and below the
actors: the runtime and the domain packages never import it."""
