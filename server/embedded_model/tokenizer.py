"""Byte-level BPE tokenizer for the embedded model, trained locally with `tokenizers`."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from .chat_template import chat_template
from .corpus import training_text

# Control tokens never appear in text; the tool-call markers must be single tokens for vLLM's
# hermes tool parser, and are not "special" so they survive decoding.
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MARKUP_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


def train_tokenizer(vocab_size: int, seed: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of exactly ``vocab_size`` entries (control and markup tokens included)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(CONTROL_TOKENS + MARKUP_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=list(CONTROL_TOKENS[1:2]),
    )
    # Markup tokens stay in the vocab but are not special: decoding keeps them in the text.
    for token in MARKUP_TOKENS:
        fast.backend_tokenizer.add_tokens([token])   # the public name of ``_tokenizer``
    fast.chat_template = chat_template()
    fast.model_max_length = 1 << 30
    return fast
