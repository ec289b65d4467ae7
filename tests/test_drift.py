"""The re-tokenisation drift's pure pieces (``textgym.retokenization``) on small exact cases with SmolLM2's tokenizer.

The cases are ones where a turn-level trainer's tokens really differ from the sampled ids: a split the
tokenizer never writes, a merge across the template's edge, a turn cut without its end token.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from textgym.envs.turns import ReplyTemplate
from textgym.models import load_tokenizer
from textgym.named_models import smollm2_folder
from textgym.retokenization import (
    common_ends,
    drift_causes,
    episode_messages,
    policy_turns,
    ratio_stats,
    retokenize,
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(smollm2_folder())


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def end_id(tok) -> int:
    return tok.convert_tokens_to_ids("<|im_end|>")


def test_policy_turns_are_the_runs_of_the_mask():
    assert policy_turns([True, True, False, False, True, False, True]) == [(0, 2), (4, 5), (6, 7)]
    assert policy_turns([False, False]) == []
    assert policy_turns([True]) == [(0, 1)]


def test_common_ends_align_prefix_and_suffix_without_overlap():
    assert common_ends([1, 2, 3, 4], [1, 9, 3, 4]) == (1, 2)
    assert common_ends([1, 2], [1, 2, 3]) == (2, 0)  # a turn cut without its end token: the body aligns
    assert common_ends([5, 5], [5]) == (1, 0)  # never counts a token twice
    assert common_ends([1, 2], [1, 2]) == (2, 0)


def test_ratio_stats_on_a_known_delta():
    delta = torch.tensor([0.0, math.log(1.1), math.log(0.5), math.log(2.0)])
    s = ratio_stats(delta, clip=0.2)
    assert s["abs_ratio_minus_1_mean"] == pytest.approx((0 + 0.1 + 0.5 + 1.0) / 4)
    assert s["outside_clip_share"] == 0.5  # 0.5 and 2 lie outside [0.8, 1.2]; 1 and 1.1 inside
    assert (s["ratio_min"], s["ratio_max"]) == pytest.approx((0.5, 2.0))
    assert s["abs_delta_max"] == pytest.approx(math.log(2.0)) and s["tokens"] == 4
    with pytest.raises(ValueError, match="delta has shape"):
        ratio_stats(torch.zeros(0))


def test_a_conversation_rebuilt_from_exact_ids_re_tokenises_to_them_but_charges_the_cut_turn_an_end_token(tok):
    """Canonical turns: the re-tokenised stream is the env's ids and the cut turn's closing; only that turn differs."""
    stop = {end_id(tok)}
    template = ReplyTemplate(tok, chat_template=True, stop_ids=stop)
    prompt_ids = tok.apply_chat_template([{"role": "user", "content": "Guess."}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)  # fmt: skip
    turn1, turn2 = [*ids(tok, "I guess [5]."), end_id(tok)], ids(tok, "Then [7]")  # the second cut at the turn cap
    reply = template.ids("Higher.", turn1[-1])
    response = turn1 + reply + turn2
    mask = [True] * len(turn1) + [False] * len(reply) + [True] * len(turn2)
    messages = episode_messages(tok, template, "Guess.", response, mask, stop)
    contents = ["Guess.", "I guess [5].", "Higher.", "Then [7]"]
    assert messages == [{"role": r, "content": c} for r, c in zip(["user", "assistant"] * 2, contents, strict=True)]
    retok, turns = retokenize(tok, messages, end_id(tok))
    exact = prompt_ids + response
    assert retok == exact + [end_id(tok), *ids(tok, "\n")]  # the template closes the cut turn
    spans = [retok[t.start : t.end] for t in turns]
    assert spans == [turn1, [*turn2, end_id(tok)]]
    assert drift_causes(tok, turn1, spans[0], stop_ids=stop, end_id=end_id(tok)) == ()
    assert drift_causes(tok, turn2, spans[1], stop_ids=stop, end_id=end_id(tok)) == ("no_end_token",)


def test_a_split_the_tokenizer_never_writes_is_a_non_canonical_split(tok):
    sampled = [*tok.convert_tokens_to_ids(["H", "ello", "Ġworld"]), end_id(tok)]  # the tokenizer writes "Hello"
    messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": tok.decode(sampled[:-1])}]
    retok, (turn,) = retokenize(tok, messages, end_id(tok))
    r = retok[turn.start : turn.end]
    assert r == [*ids(tok, "Hello world"), end_id(tok)] and not turn.crosses_boundary
    assert drift_causes(tok, sampled, r, stop_ids={end_id(tok)}, end_id=end_id(tok)) == ("non_canonical_split",)
    assert common_ends(sampled, r) == (0, 2)  # " world" and the end token still align


def test_leading_spaces_merge_with_the_templates_newline_across_the_turns_edge(tok):
    """ChatML writes ``assistant\\n`` before the turn: "   x" alone is ``ĠĠ Ġx``, after the newline ``ĊĠĠ Ġx``."""
    sampled = [*ids(tok, "   x"), end_id(tok)]
    messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "   x"}]
    retok, (turn,) = retokenize(tok, messages, end_id(tok))
    r = retok[turn.start : turn.end]
    assert tok.convert_ids_to_tokens(r[:-1]) == ["ĊĠĠ", "Ġx"] and turn.crosses_boundary
    assert drift_causes(tok, sampled, r, stop_ids={end_id(tok)}, end_id=end_id(tok),
                        crosses_boundary=turn.crosses_boundary) == ("boundary_merge",)  # fmt: skip


def test_special_tokens_and_broken_bytes_are_lost_in_decoding(tok):
    stop, end = {end_id(tok)}, end_id(tok)
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    sampled = [*ids(tok, "Hi"), im_start, *ids(tok, " there"), end]
    assert "special_token_dropped" in drift_causes(tok, sampled, [*ids(tok, "Hi there"), end], stop_ids=stop,
                                                   end_id=end)  # fmt: skip
    rare = ids(tok, "龘")  # three UTF-8 bytes, three byte tokens in SmolLM2's vocabulary
    assert len(rare) == 3
    cut = rare[:2]  # a turn cut inside the character: decodes to U+FFFD
    assert drift_causes(tok, cut, [*ids(tok, tok.decode(cut)), end], stop_ids=stop, end_id=end) == (
        "no_end_token",
        "invalid_utf8",
    )


def test_the_docs_drift_table_is_printed_from_its_json_files():
    """The table in docs/multi-turn.md is ``bench/drift.py --table`` of the committed runs, never typed by hand."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("drift_bench", root / "bench" / "drift.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    page = (root / "docs" / "multi-turn.md").read_text()
    files = re.search(r"bench/drift\.py --table ((?:docs/bench/drift/[\w.-]+\.json(?::\w+)?[ \\\n]*)+)", page)
    assert files, "docs/multi-turn.md names the JSON files of its drift table"
    sources = [f for f in files.group(1).split() if f != "\\"]
    assert bench.table(bench.columns(sources, root)) in page
