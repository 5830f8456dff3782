"""Randomly initialised Qwen3-shaped models with a locally trained tokenizer, so that real
vLLM runs without downloading anything: "tiny" (2 layers, seconds on a CPU) for the token
identity checks, and "qwen3-8b" (Qwen3-8B's layers, heads and widths, about 14 GB of bf16
weights) for the GPU tier, where a 16k-token prompt then moves the KV a real 8B model's
does (144 KiB a token); "qwen3-1.7b" for load sweeps (112 KiB a token). All share the tiny
vocabulary: KV depends on the layers and heads alone, and greedy decoding over random
weights is deterministic all the same."""

import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, max_position_embeddings=4096),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, max_position_embeddings=32768),
    # Qwen3-1.7B's: KV per token about the 8B's (112 KiB against 144), its prefill several
    # times cheaper, so one GPU shared by two engines reaches several 16k prompts a second.
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, max_position_embeddings=32768),
}


def kv_bytes_per_token(shape: str, dtype_bytes: int = 2) -> int:
    s = SHAPES[shape]
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * s["head_dim"] * dtype_bytes


def make(out: str, shape: str = "tiny") -> str:
    os.makedirs(out, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"the quick brown fox jumps over the lazy dog {i}" for i in range(2000)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=1000, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(out)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=1024, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                      **SHAPES[shape])
    if shape == "tiny":
        Qwen3ForCausalLM(cfg).save_pretrained(out)
        return out
    # Billions of parameters: made on the GPU in bf16 (seconds; on a CPU in float32, minutes).
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg.torch_dtype = torch.bfloat16
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size="4GB")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()  # else this process keeps the weights' 16 GB from the engines
    return out
