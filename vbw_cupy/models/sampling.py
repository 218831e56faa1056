"""Next-token sampling on the host: greedy, temperature, top-k and top-p, deterministic for a seed."""
from __future__ import annotations

import numpy as np

from .._checks import _is_int, _is_real


def sampling_probs(logits, temperature: float, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """The distribution a token is drawn from, float64 [vocab]: softmax(logits / temperature), restricted to the
    `top_k` most likely tokens (0: all), renormalized, then to the smallest set of most likely tokens whose
    probability reaches `top_p` (1.0: all), renormalized (the order Hugging Face and vLLM apply them in). Ties in
    probability keep the lower id first. Temperature 0 is greedy: all the mass on the argmax."""
    z = np.asarray(logits, dtype=np.float64)
    if temperature == 0:   # greedy, as Sampler(0): all the mass on the argmax (the lowest id on a tie)
        out = np.zeros_like(z)
        out[int(np.argmax(z))] = 1.0
        return out
    if not temperature > 0:
        raise ValueError(f"temperature: expected a value >= 0, got {temperature!r}")
    with np.errstate(over="ignore"):  # (shifted first: logits / a tiny temperature overflowed to inf - inf)
        p = np.exp((z - z.max()) / temperature)
    order = np.argsort(-p, kind="stable")
    keep = len(p) if top_k <= 0 else min(top_k, len(p))
    if top_p < 1.0:
        cum = np.cumsum(p[order[:keep]])
        keep = min(keep, int(np.searchsorted(cum / cum[-1], top_p)) + 1)
    out = np.zeros_like(p)
    out[order[:keep]] = p[order[:keep]]
    return out / out.sum()


class Sampler:
    """Picks next tokens from logits. temperature 0 is greedy (argmax, the lowest id on a tie); otherwise a draw
    from `sampling_probs` with a NumPy generator seeded by `seed`, so a run is reproducible: the same seed,
    logits and call order give the same tokens.

    >>> Sampler(temperature=0.8, top_p=0.9, seed=42)(np.array([2.0, 1.0, 0.5]))   # doctest: +SKIP
    """

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None):
        if not (_is_real(temperature) and 0.0 <= temperature < np.inf):
            raise ValueError(f"temperature: expected a finite number >= 0, got {temperature!r}")
        if not (_is_real(top_p) and 0.0 < top_p <= 1.0):
            raise ValueError(f"top_p: expected a number in (0, 1], got {top_p!r}")
        if not (_is_int(top_k) and top_k >= 0):
            raise ValueError(f"top_k: expected an int >= 0 (0: off), got {top_k!r}")
        if not (seed is None or (_is_int(seed) and seed >= 0)):
            raise ValueError(f"seed: expected None or an int >= 0, got {seed!r}")
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self.seed = seed
        self.rng = np.random.default_rng(seed)

    @property
    def on_gpu(self) -> bool:
        """Whether a GPU model can sample for this sampler (greedy or plain temperature; top-k / top-p run on the
        host from copied logits)."""
        return self.top_k == 0 and self.top_p == 1.0

    def __call__(self, logits) -> int:
        """One token id from host logits [vocab]."""
        if self.temperature == 0.0:
            return int(np.argmax(logits))
        p = sampling_probs(logits, self.temperature, self.top_k, self.top_p)
        return int(min(np.searchsorted(np.cumsum(p), self.rng.random(), side="right"), np.flatnonzero(p)[-1]))
