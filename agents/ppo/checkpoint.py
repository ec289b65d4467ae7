"""The one module that knows a run's file formats: weights (full, tied, LoRA), optimizer and RNG state.

A checkpoint folder holds one Hugging Face folder per trained model (``policy/``, ``critic/``),
``state.pt`` (tensors only: optimizer state, torch and sampler RNG states, loadable with
``weights_only=True``) and ``state.json`` (counters, KL controller, numpy/python/env RNG states,
config). An exported folder (``out/policy``) is a plain HF folder whose weight files are
hard links to the checkpoint's, with the tokenizer and, for the policy, its run info.

Used by the trainer (save, resume), the Ray weight sync (:mod:`.ray_rollout`) and the run folder's
check that its exports match the checkpoint.
"""

from __future__ import annotations

import filecmp
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from textgym.files import link_files

from ..evaluate import RUN_INFO

__all__ = [
    "STATE_JSON",
    "STATE_TENSORS",
    "expected_weights",
    "export_matches",
    "fill_tied",
    "is_lora",
    "load_weights",
    "read_checkpoint",
    "read_state",
    "rng_states",
    "set_rng_states",
    "write_checkpoint",
    "write_export",
]

STATE_JSON = "state.json"  # counters, KL controller, RNG states, config
STATE_TENSORS = "state.pt"  # optimizer state and torch RNG states: tensors only
WEIGHTS = "model.safetensors"
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # a LoRA model's checkpoint: its adapters (and head) only
_STATE_KEYS = ("iteration", "env_steps", "episodes", "kl_controller", "numpy_rng", "python_rng", "env_rng", "config")
_TENSOR_KEYS = ("optimizer", "torch_rng", "sampler_rng")


# ---------------------------------------------------------------------- writing
def write_checkpoint(folder: Path, models: dict[str, torch.nn.Module], tensors: dict[str, Any],
                     state: dict[str, Any]) -> None:  # fmt: skip
    """Weights as HF folders (``folder/<name>``), ``tensors`` in ``state.pt``, ``state`` (plain JSON) in ``state.json``.

    ``state.pt`` is loadable with ``weights_only=True``: put nothing in ``tensors`` but tensors and plain containers.
    """
    for name, model in models.items():
        model.save_pretrained(folder / name)
    torch.save(tensors, folder / STATE_TENSORS)
    (folder / STATE_JSON).write_text(json.dumps(state, indent=1) + "\n")


def write_export(model_folder: Path, folder: Path, tokenizer, run_info: dict[str, Any] | None) -> None:
    """A plain HF folder: ``model_folder``'s files hard-linked (stored once), the tokenizer, the run info."""
    link_files(model_folder, folder)
    tokenizer.save_pretrained(folder)
    if run_info is not None:
        (folder / RUN_INFO).write_text(json.dumps(run_info))


def export_matches(model_folder: Path, folder: Path, run_info: dict[str, Any] | None) -> bool:
    """Whether ``folder`` holds each file of ``model_folder`` unchanged (and, for the policy, this run info)."""
    if not folder.is_dir():
        return False
    for path in (p for p in model_folder.iterdir() if p.is_file()):
        twin = folder / path.name
        if not (twin.is_file() and (os.path.samefile(path, twin) or filecmp.cmp(path, twin, shallow=False))):
            return False
    if run_info is None:
        return True
    try:
        return json.loads((folder / RUN_INFO).read_text()) == json.loads(json.dumps(run_info))
    except (OSError, ValueError):
        return False


def rng_states() -> tuple[dict[str, Any], dict[str, Any]]:
    """The process's numpy and python RNG states as plain JSON (numpy's key array as a list); torch's as a tensor."""
    np_rng, py_rng = np.random.get_state(), random.getstate()
    return {
        "numpy_rng": [np_rng[0], np_rng[1].tolist(), int(np_rng[2]), int(np_rng[3]), float(np_rng[4])],
        "python_rng": [py_rng[0], list(py_rng[1]), py_rng[2]],
    }, {"torch_rng": torch.get_rng_state()}


def set_rng_states(state: dict[str, Any], tensors: dict[str, Any]) -> None:
    """Restore what :func:`rng_states` captured."""
    torch.set_rng_state(tensors["torch_rng"])
    kind, keys, *rest = state["numpy_rng"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    version, internal, gauss = state["python_rng"]
    random.setstate((version, tuple(internal), gauss))


# ---------------------------------------------------------------------- reading
def read_checkpoint(ckpt: Path, models: dict[str, torch.nn.Module]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load ``ckpt``'s weights into ``models`` and return its state (JSON) and tensors.

    Every file is read and the weights checked key by key before any model changes; nothing is
    unpickled but tensors and plain containers.
    """
    state = read_state(ckpt)
    tensors = _read_tensors(ckpt / STATE_TENSORS)
    weights = {name: _read_weights(model, ckpt / name / _weights_file(model)) for name, model in models.items()}
    for name, model in models.items():
        load_weights(model, weights[name])
    return state, tensors


def read_state(ckpt: Path) -> dict[str, Any]:
    """``ckpt/state.json``, with every key a resume needs.

    Raises:
        FileNotFoundError: naming the missing file (a checkpoint from before state.json cannot resume).
        ValueError: naming the file and what is wrong with it.
    """
    path = Path(ckpt) / STATE_JSON
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {path} is missing: the run cannot continue from {ckpt}")
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ValueError(f"checkpoint file {path} is not valid JSON ({err})") from err
    missing = [k for k in _STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"checkpoint file {path} lacks {', '.join(missing)}")
    return state


def _read_tensors(path: Path) -> dict[str, Any]:
    """``state.pt`` unpickled with ``weights_only=True``: a crafted checkpoint cannot run code."""
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {path} is missing: the run cannot continue from {path.parent}")
    try:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # UnpicklingError for forbidden objects, RuntimeError for a torn file
        raise ValueError(
            f"checkpoint file {path} cannot be loaded as tensors only (torch.load weights_only=True: "
            f"{type(err).__name__}: {err}); anything else is refused, since unpickling it could run code"
        ) from err
    missing = [k for k in _TENSOR_KEYS if not isinstance(tensors, dict) or k not in tensors]
    if missing:
        raise ValueError(f"checkpoint file {path} lacks {', '.join(missing)}")
    return tensors


def _read_weights(model: torch.nn.Module, path: Path) -> dict[str, torch.Tensor]:
    """The weights in ``path``, checked to fit ``model`` exactly: every key, no extra one, every shape.

    ``save_pretrained`` leaves tied weights out (``lm_head.weight`` when it is the embedding):
    that is the one expected absence, filled from the weight it is tied to so the load is strict.
    """
    from safetensors.torch import load_file

    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {path} is missing")
    try:
        weights = load_file(path)
    except Exception as err:  # safetensors' own error type: a truncated or garbage file
        raise ValueError(f"checkpoint file {path} is truncated or corrupt ({type(err).__name__}: {err})") from err
    expected = expected_weights(model)
    fill_tied(model, weights)
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    wrong = sorted(k for k in set(weights) & set(expected) if weights[k].shape != expected[k].shape)
    if missing or unexpected or wrong:
        raise ValueError(
            f"checkpoint file {path} does not fit this run's model: missing {missing[:4]} ({len(missing)}), "
            f"unexpected {unexpected[:4]} ({len(unexpected)}), wrong shape {wrong[:4]} ({len(wrong)})"
        )
    return weights


# ---------------------------------------------------------------------- weights: full, tied, LoRA
def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def _weights_file(model: torch.nn.Module) -> str:
    return ADAPTER_WEIGHTS if is_lora(model) else WEIGHTS


def expected_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state a checkpoint of ``model`` holds: everything, or a LoRA model's trained part as peft saves it."""
    if not is_lora(model):
        return model.state_dict()
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Load :func:`expected_weights`' keys strictly (a LoRA model: its trained part, as peft loads it)."""
    if not is_lora(model):
        model.load_state_dict(weights, strict=True)
        return
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(model, weights)


def fill_tied(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Give every name of a tied group the tensor saved under one of them (``save_pretrained`` keeps one)."""
    for group in _tied_groups(model) if not is_lora(model) else ():
        present = [k for k in group if k in weights]
        for key in group if present else ():
            weights.setdefault(key, weights[present[0]])


def _tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names that share one parameter (tied embeddings), each group in state-dict order."""
    groups: dict[int, list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(key)
    return [keys for keys in groups.values() if len(keys) > 1]
