"""The Hugging Face Trainer with asynchronous checkpoints (CPU, one process).

``LazyCheckpointTrainer`` is ``transformers.Trainer`` with lazyckpt's
checkpointing mixed in: every ``save_steps`` the checkpoint directory is
queued and the training goes on; it appears under its usual name
(``checkpoint-<step>``, the plain Trainer's files) only once complete and
durable, and ``train(resume_from_checkpoint=...)`` resumes from it. Here a
tiny Llama trains 8 steps, a second Trainer resumes from step 4, and its final
weights equal the uninterrupted run's bit for bit.

    HF_HUB_OFFLINE=1 python examples/hf_trainer_example.py
"""

from __future__ import annotations

import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

from lazyckpt.integrations.huggingface import LazyCheckpointTrainer  # noqa: E402

SEQ = 16


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=32):
        self.ids = torch.randint(0, 128, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, vocab_size=128, max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(config)


def trainer(out):
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=8, per_device_train_batch_size=4, learning_rate=3e-3,
        save_strategy="steps", save_steps=4, logging_steps=1, report_to=[], seed=42,
        use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    return LazyCheckpointTrainer(model=model(), args=args, train_dataset=Tokens(),
                                 lazyckpt_options={"host_cache_bytes": 16 << 20})


def main() -> None:
    transformers.logging.set_verbosity_error()
    root = tempfile.mkdtemp(prefix="lazyckpt-hf-example-")
    try:
        full = trainer(os.path.join(root, "run"))
        full.train()                                   # saves at steps 4 and 8, asynchronously
        print("checkpoints:", sorted(d for d in os.listdir(os.path.join(root, "run")) if d.startswith("checkpoint")))
        print("checkpoint-4 holds:", sorted(os.listdir(os.path.join(root, "run", "checkpoint-4"))))

        resumed = trainer(os.path.join(root, "resumed"))
        resumed.train(resume_from_checkpoint=os.path.join(root, "run", "checkpoint-4"))
        a, b = full.model.state_dict(), resumed.model.state_dict()
        if not all(torch.equal(a[k], b[k]) for k in a):
            raise SystemExit("the resumed run's final weights differ from the uninterrupted run's")
        print(f"restored step 4 bit-exact: after 4 more steps the weights equal the uninterrupted run's "
              f"({len(a)} tensors)")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
