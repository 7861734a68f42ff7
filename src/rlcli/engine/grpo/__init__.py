"""GRPO, one file per step of an iteration (docs/architecture.md walks one):

loop.py        the loop: plan -> play -> label -> choose groups (refill while short) -> batch -> update
               -> save -> commit -> log, and GRPO's phases
sources.py     where rollouts come from: played here (SyncRollouts, with the refill rounds) or by a
               worker process ahead of the trainer (AsyncRollouts; worker.py, staleness.py)
selection.py   which groups an iteration trains on: dynamic sampling, carried groups, replays
batch.py       their advantages (advantages.py) and training sequences
learner.py     the policy, AdamW, the schedule (schedule.py) and the KL reference: setup, update
               (update.py, loss.py), save (checkpoints.py), resume (resume.py)
evals.py       held-out evals during training; metrics.py the iteration's metrics and live view
"""
