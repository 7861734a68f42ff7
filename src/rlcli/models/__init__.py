"""Models: the cache (cache), the tiny test model (tiny), the policy and its checkpoints (loading)."""

import logging

# peft and trl import bitsandbytes, which logs a harmless "Failed to load CPU gemm_4bit_forward"
# on import and, with 8-bit weights, a float16 cast warning on every matmul. Both go through this
# logger; raise its level before anything imports bitsandbytes. Here, because the CLI imports the
# cache at start-up, before a stage's modules (engine.sft imports transformers' Trainer) pull it in.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
