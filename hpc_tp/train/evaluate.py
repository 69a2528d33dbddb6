"""Held-out accuracy on the demo task: greedy completion, by the serving engine (KV cache, prompts
of different lengths in one batch), of problems the model never trained on.

Collective over the model's tp group; every rank returns the same result (tp rank 0 decodes and
checks the answers, then broadcasts them).
"""

from __future__ import annotations

from ..serve.generate import Engine
from ..serve.sampling import SamplingParams

PROMPTS_PER_BATCH = 256  # bounds the KV cache a batch holds


def heldout_accuracy(model, task, tokenizer, problems: int) -> tuple[float, list]:
    """(fraction of the first ``problems`` held-out problems answered exactly, [(prompt, completion, ok)])."""
    engine, comm = Engine(model, tokenizer), model.comm
    examples = task.heldout_examples()[:problems]
    largest = 10**task.digits - 1
    greedy = SamplingParams(
        max_new_tokens=len(tokenizer.encode(task.answer(largest, largest) + "\n")), temperature=0.0, stop=["\n"]
    )
    results = []
    for start in range(0, len(examples), PROMPTS_PER_BATCH):
        batch = examples[start : start + PROMPTS_PER_BATCH]
        prompts = tokenizer.encode_batch([p for p, _ in batch]) if comm.rank == 0 else None
        out = engine.generate(prompts, [greedy] * len(batch) if comm.rank == 0 else None)
        if comm.rank == 0:
            completions, _ = out
            results.extend((p, c.text, task.check(p, c.text)) for (p, _), c in zip(batch, completions))
    results = comm.bcast_object(results)
    return sum(ok for _, _, ok in results) / max(len(results), 1), results
