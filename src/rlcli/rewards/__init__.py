"""Reward functions: built-ins, judges and user code, all in TRL's shape."""
