"""The stages and their machinery: sampling, rollout, labelling, GRPO maths, training, SFT, eval."""
