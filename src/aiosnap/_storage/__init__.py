"""Where bytes live: the Storage protocol and its backends (a local disk through its
POSIX calls, object stores through obstore, any fsspec filesystem), and leases.

Nothing is imported here: the worker process starts from a bare package.
"""
