"""Environments: the protocol (protocol.py), helpers that read actions from replies (parsing.py),
loading an env named by a recipe (loading.py), and adapters to other libraries' envs (adapters/)."""
