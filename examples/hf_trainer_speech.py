"""The Hugging Face Trainer on WAV shards: a tiny Wav2Vec2 classifier.

The Trainer passes its train DataLoader to ``accelerator.prepare``, which
would split a ``StreamingDataset`` between ranks a second time (shardstream
raises ``FrameworkWrapperError`` at the first batch instead).
``shardstream.transformers.StreamingTrainer`` is the ``Trainer`` whose
``get_train_dataloader`` prepares the loader with
``shardstream.accelerate.prepare_loader`` (and writes the sample ledger with
``--ledger DIR``; ``shardstream verify DIR`` checks it)::

    python examples/make_dataset.py /tmp/shards --shards 8 --samples-per-shard 12 \\
        --min-seconds 0.1 --max-seconds 0.3
    torchrun --standalone --nproc_per_node 2 examples/hf_trainer_speech.py /tmp/shards \\
        --out /tmp/trainer-out

The model is built from a small config (no weights are downloaded). Each
rank writes ``OUT/rank-{rank}.json``: ``{"rank", "steps", "epochs": {epoch:
[keys]}}``. ``--plain-trainer`` uses ``transformers.Trainer`` as it is.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import wave
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from shardstream import StreamingDataset

if TYPE_CHECKING:
    from transformers import Trainer, Wav2Vec2ForSequenceClassification

# transformers is imported where it is used, not at the top: spawned
# DataLoader workers import this script again (to find ``collate``), and
# need numpy and torch, not transformers (seconds of CPU each).

CLIP = 1600  # samples of 16 kHz audio per example (0.1 s): cropped or zero-padded


def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """WAV bytes to a padded float batch, the label from the JSON."""
    clips, labels = [], []
    for sample in samples:
        with wave.open(io.BytesIO(sample["wav"])) as wav:
            pcm = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
        clip = np.zeros(CLIP, dtype=np.float32)
        clip[: min(CLIP, len(pcm))] = pcm[:CLIP] / 32768.0
        clips.append(clip)
        labels.append(json.loads(sample["json"])["label"])
    return {
        "input_values": torch.from_numpy(np.stack(clips)),
        "labels": torch.tensor(labels),
        "keys": [s["__key__"] for s in samples],
    }


def tiny_model() -> Wav2Vec2ForSequenceClassification:
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    config = Wav2Vec2Config(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        conv_dim=(16, 16),
        conv_stride=(5, 4),
        conv_kernel=(10, 4),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2,
        num_labels=10,
        classifier_proj_size=8,
        do_stable_layer_norm=True,
        feat_extract_norm="layer",
    )
    torch.manual_seed(0)
    return Wav2Vec2ForSequenceClassification(config)


def recording(base: type[Trainer]) -> type[Trainer]:
    """``base`` that records the keys of every batch it trains on (the
    bookkeeping of this check, not part of the recipe)."""

    class Recording(base):  # type: ignore[valid-type,misc]
        seen: dict[int, list[str]] = {}  # noqa: RUF012

        def compute_loss(self, model, inputs, *args, **kwargs):  # type: ignore[no-untyped-def]
            keys = inputs.pop("keys")
            epoch = int(self.state.epoch or 0)
            self.seen.setdefault(epoch, []).extend(keys)
            return super().compute_loss(model, inputs, *args, **kwargs)

    return Recording


def main(argv: list[str] | None = None) -> int:
    from transformers import Trainer, TrainingArguments

    from shardstream.transformers import StreamingTrainer

    parser = argparse.ArgumentParser(description="HF Trainer over WAV shards with shardstream.")
    parser.add_argument("data", help="dataset spec of WAV + JSON tar shards")
    parser.add_argument("--out", type=Path, required=True, help="where to write rank-{rank}.json")
    parser.add_argument("--epochs", type=int, default=2, help="epochs (default: 2)")
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader workers")
    parser.add_argument("--plain-trainer", action="store_true", help="transformers.Trainer as is")
    parser.add_argument("--ledger", type=Path, help="write the sample ledger there")
    args = parser.parse_args(argv)

    dataset = StreamingDataset(
        args.data, seed=0, shuffle_buffer=16, sample_ids=args.ledger is not None
    )
    training_args = TrainingArguments(
        output_dir=str(args.out / "trainer"),
        per_device_train_batch_size=4,
        num_train_epochs=args.epochs,
        learning_rate=1e-3,
        dataloader_num_workers=args.num_workers,
        remove_unused_columns=False,  # the collator's "keys" are for the check above
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )
    trainer_class = recording(Trainer if args.plain_trainer else StreamingTrainer)
    ledger = {} if args.plain_trainer else {"ledger_dir": args.ledger}
    trainer = trainer_class(
        model=tiny_model(),
        args=training_args,
        train_dataset=dataset,
        data_collator=collate,
        **ledger,
    )
    trainer.train()
    record = {
        "rank": trainer.args.process_index,
        "steps": trainer.state.global_step,
        "epochs": trainer_class.seen,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank-{record['rank']}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
