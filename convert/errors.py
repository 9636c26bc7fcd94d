"""The one error type of conversion and loading: bad input, reported as one line naming the file, tensor or key."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match its config; names the file and tensor."""
