"""What goes in and comes out of a run: token data and corpora, checkpoints, HuggingFace export, the
run directory, metrics and trackers."""
