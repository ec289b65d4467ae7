"""Model and tokenizer loading, and the batched KV-cached decoder behind the environment.

The embedded defaults live in ``textgym/assets`` as Hugging Face folders (their paths in
:mod:`textgym.assets`); any other causal LM folder or hub id (already in the local cache:
nothing is downloaded at run time when ``HF_HUB_OFFLINE=1``) can be given instead.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

# The asset paths live in textgym.assets; re-exported here, where the agents, examples and tests import them.
from textgym.asset_paths import (
    ARITH_EVAL,
    ARITH_LM,
    ARITH_PROXY_RM,
    ARITH_TRAIN,
    DEFAULT_LM,
    DEFAULT_PROMPTS,
    DEFAULT_RM,
    EVAL_PROMPTS,
    EVAL_PROMPTS_BY_ENV,
    PROMPT_SETS,
)
from textgym.functional import position_ids_from_mask
from textgym.named_models import resolve_named_model
from textgym.token_logprobs import policy_logprobs, takes_logits_to_keep

__all__ = [
    "CachedDecoder",
    "DEFAULT_LM",
    "DEFAULT_RM",
    "DEFAULT_PROMPTS",
    "EVAL_PROMPTS",
    "EVAL_PROMPTS_BY_ENV",
    "PROMPT_SETS",
    "ARITH_EVAL",
    "ARITH_LM",
    "ARITH_PROXY_RM",
    "ARITH_TRAIN",
    "TOKENIZER_FILES",
    "check_finite_output",
    "check_model_source",
    "context_rows",
    "left_pad",
    "load_causal_lm",
    "load_pretrained",
    "load_tokenizer",
    "pad_id_for",
    "quiet_peft",
    "resolve_device",
    "resolve_dtype",
    "response_logits",
    "response_logprobs",
]


def quiet_transformers() -> None:
    """No per-load progress bars or load reports: the env is built often, in tests and loops."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None``/``"auto"`` → CUDA when available, else CPU; anything else is passed to torch."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device={device!r} is not a torch device; use 'auto', 'cpu' or 'cuda[:N]'") from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for but CUDA is not available here; use 'cpu' or 'auto'")
    return dev


@functools.cache  # asked before every forward of a rollout: the answer never changes in a process
def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 matmuls in hardware: CUDA with bf16, or a CPU with AVX-512 BF16 or AMX.

    Why it decides ``precision="auto"``: there bf16 autocast roughly doubles matmul throughput; on a
    CPU without those instructions bf16 is emulated and slower than fp32.
    """
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's own checks (private API)
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """``None`` → float32; strings ``"float32"``, ``"float16"``, ``"bfloat16"`` or a torch dtype."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# Any one of these makes a folder a tokenizer folder (fast, SentencePiece, BPE and WordPiece layouts).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _check_source(name: str, value: str | os.PathLike) -> str:
    """A local folder is used as is; then a name of :mod:`textgym.named_models`; a hub id only when the
    string cannot be a path (and, offline, is cached).

    A string that looks like a path and does not exist fails at once: transformers would take
    ``runs/x`` for a hub id and retry the network for half a minute before failing.
    """
    text = os.fspath(value)
    path = Path(text).expanduser()
    if path.is_dir():
        return str(path)
    named = resolve_named_model(text)  # e.g. "smollm2-135m-instruct": a cached folder, converted on first use
    if named is not None:
        return named
    if path.exists():
        raise ValueError(f"{name}={text!r} is a file, not a folder; give a Hugging Face model folder or a hub id")
    if _looks_like_path(text):
        raise FileNotFoundError(
            f"{name}={text!r} does not exist (no such folder); give a Hugging Face model folder or a hub id 'org/name'"
        )
    if _hub_offline() and not _in_hub_cache(text):
        raise FileNotFoundError(
            f"{name}={text!r} does not exist (no such folder) and is not a hub id in the local cache; "
            "downloads are off (HF_HUB_OFFLINE is set): give a Hugging Face model folder"
        )
    return text


def check_model_source(name: str, value: str | os.PathLike) -> str:
    """The folder (or cached hub id) ``value`` names, checked as a model loads it, without loading it.

    Raises:
        FileNotFoundError / ValueError: naming ``name`` and ``value``: no such folder, a file, no config.json,
            truncated weights.
    """
    src = _check_source(name, value)
    _check_model_folder(name, src)
    return src


def _looks_like_path(text: str) -> bool:
    """Not of the form ``org/name``, or ``org`` is a local folder (``runs/x`` beside a ``runs`` folder)."""
    if text.startswith((".", "/", "~")) or not _HUB_ID.fullmatch(text):
        return True
    return Path(text.split("/")[0]).is_dir()


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import constants

    return (Path(constants.HF_HUB_CACHE) / ("models--" + repo_id.replace("/", "--"))).is_dir()


def _load_error(name: str, src: str, what: str, err: Exception) -> Exception:
    """One error naming the argument, the path and the cause: missing files stay FileNotFoundError."""
    kind = FileNotFoundError if isinstance(err, OSError) else ValueError
    return kind(f"{name}={src!r} could not be loaded as {what}: {type(err).__name__}: {err}")


def load_tokenizer(source: str | os.PathLike | None = None, name: str = "tokenizer", require_eos: bool = True):
    """Load a tokenizer (default: the embedded one); with ``require_eos`` it must have an EOS token.

    A local folder must hold tokenizer files: transformers 5 would build an empty tokenizer from a
    model folder without them.
    """
    from transformers import AutoTokenizer

    src = _check_source(name, source if source is not None else DEFAULT_LM)
    if Path(src).is_dir() and not any((Path(src) / f).is_file() for f in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{name}={src!r} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
            "give a folder with its tokenizer, or the tokenizer's folder as tokenizer="
        )
    try:
        tok = AutoTokenizer.from_pretrained(src)
    except Exception as err:  # tokenizers and transformers raise many types; one clear error instead
        raise _load_error(name, src, "a tokenizer", err) from err
    if require_eos and tok.eos_token_id is None:
        raise ValueError(f"{name}={src!r} has no EOS token; the environment ends episodes on EOS")
    return tok


def _check_model_folder(name: str, src: str) -> None:
    """A local model folder has a config.json and weights files whose headers and sizes are intact."""
    from safetensors import safe_open

    folder = Path(src)
    if not folder.is_dir():
        return  # a hub id: transformers checks the download
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{name}={src!r} has no config.json: it is not a Hugging Face model folder")
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(file, "pt"):
                pass
        except Exception as err:  # safetensors' own error type: header too small, incomplete buffer, bad JSON
            raise ValueError(
                f"{name}={src!r}: {file.name} is truncated or corrupt ({type(err).__name__}: {err})"
            ) from err


def load_pretrained(auto_class, source: str | os.PathLike, name: str, what: str, dtype=None):
    """``auto_class.from_pretrained`` that says what is wrong: bad files, or weights that do not fit.

    Every weight the checkpoint lacks (initialised at random) or carries unused is refused: that
    is a model of another kind (a causal LM given as a reward model, or the reverse).

    Returns:
        ``(model, src)``, ``src`` the checked folder or hub id.
    """
    src = _check_source(name, source)
    _check_model_folder(name, src)
    try:
        model, info = auto_class.from_pretrained(src, dtype=resolve_dtype(dtype), output_loading_info=True)
    except Exception as err:  # config, weights and architecture errors come in many types
        raise _load_error(name, src, what, err) from err
    _check_loading_info(name, src, what, model, info)
    return model, src


def _check_loading_info(name: str, src: str, what: str, model, info: dict) -> None:
    """Refuse weights initialised at random or left unused: transformers only logs them (and we silence its logs)."""
    missing, unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
    parts = []
    if missing:
        parts.append(f"initialised at random (not in the checkpoint): {', '.join(missing[:4])}")
    if unexpected:
        parts.append(f"in the checkpoint but unused: {', '.join(unexpected[:4])}")
    if parts:
        arch = ", ".join(getattr(model.config, "architectures", None) or ["unknown"])
        raise ValueError(
            f"{name}={src!r} is not {what}: {'; '.join(parts)} (its config.json says {arch}); "
            "give a folder saved as that kind of model (a reward model comes from `textgym rm-train`)"
        )


@torch.no_grad()
def check_finite_output(name: str, src: str, model) -> None:
    """One forward of one token: a corrupt (bit-flipped) weight fails here, naming the model, not as NaN rewards."""
    token = 1 if getattr(model.config, "pad_token_id", None) == 0 else 0  # not PAD: a classifier pools on it
    logits = model(input_ids=torch.tensor([[token]], device=next(model.parameters()).device)).logits
    if not torch.isfinite(logits).all():
        raise ValueError(
            f"{name}={src!r} gives non-finite outputs (nan or inf) on a one-token input: its weights are "
            f"corrupt (a bit flip, a bad conversion) or overflow in {next(model.parameters()).dtype}"
        )


def pad_id_for(tokenizer, stop_ids=frozenset()) -> int:
    """A PAD id distinct from EOS and from every stop id, inside the vocabulary.

    Padding is always marked by the attention mask; a tokenizer without its own PAD (GPT-2
    style), or whose PAD is a stop id (chat models that pad with ``<|endoftext|>`` and stop on
    it), pads with UNK or the lowest other id, rather than growing the vocabulary.
    """
    taken = {tokenizer.eos_token_id, *stop_ids}
    for candidate in (tokenizer.pad_token_id, tokenizer.unk_token_id, *range(len(taken) + 1)):
        if candidate is not None and candidate not in taken:
            return int(candidate)
    raise AssertionError("unreachable: len(taken) + 1 ids cannot all be taken")


def left_pad(tokenizer, rows: list[list[int]], length: int | None = None, return_tensors: str = "pt",
             pad_id: int | None = None):  # fmt: skip
    """Left-pad token-id rows through the tokenizer (``tokenizer.pad``, ``padding_side="left"``).

    Left padding puts every row's last token in the last column (where generation continues and
    a classifier pools). ``pad_id`` replaces the tokenizer's PAD under mask 0 when the caller
    pads with another id (see :func:`pad_id_for`). Returns ``(input_ids, attention_mask)``, each
    ``(B, W)``, W = ``length`` or the longest row.
    """
    padding = "max_length" if length is not None else "longest"
    batch = tokenizer.pad({"input_ids": rows}, padding=padding, max_length=length, padding_side="left",
                          return_attention_mask=True, return_tensors=return_tensors)  # fmt: skip
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if pad_id is not None:
        ids[mask == 0] = pad_id
    return ids, mask


def context_rows(input_ids: np.ndarray, attention_mask: np.ndarray, rows: Sequence[int],
                 prompt_len: int) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Rows of observations as left-padded contexts ``(k, W)``: prompt and response so far, right-aligned.

    The observation puts the prompt left-padded in the first ``prompt_len`` columns and the response
    right after, so a row's real tokens are one contiguous run; a prefill needs them to end in the last
    column (where decoding continues). W is the longest run among ``rows``.
    """
    rows = list(rows)
    real = attention_mask[rows]  # (k, L)
    start = prompt_len - real[:, :prompt_len].sum(1)
    end = prompt_len + real[:, prompt_len:].sum(1)
    width = int((end - start).max()) if rows else 0
    ids = np.zeros((len(rows), width), dtype=input_ids.dtype)
    mask = np.zeros((len(rows), width), dtype=attention_mask.dtype)
    for k, (r, a, b) in enumerate(zip(rows, start, end, strict=True)):
        ids[k, width - (b - a) :] = input_ids[r, a:b]
        mask[k, width - (b - a) :] = 1
    return ids, mask


def load_causal_lm(
    source: str | os.PathLike | None = None,
    device: str | torch.device | None = "cpu",
    dtype: str | torch.dtype | None = None,
    name: str = "model",
    trainable: bool = False,
):
    """Load a causal LM in ``dtype`` (default float32) on ``device``; frozen and in eval mode unless ``trainable``.

    Raises:
        FileNotFoundError / ValueError: naming ``name``, the path and the cause (no such folder, a
            corrupt weights file, weights of another kind of model, non-finite outputs).
    """
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    source = source if source is not None else DEFAULT_LM
    if (Path(os.fspath(source)) / "adapter_config.json").is_file():
        model, src = load_lora_merged(source, name, dtype), os.fspath(source)
    else:
        model, src = load_pretrained(AutoModelForCausalLM, source, name, "a causal LM", dtype)
    model.to(resolve_device(device))
    model.eval()  # also for a trainable policy: PPO needs dropout off (N+ implementation details)
    check_finite_output(name, src, model)
    model.requires_grad_(trainable)
    return model


def load_lora_merged(folder: str | os.PathLike, name: str = "model", dtype=None):
    """A LoRA policy folder (peft adapters, as ``textgym train --lora-rank`` saves it) merged into its base.

    The base is the one the adapters name (``base_model_name_or_path``), loaded and checked like
    any model; the result is a plain causal LM (``textgym export --merge`` saves it as a folder).
    """
    import json

    from transformers import AutoModelForCausalLM

    try:
        from peft import PeftModel
    except ImportError as err:
        raise ModuleNotFoundError(f"{name}={os.fspath(folder)!r} holds LoRA adapters: loading them needs peft "
                                  "(pip install peft)") from err  # fmt: skip
    base_src = json.loads((Path(folder) / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base_src:
        raise ValueError(f"{name}={os.fspath(folder)!r}: adapter_config.json does not name its base model")
    base, _ = load_pretrained(AutoModelForCausalLM, base_src, f"{name} (the adapters' base)", "a causal LM", dtype)
    with quiet_peft():
        return PeftModel.from_pretrained(base, os.fspath(folder)).merge_and_unload()


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """Silence the one FutureWarning peft's wrappers raise through transformers 5 (and nothing else).

    ``PeftModel`` reads ``model.is_gradient_checkpointing``, which transformers 5 deprecated for
    ``is_activation_checkpointing``: every LoRA wrap then warns about code neither textgym nor its
    user wrote or can change.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


FP32_ATTENTION = "textgym_sdpa_fp32_under_cpu_autocast"


@functools.cache
def fp32_attention() -> str:
    """Register (once) and return the name of transformers' SDPA attention run in fp32 under CPU autocast.

    Why: torch's CPU flash-attention backward is several times slower in bf16 than in fp32, while
    attention is a small share of the FLOPs, so a bf16 PPO minibatch step is faster with attention
    in fp32 (measured in docs/performance.md, "speed levers"). Outside CPU autocast (fp32
    training, the env's π_ref, CUDA) it is transformers' ``sdpa`` itself, call for call.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    def attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
        if query.device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        with torch.autocast("cpu", enabled=False):
            out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                                  **kwargs)  # fmt: skip
        return out.to(torch.get_autocast_dtype("cpu")), weights

    AttentionInterface.register(FP32_ATTENTION, attention)
    AttentionMaskInterface.register(FP32_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return FP32_ATTENTION


def use_fp32_attention(model) -> None:
    """Give a model that attends with ``sdpa`` the :func:`fp32_attention` (other implementations are kept)."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(fp32_attention())


def prefill_forward(model, context, input_ids: Tensor, attention_mask: Tensor):
    """``model`` over left-padded prompts ``(k, P)`` into a fresh ``DynamicCache``, the last column's logits only."""
    from transformers import DynamicCache

    with context():
        return model(
            input_ids=input_ids,  # (k, P)
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            cache=DynamicCache(config=model.config),  # transformers 5 name of past_key_values
            use_cache=True,
            logits_to_keep=1,
        )


class CachedDecoder:
    """Batched incremental decoding with one KV-cache row per episode slot.

    Slots start and finish at different times, so the cache is a single ``DynamicCache`` whose
    columns are *not* positions: every row carries its own position ids (RoPE is applied before
    caching) and its own attention mask over the columns. A step appends one column for every
    slot; a reset re-fills the rows of the resetting slots with their prompt, right-aligned at
    the end of the cache. Each live row is then one contiguous run of valid columns ending at
    the right edge, so columns older than ``max_len`` can be dropped for every row at once.

    Args:
        model: a Hugging Face causal LM that accepts ``position_ids``, ``attention_mask`` and
            ``past_key_values`` (Llama-family models do).
        num_slots: number of rows N.
        max_len: the longest prompt + response a slot can hold.
    """

    def __init__(self, model, num_slots: int, max_len: int):
        self.model = model
        self.num_slots = num_slots
        self.max_len = max_len
        self.device = next(model.parameters()).device
        self.context = contextlib.nullcontext  # every forward runs inside context() (see reference_context)
        self.cache = None
        self.mask = torch.zeros(num_slots, 0, dtype=torch.long, device=self.device)  # (N, C)
        self.next_pos = torch.zeros(num_slots, dtype=torch.long, device=self.device)  # (N,)

    @property
    def started(self) -> bool:
        """Whether any slot was prefilled since the last :meth:`reset` (a step before that has nothing to extend)."""
        return self.cache is not None

    def release(self) -> None:
        """Forget every slot and free the cache (as :meth:`reset`: a new one grows at the next prefill)."""
        self.reset()

    def reset(self) -> None:
        """Forget every slot."""
        self.cache = None
        self.mask = torch.zeros(self.num_slots, 0, dtype=torch.long, device=self.device)
        self.next_pos.zero_()

    @torch.no_grad()
    def prefill(self, slots: Tensor, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Start ``slots`` on left-padded prompts; return their next-token logits ``(k, V)``."""
        return self.write_prefill(slots, self.forward_prefill(input_ids, attention_mask), attention_mask)

    @torch.no_grad()
    def forward_prefill(self, input_ids: Tensor, attention_mask: Tensor):
        """The prefill's forward over left-padded prompts ``(k, P)``, nothing written: ``write_prefill`` keeps it.

        Split so that a step can compute a reset's prefill first and write it last (nothing half-applied).
        """
        return prefill_forward(self.model, self.context, input_ids, attention_mask)

    def write_prefill(self, slots: Tensor, out, attention_mask: Tensor) -> Tensor:
        """Write :meth:`forward_prefill`'s cache into rows ``slots``; return their next-token logits ``(k, V)``."""
        self._merge(slots, out.cache, attention_mask)
        self.next_pos[slots] = attention_mask.sum(-1)
        return out.logits[:, -1].float()

    @torch.no_grad()
    def step(self, tokens: Tensor) -> Tensor:
        """Feed one token per slot ``(N,)``; return the next-token logits ``(N, V)``.

        Finished slots are fed a token too (their rows are rewritten at their next reset), which
        keeps the batch rectangular and costs less than selecting the live rows every step.
        A forward that raises (even KeyboardInterrupt) leaves the decoder as it was: the layers it
        already grew get their previous keys and values back.
        """
        if self.cache is None:
            raise RuntimeError("CachedDecoder.step() before any prefill()")
        ones = torch.ones(self.num_slots, 1, dtype=torch.long, device=self.device)
        mask = torch.cat([self.mask, ones], dim=1)  # (N, C+1)
        before = [(layer.keys, layer.values) for layer in self.cache.layers]  # a step concatenates: no in-place change
        try:
            with self.context():
                out = self.model(
                    input_ids=tokens.view(-1, 1),
                    attention_mask=mask,
                    position_ids=self.next_pos.view(-1, 1),
                    cache=self.cache,
                    use_cache=True,
                )
        except BaseException:
            for layer, (keys, values) in zip(self.cache.layers, before):
                layer.keys, layer.values = keys, values
            raise
        self.mask = mask
        self.cache = out.cache
        self.next_pos += 1
        self._trim()
        return out.logits[:, -1].float()

    def _merge(self, slots: Tensor, new_cache, new_mask: Tensor) -> None:
        """Write ``new_cache`` (k rows, P columns) into rows ``slots``, right-aligned."""
        k, p = new_mask.shape
        if self.cache is None or k == self.num_slots:  # all slots restart: a fresh cache
            self.cache = new_cache
            if k != self.num_slots or not torch.equal(slots, torch.arange(k, device=slots.device)):
                for layer in self.cache.layers:
                    for attr in ("keys", "values"):
                        t = getattr(layer, attr)
                        full = t.new_zeros((self.num_slots, *t.shape[1:]))
                        full[slots] = t
                        setattr(layer, attr, full)
            self.mask = torch.zeros(self.num_slots, p, dtype=torch.long, device=self.device)
            self.mask[slots] = new_mask
            return
        width = self.mask.shape[1]
        if p > width:  # grow every row on the left with masked columns
            self._pad_left(p - width)
            width = p
        for old, new in zip(self.cache.layers, new_cache.layers):
            for attr in ("keys", "values"):
                t = getattr(old, attr)  # (N, H, C, D)
                t[slots] = 0
                t[slots, :, width - p :] = getattr(new, attr)
        self.mask[slots] = 0
        self.mask[slots, width - p :] = new_mask

    def _pad_left(self, n: int) -> None:
        for layer in self.cache.layers:
            for attr in ("keys", "values"):
                t = getattr(layer, attr)
                setattr(layer, attr, torch.cat([t.new_zeros((*t.shape[:2], n, t.shape[3])), t], dim=2))
        self.mask = torch.cat([self.mask.new_zeros(self.num_slots, n), self.mask], dim=1)

    def _trim(self) -> None:
        """Drop columns older than ``max_len``: no live row reaches back that far."""
        extra = self.mask.shape[1] - self.max_len
        if extra <= 0:
            return
        for layer in self.cache.layers:
            layer.keys = layer.keys[:, :, extra:]
            layer.values = layer.values[:, :, extra:]
        self.mask = self.mask[:, extra:]


def response_logits(model, input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> Tensor:
    """The logits that predict the response tokens (columns ``prompt_len − 1 … L − 2``): ``(B, L − prompt_len, V)``.

    Why ``logits_to_keep``: the LM head is a (hidden × vocabulary) matmul per column, and a left-padded
    prompt's columns need none of it. HF causal LMs then run the head, its backward and the logits'
    memory on the T + 1 last columns only (SmolLM2: 49,152 × 576 per column, a fifth of the model's
    work per token); a model whose forward has no such argument gets every column and the same slice.
    """
    keep = input_ids.shape[1] - prompt_len + 1  # columns prompt_len - 1 … L - 1; the last predicts nothing
    head = {"logits_to_keep": keep} if takes_logits_to_keep(model) else {}
    position_ids = position_ids_from_mask(attention_mask)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **head)
    return out.logits[:, -keep:-1]  # the logit at column c predicts the token at column c + 1


def response_logprobs(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_len: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Teacher-forced log-probs of every response token in ONE forward pass and a chunked LM head.

    Takes the environment's observation layout: the prompt left-padded into the first
    ``prompt_len`` columns, response token k at column ``prompt_len + k``.

    Args:
        input_ids: ``(B, L)`` token ids.
        attention_mask: ``(B, L)``, 1 on real tokens.
        prompt_len: the env's ``max_prompt_tokens``.
        temperature: logits are divided by it, as when sampling.
        with_entropy: also return the per-token entropy of the (tempered) distribution.

    Returns:
        ``(B, T)`` log-probs, T = L − prompt_len, and ``(B, T)`` entropies or None. Positions
        past a response's end hold values of padding; mask them with ``attention_mask[:, prompt_len:]``.
    """
    return policy_logprobs(model, input_ids, attention_mask, prompt_len, None, temperature, with_entropy=with_entropy)
