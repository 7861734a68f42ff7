"""Recipe schema, YAML loading, dotted overrides, resume comparison and hashing (no model, no torch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlcli.errors import UsageError
from rlcli.recipe import (
    Recipe,
    apply_override,
    changed_fields,
    load_recipe,
    validate_recipe,
)

REPO = Path(__file__).parents[2]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def usage_error(path: Path | None = None, overrides: list[str] = (), data: dict | None = None) -> str:
    with pytest.raises(UsageError) as info:
        if data is not None:
            validate_recipe(data, "where.yaml")
        else:
            load_recipe(path, list(overrides))
    return str(info.value)


# --- defaults and shipped recipes ----------------------------------------------


def test_defaults_validate():
    recipe = load_recipe(None)
    assert recipe == Recipe()
    assert recipe.lora is not None and recipe.quantization.mode == "none"
    assert [r.component for r in recipe.rewards] == ["env_return"]
    # The resolved dict round-trips through validation unchanged.
    assert validate_recipe(recipe.to_dict(), "x").to_dict() == recipe.to_dict()


def test_empty_file_is_the_defaults(tmp_path):
    assert load_recipe(write(tmp_path, "")) == Recipe()


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_shipped_recipe_validates(path):
    recipe = load_recipe(path)
    assert isinstance(recipe, Recipe)
    assert recipe.sha256() == load_recipe(path).sha256()


def test_recipes_folder_has_the_quickstart():
    # The parametrized tests above would be skipped (an empty parameter set) without recipes: this fails.
    assert len(RECIPES) >= 1
    assert REPO / "recipes" / "quickstart.yaml" in RECIPES


# --- unknown keys: dotted path and did-you-mean ----------------------------------


@pytest.mark.parametrize(
    "text, dotted, suggestion",
    [
        ("grpo:\n  lrr: 1.0e-5\n", "grpo.lrr", "grpo.lr"),
        ("runn:\n  name: x\n", "runn", "run"),
        ("rollout:\n  group_sise: 4\n", "rollout.group_sise", "rollout.group_size"),
        ("rewards:\n  - fnn: env_return\n", "rewards.0.fnn", "rewards.0.fn"),
        ("rewards:\n  - fn: env_return\n  - fn: format\n    wieght: 0.5\n", "rewards.1.wieght", "rewards.1.weight"),
        ("lora:\n  rr: 8\n", "lora.rr", "lora.r"),
        ("quantization:\n  mdoe: 4bit\n", "quantization.mdoe", "quantization.mode"),
    ],
)
def test_unknown_key_names_dotted_path_and_suggestion(tmp_path, text, dotted, suggestion):
    path = write(tmp_path, text)
    message = usage_error(path)
    assert str(path) in message
    assert f"unknown key {dotted}" in message
    assert f"did you mean {suggestion}?" in message


def test_unknown_key_without_close_match_lists_the_fields(tmp_path):
    message = usage_error(write(tmp_path, "grpo:\n  zzzzzz: 1\n"))
    assert "grpo.zzzzzz" in message
    assert "expected one of:" in message and "lr" in message and "iterations" in message


def test_unknown_key_through_override():
    message = usage_error(None, ["grpo.lrr=1e-5"])
    assert "grpo.lrr" in message and "grpo.lr?" in message


# --- type errors, files, YAML -----------------------------------------------------


@pytest.mark.parametrize(
    "text, dotted, got",
    [
        ("grpo:\n  lr: fast\n", "grpo.lr", "'fast'"),
        ("rollout:\n  group_size: many\n", "rollout.group_size", "'many'"),
        ("rollout:\n  group_size: 0\n", "rollout.group_size", "0"),
        ("model:\n  dtype: float8\n", "model.dtype", "'float8'"),
        ("rewards:\n  - fn: env_return\n    weight: heavy\n", "rewards.0.weight", "'heavy'"),
        ("grpo: 5\n", "grpo", "5"),
    ],
)
def test_type_error_names_file_and_dotted_path(tmp_path, text, dotted, got):
    path = write(tmp_path, text)
    message = usage_error(path)
    assert message.startswith(f"{path}: {dotted}: ")
    assert f"got {got}" in message


def test_missing_required_reward_fn(tmp_path):
    message = usage_error(write(tmp_path, "rewards:\n  - weight: 1.0\n"))
    assert "rewards.0.fn is required" in message


def test_min_entropy_without_held_out_replies(tmp_path):
    message = usage_error(write(tmp_path, "sft:\n  min_entropy: 0.3\n  eval_fraction: 0\n"))
    assert "sft.min_entropy is measured on held-out replies; set sft.eval_fraction above 0" in message


def test_duplicate_reward_components(tmp_path):
    message = usage_error(write(tmp_path, "rewards:\n  - fn: format\n  - fn: format\n"))
    assert "rewards" in message and "unique" in message and "format" in message
    ok = load_recipe(write(tmp_path, "rewards:\n  - fn: format\n  - {fn: format, name: format2}\n", "ok.yaml"))
    assert [r.component for r in ok.rewards] == ["format", "format2"]


@pytest.mark.parametrize(
    "text, line",
    [
        ("grpo:\n  lr: 1\n bad: [\n", 3),
        ("run:\n  name: x\ngrpo: {lr: [1, 2}\n", 3),
        ("run:\n\tname: x\n", 2),
    ],
)
def test_invalid_yaml_names_file_and_line(tmp_path, text, line):
    path = write(tmp_path, text)
    message = usage_error(path)
    assert str(path) in message
    assert "not valid YAML" in message
    assert f"line {line}" in message


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    message = usage_error(path)
    assert str(path) in message and "does not exist" in message


@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "list"), ("just words\n", "str"), ("42\n", "int")])
def test_non_mapping_yaml(tmp_path, text, kind):
    path = write(tmp_path, text)
    message = usage_error(path)
    assert str(path) in message and "mapping" in message and kind in message


def test_non_utf8_file_is_a_usage_error(tmp_path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe\x00grpo: {}\n")
    message = usage_error(path)
    assert str(path) in message


# --- dotted overrides ---------------------------------------------------------------


def test_overrides_convert_to_field_types():
    recipe = load_recipe(None, ["grpo.lr=1e-5", "rollout.group_size=8", "run.name=123", "rollout.temperature=0"])
    assert recipe.grpo.lr == 1e-05 and type(recipe.grpo.lr) is float
    assert recipe.rollout.group_size == 8 and type(recipe.rollout.group_size) is int
    assert recipe.run.name == "123" and type(recipe.run.name) is str
    assert recipe.rollout.temperature == 0.0 and type(recipe.rollout.temperature) is float


def test_overrides_apply_on_top_of_the_file(tmp_path):
    path = write(tmp_path, "grpo:\n  lr: 3.0e-4\n  iterations: 2\nrollout:\n  tasks: 4\n")
    recipe = load_recipe(path, ["grpo.lr=1e-3", "rollout.stop=[END, '###']", "env.kwargs.max_number=50"])
    assert recipe.grpo.lr == 1e-3
    assert recipe.grpo.iterations == 2 and recipe.rollout.tasks == 4  # untouched file values stay
    assert recipe.rollout.stop == ["END", "###"]
    assert recipe.env.kwargs == {"max_number": 50}


def test_override_lora_null():
    assert load_recipe(None, ["lora=null"]).lora is None


def test_override_quantization_shorthand_and_dotted():
    assert load_recipe(None, ["quantization=4bit"]).quantization.mode == "4bit"
    assert load_recipe(None, ["quantization.mode=8bit"]).quantization.mode == "8bit"


def test_override_into_shorthand_section(tmp_path):
    path = write(tmp_path, "quantization: 4bit\n")
    assert load_recipe(path).quantization.mode == "4bit"
    recipe = load_recipe(path, ["quantization.quant_type=fp4"])
    assert (recipe.quantization.mode, recipe.quantization.quant_type) == ("4bit", "fp4")


@pytest.mark.parametrize("item", ["grpo.lr", "=1e-5", "noequals", ""])
def test_bad_override_syntax(item):
    message = usage_error(None, [item])
    assert repr(item) in message and "section.field=value" in message


def test_override_through_a_scalar_is_refused():
    data = {"grpo": {"lr": 1e-5}}
    with pytest.raises(UsageError, match=r"lr is not a section"):
        apply_override(data, "grpo.lr.x=1")


def test_override_type_error_names_field():
    message = usage_error(None, ["rollout.group_size=lots"])
    assert "rollout.group_size" in message and "'lots'" in message


@pytest.mark.parametrize(
    "item, expected", [("run.name=1e3", "1e3"), ("run.name=007", "007"), ("run.description=yes", "yes")]
)
def test_override_of_str_field_keeps_text(item, expected):
    recipe = load_recipe(None, [item])
    assert expected in (recipe.run.name, recipe.run.description)


# --- combinations ---------------------------------------------------------------------


def test_quantization_without_lora_is_refused(tmp_path):
    path = write(tmp_path, "quantization: 4bit\nlora: null\n")
    message = usage_error(path)
    assert str(path) in message and "quantized" in message and "lora" in message
    with pytest.raises(UsageError, match="quantized"):
        load_recipe(None, ["quantization=8bit", "lora=null"])
    # Either one alone is fine.
    assert load_recipe(None, ["lora=null"]).quantization.mode == "none"
    assert load_recipe(None, ["quantization=4bit"]).lora is not None


# --- resume comparison and hashing ---------------------------------------------------------


def test_run_names_field_states_what_a_name_may_be():
    # A 101-character name is refused (check_run_name); the field that takes it says so.
    description = Recipe.model_fields["run"].annotation.model_fields["name"].description
    assert "at most 100 characters" in description and "letters, digits and -_." in description


def test_changed_fields_ignores_resume_safe_fields():
    old = Recipe().to_dict()
    new = load_recipe(
        None,
        [
            "grpo.iterations=99",
            "eval.tasks=3",
            "run.description=longer",
            "eval.checkpoints=[latest]",
            "rollout.batch_size=4",
        ],
    ).to_dict()
    assert old != new
    assert changed_fields(old, new) == []


def test_changed_fields_reports_fields_that_matter():
    old = Recipe().to_dict()
    new = load_recipe(None, ["grpo.lr=1e-3", "grpo.iterations=99", "rollout.group_size=2"]).to_dict()
    assert changed_fields(old, new) == ["grpo.lr", "rollout.group_size"]
    assert changed_fields(old, old) == []


def test_changed_fields_sees_lists_and_removed_sections():
    old = Recipe().to_dict()
    assert changed_fields(old, load_recipe(None, ["rewards=[{fn: format}]"]).to_dict()) == ["rewards"]
    gone = changed_fields(old, load_recipe(None, ["lora=null"]).to_dict())
    assert gone and all(k.startswith("lora") for k in gone)
    assert changed_fields(old, load_recipe(None, ["env.kwargs.max_number=5"]).to_dict()) == [
        "env.kwargs",
        "env.kwargs.max_number",
    ]


def test_a_rewards_time_limit_may_change_on_resume_and_older_runs_lack_it():
    old = load_recipe(None, ["rewards=[{fn: env_return}]"]).to_dict()
    assert changed_fields(old, load_recipe(None, ["rewards=[{fn: env_return, timeout_s: 5}]"]).to_dict()) == []
    del old["rewards"][0]["timeout_s"]  # stored by an rlcli without the field
    assert changed_fields(old, load_recipe(None, ["rewards=[{fn: env_return}]"]).to_dict()) == []
    assert changed_fields(old, load_recipe(None, ["rewards=[{fn: env_return, weight: 2}]"]).to_dict()) == ["rewards"]


def test_fields_added_since_a_run_started_count_as_their_defaults():
    """A run stored by an older rlcli lacks the fields added since; they ran as their defaults, so a
    resume with the defaults is no change, and one that sets them otherwise is."""
    old = Recipe().to_dict()
    del old["grpo"]["eval_every"], old["grpo"]["keep_best"], old["grpo"]["importance"]
    assert changed_fields(old, Recipe().to_dict()) == []
    assert changed_fields(old, load_recipe(None, ["grpo.importance=sequence"]).to_dict()) == ["grpo.importance"]
    no_lora = load_recipe(None, ["lora=null"]).to_dict()
    assert changed_fields(no_lora, no_lora) == []


def test_sha256_stable_and_content_sensitive(tmp_path):
    a = load_recipe(write(tmp_path, "grpo:\n  lr: 1.0e-5\nrun:\n  seed: 1\n", "a.yaml"))
    # Same content, other key order and spelling: same hash.
    b = load_recipe(write(tmp_path, "run: {seed: 1}\ngrpo: {lr: 0.00001}\n", "b.yaml"))
    assert a.sha256() == b.sha256() == a.sha256()
    assert len(a.sha256()) == 64 and int(a.sha256(), 16) >= 0
    assert load_recipe(None, ["run.seed=1", "grpo.lr=2e-5"]).sha256() != a.sha256()
    assert Recipe().sha256() != a.sha256()
    # Even resume-safe fields are content: they change the hash (but not changed_fields).
    assert load_recipe(None, ["run.seed=1", "grpo.lr=1e-5", "grpo.iterations=3"]).sha256() != a.sha256()


# --- non-finite numbers --------------------------------------------------------


@pytest.mark.parametrize(
    "text, dotted",
    [
        ("grpo:\n  lr: .nan\n", "grpo.lr"),
        ("rollout:\n  temperature: .inf\n", "rollout.temperature"),
        ("env:\n  step_timeout_s: .inf\n", "env.step_timeout_s"),
        ("sft:\n  min_reward: -.inf\n", "sft.min_reward"),
        ("rewards:\n  - fn: env_return\n    weight: .nan\n", "rewards.0.weight"),
    ],
)
def test_non_finite_numbers_in_yaml_are_refused(tmp_path, text, dotted):
    message = usage_error(write(tmp_path, text))
    assert message.startswith(f"{tmp_path / 'recipe.yaml'}: {dotted}: ")
    assert "finite" in message and message.count(".") >= 1 and "\n" not in message


@pytest.mark.parametrize("item", ["grpo.lr=nan", "grpo.lr=.nan", "env.step_timeout_s=inf", "sft.min_reward=-inf"])
def test_non_finite_overrides_are_refused(item):
    message = usage_error(overrides=[item])
    assert f"{item.partition('=')[0]}: " in message and "finite" in message
