"""Reward labelling: apply the recipe's reward functions to stored episodes, store every component.

Labels live beside the episodes under a label-set name, so relabelling with other rewards never
needs new rollouts, and a labelled stage can be read back by any later stage.
"""

from __future__ import annotations

import json
from typing import Any

from rlcli.store.db import RunDB


def episode_dicts(rundb: RunDB, where: str, params: list[Any]) -> list[dict[str, Any]]:
    """Episodes as the plain dicts reward functions receive (see docs/rewards.md)."""
    rows = list(rundb.db.query(f"select * from episodes where {where} order by id", params))
    out = []
    for row in rows:
        messages = json.loads(row["messages"] or "[]")
        assistant = [m for m in messages if m.get("role") == "assistant"]
        first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
        out.append(
            {
                "id": row["id"],
                "messages": messages,
                "completion": _text(assistant[-1]) if assistant else "",
                "completions": [_text(m) for m in assistant],
                "prompt": messages[:first],
                "task": json.loads(row["task"] or "{}"),
                "env_return": row["env_return"] or 0.0,
                "success": bool(row["success"]) if row["success"] is not None else None,
                "num_turns": row["num_turns"],
                "num_tokens": row["num_tokens"],
                "truncated": row["end_reason"] in ("truncated", "max_turns", "context"),
                "tool_calls": sum(1 for m in messages if m.get("role") == "tool"),
                "end_reason": row["end_reason"],
            }
        )
    return out


def _text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def label_stage_episodes(ctx, rollout_stage: str, label_set: str, fns=None) -> dict[str, Any]:
    """Label every successfully finished episode of a stage; failed episodes carry no reward."""
    from rlcli.rewards.core import build_reward_fns, label_episodes

    fns = fns if fns is not None else build_reward_fns(ctx.recipe.rewards)
    episodes = episode_dicts(ctx.rundb, "run = ? and stage = ? and status = 'ok'", [ctx.run, rollout_stage])
    if not episodes:
        return {"episodes": 0, "label_set": label_set}
    labels = label_episodes(fns, episodes)
    weights = {fn.component: fn.weight for fn in fns}
    failures = {fn.component: fn.failures for fn in fns}
    rows = []
    for ep, values in zip(episodes, labels):
        for component, value in values.items():
            rows.append(
                {
                    "episode_id": ep["id"],
                    "label_set": label_set,
                    "component": component,
                    "value": float(value),
                    "weight": weights.get(component),
                    "error": failures.get(component, {}).get(ep["id"]),
                }
            )
    with ctx.rundb.transaction() as db:
        db["rewards"].upsert_all(rows, pk=("episode_id", "label_set", "component"), alter=False)
    totals = [v["total"] for v in labels]
    summary = {"episodes": len(episodes), "label_set": label_set, "reward_mean": sum(totals) / len(totals)}
    for component in labels[0]:
        if component != "total":
            summary[f"{component}_mean"] = sum(v[component] for v in labels) / len(labels)
    return summary


def run_label_stage(ctx, *, label_set: str) -> list[dict[str, Any]]:
    """`rlcli label`: label every rollout stage of the run that has episodes, under one label set."""
    from rlcli.rewards.core import build_reward_fns

    stages = [
        r[0]
        for r in ctx.rundb.db.execute(
            "select stage from episodes where run = ? group by stage order by min(id)", [ctx.run]
        ).fetchall()
    ]
    if not stages:
        from rlcli.errors import UsageError

        raise UsageError(f"Run {ctx.run!r} has no episodes to label; run `rlcli rollout` first.")
    fns = build_reward_fns(ctx.recipe.rewards)
    summaries = []
    for stage in stages:
        summary = ctx.stage(
            f"label/{label_set}/{stage}",
            lambda stage=stage: label_stage_episodes(ctx, stage, label_set, fns),
            {"label_set": label_set, "rewards": [r.model_dump() for r in ctx.recipe.rewards]},
        )
        summaries.append({"stage": stage, **summary})
    print_label_summary(ctx, summaries)
    return summaries


def print_label_summary(ctx, summaries: list[dict[str, Any]]) -> None:
    from rich.table import Table

    keys = sorted({k for s in summaries for k in s if k.endswith("_mean")})
    table = Table(title="Labels")
    for col in ("stage", "label set", "episodes", *keys):
        table.add_column(col)
    for s in summaries:
        table.add_row(s["stage"], s["label_set"], str(s["episodes"]),
                      *(f"{s[k]:.3g}" if isinstance(s.get(k), float) else "–" for k in keys))
    ctx.console.print(table)
