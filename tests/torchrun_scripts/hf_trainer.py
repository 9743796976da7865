"""A torchrun training script with the Hugging Face Trainer: a 2-layer Llama from a config
(nothing downloaded) learning sequences that count up, on CPU ranks.

Run with ``torchrun --nproc-per-node 2 hf_trainer.py --output-dir DIR --max-steps 6 --save DIR``.
"""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from save_state import save_state
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


def counting(i):
    start, stride = (7 * i) % 128, 1 + i % 5
    ids = torch.tensor([(start + stride * k) % 128 for k in range(16)])
    return {"input_ids": ids, "labels": ids}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--save", default=None)
    args = parser.parse_args()

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    training = TrainingArguments(
        output_dir=args.output_dir,
        use_cpu=True,
        per_device_train_batch_size=4,
        max_steps=args.max_steps,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        logging_steps=2,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    trainer = Trainer(model=model, args=training, train_dataset=[counting(i) for i in range(64)])
    trainer.train()
    if args.save:
        rank = int(os.environ.get("RANK", "0"))
        save_state(args.save, rank, trainer.model, trainer.optimizer)


if __name__ == "__main__":
    main()
