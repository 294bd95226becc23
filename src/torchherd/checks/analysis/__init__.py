"""Pure functions from what was observed (``Observed``) to CheckResults, one module per family."""
