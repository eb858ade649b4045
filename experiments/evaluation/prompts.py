"""The evaluation's prompts: read (the held-out ShareGPT prompts or a .jsonl file), drawn into
disjoint seeded sets, each prompt knowing where it came from.

    load_prompt_sets(source, num_prompts, sets, seed, dev_sets=, dev_num_prompts=) -> [[Prompt, ...], ...]
    eval_prompt_sets(e: EvalConfig) -> (prompt sets, their names "0", ..., "dev0", ...)
    eval_passes(modes, temperatures) -> the (mode, temperature) passes an evaluation runs on them

A `Prompt` is a `str` with `.where` (`p.jsonl:3`, `held-out prompt 17`): an error about one prompt
(too long for the backbone's context) names it. `longest_prompt(e)` counts the longest prompt an
evaluation draws without loading a model (a sweep's `--check`).

Leaves out: decoding them (experiments/evaluation/decoding.py), the corpus (mtpc/data.py).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from experiments.evaluation.config import EvalConfig
from tracking.schema import DEV_SET_PREFIX


class Prompt(str):
    """A prompt's text, with `where` it was read (`<file>:<line>` or `held-out prompt <i>`)."""

    where: str = "?"

    def __new__(cls, text: str, where: str = "?") -> Prompt:  # a default: copy and pickle call cls(text)
        p = super().__new__(cls, text)
        p.where = where
        return p


def read_prompt_file(path: Path) -> list[Prompt]:
    """A .jsonl file: each line a JSON string, {"prompt": str}, or a messages record (first user turn)."""
    prompts = []
    for i, raw in enumerate(path.read_bytes().splitlines(), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}:{i}: not valid UTF-8 (byte {e.start + 1} of the line)") from None
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not valid JSON ({e})") from None
        if isinstance(rec, str):
            text = rec
        elif isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
            text = rec["prompt"]
        elif isinstance(rec, dict) and isinstance(rec.get("messages"), list):
            users = [
                m.get("content") for m in rec["messages"] if isinstance(m, dict) and m.get("role") == "user"
            ]
            if not users or not isinstance(users[0], str):
                raise ValueError(f"{path}:{i}: messages record without a user turn")
            text = users[0]
        else:
            raise ValueError(
                f"{path}:{i}: expected a JSON string, {{'prompt': str}} or {{'messages': [...]}}"
            )
        prompts.append(Prompt(text, f"{path}:{i}"))
    return prompts


def load_prompt_sets(source: str = EvalConfig.prompts, num_prompts: int = EvalConfig.n_prompts, sets: int = EvalConfig.sets,
                     seed: int = EvalConfig.seed, *, dev_sets: int = 0, dev_num_prompts: int | None = None) -> list[list[Prompt]]:  # fmt: skip
    """`sets` disjoint sets of `num_prompts` prompts drawn (seeded) from the held-out ShareGPT prompts or
    a .jsonl, then `dev_sets` development sets of `dev_num_prompts` (default `num_prompts`), disjoint
    from them and from each other (`draw_prompt_sets`)."""
    if num_prompts < 1 or sets < 1:
        raise ValueError(f"num_prompts and sets must be >= 1, got {num_prompts} and {sets}")
    if source == "heldout":
        from mtpc.data import sharegpt_corpus

        heldout = sharegpt_corpus(progress=False).heldout_prompts
        pool = [Prompt(p, f"held-out prompt {i}") for i, p in enumerate(heldout)]
    else:
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"eval.prompts: {source!r} is neither 'heldout' nor an existing .jsonl file")
        pool = read_prompt_file(path)
    return draw_prompt_sets(
        pool, source, num_prompts, sets, seed, dev_sets=dev_sets, dev_num_prompts=dev_num_prompts
    )


def eval_prompt_sets(e: EvalConfig) -> tuple[list[list[Prompt]], list[str]]:
    """The prompt sets evaluation `e` draws (reported, then development) and their names."""
    sets = load_prompt_sets(
        e.prompts, e.n_prompts, e.sets, e.seed, dev_sets=e.dev_sets, dev_num_prompts=e.dev_n_prompts
    )
    return sets, prompt_set_names(e.sets, e.dev_sets)


def eval_passes(modes: tuple[str, ...], temperatures: tuple[float, ...]) -> list[tuple[str, float]]:
    """(mode, temperature) pairs an evaluation runs: sampling at every temperature, greedy once (at
    the first temperature, which greedy ignores)."""
    return [(m, t) for i, t in enumerate(temperatures) for m in modes if m == "sample" or i == 0]


def prompt_set_names(sets: int, dev_sets: int = 0) -> list[str]:
    """ "0".."sets-1" (reported), then "dev0".. (development prompts, disjoint from the reported ones)."""
    return [str(i) for i in range(sets)] + [f"{DEV_SET_PREFIX}{i}" for i in range(dev_sets)]


def draw_prompt_sets(pool: list[str], source: str, num_prompts: int, sets: int, seed: int, *, dev_sets: int = 0,
                     dev_num_prompts: int | None = None) -> list[list[str]]:  # fmt: skip
    """The seeded draw of `load_prompt_sets` from a pool of prompts (`source` names it in errors): the
    pool shuffled with `seed`, cut into `sets` consecutive slices of `num_prompts`, then `dev_sets`
    slices of `dev_num_prompts` after them. With dev_num_prompts = num_prompts (the default) this is
    the draw of sets + dev_sets equal sets: a study that only resizes its dev sets keeps its reported prompts."""
    if num_prompts < 1 or sets < 1 or dev_sets < 0 or (dev_num_prompts is not None and dev_num_prompts < 1):
        raise ValueError(f"num_prompts and sets must be >= 1, dev_sets >= 0 and dev_num_prompts >= 1; got "
                         f"{num_prompts}, {sets}, {dev_sets}, {dev_num_prompts}")  # fmt: skip
    dev_n = num_prompts if dev_num_prompts is None else dev_num_prompts
    sizes = [num_prompts] * sets + [dev_n] * dev_sets
    need = sum(sizes)
    if len(pool) < need:
        what = "sets x num_prompts" if not dev_sets else "sets x num_prompts + dev_sets x dev_num_prompts"
        raise ValueError(f"eval.prompts {source}: {len(pool)} prompts, but {what} = {need} are needed")
    pool = list(pool)
    random.Random(seed).shuffle(pool)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [pool[a : a + n] for a, n in zip(starts, sizes, strict=True)]


def longest_prompt(e: EvalConfig) -> tuple[int, str]:
    """(ids, what was counted) of the longest prompt evaluation `e` draws, as the suite's byte
    tokenizer renders it (a one-turn chat), without building anything: a prompt file is read and
    drawn; the held-out prompts are read when the corpus is already built; otherwise the shortest a
    held-out prompt may be (mtpc.data.PROMPT_CHARS) is counted, a lower bound."""
    from mtpc.data import CORPUS_VERSION, PROMPT_CHARS
    from mtpc.paths import cache_dir
    from mtpc.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    if e.prompts == "heldout":
        built = cache_dir() / "data" / CORPUS_VERSION / "heldout_prompts.json"
        if not built.is_file():
            return len(
                tok.render_prompt("x" * PROMPT_CHARS[0])
            ), "the shortest held-out prompt (the corpus is not built yet)"
        pool = json.loads(built.read_text(encoding="utf-8"))
    else:
        path = Path(e.prompts)
        if not path.is_file():
            raise ValueError(f"eval.prompts: {e.prompts!r} is neither 'heldout' nor an existing .jsonl file")
        pool = read_prompt_file(path)
    drawn = [p for ps in draw_prompt_sets(pool, e.prompts, e.n_prompts, e.sets, e.seed, dev_sets=e.dev_sets,
                                           dev_num_prompts=e.dev_n_prompts) for p in ps]  # fmt: skip
    return max(len(tok.render_prompt(p)) for p in drawn), "the longest drawn prompt"
