"""The shipped recipes (workers/recipes/, package data) and how a config argument is
resolved: a recipe name or a YAML file, whatever the working directory."""

from __future__ import annotations

import pytest

from workers.config import ConfigError, load_config, recipe_names, resolve_recipe


def test_every_shipped_recipe_is_a_valid_config_named_after_its_file():
    assert recipe_names() == ["gpu-150m", "gpu-1b", "small", "tiny"]
    for name in recipe_names():
        assert load_config(name).name == name


def test_the_gpu_recipes_ask_for_a_gpu_and_tiny_runs_anywhere():
    assert load_config("tiny").train.device == "auto"
    assert {load_config(n).train.device for n in ("gpu-150m", "gpu-1b")} == {"cuda"}


def test_a_yaml_file_is_read_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text("name: mine\ntrain: {steps: 7}\n")
    cfg = load_config("mine.yaml", ["train.eval_every=0"])
    assert (cfg.name, cfg.train.steps, cfg.train.eval_every) == ("mine", 7, 0)


def test_a_file_named_like_a_recipe_wins_and_a_folder_does_not(tmp_path, monkeypatch):
    """A user's own file called ``small`` is theirs to mean; a folder called ``tiny``
    (a run's output, say) does not hide the recipe."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "small").write_text("name: my-small\n")
    (tmp_path / "tiny").mkdir()
    assert load_config("small").name == "my-small"
    assert load_config("tiny").name == "tiny"
    assert resolve_recipe("tiny").name == "tiny.yaml"


def test_an_unknown_name_lists_the_recipes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^config 'tiyn' is neither a file nor a recipe; "
                                          r"recipes: gpu-150m, gpu-1b, small, tiny$"):
        load_config("tiyn")
