"""Write a random-weight QSATinyForCausalLM checkpoint that `vllm serve` can load.

Usage: python examples/vllm/make_tiny_model.py FOLDER [--seed N]
The folder gets config.json (a Qwen4ExpTextConfig with architectures ["QSATinyForCausalLM"])
and model.safetensors. There is no tokenizer: serve it with --skip-tokenizer-init.
"""

import argparse

from qsa_adapters.vllm.tiny_checkpoint import random_tiny_weights, save_tiny_checkpoint, tiny_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = tiny_config()
    save_tiny_checkpoint(args.folder, config, random_tiny_weights(config, seed=args.seed))
    print(f"wrote {args.folder}: {config.num_hidden_layers} QSA layers, budget {config.indexer_budget} tokens "
          f"in groups of {config.indexer_compress_ratio}, vocab {config.vocab_size}")


if __name__ == "__main__":
    main()
