"""TextMultiTurn-v0: conversations on the one engine — the partner's replies are observation, the policy's tokens
the only actions; the return is Σ turn rewards + final score + β·Σ log π_ref over the policy's tokens."""

import math
import time

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

import textgym  # noqa: F401  (registers the ids)
from textgym.episodes import collect_episodes, make_episode_envs
from textgym.models import response_logits
from textgym.partners import PartnerError
from textgym.policies import LMSampler

TOL = 1e-5
BETA = 0.1


class Counter:
    """Answers ``reply k`` to turn k with reward 0.5·k; says done after ``TURNS`` turns; records its seeds."""

    TURNS = 3
    seeds: list = []

    def reset(self, *, seed, prompt):
        self.k = 0
        Counter.seeds.append(seed)
        return None

    def reply(self, conversation):
        self.k += 1
        return f"reply {self.k}", 0.5 * self.k, self.k >= self.TURNS


def length_score(prompts, responses):
    """A final score the test can recompute: the last turn's length in characters / 10."""
    return [len(r) / 10 for r in responses]


def make(partner=Counter, **kwargs):
    args = {"max_turn_tokens": 3, "max_new_tokens": 40, "kl_coef": BETA, "reward_model": length_score, **kwargs}
    return gym.make("TextMultiTurn-v0", partner=partner, **args)


def non_stop_actions(env, n, seed=0):
    """``n`` token ids that are not stop tokens (so every turn runs to max_turn_tokens)."""
    rng = np.random.default_rng(seed)
    stops = set(env.unwrapped.stop_token_ids)
    out = []
    while len(out) < n:
        a = int(rng.integers(5, env.action_space.n))
        if a not in stops:
            out.append(a)
    return out


def independent_ref_logprobs(env, obs, columns):
    """log π_ref of the tokens at response ``columns`` of ``obs``, from one plain full forward (no cache)."""
    base = env.unwrapped
    P = base.max_prompt_tokens
    ids = torch.as_tensor(obs["input_ids"])[None]
    mask = torch.as_tensor(obs["attention_mask"])[None]
    with torch.no_grad():
        logits = response_logits(base.model, ids, mask, P)[0].double()  # (T, V)
    logp = torch.log_softmax(logits, -1)
    return np.array([float(logp[c, ids[0, P + c]]) for c in columns])


def play(env, actions, **reset_kwargs):
    obs, _ = env.reset(seed=0, **reset_kwargs)
    rewards, infos, done = [], [], False
    for a in actions:
        obs, r, done, truncated, info = env.step(a)
        rewards.append(r)
        infos.append(info)
        if done:
            break
    return obs, rewards, infos, done


@pytest.mark.parametrize("mode", ["step", "episode"])
def test_the_return_is_the_turn_rewards_the_final_score_and_beta_times_pi_ref_over_the_policys_tokens(mode):
    env = make(reference_scoring=mode)
    obs, rewards, infos, done = play(env, non_stop_actions(env, 40))
    assert done and len(rewards) == 9  # three turns of three tokens: the partner ends it after the third
    last = infos[-1]
    assert int(last["turns"]) == 3 and float(last["turn_reward_sum"]) == 0.5 + 1.0 + 1.5
    P, T = env.unwrapped.max_prompt_tokens, env.unwrapped.max_new_tokens
    policy_cols = np.flatnonzero(env.unwrapped._engine.layout.policy_mask[0])
    assert len(policy_cols) == 9 and policy_cols[-1] == obs["attention_mask"][P:].sum() - 1
    ref = independent_ref_logprobs(env, obs, policy_cols)
    score = len(last["response"]) / 10
    assert float(last["rm_score"]) == pytest.approx(score)
    expected = 3.0 + score + BETA * ref.sum()
    assert sum(rewards) == pytest.approx(expected, abs=1e-4)
    # the turn rewards are paid on the turn's last token, in both modes
    assert [float(i.get("turn_reward", 0)) for i in infos] == [0, 0, 0.5, 0, 0, 1.0, 0, 0, 1.5]
    if mode == "step":
        np.testing.assert_allclose([i["ref_logprob"] for i in infos], ref, atol=TOL)
    else:
        np.testing.assert_allclose(last["token_ref_logprobs"][policy_cols], ref, atol=TOL)
        off = np.setdiff1d(np.arange(T), policy_cols)
        assert not last["token_ref_logprobs"][off].any() and not last["token_rewards"][off].any()
        assert last["token_rewards"].sum() == pytest.approx(sum(rewards), abs=1e-9)


def test_the_partners_reply_is_observation_written_after_the_turn_and_its_text_is_in_the_conversation():
    env = make()
    obs, _, infos, _ = play(env, non_stop_actions(env, 40))
    base = env.unwrapped
    P = base.max_prompt_tokens
    text = base.tokenizer.decode(obs["input_ids"][P:][obs["attention_mask"][P:] == 1])
    assert "reply 1" in text and "reply 2" in text and "reply 3" not in text  # the last answer ends the episode
    conversation = infos[-1]["conversation"]
    assert [m["role"] for m in conversation] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    assert conversation[2]["content"] == "reply 1" and infos[2]["reply"] == "reply 1"
    # the reply's columns are not the policy's: 3 policy tokens, the reply, 3 policy tokens, ...
    mask = base._engine.layout.policy_mask[0]
    reply = base._engine.dialogue.template.ids("reply 1", int(obs["input_ids"][P + 2]))
    assert mask[:3].all() and not mask[3 : 3 + len(reply)].any() and mask[3 + len(reply)]
    np.testing.assert_array_equal(obs["input_ids"][P + 3 : P + 3 + len(reply)], reply)


def test_the_collector_marks_the_policys_tokens_and_both_reference_modes_agree():
    envs = make_episode_envs("TextMultiTurn-v0", 3, partner=Counter, max_turn_tokens=4, max_new_tokens=48,
                             kl_coef=BETA, reward_model=length_score)  # fmt: skip
    base = envs.unwrapped
    out = {}
    for mode in ("step", "episode"):
        sampler = LMSampler.for_env(base.model, envs, generator=torch.Generator().manual_seed(0))
        out[mode] = collect_episodes(envs, sampler, seed=0, reference_scoring=mode)
    a, b = out["step"], out["episode"]
    assert torch.equal(a["action"], b["action"]) and torch.equal(a["mask"], b["mask"])
    for key in ("ref_logprob", "env_reward"):
        assert (a[key] - b[key]).abs().max() <= TOL
        assert not b[key][~b["mask"]].any()  # nothing is charged or paid on a partner's tokens
    assert b["turns"].tolist() == [3, 3, 3] and torch.allclose(
        b["turn_reward_sum"], torch.full((3,), 3.0, dtype=torch.float64)
    )
    # the mask has holes where the replies are, and the policy's tokens sit where the mask says
    P = base.max_prompt_tokens
    for i in range(3):
        cols = torch.nonzero(b["mask"][i]).squeeze(1)
        assert (cols.diff() > 1).sum() == 2  # two replies between three turns
        assert torch.equal(b["input_ids"][i, P + cols], b["action"][i, cols])
    text = b["transcript"][0]  # the whole conversation, for reports and `textgym play`
    assert text.startswith("user: ") and "\nassistant: " in text and "\nuser: reply 2\n" in text
    single = make_episode_envs("TextRLHF-v0", 2, max_new_tokens=3, normalize_reward=False)
    assert "transcript" not in collect_episodes(single, LMSampler.for_env(base.model, single)).keys()
    # the env reward sums to the episode's return: turn rewards + score + β Σ log π_ref
    ret = b["env_reward"].double().sum(1)
    expected = b["turn_reward_sum"] + b["score_reward"] + BETA * b["ref_logprob"].double().sum(1)
    torch.testing.assert_close(ret, expected, atol=1e-4, rtol=0)


def test_the_sampler_rereads_the_conversation_after_a_reply_as_a_full_forward_would():
    envs = make_episode_envs("TextMultiTurn-v0", 2, partner=Counter, max_turn_tokens=2, max_new_tokens=40,
                             reward_model=length_score)  # fmt: skip
    base = envs.unwrapped
    sampler = LMSampler.for_env(base.model, envs, generator=torch.Generator().manual_seed(0))
    obs, _ = envs.reset(seed=0)
    P = base.max_prompt_tokens
    for _ in range(5):  # through two replies
        logits = sampler.logits(obs)
        ids, mask = torch.as_tensor(obs["input_ids"]), torch.as_tensor(obs["attention_mask"])
        with torch.no_grad():
            full = response_logits(base.model, ids, mask, P)  # (N, T, V): entry t predicts response column t
        nxt = mask[:, P:].sum(1)  # the next token's response column
        want = torch.stack([full[i, nxt[i]] for i in range(2)])
        torch.testing.assert_close(logits, want, atol=2e-4, rtol=0)
        actions = logits.argmax(-1).numpy()
        actions = np.where(np.isin(actions, base.stop_token_ids), 7, actions)
        obs, *_ = envs.step(actions)


class Raising(Counter):
    fail = True

    def reply(self, conversation):
        if Raising.fail:
            raise RuntimeError("the game server is down")
        return super().reply(conversation)


def test_a_partner_that_raises_names_itself_and_the_step_is_undone_so_it_can_be_retried():
    env = make(partner=Raising)
    actions = non_stop_actions(env, 3)
    env.reset(seed=0)
    for a in actions[:2]:
        obs, *_ = env.step(a)
    with pytest.raises(PartnerError, match="Raising.*the game server is down"):
        env.step(actions[2])
    after = env.unwrapped._engine.observation(0)
    np.testing.assert_array_equal(after["input_ids"], obs["input_ids"])  # the token is undone
    Raising.fail = False
    try:
        obs2, r, done, _, info = env.step(actions[2])
    finally:
        Raising.fail = True
    assert info["reply"] == "reply 1" and info["turn_reward"] == 0.5 and not done


class Hanging(Counter):
    def reply(self, conversation):
        time.sleep(30)


class BadReward(Counter):
    def reply(self, conversation):
        return "ok", float("nan"), False


class NotText(Counter):
    def reply(self, conversation):
        return 42, 1.0, False


class Surrogate(Counter):
    def reply(self, conversation):
        return "caf\udce9", 1.0, False


@pytest.mark.parametrize(
    "partner, match",
    [(Hanging, "did not return within partner_timeout=0.2"), (BadReward, "nan"), (NotText, "42"),
     (Surrogate, r"partner 'Surrogate' \(env slot 0\)\.reply returned .*text has a lone surrogate '\\udce9' at index "
                 "3: not valid Unicode")],
)  # fmt: skip
def test_a_hanging_or_malformed_partner_gets_one_clear_error_and_changes_nothing(partner, match):
    env = make(partner=partner, partner_timeout=0.2)
    actions = non_stop_actions(env, 3)
    env.reset(seed=0)
    for a in actions[:2]:
        obs, *_ = env.step(a)
    start = time.perf_counter()
    with pytest.raises(PartnerError, match=match):
        env.step(actions[2])
    assert time.perf_counter() - start < 5
    np.testing.assert_array_equal(env.unwrapped._engine.observation(0)["input_ids"], obs["input_ids"])
    assert env.unwrapped._engine.dialogue.turns[0] == 0 and len(env.unwrapped._engine.dialogue.messages[0]) == 1


class Endless(Counter):
    TURNS = 10**6


def test_the_turn_cap_and_the_token_cap_end_the_episode_as_terminal_states():
    env = make(partner=Endless, max_turns=2)
    _, rewards, infos, done = play(env, non_stop_actions(env, 40))
    assert done and len(rewards) == 6 and int(infos[-1]["turns"]) == 2 and not infos[-1]["length_capped"]
    # a cap mid-turn: length_capped, and the partial turn is the conversation's last message
    env = make(partner=Endless, max_turn_tokens=5, max_new_tokens=12, missing_eos_penalty=1.0)
    obs, rewards, infos, done = play(env, non_stop_actions(env, 40))
    last = infos[-1]
    assert done and last["length_capped"] and float(last["missing_eos_penalty"]) == 1.0
    assert obs["attention_mask"][env.unwrapped.max_prompt_tokens :].sum() == 12
    assert last["conversation"][-1]["role"] == "assistant"


def test_the_env_passes_gymnasium_sb3_and_torchrl_checkers():
    from stable_baselines3.common.env_checker import check_env as sb3_check_env
    from torchrl.envs import GymWrapper
    from torchrl.envs.utils import check_env_specs

    check_env(make(partner=Endless).unwrapped, skip_render_check=True)
    check_env(make(partner=Endless, reference_scoring="episode").unwrapped, skip_render_check=True)
    sb3_check_env(make(partner=Endless).unwrapped, warn=True)
    check_env_specs(GymWrapper(make(partner=Endless)), seed=0)
    vec = gym.make_vec("TextMultiTurn-v0", num_envs=2, vectorization_mode="vector_entry_point",
                       autoreset_mode="disabled", partner=Endless, max_turn_tokens=3)  # fmt: skip
    check_env_specs(GymWrapper(vec), seed=0)


def test_the_arguments_of_a_conversation_are_checked():
    with pytest.raises(TypeError, match="partner=None: TextMultiTurn-v0 needs a partner"):
        gym.make("TextMultiTurn-v0")
    with pytest.raises(TypeError, match="TextRLHFEnv is single-turn: max_turns= is an argument of a conversation"):
        gym.make("TextRLHF-v0", max_turns=2)
    with pytest.raises(ValueError, match="max_turn_tokens=0 must be an int >= 1"):
        make(max_turn_tokens=0)
    with pytest.raises(ValueError, match="partner_timeout=-1 must be"):
        make(partner_timeout=-1)
    env = make()
    with pytest.raises(ValueError, match=r"options\['partner_seed'\]"):
        env.reset(options={"partner_seed": -3})


def test_partner_seeds_come_from_the_env_rng_or_the_options_and_groups_share_one():
    Counter.seeds = []
    env = make()
    env.reset(seed=5)
    env.reset(seed=5)
    env.reset(options={"partner_seed": 2**30 + 7})
    assert Counter.seeds[-3] == Counter.seeds[-2] < 2**30 and Counter.seeds[-1] == 2**30 + 7
    from textgym.agents.ppo.algorithms import GroupBaseline
    from textgym.agents.ppo.config import PPOConfig

    envs = make_episode_envs("TextMultiTurn-v0", 4, partner=Counter, max_turn_tokens=3, reward_model=length_score)
    cfg = PPOConfig(algo="grpo", group_size=2, num_envs=4, total_episodes=8, out="unused")
    starts, seed = GroupBaseline(cfg).starts(envs, 4, seed=0)
    seeds = starts["partner_seeds"]
    assert seed is None and seeds[0] == seeds[1] and seeds[2] == seeds[3] and seeds[0] != seeds[2]


def test_the_single_turn_env_is_the_one_turn_case_and_draws_no_partner_seed():
    a = gym.make("TextRLHF-v0", max_new_tokens=4)
    obs, info = a.reset(seed=3)
    assert "turns" not in a.step(0)[4] and not a.unwrapped.has_partner
    envs = make_episode_envs("TextRLHF-v0", 2, max_new_tokens=4)
    assert envs.unwrapped.draw_partner_seeds([0, 1]) is None


def test_gae_skips_the_partners_columns_as_if_they_were_not_there():
    """GAE over a row with holes equals GAE over the same policy tokens packed together (an exact case)."""
    from tensordict import TensorDict

    from textgym.agents.ppo.advantages import compute_advantages

    torch.manual_seed(0)
    B, T = 2, 9
    holes = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1, 0], [1, 0, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    n = holes.sum(1)
    packed = torch.zeros(B, T, dtype=torch.bool)
    packed[0, : n[0]], packed[1, : n[1]] = True, True
    values, rewards = torch.randn(B, T, 1), torch.randn(B, T)

    def run(mask, order):
        v = torch.zeros(B, T, 1)
        r = torch.zeros(B, T)
        for i in range(B):
            cols = torch.nonzero(mask[i]).squeeze(1)
            v[i, cols] = values[i, order[i]]
            r[i, cols] = rewards[i, order[i]]
        data = TensorDict({"mask": mask, "reward": r, "sequence": torch.zeros(B, T, 1),
                           "sequence_mask": torch.zeros(B, T, 1)}, batch_size=[B, T])  # fmt: skip
        compute_advantages(data, lambda seq, m: v, gamma=0.9, lmbda=0.8)
        return data

    order = [torch.arange(int(k)) for k in n]
    a, b = run(holes, order), run(packed, order)
    for key in ("advantage", "value_target"):
        for i in range(B):
            torch.testing.assert_close(a[key][i, holes[i]], b[key][i, packed[i]])
            assert not a[key][i, ~holes[i]].any()
    # the hand-written recursion on row 1's three tokens, as a check of the packed layout itself
    v, r = values[1, :3, 0], rewards[1, :3]
    d2 = r[2] - v[2]
    d1 = r[1] + 0.9 * v[2] - v[1]
    d0 = r[0] + 0.9 * v[1] - v[0]
    adv = torch.stack([d0 + 0.72 * (d1 + 0.72 * d2), d1 + 0.72 * d2, d2])
    torch.testing.assert_close(b["value_target"][1, :3, 0], adv + v)


class Terse:
    """Pays each turn 1 − (its characters / 20), at least −1: a policy learns to say less; three turns a game."""

    def reset(self, *, seed, prompt):
        self.k = 0

    def reply(self, conversation):
        self.k += 1
        return "go on", max(-1.0, 1.0 - len(conversation[-1]["content"]) / 20), self.k >= 3


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_the_trainer_updates_on_the_policys_tokens_of_a_conversation(tmp_path, algo):
    from textgym.agents.ppo import PPOConfig, Trainer

    cfg = PPOConfig(env_id="TextMultiTurn-v0", max_new_tokens=36, max_turn_tokens=6, num_envs=8, total_episodes=16,
                    num_minibatches=2, ppo_epochs=1, algo=algo, group_size=4, precision="fp32", progress=False,
                    out=str(tmp_path / "run"))  # fmt: skip
    t = Trainer.create(cfg, env_overrides={"partner": Terse})
    row = t.iteration()
    ep = t.last_episodes
    assert ep["turns"].tolist() == [3] * 8
    assert all((torch.nonzero(m).squeeze(1).diff() > 1).sum() >= 1 for m in ep["mask"])  # replies between turns
    assert row["score"] == pytest.approx(float(ep["turn_reward_sum"].mean()))
    assert math.isfinite(row["policy_loss"]) and math.isfinite(row["kl"])
    sample = t.samples()[0]
    assert (
        sample["score"] == pytest.approx(float(ep["turn_reward_sum"][0])) and sample["transcript"].count("user: ") == 3
    )
    if algo == "grpo":  # a group is one game: the same partner seed, so the same opening and the same replies
        assert len(set(list(ep["prompt"])[:4])) == 1


@pytest.mark.slow
def test_ppo_learns_what_the_partner_pays_for_on_a_fixed_seed(tmp_path):
    from textgym.agents.ppo import PPOConfig, Trainer

    cfg = PPOConfig(env_id="TextMultiTurn-v0", max_new_tokens=36, max_turn_tokens=6, num_envs=16,
                    total_episodes=16 * 12, num_minibatches=2, seed=0, learning_rate=5e-4, target_kl=None,
                    precision="fp32", progress=False, checkpoint_every=100, out=str(tmp_path / "run"))  # fmt: skip
    t = Trainer.create(cfg, env_overrides={"partner": Terse})
    history = [t.iteration() for _ in range(cfg.num_iterations)]
    first = np.mean([r["score"] for r in history[:3]])
    last = np.mean([r["score"] for r in history[-3:]])
    assert last > first + 0.5, (first, last)


def test_evaluate_plays_held_out_partner_seeds_the_same_for_every_policy_and_reports_wins():
    from textgym.agents.evaluate import evaluate, format_eval, wilson_interval

    class Wins(Counter):
        TURNS = 2

        def reply(self, conversation):
            text, reward, done = super().reply(conversation)
            return text, (1.0 if self.seed % 2 == 0 else 0.25) if done else 0.0, done

        def reset(self, *, seed, prompt):
            self.seed = seed
            return super().reset(seed=seed, prompt=prompt)

        def verdict(self):  # the game's own outcome (issue 44.4), not its rewards
            return self.k >= self.TURNS and self.seed % 2 == 0

    Counter.seeds = []
    kwargs = dict(env_id="TextMultiTurn-v0", partner=Wins, max_turn_tokens=3, max_new_tokens=40)
    a = evaluate(None, episodes=6, num_envs=3, **kwargs)
    seen, Counter.seeds = list(Counter.seeds), []
    evaluate(None, episodes=6, num_envs=3, seed=99, **kwargs)
    held_out = [s for s in seen if s >= 2**30]
    assert sorted(held_out) == [2**30 + i for i in range(6)] and sorted(Counter.seeds[-6:]) == sorted(held_out)
    assert a["win_rate"] == 0.5 and a["turns"][0] == 2.0 and a["turn_reward_sum"][0] == pytest.approx(0.625)
    assert a["win_rate_ci95"] == list(wilson_interval(3, 6)) and "win_rate 0.500 [" in format_eval("pi_ref", a)
    # issue 43.3: "success" hid what it counts; the old keys stay for one version as aliases
    assert (a["success"], a["success_ci95"]) == (a["win_rate"], a["win_rate_ci95"])
    assert a["objective"][0] == pytest.approx(0.625 - a["kl_coef"] * a["kl"][0])


class ParityVerifier:
    """A verifier of the calculator's conversations: right when the transcript has an even length; its score is
    its verdict, so the paid score's mean is the share it judged right."""

    def score(self, episodes):
        return self.verdicts(episodes).astype(float)

    def verdicts(self, episodes):
        return np.array([len(r) % 2 == 0 for r in episodes.responses])


def test_win_rate_counts_the_verifiers_verdict_when_the_partner_pays_nothing():
    """Issue 44.4: the calculator pays 0 every turn, so counting turn_reward_sum >= 1 as a win reported 0 whatever
    the verifier judged; the win rate is the task's own verdict."""
    from textgym.agents.evaluate import evaluate

    a = evaluate(None, episodes=16, num_envs=4, env_id="TextMultiTurn-v0", partner="calculator", max_turn_tokens=6,
                 max_new_tokens=24, reward_model=ParityVerifier(), normalize_reward=False)  # fmt: skip
    assert a["turn_reward_sum"][0] == 0.0 and a["judged_episodes"] == 16
    assert 0.0 < a["win_rate"] < 1.0 and a["win_rate"] == pytest.approx(a["score"][0])


def test_the_partners_verdict_wins_over_the_reward_models_and_a_bad_one_is_a_partner_error():
    class Judges(Counter):
        TURNS = 1

        def verdict(self):
            return self.answer

    for answer, expected in ((True, 1.0), (False, 0.0), ("yes", None)):
        Judges.answer = answer
        env = make(partner=Judges, reward_model=ParityVerifier())
        env.reset(seed=0)
        done = False
        if expected is None:
            with pytest.raises(PartnerError, match=r"verdict returned str 'yes'; verdict\(\) must return a bool"):
                while not done:
                    _, _, done, _, info = env.step(int(env.action_space.sample()))
            continue
        while not done:
            _, _, done, _, info = env.step(int(env.action_space.sample()))
        assert info["verdict"] == expected


def test_closing_the_env_closes_each_slots_partner_once_and_a_failing_close_after_the_others():
    """A partner holding a session (OpenEnv's) releases it when the env closes; one that fails to close does not
    keep the others open."""

    class Holds(Counter):
        closed: list = []

        def close(self):
            Holds.closed.append(id(self))
            if getattr(self, "fail", False):
                raise OSError("the socket is already gone")

    envs = gym.make_vec("TextMultiTurn-v0", num_envs=3, vectorization_mode="vector_entry_point", partner=Holds,
                        max_turn_tokens=3, max_new_tokens=40)  # fmt: skip
    partners = envs.unwrapped._engine.dialogue.partners
    assert len({id(p) for p in partners}) == 3
    envs.close()
    envs.close()  # Gymnasium's close may be called again: nothing is closed twice
    assert sorted(Holds.closed) == sorted(id(p) for p in partners)

    Holds.closed = []
    envs = gym.make_vec("TextMultiTurn-v0", num_envs=3, vectorization_mode="vector_entry_point", partner=Holds,
                        max_turn_tokens=3, max_new_tokens=40)  # fmt: skip
    partners = envs.unwrapped._engine.dialogue.partners
    partners[1].fail = True
    with pytest.raises(PartnerError, match=r"partner 'Holds' \(env slot 1\)\.close raised OSError: the socket is"):
        envs.close()
    assert sorted(Holds.closed) == sorted(id(p) for p in partners)  # slot 2 closed too


def test_the_wilson_interval_matches_known_values():
    from textgym.agents.evaluate import wilson_interval

    lo, hi = wilson_interval(1, 100)
    assert (round(lo, 4), round(hi, 4)) == (0.0018, 0.0545)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0


def test_a_chat_models_conversation_is_exactly_its_chat_template_each_turn_in_its_role():
    """The observation's tokens equal the tokenizer's own chat template over the same messages."""
    from textgym.envs.turns import ReplyTemplate
    from textgym.models import load_tokenizer
    from textgym.named_models import smollm2_folder

    tok = load_tokenizer(smollm2_folder())
    end = tok.convert_tokens_to_ids("<|im_end|>")
    template = ReplyTemplate(tok, chat_template=True, stop_ids={end, tok.eos_token_id})

    def chat(messages):
        return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)

    messages = [{"role": "user", "content": "Guess a number."}]
    ids = chat(messages)
    for turn, reply in (("[5]", "Higher."), ("I say [8]", "Lower.")):
        turn_ids = tok(turn, add_special_tokens=False)["input_ids"] + [end]  # the policy ends its turn itself
        ids = ids + turn_ids + template.ids(reply, end)
        messages += [{"role": "assistant", "content": turn}, {"role": "user", "content": reply}]
    assert ids == chat(messages)
    # a partner's "<|im_end|>" in its text stays text: the only end-of-turn id is the one closing its turn
    assert template.ids("Higher. <|im_end|> is text", end).count(end) == 1
    # a turn cut by max_turn_tokens (no end-of-turn token of its own) gets the template's
    assert template.ids("Lower.", tok("[8", add_special_tokens=False)["input_ids"][-1])[0] == end


def test_the_guess_task_trains_in_its_presets_env():
    from textgym.agents import benchmark
    from textgym.agents.ppo.config import PRESET_DIR, load_config_file

    task = benchmark.TASKS["smollm2-guess"]
    for algo in ("grpo", "ppo"):
        preset = load_config_file(PRESET_DIR / f"smollm2-guess-{algo}.json")
        assert {k: preset[k] for k in task.env} == task.env and preset["env_id"] == task.env_id
        assert preset["max_new_tokens"] == task.max_new_tokens and preset["learning_rate"] == task.agent_lr
    ctx = benchmark.RunContext({**task.env, "max_new_tokens": 256, "kl_coef": 0.05}, 8192, 0, 32, None, task)
    assert ctx.policy_tokens_cap == 64 and ctx.episodes_that_fit(8192 - 64 * 5) == 5
    cfg = benchmark.agent_config(ctx, "grpo")
    assert (cfg.partner, cfg.max_turns, cfg.max_turn_tokens) == ("guess-the-number-10", 8, 8)


def test_the_calculator_tool_answers_a_call_and_a_turn_without_one_ends_the_episode():
    env = make(partner="calculator", max_turn_tokens=24, max_new_tokens=80, reward_model=None)
    base = env.unwrapped
    call = base.tokenizer("<calc>2+3*4</calc>", add_special_tokens=False)["input_ids"] + [base.eos_token_id]
    _, _, infos, done = play(env, call + [base.eos_token_id])
    assert done and infos[len(call) - 1]["reply"] == "<result>14</result>"
    assert [m["role"] for m in infos[-1]["conversation"]] == ["user", "assistant", "user", "assistant"]
    assert infos[-1]["conversation"][2]["content"] == "<result>14</result>" and int(infos[-1]["turns"]) == 2


def test_textgym_bench_offers_every_task():
    import argparse

    from textgym.agents import benchmark
    from textgym.cli import build_parser

    parser = build_parser()
    bench = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    (task,) = [a for a in bench._actions if a.dest == "task"]
    assert sorted(task.choices) == sorted(benchmark.TASKS)


def test_the_guess_bench_runs_its_reference_row_on_held_out_games(tmp_path):
    pytest.importorskip("textarena")
    from textgym.agents.benchmark import BenchConfig, run_benchmark

    cfg = BenchConfig(task="smollm2-guess", algos=["reference"], seeds=[0], budget=8, num_envs=2, eval_episodes=2,
                      calibration_episodes=2, out=str(tmp_path / "bench"))  # fmt: skip
    (row,) = run_benchmark(cfg)
    assert row["turns"] >= 1 and 0 <= row["turn_reward_sum"] <= 1.5 and math.isfinite(row["score"])
    assert row["score"] == row["turn_reward_sum"] and row["win_rate"] in (0.0, 0.5, 1.0)


class PaysOne(Counter):
    """Pays 1.0 for every turn and never ends the game."""

    def reply(self, conversation):
        return "noted", 1.0, False


def test_a_turn_ended_by_max_turn_tokens_on_the_budgets_last_column_is_answered_and_paid():
    """Issue 42: one column earlier the turn is answered; on the last column it lost its reward and paid the
    missing-EOS penalty, as if the budget had cut it."""
    probe = make(partner=PaysOne, max_turn_tokens=3, max_new_tokens=40)
    obs, *_ = play(probe, non_stop_actions(probe, 3))
    P = probe.unwrapped.max_prompt_tokens
    reply = int(obs["attention_mask"][P:].sum()) - 3  # the partner's reply, in tokens
    sums = {}
    for budget in (6 + reply, 7 + reply):  # the 2nd turn's 3rd token on the last column, then one column before it
        env = make(partner=PaysOne, max_turn_tokens=3, max_new_tokens=budget, missing_eos_penalty=1.0)
        _, rewards, infos, done = play(env, non_stop_actions(env, 40))
        last = infos[-1]
        assert done and not last["length_capped"] and float(last["missing_eos_penalty"]) == 0.0, budget
        sums[budget] = float(last["turn_reward_sum"])
        assert int(last["turns"]) == 2 and last["conversation"][-1]["role"] == "assistant"
    assert sums == {6 + reply: 2.0, 7 + reply: 2.0}


class Flood(Counter):
    """Answers with 10 MiB of text (pays 1.0, never ends)."""

    def reply(self, conversation):
        return "flood " * (10 * 2**20 // 6), 1.0, False


def test_a_reply_too_long_to_fit_ends_the_episode_without_tokenising_it_and_its_info_is_bounded(monkeypatch):
    env = make(partner=Flood, partner_timeout=5)
    template = env.unwrapped._engine.dialogue.template
    tokenised = []
    call = type(template.tokenizer).__call__
    monkeypatch.setattr(type(template.tokenizer), "__call__",
                        lambda self, text, **kw: tokenised.append(len(text)) or call(self, text, **kw))  # fmt: skip
    start = time.perf_counter()
    _, rewards, infos, done = play(env, non_stop_actions(env, 3))
    assert time.perf_counter() - start < 2  # 18.9 s before: the 10 MiB were tokenised, then thrown away
    assert done and len(rewards) == 3 and float(infos[-1]["turn_reward_sum"]) == 1.0
    assert max(tokenised, default=0) < 1000  # the template's pieces only, never the reply
    limit = env.unwrapped.max_new_tokens * template.max_token_chars
    reply = infos[-1]["reply"]
    assert len(reply) < limit + 100 and reply.endswith(f"more characters cut: no reply can hold more than {limit}]")
    assert reply.startswith("flood flood") and str(10 * 2**20 // 6 * 6 - limit) in reply


def test_a_partner_opening_that_is_not_unicode_is_refused_naming_the_partner():
    class BadOpening(Counter):
        def reset(self, *, seed, prompt):
            return "rules \ud800"

    with pytest.raises(PartnerError, match=r"partner 'BadOpening' .*reset returned .*whose text has a lone surrogate"):
        make(partner=BadOpening)


class FlakyReset(Counter):
    """Ends the game after one turn; its reset raises while ``FlakyReset.down`` (a game server that went away)."""

    down = False

    def reset(self, *, seed, prompt):
        if FlakyReset.down:
            raise ConnectionError("the game server is down")
        return super().reset(seed=seed, prompt=prompt)

    def reply(self, conversation):
        return "game over", 1.0, True


@pytest.mark.parametrize("reference_scoring", ["step", "episode"])
def test_a_failing_autoreset_leaves_the_whole_vector_step_undone_so_a_retry_steps_once(reference_scoring):
    """Issue 42.2: a partner reset failing during NEXT_STEP's autoreset left the live slots advanced (and their RNGs
    drawn): slot 1's length went 5 -> 6 on the failed step and a retry stepped it twice."""

    def make_vec():
        return gym.make_vec("TextMultiTurn-v0", num_envs=2, vectorization_mode="vector_entry_point",
                            partner=FlakyReset, max_turn_tokens=8, max_new_tokens=40, kl_coef=BETA,
                            reference_scoring=reference_scoring)  # fmt: skip

    def run(fail_once: bool):
        FlakyReset.down = False
        envs = make_vec()
        stop = envs.unwrapped.eos_token_id
        word = next(a for a in range(5, 100) if a not in envs.unwrapped.stop_token_ids)
        envs.reset(seed=3)
        outs = [envs.step(np.array([stop, word]))]  # slot 0 ends its turn, and the game with it
        e = envs.unwrapped._engine
        before = (e.layout.length.copy(), e.layout.input_ids.copy(),
                  [r.bit_generator.state for r in envs.unwrapped._slot_rngs])  # fmt: skip
        if fail_once:
            FlakyReset.down = True
            with pytest.raises(PartnerError, match="the game server is down"):
                envs.step(np.array([word, word]))  # slot 0 autoresets (NEXT_STEP), slot 1 steps
            after = (e.layout.length, e.layout.input_ids, [r.bit_generator.state for r in envs.unwrapped._slot_rngs])
            assert after[0].tolist() == before[0].tolist() and (after[1] == before[1]).all() and after[2] == before[2]
            FlakyReset.down = False
        outs += [envs.step(np.array([word, word])) for _ in range(3)]
        return [(o[0]["input_ids"], o[1]) for o in outs]

    clean, retried = run(False), run(True)
    for (obs_a, r_a), (obs_b, r_b) in zip(clean, retried, strict=True):
        np.testing.assert_array_equal(obs_a, obs_b)
        np.testing.assert_array_equal(r_a, r_b)


@pytest.mark.parametrize("reference_scoring", ["step", "episode"])
def test_a_failing_same_step_autoreset_leaves_the_step_undone_so_a_retry_steps_once(reference_scoring):
    """Issue 42.2 for SAME_STEP: the slot that ends is reset on the step itself. Before, its partner's reset ran after
    the step was written: the failed step had advanced both slots, ended slot 0's game and drawn its RNG."""

    def run(fail_once: bool):
        FlakyReset.down = False
        envs = gym.make_vec("TextMultiTurn-v0", num_envs=2, vectorization_mode="vector_entry_point",
                            autoreset_mode="same_step", partner=FlakyReset, max_turn_tokens=8, max_new_tokens=40,
                            kl_coef=BETA, reference_scoring=reference_scoring)  # fmt: skip
        stop = envs.unwrapped.eos_token_id
        word = next(a for a in range(5, 100) if a not in envs.unwrapped.stop_token_ids)
        envs.reset(seed=3)
        e, outs = envs.unwrapped._engine, [envs.step(np.array([word, word]))]
        if fail_once:
            before = (e.layout.length.copy(), e.layout.input_ids.copy(), e.layout.done.copy(),
                      e.dialogue.turns.copy(), [list(m) for m in e.dialogue.messages],
                      [r.bit_generator.state for r in envs.unwrapped._slot_rngs])  # fmt: skip
            FlakyReset.down = True
            with pytest.raises(PartnerError, match="the game server is down"):
                envs.step(np.array([stop, word]))  # slot 0 ends its game and is reset on the same step
            after = (e.layout.length, e.layout.input_ids, e.layout.done, e.dialogue.turns, e.dialogue.messages,
                     [r.bit_generator.state for r in envs.unwrapped._slot_rngs])  # fmt: skip
            assert after[0].tolist() == before[0].tolist() and (after[1] == before[1]).all()
            assert after[2].tolist() == before[2].tolist() and after[3].tolist() == before[3].tolist()
            assert after[4] == before[4] and after[5] == before[5]
            FlakyReset.down = False
        outs.append(envs.step(np.array([stop, word])))
        assert outs[-1][2].tolist() == [True, False] and "final_info" in outs[-1][4]
        outs += [envs.step(np.array([word, word])) for _ in range(3)]
        return [(o[0]["input_ids"], o[1], o[2]) for o in outs]

    clean, retried = run(False), run(True)
    for a, b in zip(clean, retried, strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)
