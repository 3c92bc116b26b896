"""Speed benchmark of one training step per variant (the ``bench`` stage)."""
