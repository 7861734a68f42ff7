"""rlcli: reinforcement-learning experiments on language-model agents, from the terminal."""

__version__ = "0.1.0"
