"""Incremental tokenization (compaction/token_cache.py): a prompt's ids equal the whole text's
tokenization whatever the previous prompt of its slot was, including where an added token's text
in the new prompt starts before a cut and ends after it (the split moves: the cut is not used)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.compaction.token_cache import Splits, TokenCache, common_prefix

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|a|>", "q<|a|>!", "<|a|>x", "[INST]"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.add_special_tokens({"additional_special_tokens": SPECIAL}, replace_extra_special_tokens=False)
    return tok


def encode(tok):
    def run(text: str):
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return enc["input_ids"], enc["offset_mapping"]
    return run


def test_a_token_that_spans_a_previous_cut_moves_the_split(tokenizer):
    """``<|a|>`` was a cut in "…q<|a|>z"; the next prompt reads "…q<|a|>!…", where the added
    token ``q<|a|>!`` starts before that cut: its ids are still the whole text's."""
    cache = TokenCache(Splits(tokenizer))
    first = "<|im_start|>user\nhello q<|a|>z<|im_end|>"
    second = "<|im_start|>user\nhello q<|a|>!z<|im_end|>"
    for text in (first, second):
        assert cache.tokenize("s", text, encode(tokenizer)) == encode(tokenizer)(text)[0]
    assert cache.stats.reused_tokens > 0 or cache.splits.spanned(second, second.index("<|a|>"))


WORDS = st.sampled_from(["<|im_start|>", "<|im_end|>", "<|a|>", "q", "!", "x", "[INST]", "user", " ", "\n",
                         "été", "🙂", "q<|a|>", "<|a|>x", "hello", "10", "10.0"])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(WORDS, max_size=30), min_size=1, max_size=6), st.randoms(use_true_random=False))
def test_any_sequence_of_prompts_tokenizes_as_the_whole_text(tokenizer, prompts, rnd):
    """Prompts that grow, shrink, and change in the middle: each one's ids are its whole text's."""
    cache = TokenCache(Splits(tokenizer))
    text = ""
    for words in prompts:
        edit = rnd.random()
        if edit < 0.5:
            text += "".join(words)                               # a conversation that grows
        elif edit < 0.8 and text:
            at = rnd.randrange(len(text))
            text = text[:at] + "".join(words) + text[at:]        # changed in the middle (clearing)
        else:
            text = "".join(words)
        assert cache.tokenize("slot", text, encode(tokenizer)) == encode(tokenizer)(text)[0]


@given(st.text(max_size=300), st.text(max_size=300), st.integers(0, 400))
def test_common_prefix(a, b, cut):
    b = a[:cut] + b
    n = common_prefix(a, b)
    assert a[:n] == b[:n] and (n == min(len(a), len(b)) or a[n] != b[n])


def test_common_prefix_of_long_texts():
    a = "".join(random.Random(1).choices("ab", k=300_000))
    for at in (0, 1, 65535, 65536, 65537, 200_000, 299_999):
        b = a[:at] + ("a" if a[at] == "b" else "b") + a[at + 1:]
        assert common_prefix(a, b) == at
    assert common_prefix(a, a + "x") == len(a)


def test_slots_are_bounded(tokenizer):
    cache = TokenCache(Splits(tokenizer), max_slots=3, max_bytes=10_000)
    for i in range(10):
        cache.tokenize(i, "<|im_start|>user\n" + "word " * (50 * i), encode(tokenizer))
        assert len(cache._slots) <= 3 and (cache._bytes <= 10_000 or len(cache._slots) == 1)
    assert cache._bytes == sum(e.nbytes for e in cache._slots.values())


# -- vocabularies whose added tokens prefix one another, with lstrip and single_word (issue 51, T1) --
CORPUS = [f"hello world {w} tool call result line {i} ok, the quick brown fox" for i, w in
          enumerate(["alpha", "beta", "gamma", "delta", "été", "naïve", "x", "qz"] * 25)]
PREFIXED = [("<tool>", {}), ("<tool>!", {"lstrip": True}), ("<q>", {}), ("<q>z", {"single_word": True}),
            ("<|end|>", {}), ("<|end|>\n", {"rstrip": True})]


def vocabulary(kind: str):
    """A fast tokenizer of ``kind`` (Unigram, WordPiece, BPE) trained here on a small corpus, with
    added tokens of which some are proper prefixes of ``lstrip`` / ``single_word`` ones."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "unigram":
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=150, unk_token="<unk>", special_tokens=["<unk>"])
    elif kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.WordPieceTrainer(vocab_size=150, special_tokens=["[UNK]"])
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_tokens([AddedToken(text, normalized=False, special=True, **flags) for text, flags in PREFIXED])
    return fast


@pytest.fixture(scope="module", params=["unigram", "wordpiece", "bpe"])
def prefixed(request):
    return vocabulary(request.param)


def test_no_cut_at_a_token_that_a_longer_lstrip_or_single_word_token_starts_with(prefixed):
    """``<tool>`` was a cut in "hello <tool>"; the next text reads "hello <tool>! b", where the
    ``lstrip`` token ``<tool>!`` takes the space before it. Cutting at ``<tool>`` gave
    ``[hello, ▁, <tool>!, ...]`` against the whole text's ``[hello, <tool>!, ...]``."""
    assert "<tool>" not in prefixed.added_tokens_encoder or \
        prefixed.added_tokens_encoder["<tool>"] not in Splits(prefixed).cutting
    cache = TokenCache(Splits(prefixed))
    for text in ("hello <tool>", "hello <tool>! b", "ok<q>", "ok<q>z b", "a <|end|>\nb", "a <|end|>\n c"):
        assert cache.tokenize("s", text, encode(prefixed)) == encode(prefixed)(text)[0], text


PREFIX_WORDS = ["<tool>", "!", " ", "<q>", "z", "<|end|>", "\n", "  ", "hello", "ok", "été", "🙂", "<tool>!", "<q>z",
                " b", "x"]


def test_600_growing_prompts_over_prefixed_added_tokens_tokenize_as_the_whole_text(prefixed):
    """The differential fuzz over the three families (seeded): conversations that grow a few words a
    turn, sometimes start over; every prompt's ids are its whole text's (before the fix, 14 of
    the 600 differed in each family)."""
    rnd = random.Random(20261207)
    cache, text, wrong = TokenCache(Splits(prefixed)), "", []
    for i in range(600):
        words = "".join(rnd.choice(PREFIX_WORDS) for _ in range(rnd.randint(1, 2)))
        text = text + words if rnd.random() < 0.9 and len(text) < 400 else words
        if cache.tokenize(i // 60, text, encode(prefixed)) != encode(prefixed)(text)[0]:
            wrong.append(text)
    assert not wrong, (len(wrong), wrong[:3])


def test_the_bound_counts_bytes_not_characters(tokenizer):
    """A slot's size is its memory: text of 4-byte code points counts 4 bytes a character, not one
    (issue 51, T2: a 512 MiB bound could hold about 2 GiB)."""
    import sys

    cache = TokenCache(Splits(tokenizer))
    ascii_text, emoji_text = "a" * 4000, "🙂" * 4000
    small = cache.tokenized("a", ascii_text, encode(tokenizer)).nbytes
    big = cache.tokenized("e", emoji_text, encode(tokenizer)).nbytes
    assert big - small >= 3 * 4000 and big >= sys.getsizeof(emoji_text)
