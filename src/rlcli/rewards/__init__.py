"""Reward functions, all in TRL's shape: scoring.py builds a recipe's rewards and labels episodes with
them; builtins.py and judge.py hold the built-in rewards, user.py calls a user's own function, and
episodes.py the dict view of an episode that every reward receives."""
