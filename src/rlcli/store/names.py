"""Stage names and policy references: every name rlcli keys a run's rows by is built and parsed here.

A stage name is a string in the database (stages.name, and the stage column of episodes, evals,
checkpoints, events and metrics); the builders below write it and `parse_stage` reads it back as a
typed record. The forms (docs/database.md):

  sft, sft/demos                     SFT and the expert demonstrations it plays (sft.demos)
  dpo, dpo/<name>                    DPO stages (run.stages' k-th dpo: dpo, then dpo/<k+1>)
  grpo, grpo/<k>                     GRPO's metrics series (every phase), and the stage around phase k >= 1
  distill/<k>                        the stage around phase k when it is a distill phase (`rlcli train distill`)
  rollout/<i>, rollout/<i>+<r>       GRPO iteration i's rollouts; r >= 1: grpo.dynamic_sampling's extra rounds
  label/<i>, label/<i>+<r>           their labels under the label set grpo
  label/<label set>/<stage>          `rlcli label`'s labels of one stage
  branch/<i>                         GRPO iteration i's branches (grpo.branch) and their labels
  teach/<i>                          a distill phase's iteration i: the teacher's logprobs of its turns
  train/<i>                          GRPO iteration i's update (and the checkpoint it saves)
  eval/<key>[@t<temp>-k<k>][/vs-<o>] an eval of key base, expert or ckpt-<id>; @: when it samples; /vs-: its
                                     opponent in a two-player game (random, bot, base, ckpt-<id>; eval.opponents)
  stale/<stage>/<n>                  episodes of <stage> that asynchronous GRPO set aside (episodes only)
  superseded/<stage>/<n>             episodes of <stage> played with weights a GRPO resume recomputes, set
                                     aside (episodes only; engine/grpo/resume.py, supersede_lost_rollouts)
  <name>                             a user's stage (`rlcli rollout --stage`): no '/', not a reserved name

A policy reference (PolicyRef) names the weights that play or are evaluated. Its stored form (the
episodes' `policy` column, a rollout stage's `policy` identity) is base, expert, sft, train/<i> (the
weights after GRPO iteration i), dpo or dpo/<name> (a DPO stage's), or a checkpoint id; its CLI and
recipe form (--policy, --checkpoint, eval.checkpoints) is base, sft, latest, best, expert or a
checkpoint id, where latest and best are resolved against the run's checkpoints
(store/checkpoints.py, resolve_checkpoint) into a checkpoint id (or base).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Protocol

from rlcli.errors import UsageError

# The label set GRPO trains on (label/<i> stages, task_stats); no `rlcli label` may replace it.
GRPO_LABEL_SET = "grpo"
# Names without '/' that rlcli's own stages use (grpo is the GRPO metrics' stage): a user stage under one
# of them would take that stage over, its summary read as the other stage's.
RESERVED_STAGES = ("sft", "dpo", "grpo", "distill")
RESERVED_LABEL_SETS = (GRPO_LABEL_SET,)

STAGE_FORMS = (
    "sft, sft/demos, dpo, dpo/<name>, grpo, grpo/<phase>, distill/<phase>, rollout/<i>[+<round>], "
    "label/<i>[+<round>], label/<label set>/<stage>, branch/<i>, teach/<i>, train/<i>, eval/<base|expert|ckpt-<id>>[@t<temperature>-k<k>][/vs-<opponent>], "
    "stale/<stage>/<n>, superseded/<stage>/<n>, or a user stage name without '/'"
)
_N = r"(0|[1-9][0-9]*)"  # a count as rlcli writes it: no sign, no leading zeros
_ITERATION = re.compile(rf"{_N}(?:\+([1-9][0-9]*))?")
_EVAL = re.compile(  # t1e-05-k4: the last -k
    rf"(base|expert|ckpt-{_N})(?:@t([^/]+)-k([1-9][0-9]*))?(?:/vs-(random|bot|base|ckpt-{_N}))?"
)


class StageNameError(ValueError):
    """A name in none of the forms rlcli writes: one message that names the forms expected."""

    def __init__(self, name: str, what: str = "stage name", expected: str = STAGE_FORMS) -> None:
        super().__init__(f"{name!r} is not a {what} rlcli writes; expected {expected}.")
        self.name = name


# --- policy references ------------------------------------------------------------------------

PolicyKind = Literal["base", "expert", "sft", "train", "dpo", "checkpoint", "latest", "best"]
POLICY_FORMS = "base, expert, sft, train/<iteration>, dpo, dpo/<name> or a checkpoint id"
CLI_POLICY_FORMS = "base, sft, latest, best or a checkpoint id"


class _Row(Protocol):  # a Checkpoint (store/records.py imports this module)
    @property
    def id(self) -> int: ...


@dataclass(frozen=True)
class PolicyRef:
    """Which weights: the base model, the env's expert, the SFT checkpoint, the weights after GRPO
    iteration `number` (train), a DPO stage's (dpo, `stage` naming it), checkpoint row `number`
    (checkpoint), or, in the CLI form only, the run's latest or best checkpoint (resolved before use)."""

    kind: PolicyKind
    number: int | None = None  # train: the iteration; checkpoint: the row's id
    stage: str | None = None  # dpo: the DPO stage that wrote the weights (dpo, dpo/<name>)

    @staticmethod
    def train(iteration: int) -> PolicyRef:
        """The weights after GRPO iteration `iteration`'s update (train/<i>)."""
        return PolicyRef("train", number=iteration)

    @staticmethod
    def checkpoint(checkpoint_id: int) -> PolicyRef:
        return PolicyRef("checkpoint", number=checkpoint_id)

    @staticmethod
    def of_checkpoint(checkpoint: _Row | None) -> PolicyRef:
        """A checkpoint row by its id; None: the base model."""
        return BASE if checkpoint is None else PolicyRef.checkpoint(checkpoint.id)

    @staticmethod
    def written_by(stage: str) -> PolicyRef:
        """The weights a checkpoint's stage wrote, named by that stage: sft, train/<i>, dpo[/<name>]."""
        parsed = parse_stage(stage)
        if isinstance(parsed, SftStage) and not parsed.demos:
            return SFT
        if isinstance(parsed, TrainStage):
            return PolicyRef.train(parsed.iteration)
        if isinstance(parsed, DpoStage):
            return PolicyRef("dpo", stage=stage)
        raise StageNameError(stage, "checkpoint's stage", "sft, train/<i>, dpo or dpo/<name>")

    @staticmethod
    def parse(text: str) -> PolicyRef:
        """The stored form (str of a PolicyRef) back; StageNameError for anything else."""
        if text in ("base", "expert", "sft"):
            return _NAMED[text]
        if re.fullmatch(_N, text):
            return PolicyRef.checkpoint(int(text))
        if text.startswith("train/") and re.fullmatch(_N, iteration := text.removeprefix("train/")):
            return PolicyRef.train(int(iteration))
        try:
            if isinstance(parse_stage(text), DpoStage):
                return PolicyRef("dpo", stage=text)
        except StageNameError:
            pass
        raise StageNameError(text, "policy reference", POLICY_FORMS)

    @staticmethod
    def from_cli(text: str) -> PolicyRef:
        """The CLI and recipe form: base, sft, latest, best, expert or a checkpoint id (digits)."""
        if text in _NAMED:
            return _NAMED[text]
        if text.isdigit():
            return PolicyRef.checkpoint(int(text))
        raise UsageError(f"Unknown checkpoint {text!r}: expected {CLI_POLICY_FORMS}.")

    @property
    def resolved(self) -> bool:
        """Whether it names weights by itself (latest and best need the run's checkpoints)."""
        return self.kind not in ("latest", "best")

    def __str__(self) -> str:
        """The stored form (and, for base, expert, sft, latest, best and ids, the CLI form)."""
        if self.kind == "train":
            return train_stage(self._number())
        if self.kind == "checkpoint":
            return str(self._number())
        if self.kind == "dpo":
            assert self.stage is not None, "a dpo PolicyRef names its stage"
            return self.stage
        return self.kind

    def _number(self) -> int:
        assert self.number is not None, f"a {self.kind} PolicyRef has a number"
        return self.number


BASE = PolicyRef("base")
EXPERT = PolicyRef("expert")
SFT = PolicyRef("sft")
LATEST = PolicyRef("latest")
BEST = PolicyRef("best")
_NAMED = {str(ref): ref for ref in (BASE, EXPERT, SFT, LATEST, BEST)}


# --- stage names ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SftStage:
    demos: bool = False  # sft/demos: the expert's demonstration episodes

    @property
    def name(self) -> str:
        return "sft/demos" if self.demos else "sft"


@dataclass(frozen=True)
class DpoStage:
    suffix: str | None = None  # dpo/<suffix>; None: the stage dpo

    @property
    def name(self) -> str:
        return "dpo" if self.suffix is None else f"dpo/{self.suffix}"


@dataclass(frozen=True)
class GrpoStage:
    phase: int = 0  # 0: grpo, the GRPO loop's metrics series (no stage row); k >= 1: the stage grpo/k

    @property
    def name(self) -> str:
        return "grpo" if self.phase == 0 else f"grpo/{self.phase}"


@dataclass(frozen=True)
class DistillStage:
    """The stage around phase `phase` of the GRPO loop when it distills (engine/grpo/teacher.py)."""

    phase: int

    @property
    def name(self) -> str:
        return f"distill/{self.phase}"


@dataclass(frozen=True)
class RolloutStage:
    iteration: int
    round: int = 0  # grpo.dynamic_sampling's extra round (>= 1); 0: the iteration's rollout

    @property
    def name(self) -> str:
        return f"rollout/{_numbered(self.iteration, self.round)}"


@dataclass(frozen=True)
class GrpoLabelStage:
    """The labels, under label set grpo, of RolloutStage(iteration, round)."""

    iteration: int
    round: int = 0

    @property
    def name(self) -> str:
        return f"label/{_numbered(self.iteration, self.round)}"


@dataclass(frozen=True)
class LabelStage:
    """`rlcli label`'s labels of `stage` under `label_set`."""

    label_set: str
    stage: str

    @property
    def name(self) -> str:
        return f"label/{self.label_set}/{self.stage}"


@dataclass(frozen=True)
class BranchStage:
    """grpo.branch's continuations from stored turns of rollout/<iteration>, labelled under label set grpo."""

    iteration: int

    @property
    def name(self) -> str:
        return f"branch/{self.iteration}"


@dataclass(frozen=True)
class TeachStage:
    """A distill phase's iteration: the teacher's logprobs of every turn of rollout/<iteration>."""

    iteration: int

    @property
    def name(self) -> str:
        return f"teach/{self.iteration}"


@dataclass(frozen=True)
class TrainStage:
    iteration: int

    @property
    def name(self) -> str:
        return f"train/{self.iteration}"


@dataclass(frozen=True)
class EvalStage:
    """An eval of `policy` (base, expert or a checkpoint) on the held-out split with one decoding;
    another decoding (temperature, k) is another measurement, a stage beside the greedy one."""

    policy: PolicyRef
    temperature: float = 0.0
    k: int = 1
    opponent: str | None = None  # two-player games: random, bot, base or ckpt-<id> (eval.opponents)

    @property
    def key(self) -> str:
        """base, expert or ckpt-<id>."""
        if self.policy.kind == "checkpoint":
            return f"ckpt-{self.policy.number}"
        if self.policy.kind in ("base", "expert"):
            return self.policy.kind
        raise ValueError(f"an eval stage evaluates base, expert or a checkpoint id, not {self.policy}")

    @property
    def decoding(self) -> str:
        """t<temperature>-k<k>, or "" for the greedy, one-sample eval."""
        return "" if (self.temperature, self.k) == (0.0, 1) else f"t{self.temperature:g}-k{self.k}"

    @property
    def name(self) -> str:
        name = f"eval/{self.key}@{self.decoding}" if self.decoding else f"eval/{self.key}"
        return f"{name}/vs-{self.opponent}" if self.opponent else name


@dataclass(frozen=True)
class StaleStage:
    """Episodes of `stage` that asynchronous GRPO set aside, the n-th time (an episodes' stage only)."""

    stage: str
    n: int

    @property
    def name(self) -> str:
        return f"stale/{self.stage}/{self.n}"


@dataclass(frozen=True)
class SupersededStage:
    """Episodes of rollout `stage` played with weights that a GRPO resume recomputed (those of an iteration
    after the checkpoint it resumed from), set aside the n-th time (an episodes' stage only)."""

    stage: str
    n: int

    @property
    def name(self) -> str:
        return f"superseded/{self.stage}/{self.n}"


@dataclass(frozen=True)
class UserStage:
    """A stage a user named (`rlcli rollout --stage`)."""

    name: str


StageName = (
    SftStage
    | DpoStage
    | GrpoStage
    | DistillStage
    | RolloutStage
    | GrpoLabelStage
    | LabelStage
    | BranchStage
    | TeachStage
    | TrainStage
    | EvalStage
    | StaleStage
    | SupersededStage
    | UserStage
)


def _numbered(iteration: int, round_: int) -> str:
    return f"{iteration}+{round_}" if round_ else str(iteration)


# The builders: the name of each kind of stage, as the store keys it.


def rollout_stage(iteration: int, round_: int = 0) -> str:
    return RolloutStage(iteration, round_).name


def grpo_label_stage(iteration: int, round_: int = 0) -> str:
    return GrpoLabelStage(iteration, round_).name


def label_stage(label_set: str, stage: str) -> str:
    return LabelStage(label_set, stage).name


def branch_stage(iteration: int) -> str:
    return BranchStage(iteration).name


def teach_stage(iteration: int) -> str:
    return TeachStage(iteration).name


def train_stage(iteration: int) -> str:
    return TrainStage(iteration).name


def eval_stage(policy: PolicyRef, temperature: float = 0.0, k: int = 1, opponent: str | None = None) -> str:
    return EvalStage(policy, temperature, k, opponent).name


def grpo_phase_stage(phase: int) -> str:
    """grpo/<phase>, the stage around GRPO phase `phase` >= 1 (phase 0 has none: `rlcli train grpo`)."""
    assert phase >= 1, "GRPO phase 0 runs outside a stage"
    return GrpoStage(phase).name


def distill_phase_stage(phase: int) -> str:
    """distill/<phase>, the stage around a distill phase (phase 0 too: it records the phase's teacher)."""
    return DistillStage(phase).name


def dpo_stage(repeat: int) -> str:
    """The stage of run.stages' dpo number `repeat` (from 0): dpo, then dpo/2, dpo/3, ... (`rlcli train dpo
    --stage dpo/2` names the same stage)."""
    return DpoStage(None if repeat == 0 else str(repeat + 1)).name


def stale_stage(stage: str, n: int) -> str:
    return StaleStage(stage, n).name


def stale_stages_like(stage: str) -> str:
    """The SQL LIKE pattern of every stale_stage(stage, n)."""
    return f"stale/{stage}/%"


def superseded_stage(stage: str, n: int) -> str:
    return SupersededStage(stage, n).name


def superseded_stages_like(stage: str) -> str:
    """The SQL LIKE pattern of every superseded_stage(stage, n)."""
    return f"superseded/{stage}/%"


# The SQL LIKE pattern of every superseded stage: their episodes are kept, and left out of what trains or
# draws tasks (task_stats, grpo.replay, SFT on a run's episodes).
ANY_SUPERSEDED_LIKE = "superseded/%"


SFT_STAGE = SftStage().name
SFT_DEMOS_STAGE = SftStage(demos=True).name
GRPO_STAGE = GrpoStage().name  # the GRPO loop's metrics series
DPO_STAGE = DpoStage().name


# --- parsing ----------------------------------------------------------------------------------


def parse_stage(name: str) -> StageName:
    """A stage name back as its typed record; StageNameError (one message, naming the forms) for a
    name in none of the forms. parse_stage(n).name == n for every name that parses."""
    head, slash, rest = name.partition("/")
    parsed: StageName | None = None
    if not slash:
        if head == "sft":
            parsed = SftStage()
        elif head == "dpo":
            parsed = DpoStage()
        elif head == "grpo":
            parsed = GrpoStage()
        elif head:
            parsed = UserStage(head)
    elif head == "sft" and rest == "demos":
        parsed = SftStage(demos=True)
    elif head == "dpo" and rest and "/" not in rest:
        parsed = DpoStage(rest)
    elif head == "grpo" and re.fullmatch(_N, rest) and rest != "0":
        parsed = GrpoStage(int(rest))
    elif head == "distill" and re.fullmatch(_N, rest):
        parsed = DistillStage(int(rest))
    elif head == "train" and re.fullmatch(_N, rest):
        parsed = TrainStage(int(rest))
    elif head == "teach" and re.fullmatch(_N, rest):
        parsed = TeachStage(int(rest))
    elif head == "branch" and re.fullmatch(_N, rest):
        parsed = BranchStage(int(rest))
    elif head in ("rollout", "label") and (match := _ITERATION.fullmatch(rest)):
        iteration, round_ = int(match.group(1)), int(match.group(2) or 0)
        parsed = RolloutStage(iteration, round_) if head == "rollout" else GrpoLabelStage(iteration, round_)
    elif head == "label":
        label_set, _, stage = rest.partition("/")
        if label_set and _parses(stage):
            parsed = LabelStage(label_set, stage)
    elif head == "eval" and (match := _EVAL.fullmatch(rest)):
        parsed = _eval_stage(match)
    elif head in ("stale", "superseded"):
        stage, _, n = rest.rpartition("/")
        if re.fullmatch(_N, n) and n != "0" and _parses(stage):
            parsed = StaleStage(stage, int(n)) if head == "stale" else SupersededStage(stage, int(n))
    if parsed is None or parsed.name != name:  # e.g. eval/base@t0-k1, which rlcli writes as eval/base
        raise StageNameError(name)
    return parsed


def try_parse_stage(name: str) -> StageName | None:
    """parse_stage, or None for a name rlcli does not write (a stored row of an older rlcli's)."""
    try:
        return parse_stage(name)
    except StageNameError:
        return None


def _parses(name: str) -> bool:
    return try_parse_stage(name) is not None


def _eval_stage(match: re.Match[str]) -> EvalStage | None:
    key, checkpoint_id, temperature, k, opponent, _ = match.groups()
    policy = PolicyRef.checkpoint(int(checkpoint_id)) if checkpoint_id is not None else _NAMED[key]
    if temperature is None:
        return EvalStage(policy, opponent=opponent)
    try:
        return EvalStage(policy, float(temperature), int(k), opponent)
    except ValueError:  # not a number after @t
        return None


def stage_family(name: str) -> tuple[str, int] | None:
    """A numbered stage's family and number (rollout/3 -> (rollout, 3), label/x/rollout/3 ->
    (label/x/rollout, 3)), for views that fold a family into one row; None for any other name."""
    match = re.fullmatch(r"(.*)/(\d+)", name)
    return (match.group(1), int(match.group(2))) if match else None


def check_user_name(option: str, name: str, reserved: tuple[str, ...]) -> str:
    """A stage (reserved: RESERVED_STAGES) or label-set name (RESERVED_LABEL_SETS) a user gives must stay
    out of the names rlcli's own stages use."""
    if not name or "/" in name or name in reserved:
        raise UsageError(
            f"{option} {name!r} is not allowed: names with '/' (rollout/<i>, train/<i>, eval/..., label/...) "
            f"and {', '.join(map(repr, reserved))} belong to rlcli's own stages; choose another name."
        )
    return name
