"""Generation: the samplers (HF and vLLM), the choice between them, sampling settings and seeds.

Below engine: rollouts, evaluation, the judge (rewards/judge.py) and the asynchronous rollout
worker all import it downhill. It imports models, errors and the console (and, for the endpoint,
the envs' tool-call reader), never engine or cli.
"""
