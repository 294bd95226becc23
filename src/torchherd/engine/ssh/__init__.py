"""The SSH backend: torchherd starts every node itself, one supervisor per node over SSH."""
