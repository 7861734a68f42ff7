"""Environments: the protocol, loading, and adapters to other libraries' envs."""
