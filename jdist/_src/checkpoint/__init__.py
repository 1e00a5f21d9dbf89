"""Checkpoints below the training layer: orbax saving and restoring on any
number of devices or processes (`checkpointer.py`), the claim on a
checkpoint directory (`directory_claim.py`), orbax's failures as one message
(`orbax_errors.py`), and the preemption notice (`preemption.py`). The
Trainer's callbacks (`training/checkpoint_callbacks.py`) build on it, and
so does `jdist.CheckpointManager` (`manager.py`), its public piece for
custom loops."""
