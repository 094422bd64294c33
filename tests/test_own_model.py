"""docs/own-model.md, "Your own model and data", as a user runs it: a Hugging Face config
(Qwen2-style: biases, grouped-query attention, untied head), a tokenizer file, and
pre-tokenized .npy shards; `diloco run` with that config, `diloco export`, and
transformers loads the export with our logits; `diloco sample` continues a prompt
with the run's own tokenizer. Also: the shipped example config, and the errors a
user meets with shards, each one line with nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers  # a dev dependency (pyproject): always installed for the tests
import yaml
from cli_runs import ROOT, SHORT, clean_env
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from cli.app import app
from diloco.run import open_run
from workers.config import load_config
from workers.data.sources import resolve_sources
from workers.export import canonical_model
from workers.model import build_model

DILOCO = str(Path(sys.executable).parent / "diloco")

QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 384,
    "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "hidden_act": "silu", "use_sliding_window": False, "sliding_window": None,
    "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
    "bos_token_id": None, "eos_token_id": None,
}


def shakespeare(limit: int) -> str:
    src = resolve_sources(["builtin:shakespeare/tragedies/*"])
    text, left = [], limit
    for f in src:
        data = f.read(left)
        text.append(data.decode("utf-8", errors="ignore"))
        left -= len(data)
        if left <= 0:
            break
    return "".join(text)


@pytest.fixture(scope="module")
def own(tmp_path_factory) -> Path:
    """A user's folder: config.json, tokenizer.json, two .npy token shards, a recipe."""
    home = tmp_path_factory.mktemp("user")
    (home / "qwen").mkdir()
    (home / "qwen" / "config.json").write_text(json.dumps(QWEN2, indent=2))
    text = shakespeare(200_000)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=384, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(str(home / "tokenizer.json"))
    ids = np.asarray(tok.encode(text).ids, dtype=np.uint16)
    half = len(ids) // 2
    (home / "shards").mkdir()
    np.save(home / "shards" / "part-000.npy", ids[:half])
    np.save(home / "shards" / "part-001.npy", ids[half:])
    (home / "own.yaml").write_text(yaml.safe_dump({
        "name": "own",
        "model": {"hf_config": "qwen/config.json"},
        "data": {"sources": ["shards/*.npy"], "tokenizer": "tokenizer.json"},
    }))
    return home


def diloco(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([DILOCO, *args], cwd=cwd, text=True, capture_output=True,
                          timeout=timeout, env=clean_env(cwd, shared_prefect=True, DILOCO_TRACKING="off"))


def short_run() -> list[str]:
    """The suite's short run (`SHORT`), minus its model and data (the user's own here)."""
    args, out = list(SHORT), []
    while args:
        flag, value = args.pop(0), args.pop(0)
        if not value.startswith(("model.", "data.sources")):
            out += [flag, value]
    return out


@pytest.mark.slow
def test_run_export_sample_with_your_own_config_tokenizer_and_shards(own, in_process,
                                                                     monkeypatch):
    # one worker: the user's model, tokenizer and shards are the subject, not how many
    # train them (a job process less)
    out = diloco(["run", "own.yaml", *short_run(), "--set", "workers=[region-a]"], own)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    run = next((own / "runs").iterdir())
    canon = canonical_model(open_run(str(run)))
    assert canon.model.layers[0].attn.wq.bias is not None  # Qwen2's q/k/v biases
    assert canon.model.head is not None  # untied

    # export and sample in this process, from the user's folder (what they write is
    # the subject, not the command's start-up)
    monkeypatch.chdir(own)
    export = in_process.invoke(app, ["export", run.name, "--out", "my-model"])
    assert export.exit_code == 0, export.stdout + export.stderr
    model_dir = own / "my-model"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in model_dir.iterdir()}
    assert json.loads((model_dir / "config.json").read_text())["model_type"] == "qwen2"
    assert (model_dir / "tokenizer.json").read_bytes() == (own / "tokenizer.json").read_bytes()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    x = torch.randint(0, 384, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=x).logits, canon.model(x)[0],
                                   atol=1e-4, rtol=1e-4)

    sample = in_process.invoke(app, ["sample", run.name, "--prompt", "KING LEAR:",
                                     "--tokens", "12"])
    assert sample.exit_code == 0, sample.stderr
    assert sample.stdout.startswith("KING LEAR:")
    assert len(sample.stdout) > len("KING LEAR:\n")


def test_the_example_config_builds_its_hf_model():
    cfg = load_config(ROOT / "configs" / "own-model.yaml")
    assert cfg.model.hf is not None and cfg.model.hf["model_type"] == "llama"
    model = build_model(cfg.model_config_resolved)
    assert sum(p.numel() for p in model.parameters()) == cfg.model_config_resolved.num_parameters()
    assert cfg.model_config_resolved.kv_heads == 2


def _store_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


@pytest.mark.parametrize(("make", "sets", "words"), [
    (lambda d: np.save(d / "f.npy", np.zeros(500, np.float32)), [],
     ["f.npy", "float32", "uint16"]),
    (lambda d: np.arange(20, dtype=np.uint16).tofile(d / "short.bin"), [],
     ["short.bin holds 20 tokens", "seq_len + 1 = 33"]),
    (lambda d: np.arange(100, dtype=np.uint16).tofile(d / "small.bin"), [],
     ["data:", "gets 24 train tokens", "seq_len + 1 = 33"]),
    (lambda d: (np.arange(4000) % 200).astype(np.uint32).tofile(d / "wide.bin"), [],
     ["wide.bin", "uint32", "data.dtype"]),
    (lambda d: np.save(d / "u16.npy", np.arange(4000, dtype=np.uint16) % 200),
     ["--set", "data.dtype=uint32"], ["u16.npy", "data.dtype", "uint16"]),
], ids=["npy-float32", "shorter-than-a-sequence", "a-slot-shorter-than-a-sequence", "uint32-read-as-uint16", "dtype-vs-header"])
def test_shard_errors_are_named_and_nothing_is_written(in_process, tmp_path, make, sets, words):
    make(tmp_path)
    name = next(p.name for p in tmp_path.iterdir() if p.suffix in (".npy", ".bin"))
    result = in_process.invoke(app, ["run", *SHORT, "--set", f"data.sources=[{name}]", *sets])
    assert result.exit_code == 2, result.output
    line = " ".join(result.stderr.split())
    assert line.startswith("error: ") and line.count("error:") == 1, result.stderr
    for word in words:
        assert word in line, line
    assert _store_files(tmp_path / "runs") == []
