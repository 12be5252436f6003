"""Tools the agent calls in its sandbox: call parsing, the registry, built-in tools and hints."""
