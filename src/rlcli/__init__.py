"""rlcli: reinforcement-learning experiments on language-model agents, from the terminal."""

# The release: the one place the version is set (pyproject.toml reads it); `rlcli --version` prints it,
# and each run records it in its versions (store/db.py package_versions).
__version__ = "0.4.0"
