"""Generation: a batch of prompts prefilled together, then decoded one token per sequence per step over the
paged KV cache; each sequence stops at a stop id (BOS or EOS, not kept), at max_new_tokens, or when it would
pass the model's seq_len."""
from __future__ import annotations

import dataclasses
import time

from .._checks import _is_int
from .llama import Llama
from .sampling import Sampler

#: decode steps a GPU model runs per call in generate_ids (`LlamaGPU.decode_steps`, one CUDA graph): the host
#: turn between calls is paid once per chunk; a sequence that stops inside one wastes at most CHUNK - 1 steps.
CHUNK = 8


@dataclasses.dataclass
class Sequence:
    """One prompt's result: its ids (BOS first), the generated ids (no stop id), their text, and why it ended
    ("stop": a stop id was sampled; "length": max_new_tokens or seq_len reached)."""
    prompt_ids: list
    ids: list
    text: str = ""
    finish_reason: str = ""


@dataclasses.dataclass
class Generation:
    """The sequences of a `generate` call, in prompt order, and its timings (host wall clock)."""
    sequences: list
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def check_prompt(ids, seq_len: int, index: int = 0, vocab_size: int | None = None) -> None:
    """ValueError when a prompt of token ids is empty, longer than the model's seq_len or (given vocab_size)
    holds an id outside [0, vocab_size)."""
    if len(ids) < 1:
        raise ValueError(f"prompt {index}: expected at least one token (BOS), got none")
    if len(ids) > seq_len:
        raise ValueError(f"prompt {index}: {len(ids)} tokens, longer than the model's seq_len = {seq_len}")
    if vocab_size is not None:
        for pos, t in enumerate(ids):
            if not 0 <= t < vocab_size:
                raise ValueError(f"prompt {index}: token {pos} is {t}, outside the vocabulary [0, {vocab_size})")


def generate_ids(model: Llama, prompts, *, max_new_tokens: int = 256, sampler: Sampler | None = None,
                 on_token=None, stop_ids=None) -> Generation:
    """Generate from prompts given as lists of token ids (BOS included when wanted).

    Sequence b generates up to min(max_new_tokens, seq_len - len(prompt b) + 1) tokens (the last one sampled
    is never fed back, as in llama2.c). `sampler` defaults to greedy; `stop_ids` to the config's BOS and EOS.
    `on_token(b, token)` is called for every kept token as it comes back (on a GPU model, the tokens of a
    chunk of up to CHUNK steps together). A GPU model samples greedy and plain
    temperature draws on the device (`LlamaGPU.decode_sample`, seeded by the sampler's seed); other samplers
    run on the host from copied logits; a model with `decode_steps` runs up to CHUNK steps per call (the ids a
    sequence sampled after its stop id are dropped). Returns a `Generation` whose sequences have no text (see
    `generate`).
    """
    cfg, ops = model.config, model.ops
    if not (_is_int(max_new_tokens) and max_new_tokens >= 0):
        raise ValueError(f"max_new_tokens: expected an int >= 0, got {max_new_tokens!r}")
    sampler = sampler or Sampler()
    # (any iterables: each taken as a list first, so an iterator is not used up by the checks)
    if stop_ids is not None:
        if isinstance(stop_ids, (str, bytes)) or not hasattr(stop_ids, "__iter__"):
            raise TypeError(f"stop_ids: expected None or a collection of int token ids, got {stop_ids!r}")
        stop_ids = list(stop_ids)
        if not all(map(_is_int, stop_ids)):
            raise TypeError(f"stop_ids: expected None or a collection of int token ids, got {stop_ids!r}")
    stop = cfg.stop_ids if stop_ids is None else frozenset(int(t) for t in stop_ids)
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__"):
        raise TypeError(f"prompts: expected a list of lists of int token ids, got {type(prompts).__name__}")
    prompts = [p if isinstance(p, (str, bytes)) or not hasattr(p, "__iter__") else list(p) for p in prompts]
    for b, p in enumerate(prompts):
        if not isinstance(p, list) or not all(map(_is_int, p)):
            raise TypeError(f"prompt {b}: expected a list of int token ids, got {p!r:.80}")
    prompts = [[int(t) for t in p] for p in prompts]
    if not prompts:
        raise ValueError("prompts: expected at least one prompt, got an empty list")
    for b, p in enumerate(prompts):
        check_prompt(p, cfg.seq_len, b, cfg.vocab_size)
    seqs = [Sequence(p, []) for p in prompts]
    budget = [min(max_new_tokens, cfg.seq_len - len(p) + 1) for p in prompts]
    cache = model.new_cache(len(prompts), max(len(p) + max(n - 1, 0) for p, n in zip(prompts, budget)))
    result = Generation(seqs, prefill_tokens=sum(map(len, prompts)))

    def keep(b, token) -> bool:
        """Record `token` for sequence b; False when b is finished (its cache slot is freed)."""
        if token in stop:
            seqs[b].finish_reason = "stop"
        else:
            seqs[b].ids.append(token)
            if on_token is not None:
                on_token(b, token)
            if len(seqs[b].ids) < budget[b]:
                return True
            seqs[b].finish_reason = "length"
        cache.free(b)
        return False

    try:
        t0 = time.perf_counter()
        active = [b for b in range(len(prompts)) if budget[b] > 0]
        result.prefill_tokens = sum(len(prompts[b]) for b in active)   # (none with max_new_tokens = 0)
        logits = ops.to_host(model.prefill([prompts[b] for b in active], cache, active)) if active else []
        active = [b for b, row in zip(active, logits) if keep(b, sampler(row))]
        result.prefill_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        on_gpu = sampler.on_gpu and hasattr(model, "decode_steps")  # only the token ids come back
        # (an unseeded sampler draws the device's seed from its own fresh generator: a new stream every run; but
        # a rank of a multi-process tensor-parallel group (a model with a communicator) keeps seed 0, so that
        # every rank samples the same ids without agreeing on a seed first)
        gpu_seed = sampler.seed if sampler.seed is not None else \
            0 if getattr(model, "comm", None) is not None else int(sampler.rng.integers(2**63))
        while active:
            last = [seqs[b].ids[-1] for b in active]
            if on_gpu:   # a power of two steps (few graphs), none past any sequence's budget
                n = min(CHUNK, min(budget[b] - len(seqs[b].ids) for b in active))
                n = 1 << (n.bit_length() - 1)
                rows = model.decode_steps(last, cache, active, n, temperature=sampler.temperature, seed=gpu_seed)
            else:
                rows = [[sampler(row) for row in ops.to_host(model.decode(last, cache, active))]]
            step_slots = active
            for row in rows:
                if not active:
                    break
                live = set(active)
                result.decode_tokens += len(active)
                active = [b for b, t in zip(step_slots, row) if b in live and keep(b, int(t))]
        result.decode_seconds = time.perf_counter() - t0
    finally:  # a GPU model: the next call's cache takes these arrays (and decode graphs), even after an error
        if hasattr(model, "recycle"):
            model.recycle(cache)
    for s in seqs:  # max_new_tokens = 0: nothing was generated
        s.finish_reason = s.finish_reason or "length"
    return result


def generate(model: Llama, tokenizer, prompts, *, max_new_tokens: int = 256, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = None, on_text=None) -> Generation:
    """Generate text from a prompt (str) or a batch of prompts (list of str).

    Each prompt is encoded with BOS first. Sampling: greedy at temperature 0, else softmax(logits / temperature)
    restricted by top_k / top_p, drawn with a generator seeded by `seed` (reproducible). `on_text(b, text)`
    streams sequence b's new text as tokens arrive (whole UTF-8 characters only). Returns a `Generation`: per
    sequence prompt_ids, generated ids (no stop token), text and finish_reason; prefill and decode timings.

    >>> from vbw_cupy.models import load_model, load_tokenizer, generate          # doctest: +SKIP
    >>> model = load_model("stories15M.bin")                                       # doctest: +SKIP
    >>> out = generate(model, load_tokenizer("tokenizer.bin"), "Once upon a time")  # doctest: +SKIP
    >>> print(out.sequences[0].text)                                               # doctest: +SKIP
    """
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    if not texts:
        raise ValueError("prompts: expected a string or a non-empty list of strings, got an empty list")
    ids = [tokenizer.encode(t, bos=True) for t in texts]
    streams = [tokenizer.stream(p[-1]) for p in ids]

    def on_token(b, token):
        piece = streams[b].push(token)
        if piece and on_text is not None:
            on_text(b, piece)

    out = generate_ids(model, ids, max_new_tokens=max_new_tokens, sampler=Sampler(temperature, top_k, top_p, seed),
                       on_token=on_token)
    for b, s in enumerate(out.sequences):
        tail = streams[b].flush()
        if tail and on_text is not None:
            on_text(b, tail)
        s.text = tokenizer.decode(s.ids, s.prompt_ids[-1])
    return out
