"""PyTorch on the same card as the peer ``make gpu-check`` times this engine against.

- ``w1_step``: W1's block stack (4 GPT-2 blocks: layernorm, fused QKV, causal
  ``scaled_dot_product_attention``, which PyTorch sends to its flash kernel for half dtypes, GELU (tanh)
  MLP), forward and backward of the same loss as ``bench step`` (mean of the squared output), its
  parameters in the step's dtype; eagerly or through ``torch.compile``;
- ``decode_step``: W1 whole (embeddings, blocks, final norm, tied LM head) decoding one token a row
  over a static KV cache after a prompt, float32 as ``bench decode``: eagerly, or replayed from a
  captured CUDA graph (``torch.cuda.CUDAGraph``: what a PyTorch server does for decode).

Each returns a function that runs ``repeats`` timed steps and gives their median in seconds (CUDA
events), so the caller can alternate it with this engine's rounds. Needs torch with CUDA; the GPU
image used so far has it in its ``python3`` (``torch_missing`` says why not where it is not).
"""

from __future__ import annotations

import statistics

HIDDEN, HEADS, LAYERS, FFN, VOCAB, SEQ = 768, 12, 4, 3072, 50304, 256  # the w1 preset


def torch_missing() -> str | None:
    """Why the peer cannot run here (None: it can)."""
    try:
        import torch  # optional: the peer's own package, only on machines that have it
    except ImportError as error:
        return f"torch is not importable here ({error})"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


def _blocks(dtype):
    import torch  # optional, see torch_missing

    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
            self.qkv, self.proj = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
            self.fc1, self.fc2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

        def forward(self, x, cache=None, position=None):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, HIDDEN // HEADS).permute(2, 0, 3, 1, 4)
            if cache is None:
                att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:  # one new token a row: written at ``position``, attending to the slots up to it
                keys, values = cache
                keys.index_copy_(2, position, k)
                values.index_copy_(2, position, v)
                seen = torch.arange(keys.shape[2], device=x.device) <= position
                att = F.scaled_dot_product_attention(q, keys, values, attn_mask=seen)
            x = x + self.proj(att.transpose(1, 2).reshape(b, t, HIDDEN))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

    torch.manual_seed(0)
    return nn.ModuleList([Block() for _ in range(LAYERS)]).cuda().to(dtype)


def _median_seconds(step, repeats: int) -> float:
    import torch  # optional, see torch_missing

    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return statistics.median(times)


def w1_step(dtype: str, batch: int, compiled: bool, warmup: int = 3):
    """``timed(repeats) -> median step seconds`` of W1's block stack forward + backward."""
    step = w1_step_function(dtype, batch, compiled, warmup)
    return lambda repeats: _median_seconds(step, repeats)


def w1_step_function(dtype: str, batch: int, compiled: bool, warmup: int = 3):
    """W1's block stack forward + backward as one call, warmed up (compiled, where ``compiled``)."""
    import torch  # optional, see torch_missing

    dt = getattr(torch, dtype)
    blocks = _blocks(dt)

    def stack(x):
        for block in blocks:
            x = block(x)
        return x

    run = torch.compile(stack) if compiled else stack
    x = torch.randn(batch, SEQ, HIDDEN, device="cuda", dtype=dt, requires_grad=True)

    def step():
        run(x).float().pow(2).mean().backward()

    for _ in range(warmup):  # torch.compile compiles at the first call
        step()
    torch.cuda.synchronize()
    return step


def decode_step(batch: int, graphs: bool, prompt: int = 64, tokens: int = 32):
    """``timed(repeats) -> median seconds a token`` of W1 decoding after a ``prompt``-token prefill,
    float32; ``graphs``: each token replays one captured CUDA graph."""
    run, reset = decode_step_function(batch, graphs, prompt, tokens)

    def timed(repeats: int) -> float:
        reset()
        return _median_seconds(run, min(repeats, tokens))

    return timed


def decode_step_function(batch: int, graphs: bool, prompt: int = 64, tokens: int = 32):
    """(step, reset): one W1 decode token a call after a ``prompt``-token prefill (``tokens`` of them
    fit), float32, replayed from a captured CUDA graph where ``graphs``; ``reset`` rewinds to the
    prompt's end."""
    import torch  # optional, see torch_missing

    blocks = _blocks(torch.float32)
    wte, wpe = (torch.nn.Embedding(n, HIDDEN).cuda() for n in (VOCAB, prompt + tokens + 8))
    norm = torch.nn.LayerNorm(HIDDEN).cuda()
    slots = prompt + tokens + 8
    caches = [tuple(torch.zeros(batch, HEADS, slots, HIDDEN // HEADS, device="cuda") for _ in range(2)) for _ in blocks]
    ids = torch.randint(0, VOCAB, (batch, 1), device="cuda")
    position = torch.full((1,), prompt, device="cuda", dtype=torch.long)

    @torch.no_grad()
    def step():
        x = wte(ids) + wpe(position)[None]
        for block, cache in zip(blocks, caches):
            x = block(x, cache, position)
        ids.copy_((norm(x) @ wte.weight.T).argmax(-1))
        position.add_(1)

    def reset():  # every round decodes the same slots again: the cache holds its random prompt
        position.fill_(prompt)

    step()
    run = step
    if graphs:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                reset()
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        run = graph.replay
    torch.cuda.synchronize()
    return run, reset
