"""Training: corpus, tokenizer, packing, the trainer (MSA warm-up recipe), checkpoints, metrics, run and
model folders (`folders`), training and conversion runs (`runs`), demo.

Import the pieces from their modules (`msakit.train.trainer.Trainer`, `msakit.train.data.prepare_data`,
...); this package imports nothing heavy on its own.
"""
