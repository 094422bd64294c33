"""Hugging Face interchange in one import: configs (``workers.hf_config``) and
weights (``workers.hf_weights``), split in two modules to keep each short."""

from workers.hf_config import from_hf_config, to_hf_config
from workers.hf_weights import (
    hf_name,
    load_hf_state_dict,
    read_safetensors,
    to_hf_state_dict,
    write_hf_model,
)

__all__ = [
    "from_hf_config", "hf_name", "load_hf_state_dict", "read_safetensors", "to_hf_config",
    "to_hf_state_dict", "write_hf_model",
]
