"""Hugging Face hub datasets for SFT (`sft.source: hub:ORG/NAME`, read offline from the datasets cache),
and `rlcli export --push-to-hub` / `rlcli runs export --push-to-hub` (staged with --dry-run; the upload
itself against a stand-in HfApi). Nothing here reaches the network: the tests run with HF_HUB_OFFLINE=1
and HF_DATASETS_OFFLINE=1 (conftest.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import yaml

from helpers import cache_hub_dataset, run_in_process, write_recipe
from rlcli.errors import UsageError
from rlcli.store.run_store import RunStore

CHATS = "rlcli-test/tiny_chats"  # config `chats`, a `conversations` column of chats
QA = "rlcli-test/tiny_qa"  # the default config, `question` and `answer` strings
CHAT_ROWS = {
    "conversations": [
        [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": str(a + b)}]
        for a, b in [(2, 3), (1, 1), (4, 4), (3, 6)]
    ],
    "source": ["hand"] * 4,  # a column rlcli does not read
}
SFT = {"batch_size": 2, "micro_batch_size": 2, "eval_fraction": 0.0}


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A datasets cache holding CHATS and QA, as datasets' cache for the module's tests."""
    import datasets

    cache = tmp_path_factory.mktemp("hf-datasets")
    cache_hub_dataset(cache, CHATS, CHAT_ROWS, config="chats")
    cache_hub_dataset(cache, QA, {"question": ["What is 2 + 3?", "What is 1 + 1?"], "answer": ["5", "2"]})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
        yield cache


@pytest.fixture(scope="module")
def trained(hub_cache, tmp_path_factory, session_models):
    """Run `t`: SFT on CHATS (columns mapped), then an eval of base and sft, offline, on tiny-random."""
    folder = tmp_path_factory.mktemp("trained")
    recipe = write_recipe(
        folder / "r.yaml",
        run={"name": "t", "seed": 0, "stages": ["sft", "eval"]},
        sft={"source": f"hub:{CHATS}", "columns": {"conversations": "messages"}, **SFT},
        eval={"tasks": 2, "checkpoints": ["base", "sft"]},
    )
    runs = folder / "runs"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RLCLI_MODELS", str(session_models))
        done = run_in_process(["run", "-r", recipe], runs)
    assert done.returncode == 0, done.stderr
    return runs, recipe


def run_db_digest(runs: Path) -> str:
    return hashlib.sha256((runs / "rlcli.db").read_bytes()).hexdigest()


def one_sentence(err: str) -> str:
    """stderr as one line, the console's wrapping undone; asserts it is a single error."""
    assert err.count("Error:") == 1 and "Traceback" not in err, err
    return " ".join(err.split())


# --- SFT on a hub dataset -------------------------------------------------------------------------------


def test_sft_trains_offline_on_a_cached_hub_dataset(trained):
    import datasets

    from rlcli.store.checkpoints import resolve_checkpoint
    from rlcli.store.db import RunDB
    from rlcli.store.evals import eval_results

    assert datasets.config.HF_HUB_OFFLINE  # the cache, not the hub
    runs, _ = trained
    rundb = RunDB.open(runs)
    try:
        stage = rundb.stage("t", "sft")
        assert stage.done and stage.result["source"] == f"hub:{CHATS}" and stage.result["examples"] == 4
        assert stage.params["columns"] == {"conversations": "messages"} and stage.params["dataset_split"] == "train"
        assert len(stage.params["data_fingerprint"]) == 16
        assert resolve_checkpoint(RunStore(rundb, "t"), "sft") is not None
        assert sorted(r.checkpoint for r in eval_results(RunStore(rundb, "t"))) == ["base", "sft"]
    finally:
        rundb.close()


def test_a_resume_on_another_version_of_the_dataset_is_refused(trained, hub_cache, tmp_path, monkeypatch):
    import datasets

    from rlcli.store.db import RunDB

    runs, recipe = trained
    newer = tmp_path / "cache"
    shutil.copytree(hub_cache, newer)
    changed = {**CHAT_ROWS, "source": ["edited"] * 4}
    cache_hub_dataset(newer, CHATS, changed, config="chats")  # a second version, the newest: what loads now
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", newer)
    done = run_in_process(["sft", "-r", recipe], runs)
    assert done.returncode == 2
    assert "was run with data_fingerprint=" in one_sentence(done.stderr)
    # Another split is other rows too (--force past the recipe check: the stage's identity refuses it).
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", hub_cache)
    done = run_in_process(["sft", "-r", recipe, "--force", "sft.dataset_split=train[:2]"], runs)
    assert done.returncode == 2 and "was run with dataset_split='train'" in one_sentence(done.stderr)
    rundb = RunDB.open(runs)
    try:
        assert rundb.stage("t", "sft").done and rundb.get_run("t").status == "done"
    finally:
        rundb.close()


def test_an_uncached_hub_dataset_fails_in_one_sentence_before_any_write(trained, tmp_path):
    runs, _ = trained
    recipe = write_recipe(tmp_path / "r.yaml", run={"name": "u"}, sft={"source": "hub:rlcli-test/not_cached", **SFT})
    before = run_db_digest(runs)
    done = run_in_process(["sft", "-r", recipe], runs)
    assert done.returncode == 2 and done.stdout == ""
    message = one_sentence(done.stderr)
    assert "hub dataset rlcli-test/not_cached is not in the local datasets cache" in message
    assert "the machine is offline" in message
    assert run_db_digest(runs) == before  # the run database untouched
    assert not (runs / "u").exists()
    fresh = tmp_path / "fresh"
    assert run_in_process(["sft", "-r", recipe], fresh).returncode == 2
    assert not (fresh / "rlcli.db").exists()  # no database made either


def test_prompt_completion_columns_config_and_split(hub_cache):
    from rlcli.engine.sft_sources import check_hub_dataset, data_identity, read_data_source, sft_hub_split
    from rlcli.recipe import SftSection

    qa = SftSection(source=f"hub:{QA}", columns={"question": "prompt", "answer": "completion"})
    check_hub_dataset(sft_hub_split(qa))
    first, second = read_data_source(qa)
    assert first.messages == [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    assert first.first_trained == 1 and second.origin == f"hub:{QA} (train): row 2"
    assert [
        c.messages[0]["content"] for c in read_data_source(qa.model_copy(update={"dataset_split": "train[1:]"}))
    ] == ["What is 1 + 1?"]
    chats = SftSection(source=f"hub:{CHATS}", dataset_config="chats", columns={"conversations": "messages"})
    assert len(read_data_source(chats)) == 4
    assert data_identity(chats) == data_identity(chats)  # the fingerprint is stable
    refusals = [
        (SftSection(source=f"hub:{CHATS}", dataset_config="other"), "holds its config chats only"),
        (SftSection(source=f"hub:{QA}", dataset_split="test"), "has no split 'test' (it has train)"),
        (SftSection(source=f"hub:{QA}", columns={"query": "prompt"}), "has no column 'query'"),
        (SftSection(source=f"hub:{QA}"), "has none of the columns SFT reads"),
    ]
    for cfg, expected in refusals:
        with pytest.raises(UsageError, match=r"^sft\.\w+: .*" + expected.replace("(", r"\(").replace(")", r"\)")):
            check_hub_dataset(sft_hub_split(cfg))
            read_data_source(cfg)


def test_columns_rename_a_data_file_too(tmp_path):
    from rlcli.engine.sft_sources import read_data_source
    from rlcli.recipe import SftSection

    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"q": "What is 2 + 3?", "a": "5", "prompt": "ignored: q replaces it"}) + "\n")
    [conversation] = read_data_source(SftSection(source=str(data), columns={"q": "prompt", "a": "completion"}))
    assert conversation.messages[0]["content"] == "What is 2 + 3?" and conversation.first_trained == 1


@pytest.mark.parametrize(
    ("sft", "expected"),
    [
        ({"source": "hub:a/b/c"}, "expected hub:NAME or hub:ORG/NAME"),
        ({"source": "data.jsonl", "dataset_config": "x"}, "sft.dataset_config names a hub dataset's config"),
        ({"source": "hub:a/b", "columns": {"text": "content"}}, "the columns SFT reads are messages"),
        ({"source": "expert", "columns": {"a": "messages"}}, "sft.source expert has none"),
    ],
)
def test_recipe_refuses_malformed_hub_fields(tmp_path, sft, expected):
    from rlcli.recipe import load_recipe

    with pytest.raises(UsageError, match=expected):
        load_recipe(write_recipe(tmp_path / "r.yaml", sft=sft), [])


# --- pushing to the hub --------------------------------------------------------------------------------


def card(folder: Path) -> tuple[dict, str]:
    """A staged card's front matter (parsed) and body."""
    text = (folder / "README.md").read_text()
    assert text.startswith("---\n")
    front, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(front), body


def test_export_dry_run_stages_the_merged_model_and_its_card(trained, tmp_path):
    runs, _ = trained
    done = run_in_process(["export", "t", "--push-to-hub", "me/tiny-sft", "--dry-run", "--json"], runs)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    folder = Path(result["folder"])
    assert folder == runs / "t" / "hub-model" and result["uploaded"] is False and result["url"] is None
    assert result["files"] == sorted(p.name for p in folder.iterdir() if p.name != ".rlcli-export")
    assert {"config.json", "model.safetensors", "README.md", "curves.png", "rlcli-recipe.yaml"} <= set(result["files"])
    assert (folder / "curves.png").read_bytes().startswith(b"\x89PNG")
    front, body = card(folder)
    assert front["library_name"] == "transformers" and front["pipeline_tag"] == "text-generation"
    assert "base_model" not in front  # tiny-random is built locally: there is no hub model to name
    assert front["datasets"] == [CHATS] and {"rlcli", "sft"} <= set(front["tags"])
    assert front["license"] == "other" and "set run.license" in body  # the placeholder, and what to do about it
    assert "`tiny-random`" in body and "the SFT checkpoint" in body and 'from_pretrained("me/tiny-sft")' in body
    assert "| checkpoint | tasks×k | success | 95% CI |" in body and "| sft (#1) | 2×1 |" in body
    assert "![Training curves of run t](curves.png)" in body and "| `sft/loss` | sft | 2 |" in body
    recipe = yaml.safe_load((folder / "rlcli-recipe.yaml").read_text())
    assert recipe["sft"]["source"] == f"hub:{CHATS}" and f"source: hub:{CHATS}" in body
    assert "license: other" in done.stderr.replace("`", "") and "--dry-run" in done.stderr
    # The default folder is rlcli's: a second dry run replaces it; --merge names another, printed alone.
    again = run_in_process(["export", "t", "--push-to-hub", "me/tiny-sft", "--dry-run"], runs)
    assert again.returncode == 0 and again.stdout.strip() == str(folder)
    merged = tmp_path / "merged"
    chosen = run_in_process(["export", "t", "--merge", merged, "--push-to-hub", "me/tiny-sft", "--dry-run"], runs)
    assert chosen.returncode == 0 and chosen.stdout.strip() == str(merged) and (merged / "README.md").is_file()


def test_the_card_names_the_hub_base_model_and_the_recipes_license():
    from rlcli.recipe import Recipe
    from rlcli.report.hub import _front_matter, base_model_id

    assert base_model_id("smollm2-135m") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert base_model_id("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert base_model_id("tiny-random") is None and base_model_id("./models/mine") is None
    recipe = Recipe.model_validate({"run": {"license": "apache-2.0"}})
    front = yaml.safe_load(_front_matter("model", recipe, base_model="Qwen/Qwen2.5-0.5B-Instruct", tags=["rlcli"]))
    assert front == {"base_model": "Qwen/Qwen2.5-0.5B-Instruct", "license": "apache-2.0", "tags": ["rlcli"]}


def test_runs_export_dry_run_stages_a_dataset_that_loads(trained):
    import datasets

    runs, _ = trained
    done = run_in_process(["runs", "export", "t", "--push-to-hub", "me/tiny-episodes", "--dry-run", "--json"], runs)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    folder = Path(result["folder"])
    assert folder == runs / "t" / "hub-dataset" and result["uploaded"] is False
    assert {"episodes.parquet", "turns.parquet", "run.json", "README.md", "rlcli-recipe.yaml"} <= set(result["files"])
    front, body = card(folder)
    configs = {c["config_name"]: c for c in front["configs"]}
    assert configs["episodes"]["default"] is True and "rewards" not in configs  # an empty table is no config
    assert configs["turns"]["data_files"] == [{"split": "train", "path": "turns.parquet"}]
    assert "rlcli" in front["tags"] and "| `episodes.parquet` | episodes | 4 |" in body and "| sft (#1) |" in body
    # What a user's load_dataset("me/tiny-episodes") reads: the card's configs, from the staged files.
    assert result["rows"]["episodes"] == 4
    assert len(datasets.load_dataset(str(folder), split="train", cache_dir=str(folder.parent / "ds-cache"))) == 4
    evals = datasets.load_dataset(str(folder), "evals", split="train", cache_dir=str(folder.parent / "ds-cache"))
    assert sorted(evals["checkpoint"]) == ["base", "sft"]


@pytest.mark.parametrize("command", [["export", "t"], ["runs", "export", "t"]])
def test_a_push_is_refused_offline_or_without_a_token(trained, tmp_path, monkeypatch, command):
    from huggingface_hub import constants

    runs, _ = trained
    target = ["--merge" if command[0] == "export" else "--out", tmp_path / "staged"]
    done = run_in_process([*command, *target, "--push-to-hub", "me/x"], runs)
    assert done.returncode == 2 and "HF_HUB_OFFLINE is set" in one_sentence(done.stderr)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    done = run_in_process([*command, *target, "--push-to-hub", "me/x"], runs)
    assert done.returncode == 2 and "without a token: log in with `hf auth login`" in one_sentence(done.stderr)
    for args, expected in [
        (["--push-to-hub", "me/x/y"], "is not a hub repo id"),
        (["--private"], "--private goes with --push-to-hub"),
        (["--dry-run"], "--dry-run goes with --push-to-hub"),
    ]:
        done = run_in_process([*command, *target, *args], runs)
        assert done.returncode == 2 and expected in one_sentence(done.stderr)
    assert not (tmp_path / "staged").exists()  # refused before anything was written


class FakeHub:
    """HfApi's create_repo, repo_info and upload_folder, recording what they were asked."""

    def __init__(self, existing_public: bool = False) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.existing_public = existing_public

    def install(self, monkeypatch) -> None:
        from huggingface_hub import HfApi, constants
        from huggingface_hub.hf_api import RepoUrl

        hub = self

        def create_repo(self, repo_id, **kwargs):
            hub.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))
            prefix = "datasets/" if kwargs.get("repo_type") == "dataset" else ""
            return RepoUrl(f"https://huggingface.co/{prefix}{repo_id}")

        def repo_info(self, repo_id, **kwargs):
            hub.calls.append(("repo_info", {"repo_id": repo_id, **kwargs}))
            return type("Info", (), {"private": not hub.existing_public})()

        def upload_folder(self, **kwargs):
            hub.calls.append(
                ("upload_folder", {**kwargs, "files": sorted(p.name for p in Path(kwargs["folder_path"]).iterdir())})
            )

        monkeypatch.setattr(HfApi, "create_repo", create_repo)
        monkeypatch.setattr(HfApi, "repo_info", repo_info)
        monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")


def test_a_push_creates_the_repo_and_uploads_the_staged_folder(trained, monkeypatch):
    runs, _ = trained
    hub = FakeHub()
    hub.install(monkeypatch)
    done = run_in_process(["export", "t", "--push-to-hub", "me/tiny-sft"], runs)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "https://huggingface.co/me/tiny-sft"
    [(_, create), (_, upload)] = hub.calls
    assert create == {"repo_id": "me/tiny-sft", "repo_type": "model", "private": None, "exist_ok": True}
    assert upload["repo_id"] == "me/tiny-sft" and upload["repo_type"] == "model"
    assert Path(upload["folder_path"]) == runs / "t" / "hub-model" and upload["ignore_patterns"] == [".rlcli-export"]
    assert "README.md" in upload["files"] and "model.safetensors" in upload["files"]

    hub.calls.clear()
    done = run_in_process(["runs", "export", "t", "--push-to-hub", "me/tiny-episodes", "--private", "--json"], runs)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["uploaded"] is True and result["url"] == "https://huggingface.co/datasets/me/tiny-episodes"
    assert [name for name, _ in hub.calls] == ["create_repo", "repo_info", "upload_folder"]
    assert hub.calls[0][1]["private"] is True and hub.calls[2][1]["repo_type"] == "dataset"
    assert "episodes.parquet" in hub.calls[2][1]["files"]

    # --private and a public repo already there: refused, nothing uploaded.
    public = FakeHub(existing_public=True)
    public.install(monkeypatch)
    done = run_in_process(["runs", "export", "t", "--push-to-hub", "me/tiny-episodes", "--private"], runs)
    assert done.returncode == 2 and "exists on the hub and is public" in one_sentence(done.stderr)
    assert "upload_folder" not in [name for name, _ in public.calls]
