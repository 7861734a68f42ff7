"""Agent programs shipped with rlcli (installed as rlcli.builtin_envs.agents): plain agents written against
the `openai` package, run as environments by `env.name: agent:rlcli.builtin_envs.agents.<module>:solve`
(docs/agents.md). Copy one as the start of your own."""
