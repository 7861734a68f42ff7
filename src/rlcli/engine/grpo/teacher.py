"""On-policy distillation's teacher (`rlcli train distill`, run.stages' distill): which weights teach, and
their judgement of every token the student sampled.

A distill phase is a phase of the GRPO loop (grpo/loop.py) with one more stage per iteration: after
label/i, teach/i runs the teacher over the episodes train/i will train on, in exactly the contexts the
student saw (the stored prompt and completion tokens of each turn), and stores the teacher's logprob of
every sampled token (store/teacher.py). train/i then gives each sampled token the advantage

    distill.kl_coef * (teacher logprob - student logprob) + distill.reward_weight * (episode advantage)

where the student logprob is the one the sampler recorded. The first term's expectation under the
student's own samples is minus the per-token reverse KL to the teacher, so the clipped policy-gradient
step of GRPO lowers it: the student is pulled towards the teacher on the states it reaches itself.

The teacher is resolved once, when the phase's stage distill/<k> begins (`best` moves as a run goes on):
its checkpoint id and folder are recorded with the stage, and a resumed phase scores with the same
weights. It must share the student's tokenizer, since its logprobs are of the student's token ids.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rlcli.engine.context import RunContext
from rlcli.errors import UsageError
from rlcli.models.cache import resolve_model
from rlcli.recipe import QuantizationSection, Recipe
from rlcli.store.checkpoints import best_and_latest, require_folder, resolve_checkpoint
from rlcli.store.names import teach_stage
from rlcli.store.records import Checkpoint, LabelledEpisode
from rlcli.store.run_store import RunStore
from rlcli.store.teacher import TurnKey, store_teacher_logprobs

# The recipe's own checkpoint names (resolve_checkpoint's CLI form), besides ids.
_THIS_RUN = ("base", "sft", "best", "latest")


@dataclass(frozen=True)
class TeacherWeights:
    """The weights that teach: a model (hub id, path or cache name), with a checkpoint folder of it (a LoRA
    adapter, or a full model in place of it) when the teacher is a run's checkpoint."""

    shown: str  # how progress lines and `runs show` name it: "checkpoint 7 (best)", "run:a checkpoint 3", a model
    model: str
    folder: str | None = None
    checkpoint: int | None = None  # the checkpoint's id (ids are unique across the run database)

    def to_params(self) -> dict[str, Any]:
        """What distill/<k> records of its teacher, so that a resumed phase scores with the same weights."""
        return asdict(self)

    @staticmethod
    def from_params(params: dict[str, Any]) -> TeacherWeights:
        return TeacherWeights(**params)


def resolve_teacher(ctx: RunContext) -> TeacherWeights:
    """distill.teacher as weights: this run's sft, best, latest, base or a checkpoint id; run:NAME (that run's
    best, else its latest checkpoint) or run:NAME/ID; else a model (hub id, path or `rlcli models` name)."""
    text = ctx.recipe.distill.teacher
    assert text is not None, "distill_problem refuses a distill phase without a teacher"
    if text.startswith("run:"):
        name, _, which = text.removeprefix("run:").partition("/")
        other = RunStore(ctx.rundb, name)
        other.require_run()
        checkpoint = resolve_checkpoint(other, which) if which else _result(other)
        if checkpoint is None:
            raise UsageError(f"distill.teacher {text}: run {name!r} has no checkpoint to teach with.")
        return _of_checkpoint(f"run:{name} checkpoint {checkpoint.id}", other.recipe(), checkpoint)
    if text in _THIS_RUN or text.isdigit():
        checkpoint = resolve_checkpoint(ctx.store, text)
        if checkpoint is None:
            return TeacherWeights(f"{text} (the base model)", ctx.recipe.model.name)
        return _of_checkpoint(f"checkpoint {checkpoint.id} ({text})", ctx.recipe, checkpoint)
    return TeacherWeights(text, text)


def _result(store: RunStore) -> Checkpoint | None:
    """A run's result: its best checkpoint by held-out success, else its newest."""
    ending = best_and_latest(store)
    if ending.best is not None and ending.best.checkpoint is not None:
        return ending.best.checkpoint
    return ending.latest


def _of_checkpoint(shown: str, recipe: Recipe, checkpoint: Checkpoint) -> TeacherWeights:
    return TeacherWeights(shown, recipe.model.name, str(require_folder(checkpoint)), checkpoint.id)


def check_tokenizer(recipe: Recipe, teacher: TeacherWeights) -> None:
    """Refuse a teacher whose tokenizer is not the student's: its logprobs would be of other tokens."""
    from transformers import AutoTokenizer

    student_tokenizer = AutoTokenizer.from_pretrained(resolve_model(recipe.model.name))
    source = teacher.folder if teacher.folder and (Path(teacher.folder) / "tokenizer_config.json").is_file() else None
    try:
        theirs = AutoTokenizer.from_pretrained(source or resolve_model(teacher.model))
    except (OSError, ValueError) as exc:
        raise UsageError(f"distill.teacher {teacher.shown}: its tokenizer could not be loaded ({exc}).") from exc
    if theirs.get_vocab() != student_tokenizer.get_vocab():
        raise UsageError(
            f"distill.teacher {teacher.shown} has another tokenizer than the student's ({len(theirs)} vs "
            f"{len(student_tokenizer)} tokens, or other ids); a teacher scores the student's tokens, so it must "
            "share the student's tokenizer: choose a teacher of the same model family."
        )


class Teacher:
    """The teacher's model, loaded for inference (with distill.quantization) on the student's device."""

    def __init__(self, recipe: Recipe, weights: TeacherWeights) -> None:
        from rlcli.models.loading import load_policy

        self.weights = weights
        self.micro_batch_size = recipe.grpo.micro_batch_size
        model_cfg = recipe.model.model_copy(update={"name": weights.model})
        quantization = QuantizationSection(mode=recipe.distill.quantization)
        self.model, _ = load_policy(model_cfg, None, quantization, adapter=weights.folder, trainable=False)

    def score(self, ctx: RunContext, episodes: list[LabelledEpisode]) -> dict[TurnKey, list[float]]:
        """The teacher's logprob (at temperature 1: its own distribution) of every token each turn of
        `episodes` sampled, in the context the student saw: the training sequences' own tokens."""
        from rlcli.engine.grpo.batch import episode_sequences, stored_id
        from rlcli.engine.grpo.update import sequence_logprobs, sequence_pictures

        sequences = [
            seq
            for e in episodes
            if e.episode.turns
            for seq in episode_sequences(stored_id(e), e.episode.task_index, e.episode.turns)
        ]
        if not sequences:
            return {}
        pictures = sequence_pictures(ctx, sequences)
        logprobs = sequence_logprobs(self.model, sequences, self.micro_batch_size, 1.0, True, pictures)
        scored: dict[TurnKey, list[float]] = {}
        for seq, row in zip(sequences, logprobs):
            values = row.tolist()  # one copy per sequence, not per token
            offset = len(seq.ids) - len(values)  # the row holds the sequence's last len(values) positions
            for position, (trained, turn) in enumerate(zip(seq.mask, seq.turn_of_token)):
                if trained:
                    scored.setdefault((seq.episode_id, turn), []).append(values[position - offset])
        return scored


class Teaching:
    """A distill phase's teach/<i> stages; the teacher is loaded by the first one with work to do (a
    resumed phase whose iterations were all scored never loads it) and kept until the phase ends."""

    def __init__(self, ctx: RunContext, weights: TeacherWeights, first: int) -> None:
        self.ctx, self.weights, self.first = ctx, weights, first
        self.teacher: Teacher | None = None

    def teach(self, it: int) -> None:
        """Stage teach/it: the teacher's logprobs of the episodes train/it trains on, stored as it ends."""
        from rlcli.engine.grpo.selection import choose_groups

        ctx, name = self.ctx, teach_stage(it)
        scored: dict[TurnKey, list[float]] = {}

        def work() -> dict[str, Any]:
            if self.teacher is None:
                ctx.console.print(f"distill: loading the teacher, {self.weights.shown}")
                self.teacher = Teacher(ctx.recipe, self.weights)
            scored.update(self.teacher.score(ctx, choose_groups(ctx, it, self.first).episodes))
            return {"turns": len(scored), "tokens": sum(len(v) for v in scored.values())}

        ctx.stage(
            name,
            work,
            params={"teacher": self.weights.shown},
            commit=lambda _: store_teacher_logprobs(ctx.store, name, scored),
        )

    def release(self) -> None:
        self.teacher = None
