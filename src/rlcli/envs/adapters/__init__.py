"""Adapters that present other environment libraries through rlcli's environment protocol.

`env.name: textarena:<GameId>`, `reasoning_gym:<dataset>` and `gymnasium:<EnvId>` load the module of
that name here and call its `make_env(rest, **env.kwargs)`. Each needs its library, installed with
`pip install 'rlcli[envs]'`; see docs/environments.md.
"""
