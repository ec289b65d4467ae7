"""A LoRA policy's rollout copy: the adapters merged into the weights, W + (α/r)·B·A per adapted layer.

Why: a decode step through peft runs each adapted linear as three matmuls (W, A, B) and a sum; on a
GPU the two thin ones are launches that cost as much as the wide one. The rollout only reads the
policy, so it can sample from a plain copy whose weights hold the sum; the update keeps training the
adapters on the shared base (π_ref stays the base with the adapters off). The copy costs one more
base model in memory, so the trainer makes it where memory is plentiful (``merged_rollout``: CUDA by
default) and refreshes it in place before every rollout (a captured decode graph keeps its weights).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["MergedPolicy", "merges_lora"]

PEFT_PREFIX = "base_model.model."  # a PeftModel's path to the wrapped model's modules


def merges_lora(merged_rollout: bool | None, lora_rank: int, device: torch.device) -> bool:
    """Whether the rollout samples from a merged copy: as ``merged_rollout`` says; None: LoRA on CUDA."""
    if merged_rollout is None:
        return lora_rank > 0 and device.type == "cuda"
    return merged_rollout


class MergedPolicy:
    """A frozen plain copy of a peft LoRA ``policy`` with its adapters merged; :meth:`refresh` re-merges.

    Args:
        policy: a ``peft.PeftModel`` whose only trained parameters are LoRA adapters (``make_lora_actor``).
    """

    def __init__(self, policy: nn.Module):
        from peft.tuners.lora import LoraLayer

        others = [name for name, p in policy.named_parameters() if p.requires_grad and "lora_" not in name]
        if others:
            raise ValueError(f"merged_rollout=True merges LoRA adapters only; the policy also trains {others[:3]}")
        with torch.no_grad():
            self.model = copy.deepcopy(policy).merge_and_unload()
        self.model.requires_grad_(False)
        self.model.eval()
        self.pairs = [(module, self.model.get_submodule(name.removeprefix(PEFT_PREFIX)))
                      for name, module in policy.named_modules() if isinstance(module, LoraLayer)]  # fmt: skip
        self.adapter = policy.active_adapter

    @torch.no_grad()
    def refresh(self) -> None:
        """Write W + ΔW of the policy's current adapters into the copy, in place (same tensors, new values)."""
        for lora, merged in self.pairs:
            merged.weight.copy_(lora.base_layer.weight + lora.get_delta_weight(self.adapter))
