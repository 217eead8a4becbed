"""The one exception type for user errors: the CLI prints its message on one line and exits 2."""


class KvsimError(Exception):
    """Bad input or an impossible request (unknown name, bad file, a batch that cannot fit)."""


class Infeasible(KvsimError):
    """A configuration that cannot run at all (does not fit in HBM or host memory)."""
