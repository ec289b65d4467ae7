"""TextRLHF-v0: token-level RLHF as a Gymnasium environment, single and natively vectorised.

The two env classes; what they share (π_ref's KV cache, the reward models, the episode slots) is
the :class:`~textgym.envs.engine.Engine`, and ``prompts=`` is read by :mod:`textgym.envs.prompts`.
"""

from __future__ import annotations

import copy
import difflib
import inspect
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.utils import seeding
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from textgym.envs.checks import check_int, check_kl_coef, resolve_stop_ids
from textgym.envs.engine import DEFAULT_KL_COEF, Engine
from textgym.envs.prompts import load_prompts
from textgym.errors import short_repr

# DEFAULT_KL_COEF, check_kl_coef, load_prompts and resolve_stop_ids live in the engine, checks and prompts
# modules; they stay importable from here, where they were public before.
__all__ = [
    "DEFAULT_KL_COEF",
    "TextRLHFEnv",
    "TextRLHFVectorEnv",
    "check_kl_coef",
    "load_prompts",
    "resolve_stop_ids",
]

RENDER_MODES = ["ansi", "rgb_array"]


def _check_render_mode(render_mode: str | None) -> str | None:
    if render_mode is not None and render_mode not in RENDER_MODES:
        raise ValueError(f"render_mode={render_mode!r} is not one of {RENDER_MODES} or None")
    return render_mode


def text_image(text: str, height: int = 256, width: int = 512) -> np.ndarray:
    """``text`` drawn black on white as an ``(height, width, 3)`` uint8 frame (``render_mode="rgb_array"``).

    Why a picture of text: SB3's ``make_vec_env`` asks every env for ``rgb_array`` and video
    recorders take frames; a fixed size keeps every frame of a video the same. Long text keeps its
    last lines (the newest tokens).
    """
    import textwrap

    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    line_height = 12
    lines = [row for part in text.splitlines() or [""] for row in textwrap.wrap(part, width // 7) or [""]]
    lines = lines[-max(1, (height - 8) // line_height) :]
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    for i, line in enumerate(lines):
        draw.text((4, 4 + i * line_height), line, fill="black", font=font)
    return np.asarray(image, dtype=np.uint8)


_TURN_ARGS = ("partner", "max_turns", "max_turn_tokens", "partner_timeout")  # a conversation's (TextMultiTurn-v0)
_VECTOR_ARGS = ("num_envs", "autoreset_mode", "render_mode")


def engine_kwargs(cls: type, kwargs: dict[str, Any], own: Sequence[str]) -> dict[str, Any]:
    """``kwargs`` once each name is one the env takes; else one TypeError naming the env, the close match, the rest.

    Why not the engine's own TypeError: ``Engine.__init__() got an unexpected keyword argument 'max_new_token'``
    names neither the env nor what it takes. A conversation's arguments on a single-turn env are refused too:
    ``partner=`` on TextRLHF-v0 would silently make it a conversation.
    """
    names = [p for p in inspect.signature(Engine.__init__).parameters if p not in ("self", "num_slots")]
    conversation = getattr(cls, "conversation", False)
    allowed = sorted({*own, *(n for n in names if conversation or n not in _TURN_ARGS)})
    for key in kwargs:
        if key in allowed:
            continue
        if key in _TURN_ARGS:
            call = "partner=..." if key == "partner" else f"partner=..., {key}=..."
            raise TypeError(f"{cls.__name__} is single-turn: {key}= is an argument of a conversation, "
                            f"gym.make('TextMultiTurn-v0', {call})")  # fmt: skip
        close = difflib.get_close_matches(key, allowed, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ";"
        raise TypeError(f"{cls.__name__} got an unexpected keyword argument {key!r}{hint} it takes: "
                        f"{', '.join(allowed)}")  # fmt: skip
    return kwargs


def _check_options(options: Any) -> dict[str, Any]:
    """``reset``'s ``options`` as a dict ({} for None), or one TypeError naming it."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError(f"options={short_repr(options)} must be a dict or None, e.g. {{'prompt': 'The movie was'}}")
    return options


PARTNER_SEEDS = 2**30  # a partner's seed is drawn from [0, 2**30): seeds from 2**30 on are never trained on


def _partner_seeds(options: dict[str, Any], n: int) -> list[int] | None:
    """``options["partner_seed"]`` as one seed per slot being reset (None when not given), or one clear error."""
    seeds = options.get("partner_seed")
    if seeds is None:
        return None
    seeds = [seeds] * n if isinstance(seeds, (int, np.integer)) and not isinstance(seeds, (bool, np.bool_)) else seeds
    ok = isinstance(seeds, (list, tuple, np.ndarray)) and len(seeds) == n
    if not ok or not all(isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)) and x >= 0
                         for x in seeds):  # fmt: skip
        raise ValueError(f"options['partner_seed']={short_repr(options['partner_seed'])} must be an int >= 0 or a "
                         f"list of {n} such ints, one per slot being reset")  # fmt: skip
    return [int(x) for x in seeds]


def _check_action(action: Any, vocab_size: int, name: str = "action") -> int:
    """A token id as a Python int, or one clear error naming the value and what is allowed."""
    if isinstance(action, np.ndarray) and action.shape == ():
        action = action.item()
    if isinstance(action, (bool, np.bool_)) or not isinstance(action, (int, np.integer)):
        raise TypeError(f"{name}={action!r} must be an integer token id in [0, {vocab_size})")
    if not 0 <= action < vocab_size:
        raise ValueError(f"{name}={action} is outside the action space: token ids are in [0, {vocab_size})")
    return int(action)


_DOC_ARGS = """
    Arguments:
        model: π_ref, a Hugging Face causal-LM folder or hub id (default: the embedded
            reference LM, a 4-layer Llama trained on short movie reviews).
        tokenizer: folder or id of the tokenizer (default: the model's).
        reward_model: r_φ: a registered name (``"default"``, ``"vader"``), an HF
            sequence-classifier folder or id, a ``"module:attr"`` string, an entry point of
            the ``textgym.reward_models`` group, ``"reasoning-gym:<dataset>"`` (that dataset's
            ``score_answer``, with verdicts), an object with ``score(episodes)``, or a
            function ``f(prompts, responses) -> floats`` (default: the embedded RM).
        gold_scorer: the same routes; scores every finished episode beside the proxy RM for
            reward over-optimisation studies (default ``"vader"``; ``None`` turns it off).
        prompts: list of str, a UTF-8 ``.txt`` / ``.jsonl`` path, a folder saved with Hugging Face
            ``datasets``' ``save_to_disk``, or a dataset's name in the local Hugging Face cache
            (``"NAME"`` or ``"NAME:SPLIT"``), or a reasoning-gym dataset's seeded questions
            (``"reasoning-gym:<dataset>[:eval]"``; see :func:`load_prompts`) (default: the embedded train
            prompts; the eval prompts are ``textgym.assets.EVAL_PROMPTS``). Special-token text in
            a prompt (``"<pad>"``) is encoded as text, never as the special token.
        prompt_column: the field of a ``.jsonl`` row or a dataset holding the prompt (default ``"prompt"``).
        max_prompt_tokens: prompt block length (default: the longest prompt of the set).
            A longer prompt is refused with a ``ValueError``, never silently truncated.
        max_new_tokens: response length cap; reaching it terminates the episode (default 32).
            ``max_prompt_tokens + max_new_tokens`` must fit the model's ``max_position_embeddings``.
        kl_coef: β of the reward (default 0.05); settable between episodes (``env.kl_coef``).
        normalize_reward: standardise the RM score with the mean/std stored beside it (measured
            under π_ref; a warning says when at another ``max_new_tokens``); ``None`` (default)
            does so whenever stats are stored; a ``(mean, std)`` pair standardises with those.
        missing_eos_penalty: subtracted from the last reward when the episode reaches
            ``max_new_tokens`` without a stop token (default 0).
        action_mask_top_p: when set, ``action_masks()`` keeps only π_ref's top-p tokens (for
            sb3-contrib's MaskablePPO; NLPO of RL4LMs); default None keeps every token.
        stop_token_ids: the ids that end an episode (default: the tokenizer's EOS plus every
            id of the model's ``generation_config.eos_token_id``, e.g. a chat model's end-of-turn).
        chat_template: put each prompt into the tokenizer's chat template as the user turn,
            followed by the assistant's generation prompt (default False: plain text).
        device: ``"cpu"`` (default), ``"cuda"`` or ``"auto"``.
        dtype: π_ref's compute dtype, ``"float32"`` (default), ``"bfloat16"`` or ``"float16"``.
        reward_timeout: seconds to wait for each ``score`` call of the reward model and the gold
            scorer (default None: no limit); a call that hangs longer raises ``RewardModelError``
            naming the model and the batch, and is abandoned (a thread cannot be stopped).
        reference_scoring: when π_ref scores the tokens. ``"step"`` (default): a cached π_ref
            forward on every step pays ``kl_coef · log π_ref(a_t|s_t)`` at that step. ``"episode"``:
            no π_ref forward while the episode runs; when it ends, one teacher-forced forward over
            the finished episodes gives every token's log π_ref at once, the last step pays
            ``kl_coef · Σ_t log π_ref(a_t|s_t)`` plus the score, and its info names each token's part
            (``token_ref_logprobs``, ``token_rewards``). The return is the same (see Rewards); what
            textgym's own collectors use. Settable between episodes (``env.reference_scoring``).
"""


class TextRLHFEnv(gym.Env):
    __doc__ = (
        """Token-level RLHF: write the next token of a response to a prompt.

    Description:
        The KL-regularised RLHF objective of Ziegler et al. (2019) / Ouyang et al. (2022) as an
        MDP. The state is a prompt plus the tokens generated so far, the action the next
        token. π_ref (frozen SFT model) and r_φ (frozen reward model) live in the
        environment; the policy being trained is the agent.

    Action Space:
        ``Discrete(vocab_size)``: a token id.

    Observation Space:
        ``Dict(input_ids=Box(0, vocab_size - 1, (L,), int64), attention_mask=Box(0, 1, (L,),
        int64))`` with ``L = max_prompt_tokens + max_new_tokens``. The prompt is left-padded
        into the first ``max_prompt_tokens`` columns; response token k is at column
        ``max_prompt_tokens + k``; the mask is 1 on real tokens.

    Rewards:
        ``r_t = kl_coef · log π_ref(a_t | s_t)``, plus on the last step the reward-model score
        (normalised when ``normalize_reward``) minus ``missing_eos_penalty`` if length-capped.
        The reward depends on (s_t, a_t) only. An agent adding ``−kl_coef · log π(a_t|s_t)``
        of its own sample gets the per-token KL-penalised reward −β·log(π/π_ref) (+ score),
        whose return is that of E[score] − β·KL(π‖π_ref) (an entropy bonus β is not equivalent).
        ``info["ref_logprob"]`` is log π_ref(a_t | s_t) on every step.

        With ``reference_scoring="episode"`` the steps before the last pay 0 and have no
        ``ref_logprob``; the last pays ``kl_coef · Σ_t log π_ref(a_t|s_t)`` + score − penalty, the
        sum of what every step would have paid, so the undiscounted return is the same. Its info adds
        ``token_ref_logprobs`` and ``token_rewards`` (``(max_new_tokens,)`` float64, 0 past the response): each
        token's log π_ref and the reward stepping pays on it. A collector that writes
        ``token_rewards`` back onto the tokens has exactly the per-step rewards (to float rounding:
        teacher forcing and the cached step run other kernels, |Δ log π_ref| ≤ 1e-5 in fp32).

    Starting State:
        A prompt drawn uniformly from ``prompts`` with ``self.np_random``, or
        ``reset(options={"prompt": text})``; the empty prompt starts from BOS. A prompt longer
        than ``max_prompt_tokens`` is refused with a ``ValueError`` before anything changes:
        the running episode, if any, steps on and the RNG is not re-seeded.

    Episode End:
        Terminated when the action is a stop token (EOS or any of the model's stop ids, see
        ``stop_token_ids``), and terminated at ``max_new_tokens`` tokens with
        ``info["length_capped"] = True``: the observation encodes the step and the score is paid
        there, so the cap is a terminal state of this MDP, not an outside time limit (an agent
        that bootstraps on ``truncated`` would add V(s_T) on top of the score). ``truncated`` is
        always False; it is left to outside time limits such as a user's ``TimeLimit``. The last
        step's info adds ``rm_score`` (raw), ``score_reward``, ``missing_eos_penalty`` (0 or the penalty
        subtracted), ``gold_score``, ``prompt``, ``response``, ``response_length`` and ``length_capped``.
        A reward model that raises, hangs past ``reward_timeout`` or returns anything but one finite float per
        episode raises :class:`textgym.rewards.RewardModelError` naming it, the batch and the
        episode's slot. Any exception in a step (``KeyboardInterrupt`` too, re-raised as it is)
        undoes the step, so it can be retried.
"""
        + _DOC_ARGS
        + """
    Vectorized Environment:
        ``gym.make_vec("TextRLHF-v0", num_envs=N, vectorization_mode="vector_entry_point")``
        gives :class:`TextRLHFVectorEnv`: one batched cached π_ref forward per step for all N
        slots and one batched RM call for the episodes ending on that step.

    Rendering:
        ``render_mode="ansi"`` returns the prompt and response so far as text, ``"rgb_array"`` that
        text drawn black on white as a ``(256, 512, 3)`` uint8 frame (for video recorders).

    Processes:
        ``gym.make_vec(..., vectorization_mode="async")`` works with the default ``fork`` start
        method: an env built in a process forked after ``import textgym`` sets torch to one thread
        (GNU OpenMP's pool does not survive fork), as torch's DataLoader workers do. One env per
        process then uses one core; ``torch.set_num_threads`` after ``make`` overrides it.

    Version History:
        v0: initial release. Changed before any release, keeping the id: reaching
            ``max_new_tokens`` is ``terminated`` with ``info["length_capped"]`` (it was
            ``truncated``); any of the model's stop ids ends an episode; ``chat_template``;
            with autoreset disabled a finished slot ignores its action (it raised); special-token
            text in prompts is encoded as text (it was parsed); ``reward_timeout``; ``render_mode=
            "rgb_array"`` draws the text as a frame (SB3's ``make_vec_env`` asks for it); numeric infos are
            numpy scalars (TorchRL's info readers need a dtype; a ``float64`` is still a Python float); in a
            process forked after textgym's import, torch runs on one thread (``AsyncVectorEnv`` hung);
            ``reference_scoring`` (default ``"step"``, the per-step reward as before); π_ref's forwards
            ignore an autocast region the caller opened (they run in the env's ``dtype``).

    Example:
        >>> import gymnasium as gym, textgym
        >>> env = gym.make("TextRLHF-v0", max_new_tokens=4)
        >>> obs, info = env.reset(seed=0, options={"prompt": "The movie was"})
        >>> obs["input_ids"].shape == env.observation_space["input_ids"].shape
        True
        >>> obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
        >>> bool(np.isclose(reward, env.unwrapped.kl_coef * info["ref_logprob"])) or terminated
        True
    """
    )

    metadata = {"render_modes": RENDER_MODES, "render_fps": 4}

    def __init__(self, render_mode: str | None = None, **kwargs: Any):
        self.render_mode = _check_render_mode(render_mode)
        self._engine = Engine(1, **engine_kwargs(type(self), kwargs, ("render_mode",)))
        e = self._engine
        self.action_space = spaces.Discrete(e.vocab_size)
        self.observation_space = spaces.Dict(
            {
                "input_ids": spaces.Box(0, e.vocab_size - 1, (e.seq_len,), np.int64),
                "attention_mask": spaces.Box(0, 1, (e.seq_len,), np.int64),
            }
        )

    # Models and settings are the engine's; expose the ones users and agents read.
    model = property(lambda self: self._engine.model)
    tokenizer = property(lambda self: self._engine.tokenizer)
    reward_model = property(lambda self: self._engine.reward_model)
    gold_scorer = property(lambda self: self._engine.gold_scorer)
    prompts = property(lambda self: self._engine.prompts)
    max_prompt_tokens = property(lambda self: self._engine.max_prompt_tokens)
    max_new_tokens = property(lambda self: self._engine.max_new_tokens)
    eos_token_id = property(lambda self: self._engine.encoding.eos_id)
    stop_token_ids = property(lambda self: tuple(sorted(self._engine.encoding.stop_ids)), doc="ids that end an episode")
    pad_token_id = property(lambda self: self._engine.encoding.pad_id)
    has_partner = property(lambda self: self._engine.dialogue.has_partner, doc="whether episodes are conversations")
    reward_norm = property(
        lambda self: self._engine.norm,
        doc="the (mean, std, ...) the reward model's score is standardised by (``normalize_reward``), or None: the "
        "scale the env pays, for an agent to give to its other envs (Ray workers, eval) as it is",
    )
    partner = property(
        lambda self: self._engine.dialogue.partners[0] if self.has_partner else None,
        doc="slot 0's partner object (each slot has its own), or None for single-turn episodes",
    )
    action_mask_top_p = property(lambda self: self._engine.action_mask_top_p, doc="π_ref mass action_masks() keep")
    kl_coef = property(lambda self: self._engine.kl_coef, lambda self, v: setattr(self._engine, "kl_coef", v), doc="β")
    reference_scoring = property(
        lambda self: self._engine.reference_scoring,
        lambda self, v: setattr(self._engine, "reference_scoring", v),
        doc='``"step"`` or ``"episode"`` (see Arguments): applies to the episodes started after it is set',
    )

    def encode_prompts(self, prompts: Sequence[str]) -> list[list[int]]:
        """The token ids π_ref is fed for each of ``prompts`` (the chat template applied when the env uses one):
        a prompt block of the observation without its padding, to give another tool the very same prompts.

        Raises:
            TypeError / ValueError: as ``reset(options={"prompt": ...})`` would for that prompt.
        """
        return self._engine.encode_prompts(list(prompts))

    reference_context = property(
        lambda self: self._engine.decoder.context,
        lambda self, factory: setattr(self._engine.decoder, "context", factory),
        doc="π_ref's forwards run inside ``reference_context()`` (default: nothing). A LoRA policy built on "
        "the env's own model (``peft.get_peft_model(env.unwrapped.model, ...)``) shares π_ref's weights; "
        "set it to ``policy.disable_adapter`` and π_ref stays the base model.",
    )

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        options = _check_options(options)
        prompt = options.get("prompt")
        # Check a given prompt before seeding: a refused reset changes nothing, the running
        # episode (if any) steps on and the RNG keeps its state.
        encoded = self._engine.encode_prompts([prompt]) if prompt is not None else None
        given_seed = _partner_seeds(options, 1) if self._engine.dialogue.has_partner else None
        super().reset(seed=seed)
        if prompt is None:
            prompt = self._engine.prompts[int(self.np_random.integers(len(self._engine.prompts)))]
        partner_seeds = None
        if self._engine.dialogue.has_partner:  # drawn after the prompt: a single-turn env's RNG stream is unchanged
            partner_seeds = given_seed or [int(self.np_random.integers(PARTNER_SEEDS))]
        self._engine.start([0], [prompt], encoded, partner_seeds)
        return self._engine.observation(0), {"prompt": self._engine.prompt_text[0]}

    def step(self, action):
        e = self._engine
        if not e.started[0]:
            raise RuntimeError("step() called before reset(); call env.reset() first")
        if e.done[0]:
            raise RuntimeError("step() called after the episode ended (terminated or truncated); call env.reset()")
        a = _check_action(action, e.vocab_size)
        deferred = bool(e.deferred[0])
        out = e.advance(np.array([a], dtype=np.int64), np.ones(1, dtype=bool))
        info = {} if deferred else {"ref_logprob": np.float64(out["ref_logprob"][0])}
        info.update(out["turn"].get(0, {}))
        info.update(out["final"].get(0, {}))
        return e.observation(0), float(out["reward"][0]), bool(out["terminated"][0]), bool(out["truncated"][0]), info

    def action_masks(self) -> np.ndarray:
        """``(vocab_size,)`` bool mask of the allowed tokens (see ``action_mask_top_p``)."""
        return self._engine.action_masks()[0]

    def close(self) -> None:
        """Close the partners (an OpenEnv session, a socket); Gymnasium's ``close`` may be called more than once."""
        if getattr(self, "_engine", None) is not None:  # a constructor that failed made none
            self._engine.close()
        super().close()

    def render(self) -> str | np.ndarray | None:
        """The prompt and response so far: text (``"ansi"``) or that text drawn as a frame (``"rgb_array"``)."""
        if self.render_mode == "ansi":
            return self._engine.render(0)
        if self.render_mode == "rgb_array":
            return text_image(self._engine.render(0))
        return None


_AUTORESET = {
    **{m: m for m in AutoresetMode},
    "next_step": AutoresetMode.NEXT_STEP,
    "same_step": AutoresetMode.SAME_STEP,
    "disabled": AutoresetMode.DISABLED,
}


class TextRLHFVectorEnv(VectorEnv):
    __doc__ = (
        """N episode slots of :class:`TextRLHFEnv` stepped together.

    Every step runs one batched, KV-cached π_ref forward over all N slots and one batched
    reward-model call for the episodes that end on it; slots finish at different steps.

    Autoreset (``autoreset_mode``, declared in ``metadata["autoreset_mode"]``):
        ``"next_step"`` (Gymnasium's default): a finished slot is reset on the next ``step``,
        whose action for it is ignored (reward 0). ``"same_step"``: reset at once, the final
        observation and info in ``info["final_obs"]`` / ``info["final_info"]``.
        ``"disabled"``: finished slots wait for ``reset(options={"reset_mask": mask})``;
        stepping one ignores its action (reward 0, not terminated; what TorchRL's ``GymWrapper``
        and :func:`textgym.episodes.collect_episodes` use).

    Seeding matches ``SyncVectorEnv``: ``reset(seed=s)`` seeds slot i with ``s + i``.
    ``reset(options={"prompt": str | list[str]})`` sets the prompts of the reset slots.
"""
        + _DOC_ARGS
        + """        num_envs: number of slots N.
        autoreset_mode: see above (an ``AutoresetMode`` or its string value).
    """
    )

    metadata = {"render_modes": RENDER_MODES, "render_fps": 4, "autoreset_mode": AutoresetMode.NEXT_STEP}

    def __init__(
        self,
        num_envs: int = 1,
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
        render_mode: str | None = None,
        **kwargs: Any,
    ):
        check_int("num_envs", num_envs, 1)
        mode = _AUTORESET.get(autoreset_mode.lower() if isinstance(autoreset_mode, str) else autoreset_mode)
        if mode is None:
            raise ValueError(f"autoreset_mode={autoreset_mode!r} is not one of {sorted(_AUTORESET, key=str)}")
        self.render_mode = _check_render_mode(render_mode)
        self.metadata = {**type(self).metadata, "autoreset_mode": mode}
        self.num_envs = int(num_envs)
        self._engine = Engine(self.num_envs, **engine_kwargs(type(self), kwargs, _VECTOR_ARGS))
        e = self._engine
        self.single_action_space = spaces.Discrete(e.vocab_size)
        self.single_observation_space = spaces.Dict(
            {
                "input_ids": spaces.Box(0, e.vocab_size - 1, (e.seq_len,), np.int64),
                "attention_mask": spaces.Box(0, 1, (e.seq_len,), np.int64),
            }
        )
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self._slot_rngs = [seeding.np_random()[0] for _ in range(self.num_envs)]
        self._autoreset = np.zeros(self.num_envs, dtype=bool)

    def rng_state(self) -> list[dict]:
        """The per-slot prompt RNG states (for exact resumption of a training run)."""
        return [rng.bit_generator.state for rng in self._slot_rngs]

    def set_rng_state(self, state: list[dict]) -> None:
        if len(state) != self.num_envs:
            raise ValueError(f"state has {len(state)} slot RNG states for num_envs={self.num_envs}")
        for rng, st in zip(self._slot_rngs, state, strict=True):
            rng.bit_generator.state = st

    @property
    def autoreset_mode(self) -> AutoresetMode:
        """The autoreset mode (also in ``metadata``; TorchRL's GymWrapper reads this attribute)."""
        return self.metadata["autoreset_mode"]

    model = TextRLHFEnv.model
    tokenizer = TextRLHFEnv.tokenizer
    reward_model = TextRLHFEnv.reward_model
    gold_scorer = TextRLHFEnv.gold_scorer
    prompts = TextRLHFEnv.prompts
    max_prompt_tokens = TextRLHFEnv.max_prompt_tokens
    max_new_tokens = TextRLHFEnv.max_new_tokens
    eos_token_id = TextRLHFEnv.eos_token_id
    stop_token_ids = TextRLHFEnv.stop_token_ids
    pad_token_id = TextRLHFEnv.pad_token_id
    has_partner = TextRLHFEnv.has_partner
    reward_norm = TextRLHFEnv.reward_norm
    partner = TextRLHFEnv.partner
    action_mask_top_p = TextRLHFEnv.action_mask_top_p
    kl_coef = TextRLHFEnv.kl_coef
    reference_scoring = TextRLHFEnv.reference_scoring
    reference_context = TextRLHFEnv.reference_context
    encode_prompts = TextRLHFEnv.encode_prompts

    def draw_prompts(self, slots) -> list[str]:
        """One prompt per slot in ``slots``, drawn with that slot's RNG as its reset would.

        For groups of G episodes on one prompt (GRPO, RLOO): draw with one slot per group and
        pass each prompt G times to ``reset(options={"prompt": ...})``. Seeded and checkpointed
        with the slots' RNGs (``rng_state``).
        """
        e = self._engine
        return [e.prompts[int(self._slot_rngs[int(s)].integers(len(e.prompts)))] for s in slots]

    def draw_partner_seeds(self, slots) -> list[int] | None:
        """One partner seed per slot in ``slots`` (a game's deal), drawn with that slot's RNG; None without a partner.

        For groups on one game (GRPO, RLOO): draw with one slot per group and pass each seed G times to
        ``reset(options={"partner_seed": ...})``, beside the group's prompt.
        """
        if not self._engine.dialogue.has_partner:
            return None
        return [int(self._slot_rngs[int(s)].integers(PARTNER_SEEDS)) for s in slots]

    def _start(self, slots: np.ndarray) -> None:
        """Start ``slots`` on prompts (and partner seeds) drawn with their own RNGs."""
        self._engine.commit_start(self._prepare_start(slots))

    def _prepare_start(self, slots: np.ndarray):
        """The start of ``slots`` computed, nothing written (their RNGs have drawn: see :meth:`_rng_states`)."""
        prompts = self.draw_prompts(slots)
        return self._engine.prepare_start(slots.tolist(), prompts, None, self.draw_partner_seeds(slots))

    def _rng_states(self, slots: np.ndarray) -> list[tuple[int, dict]]:
        """The slots' RNG states, to put back when a step that drew from them fails."""
        return [(int(s), copy.deepcopy(self._slot_rngs[int(s)].bit_generator.state)) for s in slots]

    def _given_prompts(self, prompts: Any, n: int) -> list[str]:
        """``options["prompt"]`` as one prompt per slot being reset, or one clear error."""
        if isinstance(prompts, str):
            return [prompts] * n
        if not isinstance(prompts, (list, tuple, np.ndarray)) or len(prompts) != n:
            raise ValueError(
                f"options['prompt']={short_repr(prompts)} must be a str or a list of {n} str, one per slot being reset"
            )
        return list(prompts)

    def _seeds(self, seed: Any) -> list[int | None]:
        """``seed`` as one seed (or None) per slot: an int s seeds slot i with s + i; each one checked here."""
        n = self.num_envs
        if isinstance(seed, (int, np.integer)) and not isinstance(seed, (bool, np.bool_)):
            seeds = [int(seed) + i for i in range(n)]
        else:
            seeds = list(seed) if isinstance(seed, (list, tuple, np.ndarray)) and len(seed) == n else None
        if seeds is None or not all(s is None or (isinstance(s, (int, np.integer)) and s >= 0) for s in seeds):
            raise ValueError(f"seed={short_repr(seed)} must be an int, None or a list of {n} int/None (ints >= 0)")
        return [None if s is None else int(s) for s in seeds]

    def reset(self, *, seed: int | Sequence[int | None] | None = None, options: dict[str, Any] | None = None):
        options = _check_options(options)
        mask = options.get("reset_mask")
        if mask is None:
            mask = np.ones(self.num_envs, dtype=bool)
        mask = np.asarray(mask)
        if mask.shape != (self.num_envs,) or mask.dtype != np.bool_:
            raise ValueError(f"options['reset_mask'] must be a bool array of shape ({self.num_envs},), got {mask!r}")
        slots = np.flatnonzero(mask)
        # Every check before any change: a refused reset leaves the slots and their RNGs as they were.
        seeds = self._seeds(seed) if seed is not None else None
        given, encoded = None, None
        if options.get("prompt") is not None and slots.size:
            given = self._given_prompts(options["prompt"], len(slots))
            encoded = self._engine.encode_prompts(given)
        partner_seeds = _partner_seeds(options, len(slots)) if self._engine.dialogue.has_partner else None
        if seeds is not None:
            super().reset(seed=seeds[0])
            for i in slots:
                if seeds[i] is not None:
                    self._slot_rngs[i] = seeding.np_random(int(seeds[i]))[0]
        if given is not None or (partner_seeds is not None and slots.size):
            if given is None:
                given = self.draw_prompts(slots)
            partner_seeds = partner_seeds or self.draw_partner_seeds(slots)
            self._engine.start(slots.tolist(), given, encoded, partner_seeds)
        elif slots.size:
            self._start(slots)
        self._autoreset[slots] = False
        info: dict[str, Any] = {}
        for s in slots:
            info = self._add_info(info, {"prompt": self._engine.prompt_text[s]}, int(s))
        return self._engine.observation(slice(None)), info

    def step(self, actions):
        e = self._engine
        mode = self.metadata["autoreset_mode"]
        actions = self._checked_actions(actions, mode)
        resetting = self._autoreset.copy() if mode == AutoresetMode.NEXT_STEP else np.zeros(self.num_envs, bool)
        # With autoreset disabled a finished slot waits for reset(options={"reset_mask": ...}): its
        # action is ignored, as on NEXT_STEP's reset step (reward 0, not terminated, "_ref_logprob" False).
        live = e.started & ~e.done & ~resetting
        stepped = live & ~e.deferred  # slots whose step has a ref_logprob (the others get theirs at the end)
        step, starts, ended = self._prepare(actions, live, resetting, mode)
        out = e.commit_step(step)
        # Per-step info as whole arrays: one _add_info call per slot would cost a Python call per slot and step.
        shown = stepped & ~ended if mode == AutoresetMode.SAME_STEP else stepped
        info: dict[str, Any] = {"ref_logprob": np.where(shown, out["ref_logprob"], 0.0), "_ref_logprob": shown}
        info.update(_batched_infos(out["turn"], self.num_envs))  # a turn's reward and the partner's reply
        if mode == AutoresetMode.SAME_STEP and ended.any():
            info = self._final_infos(info, out, ended)
        else:
            info.update(_batched_infos(out["final"], self.num_envs))
        if starts is not None:
            e.commit_start(starts)
            if mode == AutoresetMode.SAME_STEP:
                info.update(_batched_infos({int(s): {"prompt": e.prompt_text[s]} for s in starts.slots}, self.num_envs))
        self._autoreset = ended if mode == AutoresetMode.NEXT_STEP else np.zeros(self.num_envs, bool)
        return e.observation(slice(None)), out["reward"], out["terminated"], out["truncated"], info

    def _prepare(self, actions: np.ndarray, live: np.ndarray, resetting: np.ndarray, mode: AutoresetMode):
        """The step of the ``live`` slots and the starts of the slots it resets (NEXT_STEP: ``resetting``; SAME_STEP:
        those that end on it), all prepared before anything is written: a partner's reset, a reward model or π_ref
        failing in either leaves the whole step undone, the slots' RNGs put back.

        Returns:
            ``(the prepared step, the prepared starts or None, the slots that end on the step)``.
        """
        e, rngs, starts = self._engine, [], None
        try:
            if resetting.any():  # their RNGs draw first, as a reset of them would before the step
                rngs = self._rng_states(np.flatnonzero(resetting))
                starts = self._prepare_start(np.flatnonzero(resetting))
            step = e.prepare_step(actions, live)
            ended = step.out["terminated"] | step.out["truncated"]
            if mode == AutoresetMode.SAME_STEP and ended.any():
                rngs = self._rng_states(np.flatnonzero(ended))
                starts = self._prepare_start(np.flatnonzero(ended))
        except BaseException:
            for s, state in rngs:
                self._slot_rngs[s].bit_generator.state = state
            raise
        return step, starts, ended

    def _final_infos(self, info: dict[str, Any], out: dict[str, Any], ended: np.ndarray) -> dict[str, Any]:
        """As SyncVectorEnv: the finished slots' last observations and infos under final_obs/final_info."""
        slots = np.flatnonzero(ended)
        final_obs = self._engine.observation(slots)
        for row, s in enumerate(slots):
            info = self._add_info(info, {"final_obs": {k: v[row] for k, v in final_obs.items()}}, int(s))
        finals = {int(s): {"ref_logprob": out["ref_logprob"][s], **out["final"][int(s)]} for s in slots}
        info["final_info"], info["_final_info"] = _batched_infos(finals, self.num_envs), ended.copy()
        return info

    def _checked_actions(self, actions, mode: AutoresetMode) -> np.ndarray:
        """``actions`` as an int64 array once the step may run, or one clear error (nothing changed)."""
        e = self._engine
        actions = np.asarray(actions)
        if actions.shape != (self.num_envs,) or not np.issubdtype(actions.dtype, np.integer):
            raise ValueError(
                f"actions={actions!r} must be an integer array of shape ({self.num_envs},) "
                f"with token ids in [0, {e.vocab_size})"
            )
        # With autoreset disabled a slot waits (its action ignored) until it is reset: never started ones too.
        unstarted = ~e.started.any() if mode == AutoresetMode.DISABLED else ~e.started.all()
        if unstarted:
            raise RuntimeError("step() called before reset() for some slots; call envs.reset() first")
        if mode == AutoresetMode.DISABLED and not (e.started & ~e.done).any():
            raise RuntimeError(
                "step() called with every slot finished and autoreset disabled; "
                "reset them with reset(options={'reset_mask': mask})"
            )
        bad = np.flatnonzero((actions < 0) | (actions >= e.vocab_size))
        if bad.size:
            raise ValueError(
                f"actions[{bad[0]}]={actions[bad[0]]} is outside the action space: token ids are in [0, {e.vocab_size})"
            )
        return actions.astype(np.int64)

    def action_masks(self) -> np.ndarray:
        """``(num_envs, vocab_size)`` bool masks of the allowed tokens (see ``action_mask_top_p``)."""
        return self._engine.action_masks()

    def close_extras(self, **kwargs) -> None:
        """Close the partners (as :meth:`TextRLHFEnv.close`); Gymnasium's ``close`` calls this once."""
        if getattr(self, "_engine", None) is not None:
            self._engine.close()

    def render(self) -> tuple[str, ...] | tuple[np.ndarray, ...] | None:
        """One rendering per slot, as :meth:`TextRLHFEnv.render` (``SyncVectorEnv`` also returns a tuple)."""
        if self.render_mode == "ansi":
            return tuple(self._engine.render(i) for i in range(self.num_envs))
        if self.render_mode == "rgb_array":
            return tuple(text_image(self._engine.render(i)) for i in range(self.num_envs))
        return None


def _batched_infos(per_slot: dict[int, dict[str, Any]], num_envs: int) -> dict[str, np.ndarray]:
    """Per-slot infos in Gymnasium's vector layout: one ``(N,)`` array per key and its ``_key`` mask.

    Why not ``VectorEnv._add_info``: it turns a ``np.bool_`` into an object array; here every
    numpy scalar keeps its dtype (what TorchRL's info readers take), a numeric array becomes one
    ``(N, *shape)`` array, text goes in object arrays.
    """
    out: dict[str, np.ndarray] = {}
    for slot, info in per_slot.items():
        for key, value in info.items():
            if key not in out:
                numeric = isinstance(value, (np.generic, np.ndarray, bool, int, float))
                numeric = numeric and not isinstance(value, np.str_)
                shape = (num_envs, *np.shape(value))
                out[key] = np.zeros(shape, np.asarray(value).dtype) if numeric else np.full(num_envs, None, object)
                out[f"_{key}"] = np.zeros(num_envs, dtype=bool)
            out[key][slot] = value
            out[f"_{key}"][slot] = True
    return out
