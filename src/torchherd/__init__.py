"""torchherd: run one PyTorch distributed job on many machines from one command."""

__version__ = "0.1.0"
