"""Checkpoints usable from a custom loop; the Trainer's callbacks build on
them."""
