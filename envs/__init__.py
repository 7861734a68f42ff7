"""The built-in environments, one readable file each; installed as the package rlcli.builtin_envs.

Every .py file here whose name does not start with "_" is listed by `rlcli envs list` and loads by its
name (env.name: guess_number). Copy one as the start of your own env file.
"""
