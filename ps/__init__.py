"""hps: a hierarchical parameter server for PyTorch training across regions."""

__version__ = "0.1.0"
