#!/usr/bin/env bash
# One-shot GPU smoke test: 3 PPO iterations on the default env and on a larger policy, with
# per-phase times. For a GPU machine that has its own torch/transformers but no package registry.
#
#   bash bench/gpu_smoke.sh prepare   # HERE (with a registry): download the other wheels into .whl/
#   bash bench/gpu_smoke.sh run       # THERE: install from .whl/ (keeping the machine's torch), run
#
# `run` fits in 5 minutes on one GPU. A larger policy: an HF folder in $BIG_MODEL (e.g. SmolLM2-135M
# converted with `python -m textgym.assets.generate_corpus --n 0`, which writes .cache/smollm2-hf),
# else a randomly initialised 8-layer, 512-wide Llama over the embedded tokenizer (sizes the GPU path).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}
PYV=${PYV:-3.12}

if [ "$mode" = prepare ]; then
  mkdir -p .whl
  # Pure-python or manylinux wheels of everything but torch/numpy (the GPU machine has those).
  python3 -m pip download --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl torchrl==0.14.1 tensordict==0.14.3 gymnasium==1.4.0 stable-baselines3==2.9.2 \
    vaderSentiment==3.3.2 farama-notifications cloudpickle orjson pyvers
  echo "wheels in .whl/ ($(du -sh .whl | cut -f1)); carry .whl to the GPU machine"
  exit 0
fi

python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD:${PYTHONPATH:-}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 - <<'EOF'
import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF
python3 - <<'EOF'
import importlib.util, os, sys, time, json
import textgym
spec = importlib.util.spec_from_file_location("textgym.agents", "agents/__init__.py",
                                              submodule_search_locations=["agents"])
mod = importlib.util.module_from_spec(spec); sys.modules["textgym.agents"] = mod; spec.loader.exec_module(mod)
import torch
from textgym.agents.ppo import PPOConfig, Trainer

def bigger_policy() -> str:
    if os.environ.get("BIG_MODEL"):
        return os.environ["BIG_MODEL"]
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from textgym.models import DEFAULT_LM
    tok = AutoTokenizer.from_pretrained(DEFAULT_LM)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    path = "/tmp/big_policy"
    LlamaForCausalLM(cfg).save_pretrained(path); tok.save_pretrained(path)
    return path

for name, model in (("default env", None), ("larger policy", bigger_policy())):
    cfg = PPOConfig(total_episodes=4 * 64, num_envs=64, device="cuda", model=model, out=f"/tmp/gpu_{len(name)}",
                    progress=False, max_new_tokens=32)
    t = Trainer.create(cfg)
    assert next(t.policy.parameters()).is_cuda and next(t.critic.parameters()).is_cuda
    assert next(t.envs.unwrapped.model.parameters()).is_cuda
    t.iteration()  # warm-up (CUDA init, allocator)
    torch.cuda.synchronize()
    for i in range(3):
        start = time.perf_counter()
        row = t.iteration()
        torch.cuda.synchronize()
        print(json.dumps({"run": name, "iter": i + 1, "wall_s": round(time.perf_counter() - start, 3),
                          **{k: round(v, 4) for k, v in row.items() if k.startswith("time_") or k in
                             ("tokens_per_s", "score", "kl")}}))
print("max GPU memory (GiB):", round(torch.cuda.max_memory_allocated() / 2**30, 2))
EOF
