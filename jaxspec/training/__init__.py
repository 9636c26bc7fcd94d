"""Training code shared by `python -m jaxspec.train_target` and `python -m jaxspec.train_draft`."""
