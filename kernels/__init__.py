"""cadenza's own compiled kernels, built on first use and optional: every caller has a PyTorch path."""
