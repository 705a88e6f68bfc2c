"""Build a randomly initialised model with the exact shapes of a Qwen2.5 release, for throughput
benchmarks on machines with no model hub (same shapes, same cost as the real weights).

    python bench/make_random_model.py --arch qwen2.5-1.5b --out /tmp/qwen2.5-1.5b-random

The tokenizer is the embedded tiny model's (ids beyond its vocabulary are never produced by it,
but the model may sample them; they decode to nothing, which is fine for throughput).
"""
import argparse
import os

import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

# Shapes from the released config.json files of Qwen2.5-{1.5B,3B,7B}-Instruct.
ARCHS = {
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}


def make_random_model(arch: str, out: str, tokenizer_path: str | None = None, seed: int = 0) -> str:
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    config = Qwen2Config(**ARCHS[arch], max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645)
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)
    # On a GPU the random init takes seconds; on CPU cores a 7B one takes minutes.
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer_path is None:
        from lib.tiny_model import default_tiny_model_dir

        tokenizer_path = default_tiny_model_dir()
    AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(out)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--arch", choices=sorted(ARCHS), default="qwen2.5-1.5b")
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer-path", default=None)
    a = p.parse_args()
    print(make_random_model(a.arch, a.out, a.tokenizer_path))
