"""Publish a training step as a Hugging Face model directory, and load it with
``from_pretrained``.

A tiny Llama is checkpointed with its optimizer by a Checkpointer (the state a
training job saves); ``lazyckpt.export_hf`` writes that step's model as
``model.safetensors`` plus the config, and transformers loads it without
lazyckpt: its logits equal the trained model's. The CLI does the same:
``lazyckpt export RUN_DIR OUT_DIR --hf --config CONFIG_DIR``.

    HF_HUB_OFFLINE=1 python examples/export_hf.py
"""

from __future__ import annotations

import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import lazyckpt  # noqa: E402


def main() -> None:
    root = tempfile.mkdtemp(prefix="lazyckpt-export-example-")
    try:
        torch.manual_seed(0)
        config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=128, vocab_size=256, max_position_embeddings=32)
        model = transformers.LlamaForCausalLM(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, 256, (4, 16))
        with lazyckpt.Checkpointer(os.path.join(root, "run"), keep=2) as ckpt:
            for step in range(1, 4):
                model(input_ids=tokens, labels=tokens).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                ckpt.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, step)

        config.save_pretrained(os.path.join(root, "config"))          # the architecture to publish
        result = lazyckpt.export_hf(os.path.join(root, "run"), os.path.join(root, "hf"), key="model",
                                    config=os.path.join(root, "config"))
        print(f"exported step {result.step}: {sorted(os.listdir(os.path.join(root, 'hf')))}")

        loaded = transformers.LlamaForCausalLM.from_pretrained(os.path.join(root, "hf"))
        model.eval()
        with torch.no_grad():
            same = torch.equal(model(input_ids=tokens).logits, loaded(input_ids=tokens).logits)
        if not same:
            raise SystemExit("from_pretrained's logits differ from the trained model's")
        print("from_pretrained loaded step 3 bit-exact: its logits equal the trained model's")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
