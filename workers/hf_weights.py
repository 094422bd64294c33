"""Hugging Face safetensors weights <-> our ``Transformer``'s parameters.

Names map one to one (``layers.i.attn.wq`` <-> ``model.layers.i.self_attn.q_proj``,
``mlp.w1/w3/w2`` <-> ``gate/up/down_proj``, ...). Our RoPE rotates half-split pairs,
the same convention as transformers' ``rotate_half``, so q and k need no
permutation (tests/test_hf.py checks it by comparing logits). Reading takes a file,
a directory or any fsspec URL (the bucket included), shard by shard; writing goes
to a temporary sibling directory renamed at the end, so a crash never leaves a
model directory that loads half.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save_file

from storage.backends import open_backend
from workers.hf_config import to_hf_config
from workers.model import Transformer

_ATTN = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
_MLP = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
_TOP = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "head.weight": "lm_head.weight"}
_LAYER = re.compile(r"^layers\.(\d+)\.(attn|mlp|attn_norm|mlp_norm)(?:\.(\w+))?\.(weight|bias)$")
#: Buffers some older checkpoints carry: not parameters, recomputed by every model.
_SKIP = re.compile(r"\.rotary_emb\.inv_freq$")


def hf_name(ours: str) -> str:
    """The Hugging Face name of our parameter ``ours``."""
    if ours in _TOP:
        return _TOP[ours]
    m = _LAYER.match(ours)
    if m is None:
        raise KeyError(f"no Hugging Face name for parameter {ours!r}")
    i, part, proj, kind = m.groups()
    if part in _NORMS:
        return f"model.layers.{i}.{_NORMS[part]}.{kind}"
    if part == "attn":
        return f"model.layers.{i}.self_attn.{_ATTN[proj]}.{kind}"
    return f"model.layers.{i}.mlp.{_MLP[proj]}.{kind}"


def to_hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """Our parameters under their Hugging Face names (float32, contiguous, detached);
    a tied model has no ``lm_head.weight``, as transformers saves it."""
    return {hf_name(k): v.detach().contiguous() for k, v in model.state_dict().items()}


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")


def load_hf_state_dict(model: Transformer, sd: dict[str, torch.Tensor], *, source: str) -> None:
    """Load Hugging Face weights ``sd`` into ``model`` (cast to its float32).

    Every parameter must be there with its shape and nothing else may be (a name we
    do not know is a model we would not reproduce); a tied model accepts an
    ``lm_head.weight`` only if it equals the embedding. Raises ValueError naming
    ``source`` and the first offending names; ``model`` is untouched on error.
    """
    ours = model.state_dict()
    wanted = {hf_name(k): k for k in ours}
    given = {k: v for k, v in sd.items() if not _SKIP.search(k)}
    if model.head is None and "lm_head.weight" in given:
        head = given.pop("lm_head.weight")
        embed = given.get("model.embed_tokens.weight")
        if embed is None or not torch.equal(head.float(), embed.float()):
            raise ValueError(f"init_from {source}: lm_head.weight differs from the embedding, "
                             "but the config ties them (tie_word_embeddings: true)")
    missing = sorted(set(wanted) - set(given))
    unexpected = sorted(set(given) - set(wanted))
    if missing or unexpected:
        what = f"missing {_few(missing)}" if missing else f"unexpected {_few(unexpected)}"
        raise ValueError(f"init_from {source}: tensors do not match the model config: {what}")
    loaded = {}
    for name, tensor in given.items():
        target = ours[wanted[name]]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"init_from {source}: {name} has shape {tuple(tensor.shape)}, "
                             f"the model config needs {tuple(target.shape)}")
        loaded[wanted[name]] = tensor.to(target.dtype)
    model.load_state_dict(loaded, strict=True)


def read_safetensors(path_or_url: str, storage_options: dict | None = None
                     ) -> dict[str, torch.Tensor]:
    """All tensors of a ``.safetensors`` file, or of a directory / URL prefix holding
    ``model.safetensors`` or ``model.safetensors.index.json`` and its shards.

    Read shard by shard (one shard's bytes in memory at a time besides the tensors).
    Raises ValueError naming the path when there is no model there.
    """
    backend = open_backend(path_or_url, storage_options)
    fs, root = backend.fs, backend.root

    def read(path: str) -> bytes:
        with fs.open(path, "rb") as f:
            return f.read()

    if root.endswith(".safetensors"):
        files = [root]
    elif fs.exists(f"{root}/model.safetensors.index.json"):
        index = json.loads(read(f"{root}/model.safetensors.index.json"))
        files = [f"{root}/{name}" for name in sorted(set(index["weight_map"].values()))]
    elif fs.exists(f"{root}/model.safetensors"):
        files = [f"{root}/model.safetensors"]
    else:
        raise ValueError(f"init_from {backend.url}: no .safetensors file, model.safetensors "
                         "or model.safetensors.index.json there")
    out: dict[str, torch.Tensor] = {}
    for path in files:
        if not fs.exists(path):
            raise ValueError(f"init_from {backend.url}: shard {path.rsplit('/', 1)[-1]} is missing")
        try:
            out.update(load_bytes(read(path)))
        except Exception as exc:  # noqa: BLE001 - SafetensorError is no ValueError
            name = path.rsplit("/", 1)[-1]
            raise ValueError(f"init_from {backend.url}: {name} is not a safetensors file "
                             f"({exc})") from None
    return out


def _shards(sd: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Tensors in order, cut into groups of at most ``max_bytes`` (a bigger tensor
    gets a group of its own)."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in sd.items():
        n = t.numel() * t.element_size()
        if groups[-1] and size + n > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += n
    return groups


def _generation_config(base: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"_from_model_config": True}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if base and base.get(key) is not None:
            out[key] = base[key]
    return out


def _write_files(model: Transformer, tmp: Path, base_config: dict[str, Any] | None,
                 max_shard_bytes: int, extra_files: dict[str, bytes]) -> list[str]:
    sd = to_hf_state_dict(model)
    written = ["config.json", "generation_config.json"]
    (tmp / "config.json").write_text(json.dumps(to_hf_config(model.config, base_config),
                                                indent=2) + "\n")
    (tmp / "generation_config.json").write_text(
        json.dumps(_generation_config(base_config), indent=2) + "\n")
    groups = _shards(sd, max_shard_bytes)
    if len(groups) == 1:
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        written.append("model.safetensors")
    else:
        weight_map = {}
        for k, group in enumerate(groups, start=1):
            name = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
            save_file(group, str(tmp / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(group, name))
            written.append(name)
        total = sum(t.numel() * t.element_size() for t in sd.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        written.append("model.safetensors.index.json")
    for name, data in extra_files.items():
        if "/" in name or name in written:
            raise ValueError(f"extra file name {name!r} is a path or clashes with the model's")
        (tmp / name).write_bytes(data)
        written.append(name)
    return written


def write_hf_model(model: Transformer, out_dir: str | os.PathLike, *,
                   base_config: dict[str, Any] | None, max_shard_bytes: int = 2**31,
                   extra_files: dict[str, bytes] | None = None) -> list[str]:
    """Write ``model`` as a Hugging Face model directory ``out_dir``; the file names.

    config.json (``to_hf_config``), generation_config.json, model.safetensors or
    shards of at most ``max_shard_bytes`` plus model.safetensors.index.json, and
    ``extra_files`` (e.g. tokenizer.json). All of it lands at once: written into a
    temporary sibling and renamed. A non-empty ``out_dir`` is refused.
    """
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out}: exists and is not an empty directory; choose a new one")
    to_hf_config(model.config, base_config)  # refuses an inexpressible model before writing
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        written = _write_files(model, tmp, base_config, max_shard_bytes, extra_files or {})
        os.replace(tmp, out)  # onto an empty directory or none: atomic on POSIX
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return written
