"""Test helpers for decoding: an exact enumerator of randomised programs, a Markov-chain engine,
dense and circuit-based enumerable drafters, and tiny in-process Llama backbones.

`enumerate_outcomes(program)` runs `program(choose)` once per path of its random choices (a
depth-first replay of every `choose(probs)` call, zero-probability branches pruned) and returns
the exact distribution of its results. Any code whose randomness goes through a `Chooser`
(the acceptance rule, plain and speculative decoding) can thus be checked exactly.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import Tensor

from mtpc.speculative.loop import StepOutput


class _Replay:
    """A Chooser that follows a recorded trace, then takes the first non-zero option."""

    def __init__(self, trace: list[int]):
        self.trace = trace
        self.options: list[list[int]] = []  # non-zero options at each call
        self.taken: list[int] = []
        self.prob = 1.0

    def __call__(self, probs: Tensor) -> int:
        p = probs.detach().double().cpu()
        nz = [i for i in range(p.shape[0]) if p[i] > 0]
        k = len(self.taken)
        choice = self.trace[k] if k < len(self.trace) else nz[0]
        self.options.append(nz)
        self.taken.append(choice)
        self.prob *= float(p[choice])
        return choice


def enumerate_outcomes(program: Callable[[Callable[[Tensor], int]], object], max_paths: int = 200_000):
    """Exact distribution {result: probability} of `program(choose)` over all its random paths."""
    dist: dict[object, float] = defaultdict(float)
    trace: list[int] = []
    for _ in range(max_paths):
        rep = _Replay(trace)
        result = program(rep)
        dist[result] += rep.prob
        # next path: advance the deepest call that has an untried non-zero option
        trace = None
        for depth in range(len(rep.taken) - 1, -1, -1):
            opts = rep.options[depth]
            pos = opts.index(rep.taken[depth])
            if pos + 1 < len(opts):
                trace = rep.taken[:depth] + [opts[pos + 1]]
                break
        if trace is None:
            return dict(dist)
    raise RuntimeError(f"more than {max_paths} random paths")


def total_variation(a: dict, b: dict) -> float:
    keys = set(a) | set(b)
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in keys)


# ---------------------------------------------------------------------------- Markov target


class MarkovEngine:
    """An Engine whose verifier is a first-order Markov chain: p(x_{t+1} | x_t) = P[x_t].

    The 'draft hidden' of a position is the one-hot of its byte, so a head may depend on it.
    """

    def __init__(self, transition: Tensor):  # (v, v) probabilities
        self.logp = transition.log()
        self.v = transition.shape[0]
        self.tokens: list[int] = []
        self.length = 0
        self.calls = 0

    def feed(self, ids: Tensor) -> StepOutput:
        self.calls += 1
        self.tokens += ids.tolist()
        self.length = len(self.tokens)
        last = ids.long()
        return StepOutput(self.logp[last], torch.nn.functional.one_hot(last, self.v).double())

    def crop(self, length: int) -> None:
        assert length <= self.length
        self.tokens = self.tokens[:length]
        self.length = length


def dense_conditionals(joint: Tensor, x: list[int]) -> Tensor:
    """log q(x_i = . | x_<i) for i = 1..n from a dense joint (v,)*n over the window."""
    n, v = joint.dim(), joint.shape[0]
    rows = []
    for i in range(n):
        sub = joint[tuple(x[:i])]  # (v,)*(n-i)
        marg = sub.reshape(v, -1).sum(-1)
        rows.append((marg / marg.sum()).log())
    return torch.stack(rows)  # (n, v)


def dense_drafter(choose: Callable[[Tensor], int]):
    """Drafter over params {'joint': (v,)*n}: samples x_i ~ q(. | x_<i) through `choose`."""

    def draft(theta, prefix, greedy):
        joint = theta["joint"]
        n = joint.dim()
        x = [] if prefix is None else prefix.tolist()
        while len(x) < n:
            row = dense_conditionals(joint, x + [0] * (n - len(x)))[len(x)].exp()
            x.append(int(row.argmax()) if greedy else choose(row))
        return torch.tensor(x), dense_conditionals(joint, x)

    return draft


def circuit_enum_drafter(circuit, choose: Callable[[Tensor], int]):
    """Drafter over a real circuit that draws x_i ~ q(. | x_<i) from `_conditionals` via `choose`."""

    def draft(q, prefix, greedy):
        assert not greedy
        n = circuit.window
        x = [] if prefix is None else prefix.tolist()
        while len(x) < n:
            full = torch.tensor(x + [0] * (n - len(x)))
            row = circuit._conditionals(q, full)[len(x)].exp()
            x.append(choose(row))
        xt = torch.tensor(x)
        return xt, circuit._conditionals(q, xt)

    return draft


def markov_sequence_distribution(transition: Tensor, first: int, length: int) -> dict:
    """Exact distribution of the next `length` bytes of the chain after byte `first`."""
    v = transition.shape[0]
    out = {}
    for seq in itertools.product(range(v), repeat=length):
        p, prev = 1.0, first
        for t in seq:
            p *= float(transition[prev, t])
            prev = t
        out[seq] = p
    return out
