"""A tiny random Llama with the embedded tokenizer and 1024 positions, for partners whose openings and replies are
longer than the embedded LM's 128 positions hold (GEM's game rules, skyrl-gym's multi-turn prompts), and the
scripted turns the adapters' tests play with it."""

from __future__ import annotations

from pathlib import Path

import torch


def build_long_lm(path: Path) -> str:
    """Save the model and the embedded tokenizer in ``path``; returns the folder as ``model=`` takes it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from textgym.models import load_tokenizer

    tok = load_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def play_turns(env, turns, **reset_kwargs):
    """Reset, then write each text of ``turns`` as the policy's tokens and end the turn with EOS; the step infos.

    A turn given as a function gets the opening and returns the text (an answer computed from the problem).
    """
    obs, info = env.reset(**reset_kwargs)
    tok, infos = env.unwrapped.tokenizer, [info]
    for turn in turns:
        text = turn(info["prompt"]) if callable(turn) else turn
        for a in [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]:
            obs, reward, done, truncated, info_t = env.step(a)
            infos.append({**info_t, "reward": reward, "done": done})
            if done:
                return obs, infos
    return obs, infos
