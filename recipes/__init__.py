"""The shipped recipes, installed as the package rlcli.recipes (pyproject.toml maps this folder), so
that a wheel carries them: `rlcli recipes list` names them, `rlcli recipes copy NAME` copies one out to
edit, and `-r NAME` runs one by its name."""
