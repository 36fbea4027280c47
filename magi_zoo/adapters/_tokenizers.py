"""Tokenizers built in-process, for tiny variants and random-weight runs: nothing is
downloaded. A byte-level BPE trained on a small embedded corpus tokenizes any text
without unknown tokens; special tokens are placed at the ids the model expects.
"""

from __future__ import annotations

import functools
from typing import Sequence

# A few sentences of the kind prompts contain; the BPE merges learnt from them only
# shorten common words -- any byte sequence still tokenizes.
_CORPUS = [
    "a corgi surfing a wave at sunset, cinematic lighting, highly detailed",
    "a cat playing the piano in a jazz club, warm colors, film grain",
    "an astronaut riding a horse on the moon, photorealistic, 4k",
    "a red fox running through snow in the forest, slow motion",
    "the quick brown fox jumps over the lazy dog",
    "describe the image. what is in the picture? answer the question.",
    "a city street at night with neon signs and rain reflections",
    "hello, how are you today? I am fine, thank you.",
]


@functools.lru_cache(maxsize=None)
def _bpe(vocab_size: int, specials: tuple[str, ...]):
    # lazy: tokenizers costs ~10 ms, transformers seconds; listing models imports this module
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(specials), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok.to_str()


def byte_bpe_tokenizer(*, vocab_size: int, specials: Sequence[str], eos: str | None = None,
                       pad: str | None = None, unk: str | None = None, bos: str | None = None,
                       append_eos: bool = False, model_max_length: int = 4096, extra_ids: dict[str, int] | None = None):
    """A `PreTrainedTokenizerFast` with `specials` at ids 0..len-1 (in order).

    `append_eos` adds `eos` after every sequence (T5-style). `extra_ids` pins more special
    tokens to fixed ids above the BPE vocabulary (e.g. Qwen's ~151k multimodal ids); the
    ids in between are filled with unused placeholder tokens so the mapping is exact.
    """
    from tokenizers import AddedToken, Tokenizer, processors  # lazy: as in _bpe
    from transformers import PreTrainedTokenizerFast  # lazy: as in _bpe

    tok = Tokenizer.from_str(_bpe(vocab_size, tuple(specials)))
    if extra_ids:
        n = tok.get_vocab_size()
        top = max(extra_ids.values())
        by_id = {v: k for k, v in extra_ids.items()}
        if min(extra_ids.values()) < n:
            raise ValueError(f"extra_ids must lie above the BPE vocabulary ({n})")
        tok.add_special_tokens([AddedToken(by_id.get(i, f"<|unused_{i}|>"), special=True)
                                for i in range(n, top + 1)])
    if append_eos and eos is not None:
        eos_id = tok.token_to_id(eos)
        tok.post_processor = processors.TemplateProcessing(single=f"$A {eos}", pair=f"$A {eos} $B {eos}",
                                                           special_tokens=[(eos, eos_id)])
    kw = {k: v for k, v in dict(eos_token=eos, pad_token=pad, unk_token=unk, bos_token=bos).items() if v}
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=model_max_length, **kw)
