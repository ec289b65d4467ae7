"""The calculator task (issue 44.4): its problem sets, its verifier, and a scripted tool conversation judged
end to end in TextMultiTurn-v0 (the embedded LM's tokenizer; SmolLM2's learning run is in docs/multi-turn.md)."""

import json
import re

import gymnasium as gym
import numpy as np
import pytest

import textgym  # noqa: F401  (registers the ids)
from textgym.asset_paths import PROMPT_SETS
from textgym.assets.calculator_problems import SIZES, problems, prompt_lines
from textgym.envs.prompts import load_prompts
from textgym.rewards.base import Episodes
from textgym.rewards.verifiers import CalculatorAnswerVerifier


def judge(prompt, *responses):
    episodes = Episodes(prompts=[prompt] * len(responses), responses=list(responses),
                        prompt_ids=[[]] * len(responses), response_ids=[[]] * len(responses))  # fmt: skip
    return CalculatorAnswerVerifier().score(episodes).tolist()


def test_the_committed_problem_files_are_what_the_generator_writes_and_eval_is_held_out():
    sets = problems()
    for name, size in SIZES.items():
        assert load_prompts(name) == prompt_lines(name) and len(prompt_lines(name)) == size
        assert [json.loads(line)["prompt"] for line in PROMPT_SETS[name].read_text().splitlines()] == prompt_lines(name)
        assert all(100 <= a <= 999 and 10 <= b <= 99 and 100 <= c <= 999 for a, b, c in sets[name])
        assert len(set(sets[name])) == size
    assert not set(sets["calculator-problems"]) & set(sets["calculator-problems-eval"])


def test_the_verifier_judges_the_last_question_and_the_final_turns_answer():
    """The prompt's worked example (12 * 34 + 5 = 413) is not the question; hedges, lists and a bare call
    commit to nothing; the question's own numbers are not answers."""
    prompt = prompt_lines("calculator-problems-eval")[0]
    a, b, c = map(int, re.findall(r"What is (\d+) \* (\d+) \+ (\d+)\?", prompt)[-1])
    right = a * b + c
    assert CalculatorAnswerVerifier.question(prompt) == (right, (a, b, c))
    answers = [f"{right}", f"The answer is {right}.", f"{a} * {b} + {c} = {right}", f"<result>{right}</result>",
               "413", f"<calc>{a} * {b} + {c}</calc>", f"{right} or {right + 1}", f"{right + 1}",
               f"The answer is not {right}", ""]  # fmt: skip
    assert judge(prompt, *answers) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert judge("What is (2 + 3) * -4 // 3?", "-7") == [1.0]  # the tool's own arithmetic


def test_a_last_turn_that_still_calls_the_tool_is_no_answer():
    """GRPO on SmolLM2 found this: call <calc>RESULT</calc> until max_turns ends the conversation; the last
    turn then held the right number once (one number, not an operand) and was paid as the answer."""
    prompt = prompt_lines("calculator-problems")[0]
    right = CalculatorAnswerVerifier.question(prompt)[0]
    assert judge(prompt, f"You: <calc>{right}</calc>", f"<calc>{right}</calc> {right}", f"You: {right}") == [
        0.0,
        0.0,
        1.0,
    ]
    assert judge(prompt, f"<calc>{right}") == [1.0]  # an unclosed call is no call, for the tool as for the verifier


@pytest.mark.parametrize("prompt", ["Write a review.", "What is 7 / 2?", "What is 5 / 0?", "What is 5 5?"])
def test_a_prompt_without_an_integer_question_is_refused_naming_it(prompt):
    with pytest.raises(ValueError, match=re.escape(f"prompt={prompt!r} asks no 'What is EXPRESSION?'")):
        judge(prompt, "1")


def test_a_scripted_tool_conversation_is_judged_on_its_answer_and_the_verdict_is_the_win():
    """Call the tool, copy its result: verdict 1 and score 1; a wrong copy, or the right number inside the
    call's turn only, scores 0. What the reward model saw is the final turn's text."""
    env = gym.make("TextMultiTurn-v0", partner="calculator", prompts=["What is 12 * 3 + 4?"], max_turn_tokens=32,
                   max_new_tokens=112, reward_model="calculator-answer", normalize_reward=False)  # fmt: skip
    base = env.unwrapped
    ids = lambda text: base.tokenizer(text, add_special_tokens=False)["input_ids"] + [base.eos_token_id]  # noqa: E731
    for answer, verdict in (("40", 1.0), ("41", 0.0)):
        env.reset(seed=0)
        infos = [env.step(a)[4] for a in ids("<calc>12 * 3 + 4</calc>")]
        assert infos[-1]["reply"] == "<result>40</result>"
        for a in ids(answer):
            _, reward, done, _, info = env.step(a)
        assert done and info["response"] == answer and info["verdict"] == verdict == info["score_reward"]
        assert int(info["turns"]) == 2
    env.reset(seed=0)
    for a in ids("40 <calc>1+1</calc>"):
        _, _, done, _, info = env.step(a)
    assert not done  # the turn called the tool: it is not the final answer
    for a in ids("no"):
        _, _, done, _, info = env.step(a)
    assert done and info["verdict"] == 0.0
    env.close()


def test_the_calculator_preset_and_bench_task_play_the_same_env():
    from textgym.agents import benchmark
    from textgym.agents.ppo.config import PRESET_DIR, PPOConfig, load_config_file

    task = benchmark.TASKS["smollm2-calculator"]
    preset = load_config_file(PRESET_DIR / "smollm2-calculator-grpo.json")
    assert {k: preset[k] for k in task.env} == task.env and preset["env_id"] == task.env_id
    assert preset["max_new_tokens"] == task.max_new_tokens and preset["learning_rate"] == task.agent_lr
    assert task.eval_prompts == preset["eval_prompts"] and task.reward_model == preset["reward_model"]
    cfg = PPOConfig(**{**preset, "out": "unused"})
    assert cfg.held_out_prompts() == "calculator-problems-eval" and cfg.num_iterations * cfg.num_envs == 384
    assert np.isclose(cfg.temperature, task.temperature)
    ctx = benchmark.RunContext({**task.env, "max_new_tokens": 144, "kl_coef": 0.05}, 16384, 0, 32, None, task)
    assert np.isclose(benchmark.agent_config(ctx, "grpo").temperature, task.temperature)


class CallsInEvenSlots:
    """A scripted policy: slot k writes ``<calc>12 * 3 + 4</calc>`` and then ``40`` when k is even, ``40`` alone
    when k is odd (the calculator's result comes between, as observation)."""

    def __init__(self, envs):
        tok = envs.unwrapped.tokenizer
        ids = lambda text: tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # noqa: E731
        self.eos, n = tok.eos_token_id, envs.num_envs
        self.scripts = [ids("<calc>12 * 3 + 4</calc>") + ids("40") if k % 2 == 0 else ids("40") for k in range(n)]
        self.reset()

    def reset(self):
        self.at = [0] * len(self.scripts)

    def act(self, obs):
        out = []
        for k, script in enumerate(self.scripts):
            out.append(script[self.at[k]] if self.at[k] < len(script) else self.eos)  # EOS once its episode ended
            self.at[k] += 1
        return np.array(out), np.zeros(len(out))


def test_evaluate_reports_the_share_of_episodes_that_called_the_tool():
    """Half the slots call the tool: multi_turn_share is 1/2 with its Wilson interval, every answer is right."""
    from textgym.agents.evaluate import evaluate, wilson_interval

    result = evaluate(None, policy_factory=CallsInEvenSlots, episodes=8, num_envs=4, env_id="TextMultiTurn-v0",
                      partner="calculator", prompts=["What is 12 * 3 + 4?"], max_turn_tokens=32, max_new_tokens=112,
                      reward_model="calculator-answer", normalize_reward=False)  # fmt: skip
    assert result["multi_turn_share"] == 0.5 and result["multi_turn_share_ci95"] == list(wilson_interval(4, 8))
    assert result["turns"][0] == 1.5 and result["win_rate"] == 1.0 and result["judged_episodes"] == 8


def test_the_calculator_bench_runs_its_reference_row_on_held_out_problems_at_its_temperature(tmp_path):
    from textgym.agents.benchmark import BenchConfig, run_benchmark

    cfg = BenchConfig(task="smollm2-calculator", algos=["reference"], seeds=[0], budget=8, num_envs=2,
                      eval_episodes=2, calibration_episodes=2, out=str(tmp_path / "bench"))  # fmt: skip
    (row,) = run_benchmark(cfg)
    assert row["score"] == row["gold_score"] == row["win_rate"] and row["win_rate"] in (0.0, 0.5, 1.0)
    # π_ref sampled at 0.7 is not π_ref: its KL to π_ref (at temperature 1, the env's) is charged like any policy's
    assert 1 <= row["turns"] <= 3 and row["objective"] == pytest.approx(row["score"] - 0.05 * row["kl"], abs=1e-3)


def test_the_bench_refuses_an_algorithm_that_cannot_sample_at_the_tasks_temperature():
    from textgym.agents.benchmark import BenchConfig

    with pytest.raises(ValueError, match=r"algos=\['reinforce'\] sample at temperature 1, but "
                                         r"task='smollm2-calculator' is defined at temperature 0.7"):  # fmt: skip
        BenchConfig(task="smollm2-calculator", algos=["grpo", "reinforce"])
