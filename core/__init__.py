"""Shared plumbing: configuration, logging, small utilities used by every stage."""
