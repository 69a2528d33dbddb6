"""The logits of `hpc-tp convert`ed checkpoints against transformers' own forward pass, family by family.

    python benchmarks/against_transformers.py [--transformers-python PATH] [--families llama,qwen3,...] [--json OUT]

For each family a tiny random model (3 layers, hidden 16, 4 heads over 2 K/V heads; the MoE ones with 4
experts, top 2) is built by transformers, given weights far from its near-zero initialisation, saved
with ``save_pretrained`` in float64 and in float32, converted with ``hpc-tp convert`` and run by this
engine at tp = 1 in the same dtype; both forward passes see the same token ids (two rows of 12). The
table gives the largest absolute logit difference and the largest logit per dtype (float64 should
agree to round-off; float32 to its precision over a few layers).

transformers and torch need not be in this interpreter: with --transformers-python (e.g. a separate
venv with ``pip install torch==2.13.0 transformers``) the script runs itself there for the
transformers side only (``--transformers-side``), which writes each folder and its logits, and does
the conversion and the engine's forward pass here. Without the flag it imports transformers here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import numpy

SMALL = dict(
    vocab_size=64,
    hidden_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=24,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
# transformers' config class, model class and what each family sets beyond SMALL.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 6}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 8,
            "shared_expert_intermediate_size": 12,
            "mlp_only_layers": [1],
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 8,
            "norm_topk_prob": True,
            "head_dim": 6,
            "mlp_only_layers": [1],
        },
    ),
}
DTYPES = ("float64", "float32")
IDS = numpy.random.default_rng(0).integers(0, SMALL["vocab_size"], (2, 12))


def transformers_side(family: str, root: Path):
    """Write ``root/<dtype>/`` (a saved model) and ``root/<dtype>.npy`` (its logits of IDS) for each dtype."""
    import torch  # the transformers side only: this engine does not need torch
    import transformers

    config_class, model_class, extra = FAMILIES[family]
    if "num_experts_per_tok" in extra:  # the experts one by one: the grouped product has no float64
        extra = {**extra, "experts_implementation": "eager"}
    config = getattr(transformers, config_class)(**{**SMALL, "rope_theta": 500.0, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).to(torch.float64).eval()
    with torch.no_grad():  # larger weights than the initialisation, so that the logits differ by token
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(
                    (1.0 if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")) else 0.3)
                    * torch.randn_like(p)
                )
        for dtype in DTYPES:
            typed = model.to(getattr(torch, dtype))
            if dtype == "float64":
                in_float64(typed, config)
            typed.save_pretrained(root / dtype)
            logits = typed(torch.tensor(IDS)).logits
            numpy.save(root / f"{dtype}.npy", logits.to(torch.float64).numpy())


def in_float64(model, config):
    """transformers computes the RoPE tables and the RMSNorms in float32 whatever the model's dtype
    (errors near 1e-7 there, 1e-6 in these logits); in float64 here, so that the float64 column
    compares the architectures rather than that rounding. (The MoE routers' softmax stays float32.)"""
    import torch

    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):

            def forward(x, position_ids, scaling=module.attention_scaling):
                angles = position_ids[..., None].to(torch.float64) * inv_freq
                both = torch.cat((angles, angles), dim=-1)
                return (both.cos() * scaling).to(x.dtype), (both.sin() * scaling).to(x.dtype)

            module.forward = forward
        if type(module).__name__.endswith("RMSNorm"):

            def norm(x, module=module):
                return module.weight * x * torch.rsqrt((x * x).mean(-1, keepdim=True) + module.variance_epsilon)

            module.forward = norm


def engine_logits(folder: Path, dtype: str) -> numpy.ndarray:
    """``hpc-tp convert`` of ``folder``, then this engine's logits of IDS at tp = 1 in ``dtype``."""
    from hpc_tp.checkpoint import load_checkpoint
    from hpc_tp.cli import main
    from hpc_tp.comm.mpi import self_comm
    from hpc_tp.grid import ProcessGrid
    from hpc_tp.models import GPTModel, ModelConfig

    ckpt = folder.with_name(folder.name + "-ckpt")
    if main(["convert", str(folder), "-o", str(ckpt)]) != 0:
        raise SystemExit(f"hpc-tp convert {folder} failed")
    grid = ProcessGrid(tp=1, world=self_comm())
    meta = load_checkpoint(ckpt, {}, grid)
    model = GPTModel(ModelConfig.from_dict(meta["config"]), grid.tp, dtype=dtype)
    load_checkpoint(ckpt, model.state(), grid)
    return numpy.asarray(model.logits(IDS), dtype=numpy.float64)


def compare(family: str, root: Path, transformers_python: str | None) -> dict:
    root.mkdir()
    if transformers_python:
        command = [transformers_python, __file__, "--transformers-side", family, str(root)]
        subprocess.run(command, check=True)
    else:
        transformers_side(family, root)
    row = {"family": family}
    for dtype in DTYPES:
        theirs = numpy.load(root / f"{dtype}.npy")
        ours = engine_logits(root / dtype, dtype)
        row[dtype] = float(numpy.abs(ours - theirs).max())
        row["largest logit"] = float(numpy.abs(theirs).max())
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transformers-python", help="a Python with torch and transformers (default: this one)")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated, of: " + ", ".join(FAMILIES))
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--transformers-side", nargs=2, metavar=("FAMILY", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.transformers_side:
        transformers_side(args.transformers_side[0], Path(args.transformers_side[1]))
        return
    families = args.families.split(",")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    with tempfile.TemporaryDirectory(prefix="hpc_tp-vs-transformers-") as temp:
        rows = [compare(f, Path(temp) / f, args.transformers_python) for f in families]
    print(f"{'family':<10} {'max |diff| float64':>19} {'max |diff| float32':>19} {'largest |logit|':>16}")
    for r in rows:
        print(f"{r['family']:<10} {r['float64']:>19.3e} {r['float32']:>19.3e} {r['largest logit']:>16.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
