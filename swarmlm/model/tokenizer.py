"""A working byte-level BPE tokenizer for randomly initialised checkpoints (no model hub here).

Byte-level BPE covers any text (no unknown characters); it is trained on a small built-in English corpus so
common words are single tokens, and saved in the standard `tokenizer.json` format that AutoTokenizer reads.
"""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0, 1, 2, 3
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(4)

_CORPUS = """
The quick brown fox jumps over the lazy dog while the farmer watches from the hill.
Distributed inference splits a large language model across many small machines connected by a network.
Each server holds a contiguous range of transformer blocks and keeps attention caches for its sessions.
A client keeps the embeddings and the language model head, and sends hidden states through a chain of servers.
What is the capital of France? Paris is the capital and largest city of France.
Explain why the sky is blue in one sentence. Sunlight is scattered by molecules in the air.
Write a short poem about the sea, the wind, and the night sky full of stars.
Translate the following sentence into Spanish: the weather is nice today.
The trophy would not fit into the brown suitcase because it was too large.
Summarise the main idea of the paragraph below in plain words for a child.
Python is a programming language that lets you work quickly and integrate systems effectively.
In 1969, astronauts landed on the moon and walked on its surface for the first time.
Water boils at one hundred degrees Celsius at sea level and freezes at zero degrees.
A good recipe lists its ingredients first, then explains each step in order.
The committee will meet on Monday to discuss the budget, the schedule and the new members.
How many legs does a spider have? A spider has eight legs and most have eight eyes.
Machine learning models learn patterns from data and make predictions about new examples.
The library opens at nine in the morning and closes at six in the evening on weekdays.
She asked him whether he had seen the film, and he said that he had not seen it yet.
Throughput is the number of tokens generated per second; latency is the time a user waits.
""".strip()


def train_tokenizer(vocab_size: int, pad: bool = True) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>" if pad else None,  # Llama-3 style tokenizers have none
        padding_side="left",  # decoder-only generation pads on the left
    )


def save_tokenizer(vocab_size: int, out_dir: Path, pad: bool = True) -> PreTrainedTokenizerFast:
    tokenizer = train_tokenizer(vocab_size, pad)
    tokenizer.save_pretrained(out_dir)
    return tokenizer
