"""braidtrain: train GPT-style language models on 1 to N GPUs, one n-D device mesh."""

__version__ = "0.1.0"
